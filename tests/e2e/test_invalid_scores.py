"""``reward.invalid_scores``: NaN / Inf / past ``reward.max_abs_score`` scores planted by a
reward function into real PPO runs (``ppo_tiny`` as a subprocess).

``skip``: the run completes; every step counts the three planted scores
(``reward/invalid_scores``), warns naming the source and value, and trains on finite
losses; a left-out sample is, for the advantages and the loss mask, exactly as if it had
not been in the batch (checked in-process on one rank). ``error`` (the default): the run
stops naming the source, the value and the key. A step where every score is invalid stops
with an error rather than training on nothing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import INVALID_AT, compose_ppo, make_demo_data

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("forked_python")  # the python -m runs: forks of a preloaded server
STEPS = 2


def _run(data: Path, exp: Path, reward: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nemo_rlhf.train_ppo", "--config-name", "ppo_tiny",
           f"data.train_file={data}/ppo_prompts.jsonl", f"data.val_file={data}/eval.jsonl",
           f"data.tokenizer_dir={data}/tokenizer", f"exp_manager.exp_dir={exp}",
           f"trainer.max_steps={STEPS}", "trainer.val_check_interval=0", "trainer.sample_table_every=0",
           "exp_manager.save_interval=0", "exp_manager.resume=none", "ppo.num_rollout_samples=8",
           "ppo.global_batch_size=4", "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=4",
           "rollout.max_new_tokens=4", f"reward.functions=[{{name: 'tests.ppo_helpers:{reward}'}}]",
           "reward.normalization=none", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_RLHF_")}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("invalid_scores_data"))


def test_skip_counts_the_planted_scores_warns_and_trains_on_the_rest(data, tmp_path):
    res = _run(data, tmp_path / "exp", "invalid_some_reward", "reward.invalid_scores=skip")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "policy_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    planted = len(INVALID_AT)  # per call of 8 samples: NaN, +Inf, 1e30
    for r in steps:
        assert r["reward/invalid_scores"] == planted, r
        assert r["reward/invalid_fraction"] == planted / 8
        assert r["reward/excluded_samples"] == planted and r["reward/trained_samples"] == 8 - planted
        for k in ("policy_loss", "value_loss", "grad_norm", "reward_mean", "reward_raw_mean", "kl_mean"):
            assert math.isfinite(r[k]), (k, r[k])
        assert r["skipped_updates"] == 0
    log = res.stdout + res.stderr
    for step in range(1, STEPS + 1):
        assert f"step {step}: reward.invalid_scores=skip: 3 of 8 sample(s)" in log
    assert "source 'invalid_some_reward' returned nan at position 0" in log
    assert "returned inf at position 3" in log


def test_error_is_the_default_and_names_the_source_value_and_key(data, tmp_path):
    res = _run(data, tmp_path / "exp", "invalid_some_reward")
    assert res.returncode != 0
    assert ("reward function 'tests.ppo_helpers:invalid_some_reward' returned nan at position 0"
            in res.stderr), res.stderr[-3000:]
    assert "reward.invalid_scores=error" in res.stderr


def test_a_step_with_every_score_invalid_stops_instead_of_training_on_nothing(data, tmp_path):
    res = _run(data, tmp_path / "exp", "all_invalid_reward", "reward.invalid_scores=skip")
    assert res.returncode != 0
    assert "InvalidScoresError" in res.stderr and "nothing left to train on" in res.stderr, \
        res.stderr[-3000:]
    assert not (tmp_path / "exp" / "checkpoints" / "latest").exists()


def _rows(obj, keep: list[int]):
    """A copy of a batch-first dataclass with only the rows ``keep``."""
    idx = torch.tensor(keep)
    return dataclasses.replace(obj, **{
        f.name: getattr(obj, f.name)[idx] for f in dataclasses.fields(obj)
        if isinstance(getattr(obj, f.name), torch.Tensor)})


def _advantages(trainer, batch, scores, fwd):
    """Step 5's tensors and metrics (:func:`~nemo_rlhf.trainers.ppo.step_tensors.step_advantages`)."""
    from nemo_rlhf.trainers.ppo.step_tensors import step_advantages

    return step_advantages(trainer.cfg, trainer.advantage_cfg, trainer.kl_ctl.value, trainer.collectives,
                           batch, scores, fwd)


def _left_out_worker(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    cfg = compose_ppo(data, tmp / "exp", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
                      "reward.invalid_scores=skip", "ppo.normalize_advantages=true")
    trainer = build(cfg)
    batch = trainer.generate([trainer.encoded[i] for i in range(8)])
    fwd = trainer.compute_old_and_reference(batch)
    scores = torch.arange(8, dtype=torch.float32) / 4 + 0.5
    out = {}
    left_out = [1, 5]
    marked = scores.clone()
    marked[left_out] = float("nan")  # what rewards.step_scores hands over for left-out rows
    adv, metrics = _advantages(trainer, batch, marked, fwd)
    kept = [i for i in range(8) if i not in left_out]
    sub_adv, sub_metrics = _advantages(trainer, _rows(batch, kept), scores[kept], _rows(fwd, kept))
    out["left_out_advantages"] = adv.advantages[left_out].abs().max().item()
    out["left_out_returns"] = adv.returns[left_out].abs().max().item()
    out["left_out_loss_tokens"] = int(adv.loss_mask[left_out].sum())
    out["kept_loss_mask_is_response_mask"] = bool(torch.equal(adv.loss_mask[kept], batch.response_mask[kept]))
    out["advantages_vs_without_them"] = (adv.advantages[kept] - sub_adv.advantages).abs().max().item()
    out["returns_vs_without_them"] = (adv.returns[kept] - sub_adv.returns).abs().max().item()
    out["metrics"] = {k: (metrics[k], sub_metrics[k]) for k in
                      ("reward_mean", "reward_std", "response_length", "kl_mean", "advantages_mean")}
    return out


def test_a_left_out_sample_is_as_if_it_were_not_in_the_batch(tmp_path):
    """Rows marked NaN (left out) get no advantage, no return and no loss token; the other
    rows' advantages (whitened over the batch) and the step's metrics are those of the
    batch without them."""
    out = run_ranks(_left_out_worker, 1, tmp=str(tmp_path))[0]
    assert out["left_out_advantages"] == 0 and out["left_out_returns"] == 0
    assert out["left_out_loss_tokens"] == 0 and out["kept_loss_mask_is_response_mask"]
    assert out["advantages_vs_without_them"] < 1e-5, out
    assert out["returns_vs_without_them"] < 1e-5, out
    for k, (with_marked, without) in out["metrics"].items():
        assert with_marked == pytest.approx(without, rel=1e-5, abs=1e-6), (k, out["metrics"])
