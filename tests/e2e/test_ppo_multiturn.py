"""PPO on multi-turn episodes (#51): ``env.name`` makes the trainer roll out episodes with
an environment (:class:`~nemo_rlhf.trainers.ppo.episode_source.EpisodeRolloutSource`) and
train on them; ``env.name`` null keeps the single-turn source. One rank, the tiny model."""

from __future__ import annotations

import itertools
import json
import math
import traceback
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import TwoTurnEnv, compose_ppo, make_demo_data

EPISODE_KEYS = ("episode/turns_mean", "episode/tool_calls_mean", "episode/malformed_call_rate",
                "episode/truncated_rate", "episode/policy_tokens_mean", "episode/total_tokens_mean",
                "episode/env_reward_mean")


def _worker(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    cfg = compose_ppo(data, tmp / "exp", "env.name=tests.ppo_helpers:two_turn_env", "env.max_total_tokens=64",
                      "reward.functions=[{name: env}]")
    trainer = build(cfg)
    obs_ids = trainer.tok.encode(TwoTurnEnv.OBSERVATION)
    out = {"source": type(trainer.rollout_source).__name__, "obs_ids": obs_ids, "metrics": [], "rows": []}
    for _ in range(2):
        out["metrics"].append(trainer.train_step())
        idx, batch, scores = trainer._last_batch
        P = batch.prompt_length
        for b, ep in enumerate(batch.episodes):
            tr = ep.trajectory
            out["rows"].append({
                "turns": tr.turns, "segments": [(s.kind, s.start - tr.prompt_length, s.end - tr.prompt_length)
                                                for s in tr.segments],
                "mask": batch.response_mask[b].tolist(), "attn": batch.attention_mask[b, P:].tolist(),
                "ids": batch.input_ids[b, P:].tolist(), "length": int(batch.response_lengths[b]),
                "score": float(scores[b]), "env_reward": sum(r for r in ep.turn_rewards if r is not None),
                "device_ok": all(t.device == trainer.dims.device for t in (
                    batch.input_ids, batch.attention_mask, batch.response_mask, batch.logprobs,
                    batch.response_lengths))})
    # the held-out evaluation of the trained policy: greedy episodes with the environment
    out["eval"] = trainer.evaluate()
    samples = Path(cfg.exp_manager.exp_dir) / "eval_samples" / f"step_{trainer.step:06d}.jsonl"
    out["samples"] = [json.loads(line) for line in samples.read_text().splitlines()]
    out["obs_text"] = trainer.tok.decode(obs_ids)
    try:  # a failure here fails its own test, not the fixture of every test of the module
        out["old_logprobs"] = _old_logprobs_runs(data, tmp)
    except Exception:  # noqa: BLE001
        out["old_logprobs"] = {"error": traceback.format_exc()}
    return out


# ppo.old_logprobs_from_rollout with episodes, with the value head on the actor's backbone (the
# old values from the episode decode too) and with a separate critic (its own forward); lr 1e-3
# so that the second mini-batch's ratios move off 1 (clipped); a random value head (it starts at 0:
# every old value 0, in or out of its column)
OLD_LP = ("env.name=tests.ppo_helpers:two_turn_env", "env.max_total_tokens=64", "reward.functions=[{name: env}]",
          "optim.lr=1e-3", "model.value_head_init_std=0.05")
OLD_LP_CRITICS = ("shared", "separate")


def _old_logprobs_runs(data: Path, tmp: Path) -> dict:
    """The first PPO step on episodes with the old log-probs recomputed and taken from the
    rollout (each build re-seeds everything: the same episodes), with what the old log-probs
    were on the environment's tokens."""
    from nemo_rlhf.train_ppo import build

    out = {}
    for critic, (name, extra) in itertools.product(OLD_LP_CRITICS, (
            ("recompute", ()), ("from_rollout", ("ppo.old_logprobs_from_rollout=true",)))):
        trainer = build(compose_ppo(data, tmp / f"old_lp_{critic}_{name}", *OLD_LP, f"critic.mode={critic}",
                                    *extra))
        seen, forward = {}, trainer.compute_old_and_reference

        def capture(batch, forward=forward, seen=seen):
            fwd = forward(batch)
            env = torch.zeros_like(batch.response_mask)  # the environment's tokens: holes before the extent
            for b, n in enumerate(batch.response_lengths.tolist()):
                env[b, :n] = ~batch.response_mask[b, :n]
            seen["env_old_abs_max"] = float(fwd.old_logprobs[env].abs().max())
            seen["env_tokens"] = int(env.sum())
            return fwd

        trainer.compute_old_and_reference = capture
        out[(critic, name)] = {"metrics": trainer.train_step(), **seen}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, world_size=1, tmp=str(tmp_path_factory.mktemp("ppo_mt")))[0]


def test_env_name_builds_the_episode_source(results):
    assert results["source"] == "EpisodeRolloutSource"


def test_every_episode_has_two_policy_turns_and_the_mask_has_holes_exactly_at_the_observation(results):
    obs = results["obs_ids"]
    assert results["rows"]
    for row in results["rows"]:
        assert row["turns"] == 2
        (k1, s1, e1), (k2, s2, e2), (k3, s3, e3) = row["segments"]
        assert (k1, k2, k3) == ("policy", "env", "policy") and e1 == s2 and e2 == s3
        assert row["ids"][s2:e2] == obs
        expected = [True] * e1 + [False] * len(obs) + [True] * (e3 - s3)
        assert row["mask"][:e3] == expected
        assert not any(row["mask"][e3:])
        assert row["attn"][:e3] == [1] * e3 and not any(row["attn"][e3:])  # env tokens attended
        assert row["length"] == e3
        assert row["device_ok"]


def test_scores_are_the_episode_rewards(results):
    for row in results["rows"]:
        assert row["score"] == pytest.approx(row["env_reward"])
        assert row["env_reward"] in (1.0, 0.25)


def test_episode_metrics_are_logged_and_hand_checked(results):
    for m, rows in zip(results["metrics"], (results["rows"][:8], results["rows"][8:])):
        for k in EPISODE_KEYS:
            assert k in m and math.isfinite(m[k]), k
        assert m["episode/turns_mean"] == 2.0
        assert m["episode/tool_calls_mean"] == 1.0
        assert m["episode/malformed_call_rate"] == 0.0
        assert m["episode/truncated_rate"] == 0.0
        policy = sum(sum(r["mask"]) for r in rows) / len(rows)
        assert m["episode/policy_tokens_mean"] == pytest.approx(policy)
        assert m["response_length"] == pytest.approx(policy)  # policy tokens only
        assert m["episode/total_tokens_mean"] == pytest.approx(sum(r["length"] for r in rows) / len(rows))
        assert m["episode/total_tokens_mean"] - policy == pytest.approx(len(results["obs_ids"]))
        assert m["episode/env_reward_mean"] == pytest.approx(sum(r["env_reward"] for r in rows) / len(rows))
        assert math.isfinite(m["policy_loss"]) and math.isfinite(m["kl_mean"])


def test_the_heldout_evaluation_runs_episodes_with_the_environment(results):
    m, samples = results["eval"], results["samples"]
    assert m["eval/episode/turns_mean"] == 2.0  # single-turn decoding would have no turns at all
    assert m["eval/episode/tool_calls_mean"] == 1.0
    assert m["eval/episode/malformed_call_rate"] == 0.0 and m["eval/episode/truncated_rate"] == 0.0
    assert samples
    for row in samples:
        assert row["turns"] == 2
        assert results["obs_text"] in row["episode"]  # the environment's observation, between the turns
        # the reward (the `env` function: the episode's reward) scored the final answer
        assert row["score"] in (1.0, 0.25)
        assert row["episode"].endswith(row["response"]) and len(row["response"]) < len(row["episode"])
    assert m["eval/reward"] == pytest.approx(sum(r["score"] for r in samples) / len(samples))


@pytest.mark.parametrize("critic", OLD_LP_CRITICS)
def test_old_logprobs_from_the_episodes_train_like_the_recomputed_ones(results, critic):
    """``ppo.old_logprobs_from_rollout=true`` on episodes (#51): the megatron engine's behaviour
    log-probs (0 on the environment's tokens) and, with the value head on the actor's
    backbone, its values give the first step's metrics of the trainer's forward-only pass
    (which has the environment tokens' own log-probs there) within 1e-5: every reducer reads
    the loss mask, and the policy tokens' log-probs and values sit in their columns."""
    runs = results["old_logprobs"]
    assert "error" not in runs, runs.get("error")
    runs = {name: runs[(critic, name)] for name in ("recompute", "from_rollout")}
    got, want = runs["from_rollout"]["metrics"], runs["recompute"]["metrics"]
    # the comparison is not vacuous: the recomputed old log-probs are far from the rollout's 0
    # on the environment's tokens, the ratios moved and were clipped, the critic trained
    assert runs["recompute"]["env_tokens"] > 0 and runs["recompute"]["env_old_abs_max"] > 0.1
    assert runs["from_rollout"]["env_old_abs_max"] == 0.0
    assert want["clip_fraction"] > 0 and want["value_loss"] > 0 and want["episode/turns_mean"] == 2.0
    # no forward-only pass of the actor; the rollout's log-probs are the old ones
    assert set(want) - set(got) == {"timing/old_logprobs_values_s"} and set(got) <= set(want)
    assert got["rollout_train_logprob_diff_max"] == 0.0 < want["rollout_train_logprob_diff_max"] < 1e-5
    compared = [k for k in got if not k.startswith("timing/") and not k.endswith("_per_s")]
    for key in ("policy_loss", "kl_mean", "clip_fraction", "entropy", "approx_kl", "value_loss",
                "advantages_mean", "returns_mean", "explained_variance", "grad_norm", "reward_mean"):
        assert key in compared, key
    assert ("critic_grad_norm" in compared) == (critic == "separate")
    for key in compared:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-5), key
