"""How LoRA adapters are named in a model and its checkpoints, without megatron (the
checkpoint tools import this at start-up): a base linear ``<name>``'s adapter is the sibling
module ``<name>_lora`` with parameters ``lora_a`` and ``lora_b``
(:mod:`nemo_rlhf.models.lora`)."""

from __future__ import annotations

import torch

ADAPTER_SUFFIX = "_lora"
"""A linear ``<name>``'s adapter is the sibling module ``<name>_lora``."""


def is_adapter_param(name: str) -> bool:
    """Whether a parameter (or state-dict) name belongs to a LoRA adapter."""
    return any(part.endswith(ADAPTER_SUFFIX) for part in name.split("."))


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` (bare or wrapped) holds any LoRA adapter parameter."""
    return any(is_adapter_param(n) for n, _ in model.named_parameters())


__all__ = ["ADAPTER_SUFFIX", "has_adapters", "is_adapter_param"]
