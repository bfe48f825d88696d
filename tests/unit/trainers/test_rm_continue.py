"""An RM started from an RM checkpoint continues it (backbone and reward head loaded, not a
fresh head), which the demo's RM refresh relies on; ``rm.reward_stats_max_pairs`` caps the
pairs of the final reward statistics."""

from __future__ import annotations

import json

import pytest

from tests.distributed.harness import run_ranks
from tests.rm_helpers import tiny_rm_config


def _cfg(data: str, exp: str, **rm):
    return tiny_rm_config(data, exp, val_check_interval=3, checkpoints=True, **rm)


def _worker(rank: int, data: str, tmp: str):
    import torch

    from nemo_rlhf.checkpoint import find_latest_checkpoint, read_trainer_state
    from nemo_rlhf.trainers.rm import RMTrainer

    first = RMTrainer(_cfg(data, f"{tmp}/rm_a", reward_stats_max_pairs=5))
    first.fit()
    ckpt = find_latest_checkpoint(f"{tmp}/rm_a/checkpoints")
    trained = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    val_a = first.validation_metrics()
    cont = RMTrainer(_cfg(data, f"{tmp}/rm_b", init_from=str(ckpt)))
    loaded = {n: p.detach().clone() for n, p in cont.model.named_parameters()}
    val_b = cont.validation_metrics()
    heads = [n for n in trained if "reward_head" in n]
    return {
        "heads": heads,
        "equal": all(torch.equal(trained[n], loaded[n]) for n in trained),
        "val_a": val_a["val/accuracy"], "val_b": val_b["val/accuracy"],
        "margin_a": val_a["val/margin"], "margin_b": val_b["val/margin"],
        "stats_count": read_trainer_state(ckpt)["reward_stats_count"],
    }


def test_rm_init_from_an_rm_checkpoint_loads_the_reward_head_and_caps_the_stats_pairs(tmp_path):
    from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset

    data = tmp_path / "data"
    make_demo_dataset(data, DemoTaskConfig(n_sft=8, n_pref=16, n_ppo=4, n_eval=4, n_val=8))
    (r,) = run_ranks(_worker, world_size=1, data=str(data), tmp=str(tmp_path))
    assert r["heads"], "the RM has a reward head"
    assert r["equal"], "every weight, the reward head included, is the checkpoint's"
    assert r["val_b"] == r["val_a"] and r["margin_b"] == pytest.approx(r["margin_a"], abs=1e-6)
    assert r["stats_count"] == 2 * 4  # 16 pairs, every 4th: 4 pairs, 8 responses
    log = json.loads((tmp_path / "rm_a" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "final/train_reward_mean" in log
