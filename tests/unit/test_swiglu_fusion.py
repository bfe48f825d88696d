"""SwiGLU models train through megatron's SwiGLU autograd function (``bias_activation_fusion``):
the same gradients as the unfused chunk/silu/mul, less saved for the backward, and the
decode loop keeps its lean MLP path."""

from __future__ import annotations

import pytest
import torch

from tests.single_rank import single_rank

VOCAB = 256


@pytest.fixture(scope="module")
def dims():
    with single_rank(seed=0) as d:
        yield d


def _cfg(**kw):
    from nemo_rlhf.models.config import load_model_preset

    return load_model_preset("llama", vocab_size=VOCAB, max_position_embeddings=64, num_layers=2,
                             hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                             num_query_groups=2, hidden_dropout=0.0, attention_dropout=0.0, **kw)


def test_only_swiglu_models_get_the_fused_activation():
    from nemo_rlhf.models.config import build_transformer_config, load_model_preset

    assert build_transformer_config(_cfg(), 1, 1, "32").bias_activation_fusion is True
    gelu = load_model_preset("tiny", vocab_size=VOCAB, activation="gelu")
    assert build_transformer_config(gelu, 1, 1, "32").bias_activation_fusion is False
    # with linear biases megatron's unfused path (the decode loop's lean MLP has no bias)
    assert build_transformer_config(_cfg(add_bias_linear=True), 1, 1, "32").bias_activation_fusion is False


def _grads_and_saved(dims, fused: bool):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.engine import model_forward

    model = build_model(_cfg(), dims, "32", seed=1)
    model.config.bias_activation_fusion = fused  # megatron's MLP reads it at each forward
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (3, 24), generator=g)
    mask = torch.ones_like(ids)
    saved = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, values = model_forward(model, ids, mask)
    (logits.log_softmax(-1)[..., 3].sum() + values.sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved.values())


def test_the_same_gradients_and_less_saved_than_unfused(dims):
    fused, fused_bytes = _grads_and_saved(dims, True)
    plain, plain_bytes = _grads_and_saved(dims, False)
    for n in plain:
        torch.testing.assert_close(fused[n], plain[n], rtol=1e-5, atol=1e-6, msg=n)
    # per layer the unfused path keeps silu(gate), the product and a sum of [tokens, ffn]
    # more; the fused one keeps only the fc1 output
    tokens, ffn = 3 * 24, 160
    assert plain_bytes - fused_bytes >= 2 * tokens * ffn * 4 * 2  # two layers, >= 2 tensors each


def test_the_decode_loop_keeps_its_lean_mlp(dims):
    from nemo_rlhf.models.actor_critic import build_model

    model = build_model(_cfg(), dims, "32", seed=1).eval()
    assert model.config.bias_activation_fusion
    assert all(layer._lean for layer in model.decoder.layers)
