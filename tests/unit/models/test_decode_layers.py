"""The decoding layer spec (nemo_rlhf.models.decode_layers): same training forward as
megatron's local spec, and an incremental KV-cache path that agrees with megatron's own
static-batching path."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from nemo_rlhf.models.actor_critic import _layer_spec
from nemo_rlhf.models.config import load_model_preset
from nemo_rlhf.models.decode_layers import (
    CACHE_TAG,
    KVCacheSelfAttention,
    KVCacheTransformerLayer,
    local_layer_spec,
)
from nemo_rlhf.rollout import RolloutConfig, generate
from nemo_rlhf.rollout.incremental_stage import IncrementalStage
from tests.single_rank import random_prompts, single_rank

VOCAB = 100
MAX_SEQ = 64
LENGTHS = (5, 9, 3, 7)

MODELS = {
    "rope_gqa": dict(init_method_std=0.1),
    "rope_mha_bias": dict(init_method_std=0.1, num_query_groups=4, add_bias_linear=True),
    "learned_abs_gpt2_like": dict(init_method_std=0.1, position_embedding_type="learned_absolute",
                                  normalization="LayerNorm", activation="gelu",
                                  add_bias_linear=True),
}


@pytest.fixture(scope="module")
def dims():
    with single_rank(seed=0) as d:
        yield d


def _cfg(**overrides):
    from nemo_rlhf.models.config import load_model_preset

    return load_model_preset("tiny", vocab_size=VOCAB, **overrides)


def _build(dims, **overrides):
    from nemo_rlhf.models.actor_critic import build_model

    return build_model(_cfg(**overrides), dims, seed=11).eval()


@pytest.fixture(scope="module")
def models(dims):
    return {name: _build(dims, **kw) for name, kw in MODELS.items()}


def _prompts(lengths=LENGTHS, seed=5):
    return random_prompts(lengths, VOCAB, seed)


def _gen(model, dims, prompts=None, **cfg):
    cfg.setdefault("max_new_tokens", 12)
    return generate(model, dims, _prompts() if prompts is None else prompts, RolloutConfig(**cfg),
                    eos_token_id=VOCAB - 1, pad_token_id=0, vocab_size=VOCAB,
                    max_sequence_length=MAX_SEQ, call_index=0)


def _set_incremental(model, on: bool) -> None:
    for m in model.modules():
        if isinstance(m, KVCacheSelfAttention):
            m._fast_inference = on


def test_model_is_built_with_the_decoding_classes_and_megatron_keys(models):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = models["rope_gqa"]
    layers = list(model.decoder.layers)
    assert layers and all(type(l) is KVCacheTransformerLayer for l in layers)
    assert all(type(l.self_attention) is KVCacheSelfAttention for l in layers)
    assert all(l._lean and l.self_attention._fast_inference for l in layers)
    spec, ref = local_layer_spec("RMSNorm"), get_gpt_layer_local_spec(normalization="RMSNorm")
    assert spec.submodules.self_attention.submodules == ref.submodules.self_attention.submodules
    assert spec.submodules.mlp == ref.submodules.mlp


@pytest.mark.parametrize("name", list(MODELS))
def test_training_forward_is_megatrons_bit_for_bit(dims, name):
    """Same seed, our spec vs megatron's local spec: same parameters, keys and outputs
    (logits and values) in eval and train mode, and the same gradients."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from nemo_rlhf.distributed.parallel import reseed_model_parallel
    from nemo_rlhf.models.actor_critic import ActorCriticModel
    from nemo_rlhf.models.config import build_transformer_config
    from nemo_rlhf.models.engine import model_forward

    cfg = _cfg(**MODELS[name])

    def build(spec):
        reseed_model_parallel(11)
        tc = build_transformer_config(cfg, 1, 1)
        return ActorCriticModel(tc, cfg, pre_process=True, post_process=True, layer_spec=spec)

    ours = build(local_layer_spec(cfg.normalization))
    ref = build(get_gpt_layer_local_spec(normalization=cfg.normalization))
    sd_o, sd_r = ours.state_dict(), ref.state_dict()
    assert sd_o.keys() == sd_r.keys()
    assert all(torch.equal(sd_o[k], sd_r[k]) for k in sd_o if torch.is_tensor(sd_o[k]))
    assert ours.sharded_state_dict().keys() == ref.sharded_state_dict().keys()
    ids = torch.randint(1, VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    for train in (False, True):
        ours.train(train)
        ref.train(train)
        lo, vo = model_forward(ours, ids, mask)
        lr, vr = model_forward(ref, ids, mask)
        assert torch.equal(lo, lr) and torch.equal(vo, vr)
        if train:
            (lo.float().square().mean() + vo.sum()).backward()
            (lr.float().square().mean() + vr.sum()).backward()
            go = dict(ours.named_parameters())
            for n, p in ref.named_parameters():
                assert torch.equal(go[n].grad, p.grad), n


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("greedy", [True, False])
def test_incremental_path_equals_megatrons_static_path(models, dims, name, greedy):
    """Tokens identical and log-probs within 1e-5 with the incremental path on or off
    (off = megatron's own StaticInferenceContext path), mixed-length prompts."""
    model = models[name]
    kw = dict(greedy=True) if greedy else dict(temperature=0.7, top_p=0.9, seed=3)
    fast = _gen(model, dims, **kw)
    try:
        _set_incremental(model, False)
        slow = _gen(model, dims, **kw)
    finally:
        _set_incremental(model, True)
    assert torch.equal(fast.input_ids, slow.input_ids)
    assert torch.equal(fast.response_mask, slow.response_mask)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0)


def _step_logits(model, ctx, ids, mask=None):
    """One forward of ``ids [B, s]`` at the context's offset; returns ``[B, vocab]``."""

    s0 = ctx.sequence_len_offset
    b, s = ids.shape
    pos = torch.arange(s0, s0 + s).expand(b, s)
    out = model(ids, pos, mask, inference_context=ctx, runtime_gather_output=True)
    ctx.sequence_len_offset += s
    return out[:, -1, :VOCAB]


@pytest.mark.parametrize("name", ["rope_gqa", "learned_abs_gpt2_like"])
def test_chunked_prefill_and_decode_match_one_full_forward(models, dims, name):
    """Prefill in two chunks (the second at offset > 0, causal mask from the offset), then
    one-token steps: the cache is filled by the incremental path (our key in the
    context's dict, megatron's absent) and the logits match a forward without cache."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from nemo_rlhf.models.engine import model_forward

    model = models[name]
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    ctx = StaticInferenceContext(2, 16)
    with torch.no_grad():
        got = [_step_logits(model, ctx, ids[:, :5]), _step_logits(model, ctx, ids[:, 5:9])]
        got += [_step_logits(model, ctx, ids[:, t:t + 1]) for t in range(9, 12)]
        full = model_forward(model, ids, torch.ones_like(ids))[0][..., :VOCAB]
    keys = set(ctx.key_value_memory_dict)
    assert keys == {(l.layer_number, CACHE_TAG) for l in model.decoder.layers}
    for i, t in enumerate([4, 8, 9, 10, 11]):
        torch.testing.assert_close(got[i], full[:, t], atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_incremental_stage_gives_the_models_own_logits_step_by_step(models, dims, name):
    """The stage (no GPTModel/TransformerBlock wrappers) vs ``model(...)`` through the same
    incremental layers: a left-padded prefill then one-token steps, each side with its own
    context; the last-token logits are bit-identical."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from nemo_rlhf.models.engine import causal_padding_mask, position_ids_for

    model = models[name]
    stage = IncrementalStage.for_model(model, 16)
    assert stage is not None
    ids = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(8))
    real = torch.ones_like(ids, dtype=torch.bool)
    real[1, :3] = False  # left padding: a prefill mask and a decode key mask
    ctx_model, ctx_stage = StaticInferenceContext(3, 16), StaticInferenceContext(3, 16)
    with torch.no_grad():
        for s0, s1 in ((0, 6), (6, 7), (7, 8), (8, 9)):
            m = real[:, :s1]
            pos = position_ids_for(m)[:, s0:s1]
            mask = causal_padding_mask(m)[:, :, s0:s1, :s1]
            ref = model(ids[:, s0:s1], pos, mask, inference_context=ctx_model,
                        runtime_gather_output=True)[:, -1]
            got = stage(ids[:, s0:s1], pos, mask, ctx_stage)
            for ctx in (ctx_model, ctx_stage):
                ctx.sequence_len_offset += s1 - s0
            assert got.shape == ref.shape
            assert torch.equal(got, ref), (name, s0)


def test_incremental_stage_is_used_by_generate_and_refused_when_a_layer_is_not_lean(
        models, dims, monkeypatch):
    model = models["rope_gqa"]
    calls = []
    real_call = IncrementalStage.__call__
    monkeypatch.setattr(IncrementalStage, "__call__",
                        lambda self, *a, **k: calls.append(1) or real_call(self, *a, **k))
    out = _gen(model, dims, greedy=True, max_new_tokens=4, min_new_tokens=4)
    assert len(calls) == out.response_length == 4  # the prefill and every decode step
    try:
        _set_incremental(model, False)
        assert IncrementalStage.for_model(model, 16) is None
    finally:
        _set_incremental(model, True)
    model.train()
    try:
        assert IncrementalStage.for_model(model, 16) is None
    finally:
        model.eval()
    from nemo_rlhf.models.actor_critic import build_model

    rm = build_model(_cfg(**MODELS["rope_gqa"]), dims, kind="reward", seed=11).eval()
    assert IncrementalStage.for_model(rm, 16) is None  # its own _postprocess (reward head)


def test_a_context_filled_by_one_path_is_not_continued_by_the_other(models, dims):
    from megatron.core.inference.contexts import StaticInferenceContext

    model = models["rope_gqa"]
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    for first_fast in (True, False):
        ctx = StaticInferenceContext(2, 16)
        try:
            _set_incremental(model, first_fast)
            with torch.no_grad():
                _step_logits(model, ctx, ids[:, :5])
            _set_incremental(model, not first_fast)
            with torch.no_grad(), pytest.raises(RuntimeError, match="cannot (be )?continue"):
                _step_logits(model, ctx, ids[:, 5:6])
        finally:
            _set_incremental(model, True)


def test_cpu_compat_suspended_pops_the_mode_and_restores_it(dims):
    from torch.overrides import _get_current_function_mode_stack

    from nemo_rlhf.distributed import cpu_compat

    if not cpu_compat.is_active():
        pytest.skip("the CPU shim is not active (CUDA machine)")

    def shim_modes():
        return [m for m in _get_current_function_mode_stack()
                if isinstance(m, cpu_compat._CpuDeviceMode)]

    before = shim_modes()
    assert before
    with cpu_compat.suspended():
        assert len(shim_modes()) == len(before) - 1
        assert torch.zeros(2, device="cuda").device.type == "cpu"  # factories still remapped
    assert shim_modes() == before
    with pytest.raises(ValueError):
        with cpu_compat.suspended():
            raise ValueError("boom")
    assert shim_modes() == before


def test_the_local_spec_is_used_even_where_transformer_engine_imports(monkeypatch):
    """TE's spec has other parameter names and ignores the padding/packing masks under
    ``causal``; a TE install (an NGC container) must not switch the layers to it."""
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    spec = _layer_spec(load_model_preset("tiny"))
    assert spec.module is KVCacheTransformerLayer
    assert spec.submodules.self_attention.module is KVCacheSelfAttention
