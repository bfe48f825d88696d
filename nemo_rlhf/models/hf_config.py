"""Hugging Face ``config.json`` <-> :class:`~nemo_rlhf.models.config.ModelConfig`, for the
architectures of :mod:`nemo_rlhf.models.hf_mapping` (which maps their tensors).

:func:`model_config_from_hf` reads an HF config (transformers' defaults where a field is
absent; RoPE scaling other than ``llama3`` and the other refusals of
:mod:`~nemo_rlhf.models.hf_mapping` raise a ``ValueError`` naming the key);
:func:`hf_config` writes the config an export needs (``<Arch>ForCausalLM``, or
``<Arch>ForSequenceClassification`` with ``num_labels=1`` for a reward model).
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_rlhf.models.config import ModelConfig
from nemo_rlhf.models.hf_mapping import ARCHS, DTYPES, arch_problems, ffn_size, get_arch, head_dim, query_groups


def _hf_get(hf: dict, key: str, default):
    """A field of an HF ``config.json`` with transformers' default when it is absent."""
    value = hf.get(key)
    return default if value is None else value


def model_config_from_hf(hf: dict, name: str) -> tuple[ModelConfig, str]:
    """``(ModelConfig, arch)`` of an HF ``config.json`` (a dict).

    Defaults for absent keys are those of transformers' ``LlamaConfig``, ``Qwen2Config``
    and ``GPT2Config``. ``vocab_size`` is the embedding's row count (the real vocabulary).

    Raises:
        ValueError: unsupported ``model_type`` (lists the supported ones) or a feature this
            project's model does not have (names the HF key).
    """
    mt = hf.get("model_type")
    if mt not in ARCHS:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {sorted(ARCHS)}")
    if mt == "gpt2":
        return _gpt2_config(hf, name), mt
    moe = _moe_config(hf, mt)
    base = ARCHS[mt].base
    act = _hf_get(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: only 'silu' (SwiGLU) is supported for {mt}")
    # transformers >= 5 writes one ``rope_parameters`` dict (theta, type and the scaling's
    # parameters); earlier versions (and most Hub files) ``rope_theta`` and ``rope_scaling``
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta_value, scaling = params.get("rope_theta", 10000.0), params
        partial = params.get("partial_rotary_factor", _hf_get(hf, "partial_rotary_factor", 1.0))
    else:
        theta_value, scaling = _hf_get(hf, "rope_theta", 1e6 if mt == "mixtral" else 10000.0), hf.get("rope_scaling")
        partial = _hf_get(hf, "partial_rotary_factor", 1.0)
    rope = _rope_scaling(scaling)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial}: only 1 (RoPE on the whole head) is supported")
    if base in ("qwen2", "qwen3") and _hf_get(hf, "use_sliding_window", False):
        raise ValueError("use_sliding_window=true: sliding-window attention is not supported")
    if base == "mistral":
        window = hf.get("sliding_window")
        positions = _hf_get(hf, "max_position_embeddings", 4096 * 32)
        if window is not None and window < positions:
            raise ValueError(
                f"sliding_window={window} (< max_position_embeddings={positions}): sliding-window "
                f"attention is not supported (attention here is full: past {window} tokens it would "
                f"see tokens the window hides); checkpoints with sliding_window null (Mistral-7B-v0.2 and "
                f"later) import, or set max_position_embeddings <= {window} in a copy of config.json")
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    dim = _hf_get(hf, "head_dim", hidden // heads)
    theta = float(theta_value)
    if theta != int(theta):
        raise ValueError(f"rope_theta={theta}: a non-integer RoPE base is not supported")
    if mt == "llama":
        attn_bias = bool(_hf_get(hf, "attention_bias", False))
        mlp_bias = bool(_hf_get(hf, "mlp_bias", False))
        if attn_bias != mlp_bias:
            raise ValueError(f"attention_bias={attn_bias} with mlp_bias={mlp_bias}: only both or "
                             "neither can be expressed (model.add_bias_linear)")
        bias_linear, qkv_bias = attn_bias, attn_bias
    elif base == "mistral":
        bias_linear, qkv_bias = False, False
    elif base == "qwen3":
        if _hf_get(hf, "attention_bias", False):
            raise ValueError("attention_bias=true: qwen3 with biases on q, k, v and o but not the MLP "
                             "cannot be expressed (model.add_bias_linear covers the MLP too)")
        bias_linear, qkv_bias = False, False
    else:
        bias_linear, qkv_bias = False, True
    cfg = ModelConfig(
        name=name,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=_hf_get(hf, "num_key_value_heads", heads),
        ffn_hidden_size=hf["intermediate_size"],
        kv_channels=None if dim * heads == hidden else dim,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=_hf_get(hf, "max_position_embeddings",
                                        {"llama": 2048, "mistral": 4096 * 32, "mixtral": 4096 * 32}.get(mt, 32768)),
        normalization="RMSNorm",
        layernorm_epsilon=float(_hf_get(hf, "rms_norm_eps", 1e-5 if mt == "mixtral" else 1e-6)),
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=int(theta),
        add_bias_linear=bias_linear,
        add_qkv_bias=qkv_bias,
        qk_layernorm=base == "qwen3",
        share_embeddings_and_output_weights=bool(_hf_get(hf, "tie_word_embeddings", False)),
        init_method_std=float(_hf_get(hf, "initializer_range", 0.02)),
        **rope,
        **moe,
    )
    return cfg, mt


def _moe_config(hf: dict, mt: str) -> dict:
    """:class:`ModelConfig` MoE keys of a ``qwen3_moe`` / ``mixtral`` ``config.json`` (empty
    for a dense ``model_type``). The routers' auxiliary-loss coefficient
    (``router_aux_loss_coef``) and Mixtral's ``router_jitter_noise`` are training settings,
    not imported (``model.moe_aux_loss_coeff`` stays 0, as dropout is not imported).

    Raises:
        ValueError: a Qwen3-MoE with dense layers (``decoder_sparse_step != 1``, a non-empty
            ``mlp_only_layers``) or no experts, naming the HF key.
    """
    if mt == "qwen3_moe":
        step = _hf_get(hf, "decoder_sparse_step", 1)
        dense_layers = list(_hf_get(hf, "mlp_only_layers", []))
        if step != 1 or dense_layers:
            raise ValueError(f"decoder_sparse_step={step}, mlp_only_layers={dense_layers}: only a "
                             "qwen3_moe whose every layer is MoE (decoder_sparse_step=1, mlp_only_layers=[]) "
                             "is supported; dense layers between MoE layers are not")
        experts = _hf_get(hf, "num_experts", 128)
        if experts < 1:
            raise ValueError(f"num_experts={experts}: a qwen3_moe without experts is dense; "
                             "set model_type to qwen3")
        return {"num_moe_experts": experts, "moe_router_topk": _hf_get(hf, "num_experts_per_tok", 8),
                "moe_ffn_hidden_size": _hf_get(hf, "moe_intermediate_size", 768),
                "moe_router_pre_softmax": not _hf_get(hf, "norm_topk_prob", False)}
    if mt == "mixtral":
        return {"num_moe_experts": _hf_get(hf, "num_local_experts", 8),
                "moe_router_topk": _hf_get(hf, "num_experts_per_tok", 2),
                "moe_ffn_hidden_size": _hf_get(hf, "intermediate_size", 14336),
                "moe_router_pre_softmax": False}
    return {}


ROPE_TYPES = ("default", "llama3")
"""HF ``rope_scaling.rope_type`` values imported (``default``: none)."""


def _rope_scaling(scaling) -> dict:
    """:class:`ModelConfig` ``rope_*`` keys of an HF ``rope_scaling`` or ``rope_parameters``
    (None or a dict).

    Raises:
        ValueError: a ``rope_type`` other than :data:`ROPE_TYPES` (``linear``, ``dynamic``,
            ``yarn``, ``longrope``, ...: names it and the supported ones), or a ``llama3``
            entry missing a parameter.
    """
    if not scaling:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return {}
    if kind != "llama3":
        raise ValueError(f"rope_scaling={scaling}: rope_type {kind!r} is not supported; supported: "
                         f"{list(ROPE_TYPES)}")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling={scaling}: rope_type 'llama3' needs {missing}")
    return {"rope_scaling": "llama3", "rope_scaling_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}


def hf_rope_scaling(cfg: ModelConfig) -> Optional[dict]:
    """The HF ``rope_scaling`` entry of ``cfg`` (None without scaling)."""
    if cfg.rope_scaling is None:
        return None
    return {"rope_type": cfg.rope_scaling, "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position_embeddings}


def _gpt2_config(hf: dict, name: str) -> ModelConfig:
    act = _hf_get(hf, "activation_function", "gelu_new")
    acts = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if act not in acts:
        raise ValueError(f"activation_function={act!r}: supported for gpt2: {sorted(acts)}")
    if (not _hf_get(hf, "scale_attn_weights", True)
            or _hf_get(hf, "scale_attn_by_inverse_layer_idx", False)):
        raise ValueError("scale_attn_weights=false or scale_attn_by_inverse_layer_idx=true: "
                         "attention scaling other than 1/sqrt(head_dim) is not supported")
    hidden = _hf_get(hf, "n_embd", 768)
    return ModelConfig(
        name=name,
        num_layers=_hf_get(hf, "n_layer", 12),
        hidden_size=hidden,
        num_attention_heads=_hf_get(hf, "n_head", 12),
        ffn_hidden_size=_hf_get(hf, "n_inner", 4 * hidden),
        vocab_size=_hf_get(hf, "vocab_size", 50257),
        max_position_embeddings=_hf_get(hf, "n_positions", 1024),
        normalization="LayerNorm",
        layernorm_epsilon=float(_hf_get(hf, "layer_norm_epsilon", 1e-5)),
        activation=acts[act],
        position_embedding_type="learned_absolute",
        add_bias_linear=True,
        share_embeddings_and_output_weights=bool(_hf_get(hf, "tie_word_embeddings", True)),
        init_method_std=float(_hf_get(hf, "initializer_range", 0.02)),
    )


def hf_config(cfg: ModelConfig, arch: str, dtype: torch.dtype, reward: bool = False,
              token_ids: Optional[dict] = None) -> dict:
    """The ``config.json`` dict of an export.

    Args:
        dtype: the exported tensors' dtype (``torch_dtype``).
        reward: a ``<Arch>ForSequenceClassification`` with ``num_labels=1``.
        token_ids: ``{"bos_token_id", "eos_token_id", "pad_token_id"}`` (None entries left out).

    Raises:
        ValueError: ``cfg`` cannot be written as ``arch`` (see :func:`arch_problems`).
    """
    problems = arch_problems(cfg, arch)
    if problems:
        raise ValueError(f"model {cfg.name!r} cannot be exported as {arch}: {'; '.join(problems)}")
    a = get_arch(arch)
    dtype_name = {v: k for k, v in DTYPES.items()}[dtype]
    tied = cfg.share_embeddings_and_output_weights and not reward
    if arch == "gpt2":
        out = {"model_type": "gpt2", "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
               "n_head": cfg.num_attention_heads, "n_inner": ffn_size(cfg),
               "n_positions": cfg.max_position_embeddings,
               "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
               "layer_norm_epsilon": cfg.layernorm_epsilon, "attn_pdrop": 0.0, "embd_pdrop": 0.0,
               "resid_pdrop": 0.0, "summary_first_dropout": 0.0, "scale_attn_weights": True,
               "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    else:
        base = a.base
        out = {"model_type": arch, "hidden_size": cfg.hidden_size,
               "intermediate_size": ffn_size(cfg), "num_hidden_layers": cfg.num_layers,
               "num_attention_heads": cfg.num_attention_heads,
               "num_key_value_heads": query_groups(cfg), "head_dim": head_dim(cfg),
               "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
               "rms_norm_eps": cfg.layernorm_epsilon, "rope_theta": float(cfg.rotary_base),
               "rope_scaling": hf_rope_scaling(cfg), "attention_dropout": 0.0}
        if base == "llama":
            out.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear,
                       pretraining_tp=1)
        elif base == "mistral":
            out.update(sliding_window=None)
        elif base == "qwen3":
            out.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                       max_window_layers=cfg.num_layers)
        else:
            out.update(use_sliding_window=False, sliding_window=None,
                       max_window_layers=cfg.num_layers)
        if arch == "qwen3_moe":
            out.update(num_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                       moe_intermediate_size=cfg.moe_expert_ffn_size, norm_topk_prob=not cfg.moe_router_pre_softmax,
                       decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                       router_aux_loss_coef=cfg.moe_aux_loss_coeff)
        elif arch == "mixtral":
            out.update(num_local_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                       intermediate_size=cfg.moe_expert_ffn_size, output_router_logits=False,
                       router_aux_loss_coef=cfg.moe_aux_loss_coeff, router_jitter_noise=0.0)
    out.update(architectures=[a.seq_cls if reward else a.causal_lm], vocab_size=cfg.vocab_size,
               tie_word_embeddings=tied, initializer_range=cfg.init_method_std,
               torch_dtype=dtype_name, use_cache=True)
    if reward:
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    out.update({k: v for k, v in (token_ids or {}).items() if v is not None})
    return out

