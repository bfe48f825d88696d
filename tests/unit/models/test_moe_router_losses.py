"""The MoE router losses (``model.moe_aux_loss_coeff``, ``model.moe_z_loss_coeff``) through
:func:`nemo_rlhf.models.engine.forward_backward`: the gradients equal those of the losses
written out here from their papers (Switch Transformer eq. 4, ST-MoE eq. 5), each
micro-batch weighted by its share of the step's non-padding tokens, padded positions left
out; the logged values are unscaled; a training call without the token count is refused.
The same losses across TP, EP and PP layouts: tests/distributed/test_expert_parallel*.py."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.config import ModelConfig
from tests.single_rank import single_rank

MOE = dict(vocab_size=100, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
           init_method_std=0.2, num_layers=2)
AUX, Z = 0.1, 0.01


@pytest.fixture(scope="module")
def dims():
    with single_rank(seed=0) as d:
        yield d


def _micro_batches() -> list[dict]:
    """Two micro-batches of different shapes: right padding in one, left in the other."""
    g = torch.Generator().manual_seed(5)
    a = torch.randint(1, 100, (2, 7), generator=g)
    b = torch.randint(1, 100, (1, 9), generator=g)
    ma, mb = torch.ones_like(a), torch.ones_like(b)
    ma[1, 4:] = 0
    mb[0, :3] = 0
    return [{"input_ids": a, "attention_mask": ma}, {"input_ids": b, "attention_mask": mb}]


def _no_loss(output, mb):
    """A zero main loss: only the router losses reach the gradients."""
    logits, values = output
    return logits.sum() * 0.0 + values.sum() * 0.0, {}


def _switch_loss(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Switch Transformer eq. 4 over ``T`` tokens: ``E / (k T^2) * sum_e P_e c_e``; ``P_e``
    the summed softmax probabilities, ``c_e`` the tokens whose top-k include ``e``."""
    scores = torch.softmax(logits.float(), -1)
    T, E = scores.shape
    counts = torch.zeros(E).scatter_add_(0, scores.topk(topk, -1).indices.flatten(), torch.ones(T * topk))
    return E / (topk * T * T) * (scores.sum(0) * counts).sum()


def _z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE eq. 5: the mean over tokens of ``logsumexp(logits)^2``."""
    return torch.logsumexp(logits.float(), -1).square().mean()


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_router_losses_reach_the_gradient_token_weighted_and_padding_free(dims):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.engine import forward_backward
    from nemo_rlhf.models.moe import RouterLoad

    micro = _micro_batches()
    valid = [mb["attention_mask"].bool() for mb in micro]
    n = sum(int(v.sum()) for v in valid)  # 11 + 6 = 17 non-padding tokens
    model = build_model(ModelConfig(**MOE, moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z), dims, seed=3).train()
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # what a router-loss backward outside megatron's schedule leaves behind (a 0-d scale,
    # which the schedule's in-place [1]-shaped update cannot take): not in the way
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)
    with RouterLoad(model) as load:
        forward_backward(model, micro, _no_loss, routed_tokens=torch.tensor(float(n)), variable_shapes=True)
    got = _grads(model)
    assert model.config.moe_aux_loss_coeff == AUX and model.config.moe_z_loss_coeff == Z  # restored

    # the reference: the same weights without router losses, the losses written out over
    # each layer's router input (hooks), weighted T_mb / n
    ref_model = build_model(ModelConfig(**MOE), dims, seed=3).train()
    seen = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, i, o: seen.append((m, i[0])))
             for layer in ref_model.decoder.layers]
    from nemo_rlhf.models.engine import model_forward

    total, aux_sum, z_sum = 0.0, 0.0, 0.0
    for mb, v in zip(micro, valid):
        seen.clear()
        logits, values = model_forward(ref_model, mb["input_ids"], mb["attention_mask"])
        loss = logits.sum() * 0.0 + values.sum() * 0.0
        keep = v.t().reshape(-1)  # megatron's tokens are [seq, batch]
        for router, hidden in seen:
            rl = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), router.weight)[keep]
            aux, z = _switch_loss(rl, 2), _z_loss(rl)
            loss = loss + (AUX * aux + Z * z) * int(v.sum()) / n
            aux_sum, z_sum = aux_sum + float(aux), z_sum + float(z)
        loss.backward()
        total += float(loss)
    for h in hooks:
        h.remove()
    want = _grads(ref_model)

    router_w = "decoder.layers.0.mlp.router.weight"
    assert want[router_w].abs().max() > 1e-4  # the check has something to compare
    for name, g in want.items():
        assert torch.allclose(got[name], g, atol=1e-6, rtol=1e-5), name
    # logged unscaled (megatron's loss / coefficient), one value per layer call
    assert load.aux_loss_sum == pytest.approx(aux_sum, rel=1e-5)
    assert load.z_loss_sum == pytest.approx(z_sum, rel=1e-5)
    assert load.calls == 4  # 2 layers x 2 micro-batches
    # padded positions are not counted: 17 tokens x top-2 per layer
    assert load.counts.sum(1).tolist() == [2 * 17.0, 2 * 17.0]


def test_a_training_call_with_router_losses_needs_the_token_count(dims):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.engine import forward_backward

    model = build_model(ModelConfig(**MOE, moe_z_loss_coeff=Z), dims, seed=3).train()
    with pytest.raises(ValueError, match=r"model\.moe_z_loss_coeff=0\.01.*routed_tokens"):
        forward_backward(model, _micro_batches(), _no_loss, variable_shapes=True)
    with torch.no_grad():  # forward only: no router loss, nothing needed
        forward_backward(model.eval(), _micro_batches(), None, forward_only=True, variable_shapes=True)
    # without router losses a training call needs no count (the default path)
    plain = build_model(ModelConfig(**MOE), dims, seed=3).train()
    forward_backward(plain, _micro_batches(), _no_loss, variable_shapes=True)


def test_a_packed_micro_batch_gives_the_padded_ones_router_losses(dims):
    """Packed rows (sequence packing) route the same non-padding tokens as the padded
    micro-batch (the packed padding mask is the bins' tails): the same router losses and
    the same gradients from them."""
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.engine import forward_backward
    from nemo_rlhf.models.moe import RouterLoad
    from nemo_rlhf.models.packing import pack_rows

    ids = torch.randint(3, 100, (3, 8), generator=torch.Generator().manual_seed(9))
    spans = [(1, 7), (0, 5), (2, 8)]  # left-padded prompts (P = 4), right-padded responses
    mask = torch.zeros_like(ids)
    for i, (a, b) in enumerate(spans):
        mask[i, a:b] = 1
    n = int(mask.sum())
    padded = {"input_ids": ids, "attention_mask": mask}
    packed = {**padded, "packed": pack_rows(ids, spans, [[0, 1], [2]], prompt_length=4)}
    out = []
    for mb in (padded, packed):
        model = build_model(ModelConfig(**MOE, moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z), dims, seed=3).train()
        with RouterLoad(model) as load:
            forward_backward(model, [mb], _no_loss, routed_tokens=n)
        out.append((_grads(model), load.aux_loss_sum, load.z_loss_sum, load.counts.clone()))
    (g_pad, aux_pad, z_pad, c_pad), (g_pack, aux_pack, z_pack, c_pack) = out
    assert aux_pad > 0 and z_pad > 0
    assert (aux_pack, z_pack) == pytest.approx((aux_pad, z_pad), rel=1e-5)
    assert torch.equal(c_pack, c_pad) and c_pad.sum(1).tolist() == [2.0 * n] * 2
    assert g_pad["decoder.layers.0.mlp.router.weight"].abs().max() > 1e-4
    for name, g in g_pad.items():
        torch.testing.assert_close(g_pack[name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_full_recompute_counts_each_router_call_once(dims):
    """Under full activation recompute each layer's forward runs twice (without autograd,
    then again in the backward); the router losses are computed in the second run only, and
    the moe/ metrics count each routed token and each call once: the same numbers, and the
    same gradients, as without recompute."""
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.engine import forward_backward
    from nemo_rlhf.models.moe import RouterLoad, router_load_metrics

    micro = _micro_batches()
    n = sum(int(mb["attention_mask"].sum()) for mb in micro)
    out = []
    for recompute in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        cfg = ModelConfig(**MOE, moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z, **recompute)
        model = build_model(cfg, dims, seed=3).train()
        with RouterLoad(model) as load:
            forward_backward(model, micro, _no_loss, routed_tokens=n, variable_shapes=True)
        out.append((load.calls, load.counts.clone(), router_load_metrics(load.stage_sums()), _grads(model)))
    (calls, counts, metrics, grads), (r_calls, r_counts, r_metrics, r_grads) = out
    assert r_calls == calls == 4 and torch.equal(r_counts, counts)
    assert r_metrics == pytest.approx(metrics, rel=1e-6) and "moe/aux_loss" in metrics
    for name, g in grads.items():
        torch.testing.assert_close(r_grads[name], g, atol=1e-6, rtol=1e-5, msg=name)
