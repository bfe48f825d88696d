"""The mixture-of-experts keys of ModelConfig (``model.num_moe_experts`` ...): validation,
fingerprints, and the megatron MoE layer they build, checked against a plain loop of the
routing rule (softmax over all experts, top-k, renormalised unless
``moe_router_pre_softmax``)."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.config import MOE_KEYS, ModelConfig, build_transformer_config
from tests.single_rank import single_rank

MOE = dict(vocab_size=100, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
           init_method_std=0.2)


@pytest.mark.parametrize("overrides, key", [
    (dict(num_moe_experts=0), "model.num_moe_experts=0"),
    (dict(num_moe_experts=4, moe_router_topk=5), "model.moe_router_topk=5"),
    (dict(num_moe_experts=4, moe_router_topk=0), "model.moe_router_topk=0"),
    (dict(num_moe_experts=4, moe_ffn_hidden_size=0), "model.moe_ffn_hidden_size=0"),
    (dict(num_moe_experts=4, moe_aux_loss_coeff=-1.0), "model.moe_aux_loss_coeff=-1.0"),
    (dict(num_moe_experts=4, moe_z_loss_coeff=-0.001), "model.moe_z_loss_coeff=-0.001: must be >= 0"),
    (dict(moe_ffn_hidden_size=32), "model.moe_ffn_hidden_size=32"),
    (dict(moe_z_loss_coeff=0.1), "model.moe_z_loss_coeff=0.1"),
    (dict(num_moe_experts=4, add_bias_linear=True), "model.add_bias_linear=true"),
    (dict(num_moe_experts=4, recompute_granularity="selective", recompute_modules=["mlp"]),
     "model.recompute_modules"),
])
def test_invalid_moe_settings_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("[", r"\[")):
        ModelConfig(**overrides)


def test_dense_fingerprint_has_no_moe_keys_and_moe_fingerprint_has_the_architecture_ones():
    dense = ModelConfig(vocab_size=100).fingerprint()
    assert not set(MOE_KEYS) & set(dense)
    moe_cfg = ModelConfig(**MOE, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    moe = moe_cfg.fingerprint()
    assert moe["num_moe_experts"] == 4 and moe["moe_router_topk"] == 2
    assert moe["moe_ffn_hidden_size"] == 32 and moe["moe_router_pre_softmax"] is False
    # loss coefficients are training settings: they do not stop a checkpoint from loading
    assert "moe_aux_loss_coeff" not in moe and "moe_z_loss_coeff" not in moe
    assert moe != ModelConfig(**{**MOE, "moe_router_topk": 1}).fingerprint()


def test_transformer_config_carries_the_moe_settings():
    cfg = ModelConfig(**MOE, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    tc = build_transformer_config(cfg, 1, 1)
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size) == (4, 2, 32)
    assert tc.moe_router_pre_softmax and tc.moe_token_dispatcher_type == "allgather"
    assert tc.moe_router_load_balancing_type == "aux_loss" and tc.moe_aux_loss_coeff == 0.01
    assert tc.moe_z_loss_coeff == 0.001
    assert not tc.moe_grouped_gemm
    dense = build_transformer_config(ModelConfig(vocab_size=100), 1, 1)
    assert dense.num_moe_experts is None
    no_aux = build_transformer_config(ModelConfig(**MOE), 1, 1)
    assert no_aux.moe_router_load_balancing_type == "none" and no_aux.moe_z_loss_coeff is None
    # moe_ffn_hidden_size null: each expert is ffn_hidden_size wide
    wide = build_transformer_config(ModelConfig(**{**MOE, "moe_ffn_hidden_size": None}, ffn_hidden_size=48), 1, 1)
    assert wide.moe_ffn_hidden_size == 48


@pytest.fixture(scope="module")
def dims():
    with single_rank(seed=0) as d:
        yield d


def _loop_moe(mlp, x: torch.Tensor, topk: int, pre_softmax: bool) -> torch.Tensor:
    """The MoE MLP of ``x [tokens, hidden]`` token by token: softmax over all experts, the
    top-k, renormalised over them unless ``pre_softmax``; SwiGLU experts."""
    w_router = mlp.router.weight
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ w_router.t(), dim=-1)
        top, idx = probs.topk(topk)
        if not pre_softmax:
            top = top / top.sum()
        for p, e in zip(top, idx):
            expert = mlp.experts.local_experts[int(e)]
            gate, up = (x[t] @ expert.linear_fc1.weight.t()).chunk(2)
            out[t] += p * ((torch.nn.functional.silu(gate) * up) @ expert.linear_fc2.weight.t())
    return out


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_moe_layer_routes_as_the_plain_loop(dims, pre_softmax):
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.engine import model_forward

    model = build_model(ModelConfig(**MOE, moe_router_pre_softmax=pre_softmax), dims, seed=3).eval()
    mlp = model.decoder.layers[0].mlp
    assert isinstance(mlp, MoELayer) and isinstance(mlp.experts, SequentialMLP)
    assert len(mlp.experts.local_experts) == 4
    assert tuple(mlp.router.weight.shape) == (4, 64)
    assert tuple(mlp.experts.local_experts[0].linear_fc1.weight.shape) == (64, 64)  # [gate; up] x 32
    x = torch.randn(7, 1, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, bias = mlp(x)
        ref = _loop_moe(mlp, x[:, 0], 2, pre_softmax)
    assert bias is None
    torch.testing.assert_close(out[:, 0], ref, atol=1e-5, rtol=1e-5)
    # the two rules differ on these inputs (the test would catch the other one)
    other = _loop_moe(mlp, x[:, 0], 2, not pre_softmax)
    assert float((other - ref).abs().max()) > 1e-3
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, values = model_forward(model, ids, torch.ones_like(ids))
    assert logits.shape == (2, 9, 128) and torch.isfinite(logits).all()


def test_the_tp_moe_layer_rests_on_megatron_reading_its_attention_tp_group_in_one_check_only():
    """TensorParallelMoELayer swaps ``attn_tp_group`` for a one-rank stand-in around
    megatron's training check at TP > 1 without sequence parallelism; that is sound only
    while megatron's ``MoELayer`` reads the group nowhere else (its numbers at TP=2:
    tests/distributed/test_expert_parallel.py)."""
    import inspect

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from nemo_rlhf.models.decode_layers import local_layer_spec
    from nemo_rlhf.models.decode_layers import TensorParallelMoELayer

    source = inspect.getsource(inspect.getmodule(MoELayer))  # MoELayer and BaseMoELayer
    assert "without also enabling sequence parallelism" in source
    assert source.count("attn_tp_group") == 2  # set in BaseMoELayer.__init__, read in that check
    assert local_layer_spec(num_experts=4).submodules.mlp.module is TensorParallelMoELayer
    assert issubclass(TensorParallelMoELayer, MoELayer)
