"""The MoE router metrics (nemo_rlhf.models.moe.RouterLoad / router_load_metrics): the hooks
count what the routers chose, the ratios are those of a worked example, megatron's aux loss
is read in training passes, and a dense model records nothing."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.config import ModelConfig
from nemo_rlhf.models.moe import RouterLoad, router_load_metrics
from tests.single_rank import single_rank

MOE = dict(vocab_size=100, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, init_method_std=0.2)


@pytest.fixture(scope="module")
def dims():
    with single_rank(seed=0) as d:
        yield d


def test_router_load_metrics_of_a_worked_example():
    # two layers: [4, 4, 4, 4] (balanced: 1 and 1), [8, 4, 4, 0] (mean 4: 2 and 0)
    counts = torch.tensor([[4.0, 4, 4, 4], [8.0, 4, 4, 0]], dtype=torch.float64)
    load = RouterLoad(torch.nn.Linear(1, 1))
    assert not load.active
    load.counts, load.calls, load.aux_loss_sum = counts, 6, 0.0
    m = router_load_metrics(load.stage_sums())
    assert m == {"moe/tokens_per_expert_max_over_mean": 1.5, "moe/tokens_per_expert_min_over_mean": 0.5}
    load.aux_loss_sum = 3.0
    assert router_load_metrics(load.stage_sums())["moe/aux_loss"] == 0.5
    # another DP rank routed [0, 4, 4, 8] and [0, 4, 4, 8]: summed first, the batch's
    # counts are [4, 8, 8, 12] (mean 8: 1.5, 0.5) and [8, 8, 8, 8] (1, 1); the mean of the
    # two ranks' own ratios (1.5 and 1.75) would be another number
    other = torch.tensor([0.0, 4, 4, 8, 0, 4, 4, 8, 1.0, 0.0, 6], dtype=torch.float64)
    m = router_load_metrics(load.stage_sums(dp_sum=lambda t: t.add_(other)))
    assert m == {"moe/tokens_per_expert_max_over_mean": 1.25, "moe/tokens_per_expert_min_over_mean": 0.75,
                 "moe/aux_loss": 4.0 / 12}
    # under CP the other CP rank routed its positions: counts and aux losses are summed over
    # CP, the router calls are not (both CP ranks made the same 6 calls)
    m = router_load_metrics(load.stage_sums(cp_sum=lambda t: t.add_(other[:-1])))
    assert m == {"moe/tokens_per_expert_max_over_mean": 1.25, "moe/tokens_per_expert_min_over_mean": 0.75,
                 "moe/aux_loss": 4.0 / 6}
    load.z_loss_sum = 6.0  # the z-loss: its own mean over the calls
    assert router_load_metrics(load.stage_sums())["moe/z_loss"] == 1.0


def test_hooks_count_the_routers_choices_and_read_the_aux_loss(dims):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.engine import model_forward

    cfg = ModelConfig(**MOE)
    cfg.moe_aux_loss_coeff = 0.01  # the tracker path (the gradient: test_moe_router_losses.py)
    model = build_model(cfg, dims, seed=3).train()
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    with RouterLoad(model) as load:
        logits, values = model_forward(model, ids, torch.ones_like(ids))
        (logits.float().square().mean() + values.sum()).backward()
    assert load.active and load.calls == 2 and load.counts.shape == (2, 4)
    assert load.counts.sum(1).tolist() == [2 * 18.0, 2 * 18.0]  # 18 tokens x top-2 per layer
    # the counts are what the first router chooses for the first layer's input
    seen = {}

    def record(_module, _inputs, output):  # returns None: the output is kept
        seen.setdefault("map", output[1].sum(0).double())

    h = model.decoder.layers[0].mlp.router.register_forward_hook(record)
    with torch.no_grad():
        model_forward(model.eval(), ids, torch.ones_like(ids))
    h.remove()
    assert torch.equal(seen["map"], load.counts[0])
    assert load.aux_loss_sum > 0  # megatron's tracker, unscaled: 1 for a balanced router, E / k at most
    m = router_load_metrics(load.stage_sums())
    assert 1.0 <= m["moe/tokens_per_expert_max_over_mean"] <= 2.0
    assert 0.0 <= m["moe/tokens_per_expert_min_over_mean"] <= 1.0
    assert 0.5 < m["moe/aux_loss"] < 4.0
    assert not model.decoder.layers[0].mlp.router._forward_hooks  # removed on exit


def test_a_dense_model_records_nothing(dims):
    from nemo_rlhf.models.actor_critic import build_model

    with RouterLoad(build_model(ModelConfig(vocab_size=100), dims, seed=3)) as load:
        pass
    assert not load.active and load.counts is None
