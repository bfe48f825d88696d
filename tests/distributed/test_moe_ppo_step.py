"""A PPO step of a mixture-of-experts actor at DP=2 (2 gloo ranks): the step's metrics carry
the routers' ``moe/`` tokens-per-expert metrics, the same on both ranks' reduction; a dense
step has none; the same at PP=2 (the stages' layers summed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

MOE = ("model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32")


def _worker(rank: int, tmp: str) -> dict:
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    out = {}
    for name, extra in (("moe", MOE), ("dense", ()), ("moe_pp2", MOE + ("parallel.pipeline_model_parallel_size=2",))):
        cfg = compose_ppo(make_demo_data(tmp / "data"), tmp / f"exp_{name}", "rollout.max_new_tokens=6",
                          "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", *extra)
        trainer = build(cfg)
        metrics = trainer.train_step()
        out[name] = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))}
        trainer.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, world_size=2, tmp=str(tmp_path_factory.mktemp("moe_ppo")))


def test_a_moe_ppo_step_reports_the_router_metrics(ranks):
    m = ranks[0]["moe"]
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    assert 1.0 <= m["moe/tokens_per_expert_max_over_mean"] <= 4 / 2  # at most E / top-k
    assert 0.0 <= m["moe/tokens_per_expert_min_over_mean"] <= 1.0
    assert m["moe/tokens_per_expert_max_over_mean"] > m["moe/tokens_per_expert_min_over_mean"]
    assert "moe/aux_loss" not in m  # model.moe_aux_loss_coeff=0: megatron computes none
    assert m["grad_norm"] > 0 and m["skipped_updates"] == 0
    moe_keys = {k: v for k, v in m.items() if k.startswith("moe/")}
    assert {k: v for k, v in ranks[1]["moe"].items() if k.startswith("moe/")} == moe_keys  # DP-reduced


def test_a_moe_ppo_step_at_pp2_reports_every_stage_s_layers(ranks):
    """Each stage holds one of the two layers: the metrics are summed over the stages (a
    stage's own layer alone would give its own ratio, not the mean of both)."""
    for r in ranks:
        m = r["moe_pp2"]
        assert 1.0 <= m["moe/tokens_per_expert_max_over_mean"] <= 2.0
        assert m["moe/tokens_per_expert_max_over_mean"] == ranks[0]["moe_pp2"]["moe/tokens_per_expert_max_over_mean"]
        assert m["grad_norm"] > 0


def test_a_dense_ppo_step_has_no_router_metrics(ranks):
    assert not [k for k in ranks[0]["dense"] if k.startswith("moe/")]
