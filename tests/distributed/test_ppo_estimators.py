"""Advantage estimators, loss aggregation, KL in the loss and critic modes in the trainer.

One 1-rank spawn runs every estimator and critic mode for two steps (and checks what each
trains); one 2-rank spawn runs every estimator (grpo with a KL loss, Dr. GRPO, rloo,
reinforce_plus_plus; gae: test_ppo_parallel.py) and the detached and separate critics at
TP=2 and PP=2, whose first-step metrics must match the TP=1 run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

BASE = ("reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "optim.lr=1e-3",
        "ppo.num_rollout_samples=8", "ppo.global_batch_size=8", "ppo.micro_batch_size=2",
        "ppo.forward_micro_batch_size=2", "ppo.ppo_epochs=1")
VARIED = ("rollout.max_new_tokens=8", "rollout.stop_token_ids=[3,4,5]")
# sequence packing: one packed row of up to 40 tokens per micro-batch (several sequences each)
PACKED = ("ppo.max_tokens_per_micro_batch=40", "ppo.sequence_packing=true", "ppo.packed_row_length=40")
RUNS = {
    "grpo": ("ppo.advantage_estimator=grpo", "rollout.n_samples_per_prompt=2"),
    "dr_grpo": ("ppo.advantage_estimator=grpo", "ppo.norm_by_std=false",
                "rollout.n_samples_per_prompt=4", "ppo.loss_agg_mode=seq-mean-token-sum-norm"),
    "rloo": ("ppo.advantage_estimator=rloo", "rollout.n_samples_per_prompt=2"),
    "reinforce_plus_plus": ("ppo.advantage_estimator=reinforce_plus_plus",),
    "kl_in_loss": ("kl.in_reward=false", "kl.type=fixed", "kl.init_kl_coef=0.3", "kl.loss_coef=0.1",
                   "kl.loss_estimator=k3", "ppo.loss_agg_mode=seq-mean-token-mean"),
    "shared_detached": ("critic.mode=shared_detached", "ppo.loss_agg_mode=seq-mean-token-sum"),
    "precision_auto": ("trainer.precision=auto",),
    # the fused chunked output layer (default ppo.logprob_chunk_size) vs the logits path
    "logits_path": ("ppo.logprob_chunk_size=0",),
    "chunk3": ("ppo.logprob_chunk_size=3",),
    "unscaled_kl_chunk3": ("rollout.temperature=0.7", "kl.temperature=unscaled", "ppo.logprob_chunk_size=3",
                           "ppo.entropy_coef=0.01"),
    "unscaled_kl_logits": ("rollout.temperature=0.7", "kl.temperature=unscaled", "ppo.logprob_chunk_size=0",
                           "ppo.entropy_coef=0.01"),
    # the rollout-mismatch correction on: truncated IS (cap 1.0: every weight <= 1), then
    # row masking at a threshold nothing passes (every row masked: no policy gradient)
    # token-budget micro-batches with their padding cut vs fixed rows of the full width
    # (responses of varied lengths: stops on the digits 0-2)
    "varied": VARIED,
    "token_budget": VARIED + ("ppo.max_tokens_per_micro_batch=40",),
    "separate": VARIED + ("critic.mode=separate",),
    "separate_budget": VARIED + ("critic.mode=separate", "ppo.max_tokens_per_micro_batch=40"),
    "separate_packed": VARIED + ("critic.mode=separate", *PACKED),
    # old log-probs and values from the rollout (no forward-only pass of the actor)
    "from_rollout": ("ppo.old_logprobs_from_rollout=true",),
    "from_rollout_grpo": ("ppo.old_logprobs_from_rollout=true", "ppo.advantage_estimator=grpo",
                          "rollout.n_samples_per_prompt=2"),
    # the decode that gives the values with megatron's MLP recompute on (it crashed: the
    # layers' recompute flag took them off the incremental path)
    "from_rollout_recompute_mlp": ("ppo.old_logprobs_from_rollout=true", "model.recompute_granularity=selective",
                                   "model.recompute_modules=[mlp]"),
    # activation recompute (megatron's): the same training, less memory
    "recompute_full": ("model.recompute_granularity=full",),
    "recompute_separate_packed": VARIED + ("critic.mode=separate", *PACKED, "model.recompute_granularity=selective",
                                           "model.recompute_modules=[core_attn,mlp]"),
    "tis": ("ppo.rollout_is_cap=1.0",),
    # AReaL's rule: the tokens whose weight exceeds the cap dropped instead of truncated
    "tis_mask": ("ppo.rollout_is_cap=1.0", "ppo.rollout_is_mode=mask"),
    "mask_all": ("ppo.rollout_mask_threshold=1e-12", "ppo.value_loss_coef=0.0"),
}
# one mini-batch, no shuffle: every layout sees the same samples in the same update (grpo
# samples: greedy copies of a prompt would all get advantage 0; the sampler's seed depends on
# the DP rank only, which is 0 in every layout here)
PARITY = {
    "grpo_kl_loss": ("ppo.shuffle=false", "ppo.advantage_estimator=grpo",
                     "rollout.n_samples_per_prompt=2", "kl.loss_coef=0.1",
                     "ppo.loss_agg_mode=seq-mean-token-mean"),
    "gae_detached": ("rollout.greedy=true", "ppo.shuffle=false", "critic.mode=shared_detached",
                     "ppo.loss_agg_mode=seq-mean-token-sum"),
    "gae_separate": ("rollout.greedy=true", "ppo.shuffle=false", "critic.mode=separate"),
    "rloo": ("ppo.shuffle=false", "ppo.advantage_estimator=rloo", "rollout.n_samples_per_prompt=2"),
    "reinforce_plus_plus": ("rollout.greedy=true", "ppo.shuffle=false",
                            "ppo.advantage_estimator=reinforce_plus_plus"),
    "dr_grpo": ("ppo.shuffle=false", "ppo.advantage_estimator=grpo", "ppo.norm_by_std=false",
                "rollout.n_samples_per_prompt=2", "ppo.loss_agg_mode=seq-mean-token-sum-norm"),
    # token-budget micro-batches of varied shapes (padding cut; sampled responses of varied
    # lengths): at PP=2 the stages send each activation's shape ahead of it
    "gae_token_budget": ("ppo.shuffle=false", *VARIED, "ppo.max_tokens_per_micro_batch=40"),
    # the same with the sequences packed into rows (block-diagonal attention)
    "gae_packed": ("ppo.shuffle=false", *VARIED, *PACKED),
    # old log-probs and values from the rollout: at PP=2 the last stage's decode has them
    "gae_from_rollout": ("ppo.shuffle=false", *VARIED, "ppo.old_logprobs_from_rollout=true"),
}
# references only (no TP/PP layouts): the padded twin of gae_token_budget
PADDED = {"gae_padded": ("ppo.shuffle=false", *VARIED)}
COMPARED = ("reward_mean", "response_length", "kl_mean", "policy_loss", "entropy", "approx_kl",
            "grad_norm", "advantages_mean")
COMPARED_IF_PRESENT = ("value_loss", "critic_grad_norm", "returns_mean")


def _head(trainer) -> dict:
    from nemo_rlhf.models.engine import unwrap

    return {n: p.detach().clone() for n, p in unwrap(trainer.model).named_parameters()
            if n.startswith("value_head.")}


def _backbone_grads_from_values(trainer) -> float:
    """Sum of |grad| the backbone gets from a loss on the values alone."""
    from nemo_rlhf.models.engine import model_forward, unwrap

    core = unwrap(trainer.model)
    ids = torch.tensor([trainer.encoded[0]], device=trainer.dims.device)
    trainer.optimizer.zero_grad()
    _, values = model_forward(core, ids, torch.ones_like(ids))
    values.sum().backward()
    total = 0.0
    for n, p in core.named_parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if not n.startswith("value_head.") and g is not None:
            total += float(g.abs().sum())
    trainer.optimizer.zero_grad()
    return total


def _single(rank: int, tmp: str):
    from nemo_rlhf.models.engine import unwrap
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    out = {}
    for name, overrides in {**RUNS, "shared": ()}.items():
        tr = build(compose_ppo(data, tmp / name, *BASE, *overrides))
        head = _head(tr)
        metrics = []
        for _ in range(2):
            metrics.append(tr.train_step())
            tr.step += 1
        after = _head(tr)
        out[name] = {"metrics": metrics, "precision": tr.cfg.trainer.precision,
                     "recompute": unwrap(tr.model).config.recompute_granularity,
                     "head_changed": any(not torch.equal(head[k], after[k]) for k in head)}
        if name in ("shared", "shared_detached"):
            out[name]["backbone_grad_from_values"] = _backbone_grads_from_values(tr)
    out["errors"] = {}
    try:  # the rollout records log-probs at the sampling temperature only
        build(compose_ppo(data, tmp / "bad", *BASE, "ppo.old_logprobs_from_rollout=true",
                          "rollout.temperature=0.7", "kl.temperature=unscaled"))
    except ValueError as e:
        out["errors"]["from_rollout_unscaled_kl"] = str(e)
    try:  # vLLM records log-probs after top-p (refused before vLLM is imported)
        build(compose_ppo(data, tmp / "bad_vllm", *BASE, "ppo.old_logprobs_from_rollout=true",
                          "rollout.engine=vllm", "rollout.top_p=0.9", "ppo.advantage_estimator=grpo",
                          "rollout.n_samples_per_prompt=2"))
    except ValueError as e:
        out["errors"]["from_rollout_vllm_top_p"] = str(e)
    try:  # vLLM's processed log-probs come after its min-tokens processor (EOS/stops removed)
        build(compose_ppo(data, tmp / "bad_vllm_min", *BASE, "ppo.old_logprobs_from_rollout=true",
                          "rollout.engine=vllm", "rollout.min_new_tokens=2", "ppo.advantage_estimator=grpo",
                          "rollout.n_samples_per_prompt=2"))
    except ValueError as e:
        out["errors"]["from_rollout_vllm_min_tokens"] = str(e)
    for name, correction in (("from_rollout_tis", "ppo.rollout_is_cap=2.0"),
                             ("from_rollout_mask", "ppo.rollout_mask_threshold=0.5")):
        try:  # the correction would compare the rollout's log-probs with themselves
            build(compose_ppo(data, tmp / name, *BASE, "ppo.old_logprobs_from_rollout=true", correction))
        except ValueError as e:
            out["errors"][name] = str(e)
    return out


def _references(rank: int, tmp: str, names: list[str]):
    """One rank's first step of each configuration, in one process (each build re-seeds
    everything), and each one's initial weights for the layouts."""
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    out = {}
    for name in names:
        trainer = build(compose_ppo(data, tmp / f"ref_{name}", *BASE, *{**PARITY, **PADDED}[name]))
        # a separate critic's initial weights too (the layouts' critics start from them)
        critic = None if trainer.critic.checkpoint is None else (trainer.critic.checkpoint[0], None)
        save_checkpoint(tmp / f"init_{name}", 0, trainer.model, dims=trainer.dims, critic=critic)
        out[name] = [trainer.train_step()]
    return out


def _layouts(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    out = {}
    for name in PARITY:
        for layout, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
            cfg = compose_ppo(data, tmp / f"{name}_{layout}", *BASE, *PARITY[name],
                              f"exp_manager.init_from={tmp}/init_{name}/step_0",
                              f"parallel.tensor_model_parallel_size={tp}",
                              f"parallel.pipeline_model_parallel_size={pp}")
            out[(name, layout)] = [build(cfg).train_step()]
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_ranks(_single, world_size=1, tmp=str(tmp_path_factory.mktemp("est")))[0]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("est_par"))
    refs = run_ranks(_references, world_size=1, tmp=tmp, names=[*PARITY, *PADDED])[0]
    return refs, run_ranks(_layouts, world_size=2, tmp=tmp)[0]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus"])
def test_critic_free_estimators_train_the_policy_and_not_the_value_head(single, name):
    run = single[name]
    for m in run["metrics"]:
        assert torch.isfinite(torch.tensor([m["policy_loss"], m["grad_norm"]])).all()
        assert "value_loss" not in m and "explained_variance" not in m  # no values computed
    assert any(m["grad_norm"] > 0 for m in run["metrics"])
    assert not run["head_changed"]
    assert single["shared"]["head_changed"]  # the comparison is not vacuous


def test_kl_in_the_loss_instead_of_the_reward(single):
    m = single["kl_in_loss"]["metrics"]
    assert all("kl_loss" in s and s["kl_loss"] >= 0 for s in m)  # k3 is non-negative
    assert m[1]["kl_loss"] > 0  # the first update moved the actor off the reference
    # no KL in the reward: the token rewards sum to the score
    assert m[1]["token_reward_sum_mean"] == pytest.approx(m[1]["reward_mean"], rel=1e-5)
    # the betas logged are the ones applied: none in the reward (not kl.init_kl_coef's 0.3),
    # kl.loss_coef on the loss's KL term (#50)
    assert [(s["kl_coef"], s["kl_loss_coef"]) for s in m] == [(0.0, 0.1), (0.0, 0.1)]
    assert "kl_loss_coef" not in single["shared"]["metrics"][0]
    assert single["shared"]["metrics"][1]["token_reward_sum_mean"] != pytest.approx(
        single["shared"]["metrics"][1]["reward_mean"], rel=1e-5)


def test_precision_auto_is_resolved_to_a_concrete_choice_before_the_build(single):
    from nemo_rlhf.models.config import host_bf16

    expected = "bf16-mixed" if host_bf16()[0] else "32"  # the machine's, whatever its load
    run = single["precision_auto"]
    assert run["precision"] == expected
    assert all(torch.isfinite(torch.tensor(m["grad_norm"])) for m in run["metrics"])


@pytest.mark.parametrize("fused, logits", [("shared", "logits_path"), ("chunk3", "logits_path"),
                                           ("unscaled_kl_chunk3", "unscaled_kl_logits"),
                                           ("token_budget", "varied"), ("separate_budget", "separate"),
                                           ("separate_packed", "separate")])
def test_the_fused_chunked_output_layer_and_token_budget_train_like_the_plain_path(single, fused, logits):
    for a, b in zip(single[fused]["metrics"], single[logits]["metrics"]):
        assert a.keys() == b.keys()
        for key in COMPARED + ("value_loss", "clip_fraction", "kl_mean", "explained_variance"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert single[logits]["metrics"][1]["kl_mean"] != 0  # the second step saw an updated actor


@pytest.mark.parametrize("recompute, plain", [("recompute_full", "shared"),
                                              ("recompute_separate_packed", "separate_packed")])
def test_activation_recompute_trains_exactly_like_keeping_the_activations(single, recompute, plain):
    assert single[plain]["recompute"] is None
    assert single[recompute]["recompute"] == {"recompute_full": "full"}.get(recompute, "selective")
    for a, b in zip(single[recompute]["metrics"], single[plain]["metrics"]):
        for key in COMPARED + ("value_loss", "clip_fraction", "explained_variance") + COMPARED_IF_PRESENT:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (recompute, key)
    assert single[plain]["metrics"][1]["kl_mean"] != 0  # the second step saw an updated actor


def test_the_token_budget_cuts_padding(single):
    for budget, rows in (("token_budget", "varied"), ("separate_budget", "separate")):
        for a, b in zip(single[budget]["metrics"], single[rows]["metrics"]):
            assert 0 <= a["padding_fraction"] < b["padding_fraction"] < 1
    for a, b in zip(single["separate_packed"]["metrics"], single["separate_budget"]["metrics"]):
        assert 0 <= a["padding_fraction"] < b["padding_fraction"]


def test_old_logprobs_and_values_from_the_rollout_train_like_the_forward_pass(single):
    for name, ref in (("from_rollout", "shared"), ("from_rollout_grpo", "grpo")):
        got, want = single[name]["metrics"], single[ref]["metrics"]
        for a, b in zip(got, want):
            assert "timing/old_logprobs_values_s" in b and "timing/old_logprobs_values_s" not in a
            for key in COMPARED + ("value_loss", "clip_fraction", "explained_variance"):
                if key in b:
                    assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (name, key)
            # the training forward recomputes what the decode gave: ~1, not exactly 1
            # "old" by the fused forward-only pass, "new" by the training pass over the same
            # weights and tokens: equal to fp32 rounding (bit-equal on AVX-512/AMX kernels;
            # 1 + 2.4e-7, two fp32 ulps, with torch/oneDNN/MKL held to AVX2)
            assert b["first_minibatch/ratio_max"] == pytest.approx(1.0, rel=0, abs=1e-6)
            assert a["first_minibatch/ratio_max"] == pytest.approx(1.0, abs=1e-4)
            assert a["rollout_train_logprob_diff_max"] == 0.0  # rollout vs "old": the same numbers now
    assert "kl.temperature=sampling" in single["errors"]["from_rollout_unscaled_kl"]
    assert "rollout.top_p=1.0" in single["errors"]["from_rollout_vllm_top_p"]
    assert "set rollout.min_new_tokens=0" in single["errors"]["from_rollout_vllm_min_tokens"]
    for name, key in (("from_rollout_tis", "ppo.rollout_is_cap=2.0"),
                      ("from_rollout_mask", "ppo.rollout_mask_threshold=0.5")):
        assert key in single["errors"][name] and "no-op" in single["errors"][name]
        assert "ppo.old_logprobs_from_rollout=false" in single["errors"][name]


def test_values_from_the_rollout_with_mlp_recompute_train_like_without(single):
    assert single["from_rollout_recompute_mlp"]["recompute"] == "selective"
    for a, b in zip(single["from_rollout_recompute_mlp"]["metrics"], single["from_rollout"]["metrics"]):
        assert "timing/old_logprobs_values_s" not in a
        for key in COMPARED + ("value_loss", "clip_fraction", "explained_variance"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


def test_old_logprobs_from_the_rollout_refuses_what_it_cannot_take(tmp_path):
    from nemo_rlhf.rollout.config import RolloutConfig
    from nemo_rlhf.rollout.engines import build_rollout_engine

    with pytest.raises(ValueError, match="rollout.engine=megatron"):
        build_rollout_engine(RolloutConfig(engine="vllm"), None, None, eos_token_id=1, pad_token_id=0,
                             with_values=True)
    # refused when the job is built, not at the first rollout
    with pytest.raises(ValueError, match="rollout.use_kv_cache=true or ppo.old_logprobs_from_rollout=false"):
        build_rollout_engine(RolloutConfig(use_kv_cache=False), None, None, eos_token_id=1, pad_token_id=0,
                             with_values=True)


def test_rollout_correction_weights_the_policy_loss_and_reports_its_metrics(single):
    tis, plain = single["tis"]["metrics"], single["shared"]["metrics"]
    keys = {"rollout_correction/" + k for k in ("mismatch", "mismatch_max", "is_weight", "is_weight_max",
                                                 "is_truncated_fraction", "masked_fraction")}
    assert keys <= set(tis[0]) and not keys & set(plain[0])
    for m in tis:
        # the megatron decode and the training forward differ in the last bits only
        assert 0 <= m["rollout_correction/mismatch_max"] < 1e-3
        assert m["rollout_correction/is_weight_max"] <= 1.0 and m["rollout_correction/masked_fraction"] == 0
        # per row (#52): none masked; a row with a truncated token whenever a token is
        assert m["rollout_correction/masked_rows_fraction"] == 0.0
        assert (m["rollout_correction/is_truncated_rows_fraction"] > 0) == (m["rollout_correction/is_truncated_fraction"] > 0)
        assert 0.0 <= m["rollout_correction/is_truncated_rows_fraction"] <= 1.0
        assert m["rollout_correction/is_weight"] == pytest.approx(1.0, abs=1e-3)
    assert tis[0]["policy_loss"] == pytest.approx(plain[0]["policy_loss"], rel=1e-2, abs=1e-4)
    # mask mode: the same first rollout (same seed), its tokens above the cap dropped, not
    # truncated: the share truncated above is the share dropped here; the others keep rho ~ 1
    cap_mask = single["tis_mask"]["metrics"][0]
    dropped = cap_mask["rollout_correction/is_masked_fraction"]
    assert "rollout_correction/is_truncated_fraction" not in cap_mask
    assert dropped == tis[0]["rollout_correction/is_truncated_fraction"] and 0 < dropped < 1
    assert cap_mask["rollout_correction/is_weight"] == pytest.approx(1.0 - dropped, abs=1e-3)
    assert cap_mask["rollout_correction/is_masked_rows_fraction"] == tis[0]["rollout_correction/is_truncated_rows_fraction"]
    assert 0 < cap_mask["rollout_correction/is_masked_rows_fraction"] <= 1
    masked = single["mask_all"]["metrics"]
    assert masked[0]["rollout_correction/masked_fraction"] > 0.5  # the last bits exceed 1e-12 nats
    assert 0.5 < masked[0]["rollout_correction/masked_rows_fraction"] <= 1.0  # of the rows, too
    assert "rollout_correction/is_truncated_rows_fraction" not in masked[0]  # no cap
    assert masked[0]["grad_norm"] < plain[0]["grad_norm"]


def test_detached_critic_sends_no_value_gradient_into_the_backbone(single):
    assert single["shared_detached"]["backbone_grad_from_values"] == 0.0
    assert single["shared"]["backbone_grad_from_values"] > 0.0
    assert single["shared_detached"]["head_changed"]


def test_token_budget_micro_batches_train_like_padded_rows_and_cut_padding(parity):
    refs, par = parity
    budget, padded = refs["gae_token_budget"][0], refs["gae_padded"][0]
    for key in COMPARED + tuple(k for k in COMPARED_IF_PRESENT if k in padded):
        assert abs(budget[key] - padded[key]) <= 1e-4 * max(1.0, abs(padded[key])), key
    assert budget["padding_fraction"] < padded.get("padding_fraction", 1.0)
    for layout in ("tp2", "pp2"):  # the same budget, cut the same way, in every layout
        assert par[("gae_token_budget", layout)][0]["padding_fraction"] == budget["padding_fraction"]


def test_packed_micro_batches_train_like_padded_rows_without_padding(parity):
    refs, par = parity
    packed, padded = refs["gae_packed"][0], refs["gae_padded"][0]
    budget = refs["gae_token_budget"][0]
    for key in COMPARED + tuple(k for k in COMPARED_IF_PRESENT if k in padded):
        assert abs(packed[key] - padded[key]) <= 1e-4 * max(1.0, abs(padded[key])), key
    assert packed["padding_fraction"] < budget["padding_fraction"] < padded["padding_fraction"]
    for layout in ("tp2", "pp2"):
        assert par[("gae_packed", layout)][0]["padding_fraction"] == packed["padding_fraction"]


@pytest.mark.parametrize("name", list(PARITY))
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_first_step_metrics_match_tp1(parity, name, layout):
    refs, par = parity
    ref, got = refs[name][0], par[(name, layout)][0]
    for key in COMPARED + tuple(k for k in COMPARED_IF_PRESENT if k in ref):
        assert abs(got[key] - ref[key]) <= 1e-4 * max(1.0, abs(ref[key])), f"{layout} {key}"
    assert ref["grad_norm"] > 0
    if name == "gae_separate":
        assert ref["critic_grad_norm"] > 0 and "critic_grad_norm" in got


def test_groups_stay_whole_and_on_one_dp_rank():
    from nemo_rlhf.trainers.ppo.config import PPOAlgoConfig, validate_batch_sizes
    from nemo_rlhf.trainers.ppo.state import dp_group_slice

    prompts = [10, 11, 12, 13]
    ranks = [dp_group_slice(prompts, r, 2, 3) for r in range(2)]
    assert ranks == [[10, 10, 10, 11, 11, 11], [12, 12, 12, 13, 13, 13]]
    with pytest.raises(ValueError, match="rollout.n_samples_per_prompt=3"):
        validate_batch_sizes(PPOAlgoConfig(num_rollout_samples=8, global_batch_size=8,
                                           micro_batch_size=2, forward_micro_batch_size=2), 2, 3)


def test_config_rejects_what_cannot_work(tmp_path):
    data = make_demo_data(tmp_path / "data")
    with pytest.raises(Exception, match="n_samples_per_prompt >= 2"):
        compose_ppo(data, tmp_path / "x", "ppo.advantage_estimator=grpo")
    with pytest.raises(Exception, match="ppo.advantage_estimator='ppo2'.*valid choices"):
        compose_ppo(data, tmp_path / "x", "ppo.advantage_estimator=ppo2")
    with pytest.raises(Exception, match="ppo.loss_agg_mode"):
        compose_ppo(data, tmp_path / "x", "ppo.loss_agg_mode=mean")
    with pytest.raises(Exception, match="critic.mode='separated'.*'separate'"):
        compose_ppo(data, tmp_path / "x", "critic.mode=separated")
    with pytest.raises(Exception, match="critic.mode=separate with the critic-free"):
        compose_ppo(data, tmp_path / "x", "critic.mode=separate", "ppo.advantage_estimator=rloo",
                    "rollout.n_samples_per_prompt=2")
    with pytest.raises(Exception, match="critic.init_from / critic.lr are for critic.mode=separate"):
        compose_ppo(data, tmp_path / "x", "critic.lr=1e-5")
