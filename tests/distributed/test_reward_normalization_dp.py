"""Running reward normalisation is one statistic over all data-parallel ranks.

With ``reward.normalization=running`` the served RM's scores are normalised with the
running mean/std of every score seen on every DP rank: DP=2 gives the same normalised
rewards as DP=1 on the same rollouts (greedy decoding, same weights), and a DP=2 run
resumed from its step-2 checkpoint continues exactly like the uninterrupted run (every
rank restores the same statistics). The ``reward/*`` metrics are means over every DP
rank's samples too, not rank 0's (#50).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
COMMON = ("rollout.greedy=true", "ppo.num_rollout_samples=8", "ppo.global_batch_size=8",
          "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=2", "ppo.ppo_epochs=1",
          "ppo.shuffle=false", "reward.functions=[]", "reward.normalization=running",
          "reward.max_retries=1", "optim.lr=1e-3", "exp_manager.save_interval=1",
          "exp_manager.keep_last=5")
VOLATILE = ("timing/", "_per_s")


def _recording(trainer) -> list:
    """Wrap ``trainer.score``: record this rank's normalised scores of every step."""
    seen, real = [], trainer.score

    def score(idx, batch):
        scores, metrics = real(idx, batch)
        seen.append(scores.tolist())
        return scores, metrics

    trainer.score = score
    return seen


def _metrics(exp: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not any(s in k for s in VOLATILE)}
            for r in rows}


def _dp1(rank: int, tmp: str, url: str):
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    cfg = compose_ppo(make_demo_data(tmp / "data"), tmp / "dp1", *COMMON, f"reward.rm_url={url}",
                      f"trainer.max_steps={STEPS}")
    trainer = build(cfg)
    save_checkpoint(tmp / "init", 0, trainer.model, dims=trainer.dims)
    seen = _recording(trainer)
    assert trainer.fit() == 0
    return {"scores": seen, "metrics": _metrics(tmp / "dp1")}


def _hand_scored(dims, rank: int) -> dict:
    """:func:`step_scores`' metrics of two ranks that scored differently: rank 0 three
    samples (the third invalid: left out), rank 1 one; sources ``rm`` (with an ensemble
    spread) and ``exact``."""
    from nemo_rlhf.reward.functions import RewardOutput
    from nemo_rlhf.trainers.ppo.scoring import step_scores

    nan, t = float("nan"), torch.tensor
    if rank == 0:
        out = RewardOutput(scores=t([1.0, 2.0, nan]), raw_scores=t([1.0, 2.0, nan]),
                           per_source={"rm": t([10.0, 20.0, float("inf")]), "exact": t([0.0, 1.0, 0.0])},
                           per_source_normalized={"rm": t([0.5, 1.5, 0.0]), "exact": t([0.0, 1.0, 0.0])},
                           diagnostics={"rm_ensemble_std": t([0.2, 0.4, nan])},
                           valid=t([True, True, False]), invalid=[("rm", 2, float("inf"))], skipping=True)
    else:
        out = RewardOutput(scores=t([6.0]), raw_scores=t([6.0]),
                           per_source={"rm": t([40.0]), "exact": t([1.0])},
                           per_source_normalized={"rm": t([4.0]), "exact": t([1.0])},
                           diagnostics={"rm_ensemble_std": t([1.2])}, skipping=True)
    return step_scores(dims, out, step=1)[1]


def _dp2(rank: int, tmp: str, url: str):
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    args = (*COMMON, f"reward.rm_url={url}", f"trainer.max_steps={STEPS}",
            f"exp_manager.init_from={tmp}/init/step_0", "exp_manager.resume=auto")
    cfg = compose_ppo(data, tmp / "full", *args)
    trainer = build(cfg)
    assert trainer.dims.dp == 2
    hand = _hand_scored(trainer.dims, rank)
    full = _recording(trainer)
    assert trainer.fit() == 0
    full_state = trainer.reward.state_dict()
    # the state a crash right after step 2's checkpoint leaves: step_1, step_2, latest=step_2
    if rank == 0:
        ckpts = tmp / "resumed" / "checkpoints"
        shutil.copytree(tmp / "full" / "checkpoints", ckpts)
        shutil.rmtree(ckpts / f"step_{STEPS}")
        (ckpts / "latest").write_text(f"step_{STEPS - 1}\n")
    dist.barrier()
    cfg = compose_ppo(data, tmp / "resumed", *args)
    trainer = build(cfg)
    resumed = _recording(trainer)
    assert trainer.fit() == 0 and trainer.step == STEPS
    out = {"scores": full, "resumed_scores": resumed, "state": full_state,
           "resumed_state": trainer.reward.state_dict(), "hand": hand}
    if rank == 0:
        out["metrics"], out["resumed_metrics"] = _metrics(tmp / "full"), _metrics(tmp / "resumed")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rnorm")
    addr = tmp / "rm_address"
    server = subprocess.Popen([sys.executable, str(REPO / "tests/rm_server_proc.py"),
                               "--address-file", str(addr)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not addr.exists() and time.time() < deadline:
            time.sleep(0.1)
        url = addr.read_text().strip()
        dp1 = run_ranks(_dp1, world_size=1, tmp=str(tmp), url=url)[0]
        dp2 = run_ranks(_dp2, world_size=2, tmp=str(tmp), url=url)
    finally:
        server.kill()
        server.wait()
    return dp1, dp2


def test_dp2_normalises_like_dp1_on_the_same_rollouts(runs):
    dp1, dp2 = runs
    assert len(dp1["scores"]) == STEPS
    for step in range(STEPS):
        merged = dp2[0]["scores"][step] + dp2[1]["scores"][step]  # rank r holds slice r
        torch.testing.assert_close(torch.tensor(merged), torch.tensor(dp1["scores"][step]),
                                   atol=1e-5, rtol=0, msg=f"step {step + 1}")
    assert torch.tensor(dp1["scores"][1]).std() > 0.1  # normalised rewards with spread
    for step in range(1, STEPS + 1):
        for key in ("reward_mean", "reward_std", "reward_raw_mean", "reward/total", "reward/rm",
                    "reward/rm_normalized"):  # reward/*: every DP rank's samples, not rank 0's (#50)
            a, b = dp2[0]["metrics"][step][key], dp1["metrics"][step][key]
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (step, key, a, b)


def test_reward_metrics_are_means_over_every_dp_ranks_samples(runs):
    """Sums and counts reduced over the scoring ranks (#50): the global mean over the 3 valid
    samples, not rank 0's mean (e.g. reward/total 1.5) nor the ranks' mean of means (3.75);
    reward/rm_ensemble_std likewise the mean of the per-sample spread over all of them."""
    _, dp2 = runs
    want = {"reward/total": (1 + 2 + 6) / 3, "reward/rm": (10 + 20 + 40) / 3,
            "reward/rm_normalized": (0.5 + 1.5 + 4.0) / 3, "reward/exact": (0 + 1 + 1) / 3,
            "reward/exact_normalized": (0 + 1 + 1) / 3, "reward/rm_ensemble_std": (0.2 + 0.4 + 1.2) / 3,
            "reward_raw_mean": 3.0, "reward/invalid_scores": 1.0, "reward/invalid_fraction": 0.25,
            "reward/excluded_samples": 1.0, "reward/trained_samples": 3.0}
    for r in (0, 1):
        got = dp2[r]["hand"]
        assert got.keys() == want.keys(), r
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-6), (r, key, got[key], value)


def test_raw_reward_mean_is_reported_next_to_the_normalised_one(runs):
    dp1, _ = runs
    for step in range(1, STEPS + 1):
        m = dp1["metrics"][step]
        assert abs(m["reward_raw_mean"] - m["reward/rm"]) <= 1e-5  # one source, weight 1
        assert m["reward_raw_mean"] > 1.0  # the fake RM scores length + a fraction
    assert abs(dp1["metrics"][1]["reward_mean"]) < 1e-5  # step 1: normalised by its own stats


def test_every_dp_rank_holds_the_same_statistics(runs):
    _, dp2 = runs
    assert dp2[0]["state"] == dp2[1]["state"]
    assert dp2[0]["state"]["rm"]["count"] == STEPS * 8  # every rank's scores counted


def test_resumed_dp2_run_continues_exactly(runs):
    _, dp2 = runs
    for r in (0, 1):
        assert dp2[r]["resumed_scores"] == dp2[r]["scores"][STEPS - 1:], f"rank {r}"
        assert dp2[r]["resumed_state"] == dp2[r]["state"], f"rank {r}"
    assert dp2[0]["resumed_metrics"][STEPS] == dp2[0]["metrics"][STEPS]
