"""Multi-turn episodes (#51) under TP=2 and PP=2 on 2 gloo ranks agree with one rank.

One spawn: TP=1 reference (each rank its own DP replica), then TP=2, then PP=2 (the PP
stages load the PP=1 weights by global layer name), as ``test_rollout_parallel.py`` does.
The environments are stepped on one rank of each model-parallel group only, and their
outcomes shared: every rank ends with the same episodes.
"""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.envs import EnvLimits, Environment, StepResult
from tests.distributed.harness import run_ranks
from tests.distributed.test_rollout_parallel import VOCAB, _global_name, _model_cfg

PAD = 0
EOS = VOCAB - 1
PROBLEMS = [7, 12345, 42, 9999999]


def encode(text: str) -> list[int]:
    return [3 + (b % 90) for b in text.encode()]


def decode(ids) -> str:
    return "".join(chr(33 + (int(i) % 90)) for i in ids)


class CountingEnv(Environment):
    """Observations of different lengths per episode; done after ``done_after`` turns;
    counts its ``step`` calls (only the leader rank's instances should be stepped)."""

    def __init__(self, done_after: int):
        self.done_after, self.steps = done_after, 0

    def reset(self, problem) -> str:
        self.problem, self.k = problem, 0
        return f"Q{problem}:"

    def step(self, trajectory_so_far, last_action_text) -> StepResult:
        self.steps += 1
        self.k += 1
        if self.k >= self.done_after:
            return StepResult(None, True, float(self.k))
        return StepResult(f"o{self.k}:{self.problem}#" * self.k, False)


def _episodes(model, dims, **cfg):
    from nemo_rlhf.rollout import RolloutConfig
    from nemo_rlhf.rollout.episodes import run_episodes

    envs = [CountingEnv(n) for n in (1, 3, 2, 3)]
    eps = run_episodes(model, dims, envs, PROBLEMS, RolloutConfig(max_new_tokens=5, **cfg),
                       EnvLimits(max_turns=4, max_total_tokens=80), encode_prompt=encode,
                       encode_observation=encode, decode_fn=decode, eos_token_id=EOS,
                       pad_token_id=PAD, vocab_size=VOCAB, max_sequence_length=96, call_index=0)
    return {"train_diff": _train_diff(model, dims, eps, cfg.get("temperature", 1.0)),
            "ids": [e.trajectory.token_ids for e in eps],
            "mask": [e.trajectory.loss_mask for e in eps],
            "logprobs": [e.trajectory.logprobs for e in eps],
            "rewards": [e.turn_rewards for e in eps],
            "reasons": [e.stop_reason for e in eps],
            "steps": sum(e.steps for e in envs)}


def _train_diff(model, dims, eps, temperature):
    """Max |behaviour - training| log-prob over the policy tokens, the training forward run
    through the engine's schedule over ``to_padded_batch``'s layout (last stage; else None)."""
    from nemo_rlhf.models.engine import forward_backward
    from nemo_rlhf.models.logprobs import response_logprobs
    from nemo_rlhf.rollout.trajectory import to_padded_batch

    padded = to_padded_batch([e.trajectory for e in eps], PAD, dims.device)
    with torch.no_grad():
        res = forward_backward(model, [{"input_ids": padded.input_ids,
                                        "attention_mask": padded.attention_mask}],
                               loss_fn=None, forward_only=True)
    if not res:
        return None
    logits, _values = res[0]["output"]
    train, _ = response_logprobs(logits, (padded.input_ids, padded.prompt_length), dims, temperature,
                                 vocab_size=VOCAB, compute_entropy=False)
    return float((train - padded.logprobs).abs()[padded.response_mask].max())


def _run_all(model, dims):
    return {"greedy": _episodes(model, dims, greedy=True),
            "sample": _episodes(model, dims, temperature=0.7, top_p=0.9, seed=3)}


def _worker(rank: int):
    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model

    cfg = _model_cfg()  # max_position_embeddings 128 >= 96
    out = {}
    dims = initialize_distributed(ParallelConfig(), seed=3, num_layers=cfg.num_layers)
    model = build_model(cfg, dims, seed=11)
    ref_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["dp_rank_tp1"] = dims.dp_rank
    out["tp1"] = _run_all(model, dims)

    dims = initialize_distributed(ParallelConfig(tensor_model_parallel_size=2), seed=3)
    model = build_model(cfg, dims, seed=11)
    out["tp2"] = _run_all(model, dims)
    out["tp_rank"] = dims.tp_rank

    dims = initialize_distributed(ParallelConfig(pipeline_model_parallel_size=2), seed=3,
                                  num_layers=cfg.num_layers)
    model = build_model(cfg, dims, seed=11)
    per_stage = cfg.num_layers // 2
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ref_weights[_global_name(n, dims.pp_rank, per_stage)])
    out["pp2"] = _run_all(model, dims)
    out["pp_rank"] = dims.pp_rank
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, world_size=2)


def _same(a, b):
    assert a["ids"] == b["ids"] and a["mask"] == b["mask"]
    assert a["rewards"] == b["rewards"] and a["reasons"] == b["reasons"]
    for x, y in zip(a["logprobs"], b["logprobs"]):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=0)


def test_tp2_and_pp2_episodes_equal_one_rank(results):
    ref = results[0]["tp1"]  # DP rank 0: the sampler seed of the TP / PP groups
    assert results[0]["dp_rank_tp1"] == 0
    for mode in ("greedy", "sample"):
        assert ref[mode]["reasons"] == ["done"] * 4
        assert [sum(1 for j, m in enumerate(mk) if m and (j == 0 or not mk[j - 1]))
                for mk in ref[mode]["mask"]] == [1, 3, 2, 3]  # policy turns per episode: they end at different turns
    for r in results:
        for layout in ("tp2", "pp2"):
            for mode in ("greedy", "sample"):
                _same(r[layout][mode], ref[mode])


def test_behaviour_logprobs_equal_the_training_forward_in_every_layout(results):
    for r in results:
        for layout in ("tp1", "tp2", "pp2"):
            for mode in ("greedy", "sample"):
                diff = r[layout][mode]["train_diff"]
                if layout == "pp2" and r["pp_rank"] == 0:
                    assert diff is None  # only the last stage has logits
                    continue
                assert diff < 1e-5, f"{layout} {mode}: max |rollout - train| = {diff}"


def test_environments_are_stepped_on_one_rank_of_the_group(results):
    turns = 1 + 3 + 2 + 3
    for r in results:
        assert r["tp1"]["greedy"]["steps"] == turns  # alone: each rank steps its own
        leader_tp = r["tp_rank"] == 0
        assert r["tp2"]["greedy"]["steps"] == (turns if leader_tp else 0)
        leader_pp = r["pp_rank"] == 1
        assert r["pp2"]["greedy"]["steps"] == (turns if leader_pp else 0)
