"""MoE routing replay (R3, :mod:`nemo_rlhf.models.routing_replay`): the recorded routes of a
KV-cache decode, replayed in the training forward; a forced route is the one the experts run."""

from __future__ import annotations


import pytest
import torch

from nemo_rlhf.models.logprobs import response_logprobs
from nemo_rlhf.models.routing_replay import RoutingReplay, moe_routers
from nemo_rlhf.rollout import RolloutConfig, generate
from tests.single_rank import random_prompts, single_rank

VOCAB = 100
MAX_SEQ = 64
MOE = dict(vocab_size=VOCAB, init_method_std=0.1, qk_layernorm=True, kv_channels=24, num_moe_experts=4,
           moe_router_topk=2, moe_ffn_hidden_size=32)


@pytest.fixture(scope="module")
def dims():
    with single_rank(seed=0) as d:
        yield d


def _build(dims, pre_softmax=False):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset

    cfg = load_model_preset("tiny", **MOE, moe_router_pre_softmax=pre_softmax)
    with torch.no_grad():  # routers sharper than the init: top-k choices that differ by token
        m = build_model(cfg, dims, seed=11)
        for layer in m.decoder.layers:
            layer.mlp.router.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    return m.eval()


@pytest.fixture(scope="module", params=[False, True], ids=["renormalised", "pre_softmax"])
def model(dims, request):
    return _build(dims, request.param)


def _gen(model, dims, **kw):
    cfg = RolloutConfig(**{"max_new_tokens": 12, "temperature": 0.7, "seed": 4, **kw})
    return generate(model, dims, random_prompts((5, 9, 3, 7), VOCAB, 5), cfg, eos_token_id=VOCAB - 1,
                    pad_token_id=0, vocab_size=VOCAB, max_sequence_length=MAX_SEQ, call_index=0)


def _train_logprobs(model, dims, batch, routes=None):
    from nemo_rlhf.models.engine import model_forward

    with torch.no_grad():
        if routes is None:
            logits, _ = model_forward(model, batch.input_ids, batch.attention_mask)
        else:
            with RoutingReplay(model, "replay", routes):
                logits, _ = model_forward(model, batch.input_ids, batch.attention_mask)
    lp, _ = response_logprobs(logits, batch, dims, RolloutConfig(temperature=0.7).logprob_temperature)
    return lp


def _full_routes(routes_BSLk, seq_len):
    """The decode's routes padded with -1 (the router's own) to the forward's length."""
    B, S, L, k = routes_BSLk.shape
    pad = torch.full((B, seq_len - S, L, k), -1, dtype=routes_BSLk.dtype)
    return torch.cat([routes_BSLk, pad], dim=1)


def test_record_gives_the_decode_routes_and_replay_reproduces_the_rollout_logprobs(model, dims):
    with RoutingReplay(model, "record") as rr:
        b = _gen(model, dims)
    routes = rr.routes()
    B, T = b.input_ids.shape
    assert routes.shape == (B, T - 1, 2, 2) and routes.dtype == torch.long  # the last token is never fed
    # the recorded routes are the training forward's own (same weights, exact decode)
    own = {}
    def grab(i):
        return lambda mod, inp, out: own.__setitem__(i, out[1])
    hs = [r.register_forward_hook(grab(i)) for i, r in enumerate(moe_routers(model))]
    _train_logprobs(model, dims, b)
    for h in hs:
        h.remove()
    for i in range(2):  # routing_map [S*B, E] in (s, b) order
        m = own[i].view(T, B, -1).transpose(0, 1)[:, :T - 1]
        got = torch.zeros_like(m).scatter_(-1, routes[:, :, i, :], True)
        real = b.attention_mask[:, :T - 1].bool()  # after a row's end the two passes differ
        assert torch.equal(got[real], m[real])  # (decode feeds pads unmasked), unused by any log-prob
    lp = _train_logprobs(model, dims, b, _full_routes(routes, T))
    # same weights, same routes: the replayed forward is the plain one bit for bit, and both
    # are the decode's log-probs to the KV-cache's fp32 rounding (~2e-6 seen; the bound of
    # test_moe_decode's decode-vs-forward check)
    assert torch.equal(lp, _train_logprobs(model, dims, b))
    diff = float((b.logprobs - lp).abs()[b.response_mask].max())
    assert diff <= 1e-5, f"max |rollout - replayed forward| = {diff}"


def test_replay_runs_the_experts_of_the_forced_route(dims):
    """Force every token to the two experts the router ranks lowest: the layer's output equals
    the experts' computation of that route with R3's weights (softmax of the router's logits
    over the forced experts), not the router's own top-2."""
    model = _build(dims, pre_softmax=False)
    layer = model.decoder.layers[0].mlp
    x = torch.randn(6, 3, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = layer.router.gating(x).view(-1, 4)
        worst = logits.topk(2, dim=-1, largest=False).indices  # [18, 2], never the argmax
        routes = worst.view(6, 3, 1, 2).transpose(0, 1)  # [B=3, S=6, L=1, k]
        full = routes.repeat(1, 1, 2, 1)  # both layers (only layer 0 is called here)
        rr = RoutingReplay(model, "replay", full)
        rr.layers = rr.layers[:1]  # the single layer called below
        with rr:
            out, _ = layer(x)
        own, _ = layer(x)
        w = torch.softmax(logits.gather(1, worst), dim=-1)  # R3: softmax over the replayed logits
        want = torch.zeros(18, 64)
        flat = x.view(18, 64)
        for t in range(18):
            for j in range(2):
                expert = layer.experts.local_experts[int(worst[t, j])]
                y, _ = expert(flat[t:t + 1], torch.tensor([1]))
                want[t] += w[t, j] * y[0]
    torch.testing.assert_close(out.view(18, 64), want, atol=1e-5, rtol=1e-5)
    assert (out - own).abs().max() > 1e-3, "the forced route changed nothing: a weak test"


def test_replay_gives_the_router_gradients(dims):
    model = _build(dims).train()
    x = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(2))
    layer = model.decoder.layers[0].mlp
    routes = torch.tensor([[0, 3]]).expand(2, 4, 2, 2).contiguous()
    rr = RoutingReplay(model, "replay", routes)
    rr.layers = rr.layers[:1]
    with rr:
        out, _ = layer(x)
    out.sum().backward()
    g = layer.router.weight.grad
    assert g is not None and g[[0, 3]].abs().sum() > 0 and g[[1, 2]].abs().sum() == 0


def test_replay_refuses_a_route_of_the_wrong_shape(model, dims):
    b = _gen(model, dims, max_new_tokens=3)
    B, T = b.input_ids.shape
    with pytest.raises(ValueError, match=r"MoE layer 0 is called on .* expected a route"):
        with RoutingReplay(model, "replay", torch.zeros(B, T + 1, 2, 2, dtype=torch.long)):
            _train_logprobs(model, dims, b)
    with pytest.raises(ValueError, match=r"L = 2 MoE layers"):
        RoutingReplay(model, "replay", torch.zeros(B, T, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"valid: 0..3"):
        RoutingReplay(model, "replay", torch.full((B, T, 2, 2), 4, dtype=torch.long))
    with pytest.raises(ValueError, match="mode='replay' needs the routes"):
        RoutingReplay(model, "replay")
    assert all(r.router_replay is None for r in moe_routers(model))  # uninstalled after the error


def test_generate_records_the_routes_into_the_rollout_batch(model, dims):
    """generate(record_routes=True): RolloutBatch.routes [B, P+R, L, k], -1 on the never-fed
    last column and on pad_response_to's columns; replaying them is the record above."""
    with RoutingReplay(model, "record") as rr:
        plain = _gen(model, dims)
    b = generate(
        model, dims, random_prompts((5, 9, 3, 7), VOCAB, 5),
        RolloutConfig(max_new_tokens=12, temperature=0.7, seed=4), eos_token_id=VOCAB - 1, pad_token_id=0,
        vocab_size=VOCAB, max_sequence_length=MAX_SEQ, call_index=0, record_routes=True)
    assert plain.routes is None and torch.equal(b.input_ids, plain.input_ids)
    B, T = b.input_ids.shape
    assert b.routes.shape == (B, T, 2, 2)
    assert torch.equal(b.routes[:, :T - 1], rr.routes()) and bool((b.routes[:, T - 1] == -1).all())
    padded = b.pad_response_to(b.response_length + 3, 0)
    assert padded.routes.shape == (B, T + 3, 2, 2) and bool((padded.routes[:, T:] == -1).all())
    torch.testing.assert_close(_train_logprobs(model, dims, padded, padded.routes)[:, :b.response_length],
                               _train_logprobs(model, dims, b, b.routes), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="record_routes=True"):
        generate(model, dims, [[1, 2]], RolloutConfig(max_new_tokens=2, use_kv_cache=False), eos_token_id=VOCAB - 1,
                 pad_token_id=0, vocab_size=VOCAB, max_sequence_length=MAX_SEQ, record_routes=True)


def test_record_needs_the_kv_cache(model, dims):
    with RoutingReplay(model, "record") as rr:
        _gen(model, dims, max_new_tokens=3, use_kv_cache=False)
    with pytest.raises(RuntimeError, match="rollout.use_kv_cache=true"):
        rr.routes()
