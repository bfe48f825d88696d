"""Two PPO steps with DP=2, TP=2 and PP=2 run, and their first-step metrics match TP=1; a
held-out set smaller than DP is evaluated at DP=2 as at DP=1."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

COMPARED = ("reward_mean", "response_length", "kl_mean", "policy_loss", "value_loss", "entropy",
            "approx_kl", "clip_fraction", "grad_norm", "returns_mean")
# one mini-batch per step, greedy rollouts: every layout sees the same samples in the same update
COMMON = ("rollout.greedy=true", "ppo.num_rollout_samples=8", "ppo.global_batch_size=8",
          "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=2", "ppo.ppo_epochs=1",
          "ppo.shuffle=false", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
          "optim.lr=1e-3")


def _reference(rank: int, tmp: str):
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    cfg = compose_ppo(data, tmp / "ref", *COMMON)
    trainer = build(cfg)
    save_checkpoint(tmp / "init", 0, trainer.model, dims=trainer.dims)
    return [trainer.train_step() for _ in range(2)] + [_evaluate_one_prompt(trainer)]


def _evaluate_one_prompt(trainer) -> dict:
    """The held-out evaluation on one prompt (at DP=2: fewer prompts than ranks)."""
    trainer.eval_prompts = trainer.eval_prompts[:1]
    return trainer.evaluate()


def _layouts(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    out = {}
    for name, tp, pp in (("dp2", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2)):
        cfg = compose_ppo(data, tmp / name, *COMMON, f"exp_manager.init_from={tmp}/init/step_0",
                          f"parallel.tensor_model_parallel_size={tp}",
                          f"parallel.pipeline_model_parallel_size={pp}")
        trainer = build(cfg)
        out[name] = [trainer.train_step() for _ in range(2)]
        if name == "dp2":
            out["dp2_eval"] = _evaluate_one_prompt(trainer)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ppo_par"))
    ref = run_ranks(_reference, world_size=1, tmp=tmp)[0]
    par = run_ranks(_layouts, world_size=2, tmp=tmp)[0]  # rank 0 reports
    return ref, par


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_two_ppo_steps_run_and_first_step_metrics_match_tp1(results, layout):
    ref, par = results
    steps = par[layout]
    assert len(steps) == 2 and all("grad_norm" in s for s in steps)
    for key in COMPARED:
        a, b = steps[0][key], ref[0][key]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"{layout} {key}: {a} vs TP=1 {b}"
    assert ref[0]["grad_norm"] > 0 and ref[0]["reward_mean"] > 0  # the comparison is not vacuous
    # reduced over DP (they were DP rank 0's rows alone); the second step's: at the first,
    # the value head starts at 0 (explained variance 0 on any rows)
    for key in ("explained_variance", "repetition", "response_length_max",
                "rollout_train_logprob_diff_mean", "rollout_train_logprob_diff_max", "rollout_train_k3_kl",
                "critic/value_error_pos_0-1", "critic/value_error_pos_2-3"):
        a, b = steps[1][key], ref[1][key]
        assert abs(a - b) <= 1e-3 * max(1.0, abs(b)), f"{layout} {key}: {a} vs TP=1 {b}"


def test_a_held_out_set_smaller_than_dp_is_evaluated_as_at_dp1(results):
    """One held-out prompt at DP=2: the rank without one decodes a copy and leaves it out;
    the metrics are DP=1's on that prompt."""
    ref, par = results
    got, want = par["dp2_eval"], ref[2]
    for key in ("eval/reward", "eval/response_length", "eval/repetition", "eval/accuracy"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    assert want["eval/response_length"] > 0
