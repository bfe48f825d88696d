"""PPO trainer behaviour on one rank (run in a spawned process for isolation)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

REPO = Path(__file__).resolve().parents[2]


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build
    from nemo_rlhf.models.engine import unwrap
    from nemo_rlhf.trainers.ppo.reference import ReferencePolicy

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    cfg = compose_ppo(data, tmp / "exp", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
                      "rollout.temperature=0.7", "rollout.top_p=0.9", "optim.lr=1e-3")
    trainer = build(cfg)
    out = {"source": type(trainer.rollout_source).__name__}
    batch = trainer.generate([trainer.encoded[i] for i in range(8)])
    ref0 = trainer.compute_old_and_reference(batch).ref_logprobs
    out["rollout_vs_train"] = (trainer.compute_old_and_reference(batch).old_logprobs
                               - batch.logprobs).abs()[batch.response_mask].max().item()

    orig = _params(trainer.model)
    with torch.no_grad():  # make the actor differ from the reference before swapping
        for p in trainer.model.parameters():
            p.add_(0.01)
    before = _params(trainer.model)
    with trainer.reference.swapped_in() as m:
        assert m is unwrap(trainer.model)
        out["swap_changed_weights"] = any(
            not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    out["swap_restores_bit_identical"] = all(
        torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            p.copy_(orig[n])
    before = orig

    def make_stage():
        from nemo_rlhf.models.actor_critic import build_model

        return build_model(cfg.model, trainer.dims, cfg.trainer.precision, seed=99)

    offload = trainer.reference
    trainer.reference = ReferencePolicy(unwrap(trainer.model), "colocated", build_fn=make_stage)
    ref_coloc = trainer.compute_old_and_reference(batch).ref_logprobs
    trainer.reference = offload
    out["offload_vs_colocated_maxdiff"] = (ref_coloc - ref0).abs().max().item()

    metrics = [trainer.train_step() for _ in range(3)]
    out["ratio_first_minibatch"] = (metrics[0]["first_minibatch/ratio_max"],
                                    metrics[0]["first_minibatch/ratio_min"])
    out["metric_keys"] = sorted(metrics[0])
    out["kl"] = [(m["kl_mean"], m["kl_per_token"], m["response_length"]) for m in metrics]
    after = _params(trainer.model)
    out["actor_changed"] = any(not torch.equal(after[n], before[n]) for n in before
                               if "value_head" not in n)
    ref_after = trainer.compute_old_and_reference(batch).ref_logprobs
    out["ref_after_updates_maxdiff"] = (ref_after - ref0).abs().max().item()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, world_size=1, tmp=str(tmp_path_factory.mktemp("ppo1")))[0]


def test_ratio_is_one_on_first_minibatch(results):
    rmax, rmin = results["ratio_first_minibatch"]
    assert abs(rmax - 1) < 1e-6 and abs(rmin - 1) < 1e-6


def test_sampling_logprobs_match_training_forward(results):
    assert results["rollout_vs_train"] <= 1e-5


def test_reference_swap_changes_then_restores_actor_weights_bit_identically(results):
    assert results["swap_changed_weights"] is True
    assert results["swap_restores_bit_identical"] is True


def test_reference_logprobs_unchanged_after_actor_updates(results):
    assert results["actor_changed"], "the actor must have been updated for this test to mean anything"
    assert results["ref_after_updates_maxdiff"] == 0.0


def test_offload_and_colocated_reference_give_same_logprobs(results):
    assert results["offload_vs_colocated_maxdiff"] <= 1e-6


def test_step_reports_the_metrics_users_read(results):
    for key in ("reward_mean", "kl_mean", "response_length", "entropy", "value_loss",
                "clip_fraction", "approx_kl", "grad_norm", "kl_coef", "explained_variance",
                "policy_loss", "lr", "rollout_train_logprob_diff_max", "timing/rollout_s",
                "generated_tokens_per_s", "truncated_fraction", "ratio_max"):
        assert key in results["metric_keys"], key


def test_single_turn_builds_the_local_source_and_logs_no_episode_metrics(results):
    # env.name null (the default): today's path, no EpisodeRolloutSource (#51)
    assert results["source"] == "LocalRolloutSource"
    assert not [k for k in results["metric_keys"] if k.startswith("episode/")]


def test_kl_is_reported_per_sequence_and_per_token(results):
    """kl_mean sums over each response (nats per sequence); kl_per_token divides by the
    response tokens: their ratio is the mean response length."""
    for kl_mean, kl_per_token, length in results["kl"]:
        assert kl_per_token * length == pytest.approx(kl_mean, rel=1e-5, abs=1e-9)
    assert any(kl_mean != 0 for kl_mean, _, _ in results["kl"][1:])  # the policy moved: a real check


# --- the RM service dies mid-run -------------------------------------------------------

def _rm_dies_worker(rank: int, tmp: str, url: str, pid: int):
    import signal

    from nemo_rlhf.reward.client import RewardServiceError
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    cfg = compose_ppo(data, tmp / "exp", f"reward.rm_url={url}", "reward.functions=[]",
                      "reward.max_retries=1", "reward.timeout_s=5", "reward.restart_wait_s=2", "trainer.max_steps=1",
                      "exp_manager.save_interval=1")
    trainer = build(cfg)
    assert trainer.fit() == 0
    os.kill(pid, signal.SIGKILL)
    cfg.trainer.max_steps = 3
    try:
        trainer.fit()
    except RewardServiceError as exc:
        return {"error": str(exc), "ckpts": sorted(p.name for p in (tmp / "exp" / "checkpoints").iterdir()),
                "latest": (tmp / "exp" / "checkpoints" / "latest").read_text().strip()}
    return {"error": None}


def test_rm_service_dying_mid_run_stops_training_with_clear_error_and_no_partial_checkpoint(tmp_path):
    addr = tmp_path / "rm_address"
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/rm_server_proc.py"),
                             "--address-file", str(addr)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not addr.exists() and time.time() < deadline:
            time.sleep(0.1)
        url = addr.read_text().strip()
        res = run_ranks(_rm_dies_worker, world_size=1, tmp=str(tmp_path), url=url, pid=proc.pid)[0]
    finally:
        proc.kill()
        proc.wait()
    assert res["error"] is not None and url in res["error"]
    assert res["ckpts"] == ["latest", "step_1"], res["ckpts"]
    assert res["latest"] == "step_1"


# --- non-finite updates ------------------------------------------------------------------

def _nonfinite_worker(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    cfg = compose_ppo(data, tmp / "exp", "trainer.max_steps=1", "exp_manager.save_interval=1",
                      "trainer.max_consecutive_nonfinite=3")
    trainer = build(cfg)
    assert trainer.fit() == 0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer.step = lambda: (False, float("nan"))  # every update: NaN grad norm
    cfg.trainer.max_steps = 3
    try:
        trainer.fit()
    except RuntimeError as exc:
        ckpts = sorted(p.name for p in (tmp / "exp" / "checkpoints").iterdir())
        unchanged = all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
        return {"error": str(exc), "ckpts": ckpts, "unchanged": unchanged}
    return {"error": None}


def test_consecutive_nonfinite_updates_stop_the_run_keeping_the_last_good_checkpoint(tmp_path):
    res = run_ranks(_nonfinite_worker, world_size=1, tmp=str(tmp_path))[0]
    assert res["error"] is not None
    assert "consecutive updates had a non-finite loss or gradient norm" in res["error"]
    assert "trainer.max_consecutive_nonfinite=3" in res["error"]
    assert res["ckpts"] == ["latest", "step_1"]
    assert res["unchanged"]  # skipped updates changed no weight


def _mlflow_worker(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    cfg = compose_ppo(make_demo_data(tmp / "data"), tmp / "exp", "logger.mlflow.enabled=true",
                      "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]")
    assert build(cfg).fit() == 0
    return {}


def test_a_ppo_run_sends_its_step_metrics_to_mlflow_under_the_tensorboard_names(tmp_path, monkeypatch):
    import json

    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the tracker sets in the job
    run_ranks(_mlflow_worker, world_size=1, tmp=str(tmp_path))
    exp = tmp_path / "exp"
    run_id = json.loads((exp / "trackers.json").read_text())["mlflow"]
    client = mlflow.tracking.MlflowClient((exp / "mlruns").as_uri())
    logged = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    kl = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/kl_mean"))
    assert kl == [(r["step"], pytest.approx(r["kl_mean"])) for r in logged if "kl_mean" in r]
    assert len(kl) == 2
    run = client.get_run(run_id)
    assert run.data.params["trainer.max_steps"] == "2" and run.info.status == "FINISHED"


def _judge_worker(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    cfg = compose_ppo(make_demo_data(tmp / "data"), tmp / "exp", "trainer.val_check_interval=2",
                      "trainer.max_eval_samples=8", "trainer.eval_judge='tests.ppo_helpers:length_reward'",
                      "reward.functions=[{name: arithmetic_exact_match}]", "rollout.temperature=1.0")
    assert build(cfg).fit() == 0
    return {}


def test_an_independent_judge_scores_the_heldout_responses_beside_the_self_judged_win_rate(tmp_path):
    import json

    from nemo_rlhf.trainers.ppo.evaluation import win_rate

    run_ranks(_judge_worker, world_size=1, tmp=str(tmp_path))
    exp = tmp_path / "exp"
    last = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()
            if "eval/judge_win_rate_vs_initial" in line][-1]
    step0, step2 = ([json.loads(line) for line in (exp / "eval_samples" / f"step_00000{s}.jsonl").read_text().splitlines()]
                    for s in (0, 2))
    # the judge (response characters / 4) is not the training reward (exact match)
    assert all(r["judge"] == len(r["response"]) / 4.0 for r in step0 + step2)
    assert last["eval/judge_score"] == pytest.approx(sum(r["judge"] for r in step2) / len(step2))
    assert last["eval/judge_win_rate_vs_initial"] == pytest.approx(win_rate(step2, step0, "judge"))
    assert last["eval/win_rate_vs_initial"] == pytest.approx(win_rate(step2, step0, "score"))
