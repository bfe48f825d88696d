"""KV-cache decoding of a mixture-of-experts model (Qwen3-MoE-like: q / k norms, 4 experts,
top-2): the incremental stage runs it (the MoE MLP called per new token), and its tokens and
log-probs equal a full recompute's and the training forward's."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.logprobs import response_logprobs
from nemo_rlhf.rollout import RolloutConfig, generate
from nemo_rlhf.rollout.incremental_stage import IncrementalStage
from tests.single_rank import random_prompts, single_rank

VOCAB = 100
MAX_SEQ = 64
MOE = dict(vocab_size=VOCAB, init_method_std=0.1, qk_layernorm=True, kv_channels=24, num_moe_experts=4,
           moe_router_topk=2, moe_ffn_hidden_size=32)


@pytest.fixture(scope="module")
def dims():
    with single_rank(seed=0) as d:
        yield d


@pytest.fixture(scope="module", params=[False, True], ids=["renormalised", "pre_softmax"])
def model(dims, request):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset

    cfg = load_model_preset("tiny", **MOE, moe_router_pre_softmax=request.param)
    with torch.no_grad():  # routers sharper than the init: top-k choices that differ by token
        m = build_model(cfg, dims, seed=11)
        for layer in m.decoder.layers:
            layer.mlp.router.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    return m.eval()


def _gen(model, dims, **cfg):
    cfg.setdefault("max_new_tokens", 12)
    return generate(model, dims, random_prompts((5, 9, 3, 7), VOCAB, 5), RolloutConfig(**cfg),
                    eos_token_id=VOCAB - 1, pad_token_id=0, vocab_size=VOCAB, max_sequence_length=MAX_SEQ,
                    call_index=0)


def test_the_incremental_stage_takes_a_moe_model_and_generate_uses_it(model, dims, monkeypatch):
    assert IncrementalStage.for_model(model, 16) is not None
    calls = []
    real = IncrementalStage.__call__
    monkeypatch.setattr(IncrementalStage, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    out = _gen(model, dims, greedy=True, max_new_tokens=4, min_new_tokens=4)
    assert len(calls) == out.response_length == 4


@pytest.mark.parametrize("kw", [dict(greedy=True, max_new_tokens=16), dict(temperature=0.7, top_p=0.9, seed=3)],
                         ids=["greedy", "sampled"])
def test_moe_kv_cache_decode_equals_full_recompute(model, dims, kw):
    kv = _gen(model, dims, **kw)
    full = _gen(model, dims, use_kv_cache=False, **kw)
    assert torch.equal(kv.input_ids, full.input_ids) and torch.equal(kv.response_mask, full.response_mask)
    torch.testing.assert_close(kv.logprobs, full.logprobs, atol=1e-5, rtol=0)
    assert len(set(kv.response_ids[kv.response_mask].tolist())) >= 8, "degenerate output: a weak test"


def test_moe_decode_logprobs_equal_the_training_forward(model, dims):
    from nemo_rlhf.models.engine import model_forward

    b = _gen(model, dims, temperature=0.7, top_p=0.9, seed=4)
    with torch.no_grad():
        logits, _ = model_forward(model, b.input_ids, b.attention_mask)
    lp, _ = response_logprobs(logits, b, dims, RolloutConfig(temperature=0.7).logprob_temperature)
    diff = float((b.logprobs - lp).abs()[b.response_mask].max())
    assert diff <= 1e-5, f"max |decode - forward| = {diff}"


def test_the_experts_are_used_unevenly_by_token(model):
    """Each token's top-2 differs across tokens (else the tests above would not exercise
    the routing: one fixed pair of experts is a dense MLP)."""
    x = torch.randn(64, 1, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, routing_map = model.decoder.layers[0].mlp.router(x)
    assert len({tuple(r.nonzero().flatten().tolist()) for r in routing_map}) >= 3
