"""Expert parallelism (``parallel.expert_model_parallel_size=2``) on 2 gloo ranks agrees with
EP=1 (DP=2, every rank holding every expert). ONE spawn runs:

* the engine: a MoE model saved at EP=1 and loaded at EP=2 (each rank: 2 of the 4 experts);
  the two ranks hold different numbers of micro-batches of different shapes (rank 0 three,
  rank 1 one), so the token dispatcher pads and the schedule adds zero-loss copies; logits,
  the DP-reduced gradients (experts by their global index) and the gradient norm equal EP=1's;
* SFT and RM: two steps and their validations at EP=1 and EP=2 give the same metrics;
* PPO: from one initial checkpoint, two steps at EP=1, at EP=2 (each with a checkpoint
  after the first) and at TP=2; the EP=2 checkpoint resumed at EP=1 and at TP=2, and the EP=1
  checkpoint resumed at EP=2: saved again at once, the same tensors bit for bit (weights,
  Adam moments), and the same next step.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

VOCAB = 100
# the router losses on (large enough to move the gradient norm): each layout must weight them alike
ROUTER_LOSSES = dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
MOE = ("model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
       *(f"model.{k}={v}" for k, v in ROUTER_LOSSES.items()))
COMPARED = ("reward_mean", "response_length", "kl_mean", "policy_loss", "value_loss", "entropy",
            "approx_kl", "clip_fraction", "grad_norm", "returns_mean",
            "moe/tokens_per_expert_max_over_mean", "moe/tokens_per_expert_min_over_mean",
            "moe/aux_loss", "moe/z_loss")
# one mini-batch per step, greedy rollouts: every layout sees the same samples in the same update
COMMON = ("rollout.greedy=true", "ppo.num_rollout_samples=8", "ppo.global_batch_size=8",
          "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=2", "ppo.ppo_epochs=1",
          "ppo.shuffle=false", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
          "optim.lr=1e-3", "rollout.max_new_tokens=6", *MOE)
# (rows, columns) of each micro-batch, per rank: unequal counts and token counts
SHAPES = {0: [(2, 12), (2, 9), (1, 7)], 1: [(1, 5)]}


def _micro_batches(rank: int) -> list[dict]:
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for rows, cols in SHAPES[rank]:
        ids = torch.randint(3, VOCAB, (rows, cols), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # left padding in the first row
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _loss_fn(n_tokens: int):
    from nemo_rlhf.models.vocab_parallel import gather_vocab_parallel

    def fn(output, mb):
        logits, values = output
        full = gather_vocab_parallel(logits, None)[..., :VOCAB].float()
        lp = torch.log_softmax(full[:, :-1], -1).gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
        m = mb["attention_mask"][:, 1:].bool()
        loss = torch.where(m, -lp + 0.5 * values[:, :-1] ** 2, 0.0).sum() / n_tokens
        return loss, {"loss": loss.detach(), "logits": full.detach()}

    return fn


def _global_expert_name(name: str, ep_rank: int, local: int) -> str:
    """``...local_experts.<i>...`` -> the global expert index ``ep_rank * local + i``."""
    name = name.replace("module.", "")
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{ep_rank * local + int(m.group(1))}.",
                  name)


def _engine(ep: int, tmp: Path, n_tokens: int, routed_tokens: int) -> dict:
    """Forward-only logits, then one training forward/backward, DP-reduced gradients by
    global name and the gradient norms, at ``ep``."""
    from nemo_rlhf.checkpoint import load_model_weights, save_checkpoint
    from nemo_rlhf.checkpoint.optimizer_state import global_param_names
    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.engine import finalize_grads, forward_backward, unwrap, wrap_ddp
    from nemo_rlhf.models.moe import RouterLoad
    from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig

    cfg = load_model_preset("tiny", vocab_size=VOCAB, value_head_init_std=0.05, num_moe_experts=4,
                            moe_router_topk=2, moe_ffn_hidden_size=32, **ROUTER_LOSSES)
    dims = initialize_distributed(ParallelConfig(expert_model_parallel_size=ep), seed=3,
                                  num_moe_experts=cfg.num_moe_experts)
    model = build_model(cfg, dims, seed=11)
    if ep == 1:
        save_checkpoint(tmp / "engine_weights", 0, model, dims=dims)
    else:  # the EP=1 weights, resharded: this rank's two experts
        load_model_weights(tmp / "engine_weights" / "step_0", model)
    ddp = wrap_ddp(model)
    mbs = _micro_batches(dims.rank)
    out = {"dims": (dims.dp, dims.ep, dims.ep_rank)}
    with torch.no_grad(), RouterLoad(model) as load:
        model.eval()
        res = forward_backward(ddp, mbs, _loss_fn(n_tokens), forward_only=True, variable_shapes=True,
                               device=dims.device)
        out["logits"] = [r["logits"] for r in res]
    out["routed"] = (load.counts.clone(), load.calls)  # this rank's tokens per expert, router calls
    model.train()
    with RouterLoad(model) as train_load:  # the router losses, logged unscaled
        res = forward_backward(ddp, mbs, _loss_fn(n_tokens), variable_shapes=True, device=dims.device,
                               routed_tokens=routed_tokens)
    out["losses"] = [float(r["loss"]) for r in res]
    out["router_losses"] = (train_load.aux_loss_sum, train_load.z_loss_sum)
    finalize_grads(ddp)
    local = cfg.num_moe_experts // dims.ep
    out["grads"] = {_global_expert_name(n, dims.ep_rank, local): p.main_grad.clone()
                    for n, p in unwrap(ddp).named_parameters()}
    opt = MixedPrecisionOptimizer(ddp, OptimizerConfig(clip_grad=0.0), mp_group=dims.mp_group,
                                  expert_mp_group=dims.expert_mp_group if dims.ep > 1 else None)
    out["param_names"] = global_param_names(ddp, opt.ordered_params)  # the Adam step table's
    opt._collect_grads()
    out["grad_norm"] = opt.grad_norm()
    for name, m in zip(opt.names, opt.masters):  # the experts' share alone
        if "local_experts" not in name:
            m.grad = None
    out["expert_grad_norm"] = opt.grad_norm()
    # as before expert parallelism: the experts' squares summed over the model-parallel
    # group only, i.e. this rank's two experts
    opt.expert_parallel = [False] * len(opt.params)
    out["expert_grad_norm_without_expert_group"] = opt.grad_norm()
    out["generated"] = _generate(model, dims)
    out["expert_allreduce_flags"] = sorted({bool(getattr(p, "allreduce", True))
                                            for n, p in model.named_parameters() if "local_experts" in n})
    return out


# per rank: prompts of other lengths and counts; rank 1 stops after its first token
PROMPTS = {0: [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]], 1: [[20, 21, 22, 23], [30]]}


def _generate(model, dims) -> dict:
    """Greedy KV-cache decoding of this rank's :data:`PROMPTS` (rank 0 decodes 6 tokens,
    rank 1 stops at its first: every token id is a stop id there)."""
    from nemo_rlhf.rollout.config import RolloutConfig
    from nemo_rlhf.rollout.generate import generate

    stop = list(range(VOCAB)) if dims.rank == 1 else []
    batch = generate(model, dims, PROMPTS[dims.rank], RolloutConfig(max_new_tokens=6, greedy=True, stop_token_ids=stop),
                     eos_token_id=2, pad_token_id=0, vocab_size=VOCAB, max_sequence_length=64)
    m = batch.response_mask
    return {"tokens": torch.where(m, batch.response_ids, -1), "logprobs": torch.where(m, batch.logprobs, 0.0),
            "lengths": batch.response_lengths.clone()}


def numbers(metrics: dict) -> dict:
    """A step's numeric metrics as floats."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))}


def initial_checkpoint(data, tmp: Path) -> str:
    """One initialisation for every layout (a random one depends on the expert layout):
    saved from a default-layout build; returns the ``exp_manager.init_from`` override."""
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.train_ppo import build

    t = build(compose_ppo(data, tmp / "init_run", *COMMON))
    save_checkpoint(tmp / "init", 0, t.model, dims=t.dims)
    t.close()
    return f"exp_manager.init_from={tmp}/init/step_0"


def _ppo(tmp: Path) -> dict:
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.checkpoint.io import load_full_tensors
    from nemo_rlhf.train_ppo import build

    data = make_demo_data(tmp / "data")
    init = initial_checkpoint(data, tmp)
    out = {}
    for ep in (1, 2):
        t = build(compose_ppo(data, tmp / f"ep{ep}", *COMMON, init, f"parallel.expert_model_parallel_size={ep}"))
        first = numbers(t.train_step())
        t.step = 1
        t.save()
        out[f"ep{ep}"] = [first, numbers(t.train_step())]
        out[f"ep{ep}_describe"] = t.dims.describe()
        t.close()
    # TP=2 (DP=1): megatron's MoE layer trains without sequence parallelism here
    # (nemo_rlhf.models.decode_layers.TensorParallelMoELayer); the same two steps as EP=1 (DP=2)
    t = build(compose_ppo(data, tmp / "tp2", *COMMON, init, "parallel.tensor_model_parallel_size=2"))
    out["tp2"] = [numbers(t.train_step()), numbers(t.train_step())]
    out["tp2_describe"] = t.dims.describe()
    t.close()
    layouts = ((1, "ep2", "parallel.expert_model_parallel_size=1"),
               (2, "ep1", "parallel.expert_model_parallel_size=2"),
               ("tp2", "ep2", "parallel.tensor_model_parallel_size=2"))
    for ep, source, layout in layouts:  # each checkpoint resumed at another layout
        t = build(compose_ppo(data, tmp / source, *COMMON, init, "exp_manager.resume=auto", layout))
        t.resume()
        out[f"{source}_at_ep{ep}_step"] = t.step
        # what was loaded, written again at this EP: the same tensors, Adam moments included
        resaved = save_checkpoint(tmp / f"{source}_at_ep{ep}", 1, t.model, t.optimizer, t.state_dict(), None, t.dims)
        full, src = load_full_tensors(resaved), load_full_tensors(tmp / source / "checkpoints" / "step_1")
        tensors = [k for k, v in src.items() if torch.is_tensor(v) and k.startswith(("model.", "optimizer"))]
        out[f"{source}_at_ep{ep}_tensors"] = (sorted(tensors) == sorted(k for k, v in full.items() if torch.is_tensor(v)
                                                                        and k.startswith(("model.", "optimizer"))),
                                              [k for k in tensors if not torch.equal(full[k], src[k])],
                                              sum(".experts." in k and "exp_avg" in k for k in tensors))
        out[f"{source}_at_ep{ep}"] = numbers(t.train_step())
        t.close()
    return out


def _supervised(tmp: Path) -> dict:
    """SFT and RM, two steps each at EP=1 and EP=2 (router losses on), from the PPO phase's
    initial checkpoint; validation sets whose shards leave the ranks unequal numbers of
    micro-batches (5 rows over 2 ranks, micro-batches of 2) and one rank none (an extra RM
    validation file of one pair). Returns rank 0's ``metrics.jsonl`` rows per run."""
    import json

    from nemo_rlhf.data.datasets import DataConfig
    from nemo_rlhf.distributed import ParallelConfig
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.trainers.mixed_precision import OptimizerConfig
    from nemo_rlhf.trainers.rm import RMConfig, RMRunConfig, RMTrainer
    from nemo_rlhf.trainers.sft import SFTConfig, SFTRunConfig, SFTTrainer
    from nemo_rlhf.trainers.supervised import SupervisedExpManagerConfig, SupervisedTrainerConfig

    data = tmp / "data"
    if torch.distributed.get_rank() == 0:
        for name, n in (("sft_val", 5), ("preference_val", 5), ("preference_val", 1)):
            lines = (data / f"{name}.jsonl").read_text().splitlines()[:n]
            (data / f"{name}_{n}.jsonl").write_text("".join(x + "\n" for x in lines))
    torch.distributed.barrier()
    init = str(tmp / "init" / "step_0")
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, **ROUTER_LOSSES)

    def common(run: str, ep: int, train: str, val: str):
        # the reward head starts at 0 (a random one would be drawn after the experts, whose
        # draws depend on the expert layout); the backbone is the checkpoint's
        return dict(
            model=load_model_preset("tiny", value_head_init_std=0.0, **moe),
            parallel=ParallelConfig(expert_model_parallel_size=ep), optim=OptimizerConfig(lr=1e-3),
            data=DataConfig(train_file=str(data / train), val_file=str(data / val),
                            tokenizer_dir=str(data / "tokenizer"), max_seq_length=24),
            trainer=SupervisedTrainerConfig(max_steps=2, global_batch_size=4, micro_batch_size=2,
                                            val_check_interval=2, log_every_n_steps=1),
            exp_manager=SupervisedExpManagerConfig(exp_dir=str(tmp / run), tensorboard=False, checkpoints=False))

    out = {}
    for ep in (1, 2):
        SFTTrainer(SFTRunConfig(**common(f"sft_ep{ep}", ep, "sft.jsonl", "sft_val_5.jsonl"),
                                sft=SFTConfig(num_sample_prompts=1, sample_max_new_tokens=3, init_from=init))).fit()
        RMTrainer(RMRunConfig(**common(f"rm_ep{ep}", ep, "preference.jsonl", "preference_val_5.jsonl"),
                              rm=RMConfig(init_from=init,
                                          extra_val_files={"one": str(data / "preference_val_1.jsonl")}))).fit()
        if torch.distributed.get_rank() == 0:
            for job in ("sft", "rm"):
                rows = [json.loads(x) for x in (tmp / f"{job}_ep{ep}" / "metrics.jsonl").read_text().splitlines()]
                out[f"{job}_ep{ep}"] = rows
    return out


def _worker(rank: int, tmp: str) -> dict:
    import time

    tmp = Path(tmp)
    n_tokens = sum(int(mb["attention_mask"][:, 1:].sum()) for r in SHAPES for mb in _micro_batches(r))
    routed = sum(int(mb["attention_mask"].sum()) for r in SHAPES for mb in _micro_batches(r))
    t0 = time.perf_counter()
    out = {"engine": {ep: _engine(ep, tmp, n_tokens, routed) for ep in (1, 2)}}
    out["engine_s"] = time.perf_counter() - t0
    out["ppo"] = _ppo(tmp)
    out["ppo_s"] = time.perf_counter() - t0 - out["engine_s"]
    out["supervised"] = _supervised(tmp)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, world_size=2, tmp=str(tmp_path_factory.mktemp("expert_parallel")))


def test_ep2_splits_the_experts_and_marks_them_expert_parallel(ranks):
    for rank, r in enumerate(ranks):
        assert r["engine"][1]["dims"] == (2, 1, 0)
        assert r["engine"][2]["dims"] == (2, 2, rank)
        assert r["engine"][1]["expert_allreduce_flags"] == [True]  # EP=1: reduced over DP
        assert r["engine"][2]["expert_allreduce_flags"] == [False]  # EP=2: over expert-DP
        assert r["ppo"]["ep2_describe"]["ep"] == 2 and "ep" not in r["ppo"]["ep1_describe"]


def test_ep2_forward_with_unequal_micro_batches_gives_ep1_logits(ranks):
    """Rank 0 holds three micro-batches (12, 9 and 7 columns), rank 1 one (5 columns): the
    dispatcher pads the shorter token lists and rank 1 runs two zero-loss copies."""
    for rank, r in enumerate(ranks):
        got, ref = r["engine"][2]["logits"], r["engine"][1]["logits"]
        assert len(got) == len(ref) == len(SHAPES[rank])  # the copies' results are dropped
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        assert r["engine"][2]["losses"] == pytest.approx(r["engine"][1]["losses"], abs=1e-6)
        # the router metrics count this rank's own tokens, the copies' not
        (counts, calls), (ref_counts, ref_calls) = r["engine"][2]["routed"], r["engine"][1]["routed"]
        assert calls == ref_calls == 2 * len(SHAPES[rank]) and torch.equal(counts, ref_counts)
        # the copies add no router loss (their coefficients are 0): EP=1's values
        aux, z = r["engine"][2]["router_losses"]
        assert aux > 0 and z > 0
        assert (aux, z) == pytest.approx(r["engine"][1]["router_losses"], rel=1e-5)


def test_ep2_decoding_stops_when_every_expert_parallel_rank_is_done(ranks):
    """Rank 1's rows are done after one token; at EP=2 it keeps stepping (pad tokens) while
    rank 0 decodes, its MoE layers joining rank 0's calls; the valid tokens are EP=1's."""
    for rank, r in enumerate(ranks):
        ref, got = r["engine"][1]["generated"], r["engine"][2]["generated"]
        assert torch.equal(got["lengths"], ref["lengths"])
        n = ref["tokens"].shape[1]
        assert torch.equal(got["tokens"][:, :n], ref["tokens"]) and bool((got["tokens"][:, n:] == -1).all())
        torch.testing.assert_close(got["logprobs"][:, :n], ref["logprobs"], atol=1e-5, rtol=0)
    assert ranks[1]["engine"][1]["generated"]["lengths"].tolist() == [1, 1]
    assert ranks[1]["engine"][1]["generated"]["tokens"].shape[1] == 1  # alone: one step
    assert ranks[1]["engine"][2]["generated"]["tokens"].shape[1] == ranks[0]["engine"][2]["generated"]["tokens"].shape[1] > 1


def test_ep2_gradients_equal_ep1_for_every_expert_and_dense_weight(ranks):
    """Expert weights are reduced over the expert-data-parallel group (size 1 here): their
    gradients hold both ranks' tokens, as EP=1's DP-summed ones do. The router losses are
    on: rank 1's two zero-loss copies add none to the routers' gradients."""
    for r in ranks:
        ref, got = r["engine"][1]["grads"], r["engine"][2]["grads"]
        assert set(got) <= set(ref) and any("local_experts.2." in n for n in ref)
        assert len([n for n in got if "local_experts" in n]) * 2 == len([n for n in ref if "local_experts" in n])
        for name, g in got.items():
            torch.testing.assert_close(g, ref[name], atol=1e-6, rtol=1e-5, msg=name)
        assert float(ref["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"].abs().sum()) > 0


def test_checkpoint_names_of_expert_parameters_are_their_global_ones(ranks):
    """The Adam step table is merged over ranks by name: at EP=2 rank 1's local experts 0
    and 1 are experts 2 and 3, and the two ranks' names together are EP=1's."""
    ep1 = set(ranks[0]["engine"][1]["param_names"])
    assert ep1 == set(ranks[1]["engine"][1]["param_names"])
    ep2 = [set(r["engine"][2]["param_names"]) for r in ranks]
    assert ep2[0] | ep2[1] == ep1
    assert {n for n in ep2[0] ^ ep2[1]} == {n for n in ep1 if "local_experts" in n}
    assert any(".local_experts.3." in n for n in ep2[1]) and not any(".local_experts.3." in n for n in ep2[0])


def test_ep2_grad_norm_counts_every_expert_once(ranks):
    ref = ranks[0]["engine"][1]["grad_norm"]
    assert ref > 0
    experts = ranks[0]["engine"][1]["expert_grad_norm"]
    assert experts > 0
    for r in ranks:
        assert r["engine"][2]["grad_norm"] == pytest.approx(ref, rel=1e-6)
        assert r["engine"][2]["expert_grad_norm"] == pytest.approx(experts, rel=1e-5)
    # summed over the model-parallel group alone, each rank would count its own two experts:
    # two different norms, whose squares add up to the right one
    partial = [r["engine"][2]["expert_grad_norm_without_expert_group"] for r in ranks]
    assert abs(partial[0] - partial[1]) > 1e-3 * experts and max(partial) < 0.99 * experts
    assert partial[0] ** 2 + partial[1] ** 2 == pytest.approx(experts ** 2, rel=1e-5)


def test_ppo_first_step_at_ep2_equals_ep1(ranks):
    ppo = ranks[0]["ppo"]
    ref, got = ppo["ep1"][0], ppo["ep2"][0]
    assert ref["grad_norm"] > 0 and ref["reward_mean"] > 0  # the comparison is not vacuous
    for key in COMPARED:
        assert abs(got[key] - ref[key]) <= 1e-5 * max(1.0, abs(ref[key])), f"{key}: EP=2 {got[key]} vs EP=1 {ref[key]}"


def test_ppo_second_step_at_ep2_equals_ep1(ranks):
    ppo = ranks[0]["ppo"]
    for key in COMPARED:
        a, b = ppo["ep2"][1][key], ppo["ep1"][1][key]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"{key}: EP=2 {a} vs EP=1 {b}"


def test_ppo_at_tp2_trains_the_moe_model_as_tp1_does(ranks):
    """megatron's MoE layer refuses training at TP > 1 without sequence parallelism (a
    performance check); TensorParallelMoELayer trains there and gives TP=1's steps."""
    ppo = ranks[0]["ppo"]
    assert ppo["tp2_describe"]["tp"] == 2
    for step, tol in ((0, 1e-5), (1, 1e-4)):
        ref, got = ppo["ep1"][step], ppo["tp2"][step]
        for key in COMPARED:
            assert abs(got[key] - ref[key]) <= tol * max(1.0, abs(ref[key])), \
                f"step {step + 1} {key}: TP=2 {got[key]} vs TP=1 {ref[key]}"
    for step in (0, 1):  # both TP ranks report the same step
        assert {k: ranks[1]["ppo"]["tp2"][step][k] for k in COMPARED} == {k: ppo["tp2"][step][k] for k in COMPARED}


@pytest.mark.parametrize("source, ep", [("ep2", 1), ("ep1", 2), ("ep2", "tp2")])
def test_a_checkpoint_saved_at_one_ep_resumes_at_the_other_with_the_same_next_step(ranks, source, ep):
    ppo = ranks[0]["ppo"]
    assert ppo[f"{source}_at_ep{ep}_step"] == 1
    same_keys, differing, expert_moments = ppo[f"{source}_at_ep{ep}_tensors"]
    assert same_keys and not differing, differing  # weights, Adam moments, masters: bit for bit
    assert expert_moments >= 2  # the experts' exp_avg (fc1, fc2) among them
    resumed, continued = ppo[f"{source}_at_ep{ep}"], ppo[source][1]
    for key in COMPARED:
        a, b = resumed[key], continued[key]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"{key}: resumed at EP={ep} {a} vs {source} {b}"


@pytest.mark.parametrize("job, keys", [
    ("sft", ("train/loss", "grad_norm", "val/loss")),
    ("rm", ("train/loss", "grad_norm", "val/accuracy", "val/margin", "val_one/margin",
            "final/train_reward_mean", "final/train_reward_std")),
])
def test_sft_and_rm_at_ep2_equal_ep1(ranks, job, keys):
    """The SFT and RM jobs at EP=2: every rank makes the same forward calls (one per
    training step and per validation set, a filler where it holds no row), and the metrics
    are EP=1's (router losses on)."""
    sup = ranks[0]["supervised"]

    def by_key(rows):
        got = {}
        for r in rows:
            for k, v in r.items():
                got.setdefault(k, []).append(v)
        return got

    ref, got = by_key(sup[f"{job}_ep1"]), by_key(sup[f"{job}_ep2"])
    for key in keys:
        assert ref[key] and len(got[key]) == len(ref[key]), key
        for a, b in zip(got[key], ref[key]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"{job} {key}: EP=2 {a} vs EP=1 {b}"
    assert ref["grad_norm"][0] > 0
