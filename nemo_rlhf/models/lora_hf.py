"""LoRA adapters of a checkpoint in Hugging Face terms: merged into the base weights, or as a
PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``) that ``peft`` loads
onto the exported base model.

Works on full (TP=1, layer-stacked) tensors as :func:`nemo_rlhf.checkpoint.io.load_full_tensors`
returns them, ``model.`` stripped:

* ``decoder.layers.<path>_lora.lora_a`` ``[L, r, in]`` and ``lora_b`` ``[L, out, r]`` beside
  the base weight ``decoder.layers.<path>.weight`` ``[L, out, in]`` (``<path>``:
  ``self_attention.linear_qkv``, ``self_attention.linear_proj``, ``mlp.linear_fc1``,
  ``mlp.linear_fc2``); a gated ``linear_fc1``'s B rows are ``[gate; up]`` like its weight.
* merged: ``W + (alpha / r) B A`` (Hu et al. 2021, eq. 3), the product in fp32.
* PEFT: the fused megatron linears are split as the weight mapping splits them
  (:func:`nemo_rlhf.models.hf_mapping.split_qkv`, the ``[gate; up]`` halves): ``q_proj``,
  ``k_proj``, ``v_proj`` share the QKV adapter's A and take their rows of B, ``gate_proj``
  and ``up_proj`` likewise, so ``B_q A`` is exactly the q rows of ``B A``; PEFT's
  ``lora_alpha / r`` scale is the same (no rank-stabilised scaling).
"""

from __future__ import annotations

import torch

from nemo_rlhf.models.config import ModelConfig
from nemo_rlhf.models.hf_mapping import get_arch, head_dim, query_groups, split_qkv

ADAPTED_PATHS = {
    "linear_qkv": "self_attention.linear_qkv",
    "linear_proj": "self_attention.linear_proj",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
}
"""``model.lora.target_modules`` -> the linear's path inside a layer."""
PEFT_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
"""Architectures whose HF module names the PEFT export knows."""


def adapter_keys(target: str) -> tuple[str, str, str]:
    """``(A key, B key, base weight key)`` of ``target`` in full tensors (``model.`` stripped)."""
    path = f"decoder.layers.{ADAPTED_PATHS[target]}"
    return f"{path}_lora.lora_a", f"{path}_lora.lora_b", f"{path}.weight"


def split_adapters(full: dict) -> tuple[dict, dict]:
    """``(base tensors, {target: (A [L, r, in], B [L, out, r])})`` of full tensors that may
    hold adapters."""
    adapters, taken = {}, set()
    for target in ADAPTED_PATHS:
        a, b, _ = adapter_keys(target)
        if a in full and b in full:
            adapters[target] = (full[a], full[b])
            taken |= {a, b}
    return {k: v for k, v in full.items() if k not in taken}, adapters


def merge_adapters(base: dict, adapters: dict, scale: float) -> dict:
    """``base`` with every adapted weight replaced by ``W + scale * B A`` (fp32 product,
    the weight's dtype kept).

    Raises:
        ValueError: an adapter without its base weight, or shapes that do not compose.
    """
    out = dict(base)
    for target, (a, b) in adapters.items():
        key = adapter_keys(target)[2]
        if key not in base:
            raise ValueError(f"the base has no {key} for the {target} adapter")
        w = base[key]
        if b.shape[:-1] != w.shape[:-1] or a.shape[-1] != w.shape[-1] or a.shape[-2] != b.shape[-1]:
            raise ValueError(f"{target} adapter A {tuple(a.shape)}, B {tuple(b.shape)} do not fit "
                             f"the base weight {tuple(w.shape)}")
        out[key] = (w.float() + scale * torch.matmul(b.float(), a.float())).to(w.dtype)
    return out


def peft_adapter(adapters: dict, cfg: ModelConfig, arch: str, lora: dict) -> tuple[dict, dict]:
    """The adapters as PEFT's ``(state dict, adapter_config)``.

    Args:
        adapters: from :func:`split_adapters`.
        cfg: the model's config (heads, groups, head size).
        arch: the HF architecture (:data:`PEFT_ARCHS`).
        lora: ``model.lora`` as a dict (``rank``, ``alpha``, ``dropout``).

    Returns:
        ``{"base_model.model.<hf module>.lora_A.weight": [r, in], ... lora_B: [out, r]}``
        and the ``adapter_config.json`` contents.

    Raises:
        ValueError: an architecture PEFT's module names are not known for, or an MoE model.
    """
    if arch not in PEFT_ARCHS or cfg.num_moe_experts is not None:
        raise ValueError(f"a PEFT adapter export of {arch!r} is not supported (supported: "
                         f"{list(PEFT_ARCHS)}, dense)")
    prefix = "base_model.model." + get_arch(arch).prefix
    heads, groups, dim = cfg.num_attention_heads, query_groups(cfg), head_dim(cfg)
    out, modules = {}, set()

    def put(module: str, i: int, a: torch.Tensor, b: torch.Tensor) -> None:
        name = f"{prefix}layers.{i}.{module}"
        out[f"{name}.lora_A.weight"] = a.clone()  # (q, k, v share A: one copy each on disk)
        out[f"{name}.lora_B.weight"] = b.clone()
        modules.add(module.rsplit(".", 1)[-1])

    for target, (a_all, b_all) in adapters.items():
        for i in range(a_all.shape[0]):
            a, b = a_all[i], b_all[i]
            if target == "linear_qkv":
                for name, rows in zip(("q_proj", "k_proj", "v_proj"), split_qkv(b, heads, groups, dim)):
                    put(f"self_attn.{name}", i, a, rows)
            elif target == "linear_proj":
                put("self_attn.o_proj", i, a, b)
            elif target == "linear_fc1":
                gate, up = b.chunk(2, dim=0)
                put("mlp.gate_proj", i, a, gate)
                put("mlp.up_proj", i, a, up)
            else:
                put("mlp.down_proj", i, a, b)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"]), "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "inference_mode": True, "base_model_name_or_path": None,
    }
    return out, config


__all__ = ["ADAPTED_PATHS", "PEFT_ARCHS", "adapter_keys", "merge_adapters", "peft_adapter",
           "split_adapters"]
