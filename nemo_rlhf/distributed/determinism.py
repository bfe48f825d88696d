"""Deterministic mode (``trainer.deterministic=true``): a run repeated with the same seed on
the same machine, software and layout gives bit-identical steps.

What :func:`enable_deterministic_mode` sets, before any process group, model or cuBLAS
handle exists (it must run first: ``CUBLAS_WORKSPACE_CONFIG`` is read at the first cuBLAS
call):

* ``torch.use_deterministic_algorithms(True, warn_only=False)``: every op with a
  deterministic implementation uses it (on CUDA: ``index_add_``, ``scatter_add_``,
  ``index_put_(accumulate=True)``, the embedding backward, ...) and an op without one raises
  a ``RuntimeError`` naming it instead of silently varying; ``torch.backends.cudnn``
  ``deterministic=True``, ``benchmark=False``;
* megatron's ``TransformerConfig.deterministic_mode`` (it follows
  ``torch.are_deterministic_algorithms_enabled()`` when the model is built:
  :func:`~nemo_rlhf.models.config.transformer_config`): the vocab-parallel embedding's
  lookup by indexing, Transformer Engine's deterministic attention; megatron's MoE token
  combine takes its ``index_add_`` path under the torch flag;
* environment variables, each filled with its default when unset and refused (naming the
  variable, its value and the accepted ones) when set to another value, as Megatron-LM's
  ``--deterministic-mode`` does (NVIDIA, "Deterministic Training", Megatron Core developer
  guide): ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``; cuBLAS' split-K reductions
  otherwise depend on the workspace left), ``NCCL_ALGO=Ring`` (Ring's reduction order is
  fixed by the topology; NCCL may otherwise pick Tree / NVLS per message size), and
  ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (Transformer Engine's kernels).

The reduction orders the code itself chooses are fixed whatever the mode: the DP
all-reduces of the step's sums are over the same ranks in the same order, the micro-batch
order and the token-budget packing are seeded by ``trainer.seed + step``, and the rollout's
sampler cumulates with :func:`cumsum` (a fixed-order scan on CUDA in this mode: CUDA's
float ``cumsum`` has no deterministic implementation and would raise).

Not covered (documented in docs/reproducibility.md): ``rollout.engine=vllm`` (vLLM's own
kernels and batching), ``rollout.mode=async`` (which policy version a sample comes from
depends on timing), a different layout, GPU model, driver or library version.
"""

from __future__ import annotations

import logging
import os
from typing import MutableMapping, Optional

import torch

log = logging.getLogger(__name__)

DETERMINISTIC_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": (":4096:8", (":4096:8", ":16:8")),
    "NCCL_ALGO": ("Ring", ("Ring",)),
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0", ("0",)),
}
"""Variable -> ``(default filled when unset, accepted values)``."""


def enable_deterministic_mode(environ: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """Turn on deterministic mode for this process (see the module docstring).

    Args:
        environ: the environment to fill (default ``os.environ``; tests pass a dict).

    Returns:
        ``{variable: value}`` of :data:`DETERMINISTIC_ENV` as now set.

    Raises:
        ValueError: a variable of :data:`DETERMINISTIC_ENV` set to a value not accepted
            (the message names it, its value, the accepted values and ``trainer.deterministic``).
    """
    env = os.environ if environ is None else environ
    for key, (default, accepted) in DETERMINISTIC_ENV.items():
        value = env.get(key)
        if value is not None and value not in accepted:
            raise ValueError(f"trainer.deterministic=true: {key}={value!r} is not a deterministic "
                             f"setting; valid choices are {list(accepted)} (unset: {default!r}), or "
                             f"set trainer.deterministic=false")
    for key, (default, _) in DETERMINISTIC_ENV.items():
        env.setdefault(key, default)
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    applied = {k: env[k] for k in DETERMINISTIC_ENV}
    log.info("deterministic mode: torch.use_deterministic_algorithms(True), %s", applied)
    return applied


def cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.cumsum(x, dim)``, except for a floating CUDA tensor in deterministic mode
    (``torch.are_deterministic_algorithms_enabled()``), where CUDA's kernel has no
    deterministic implementation: there :func:`scan_cumsum`, whose order of additions is
    fixed. CPU tensors and the default mode: ``torch.cumsum`` itself (same bits as before).

    Shapes and dtype: those of ``x``.
    """
    if x.is_cuda and x.is_floating_point() and torch.are_deterministic_algorithms_enabled():
        return scan_cumsum(x, dim)
    return torch.cumsum(x, dim=dim)


def scan_cumsum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inclusive prefix sum by a Hillis-Steele scan (W. D. Hillis and G. L. Steele, "Data
    Parallel Algorithms", CACM 1986): ``ceil(log2(n))`` rounds of one element-wise add
    each, so every output is the same sum in the same order on any device, every run.
    ``O(n log n)`` additions; rounding differs from a sequential ``cumsum`` in the last
    bits (the additions are grouped differently).

    Args:
        x: any shape, floating (or integer) dtype.
        dim: the dimension summed along.

    Returns:
        a tensor of ``x``'s shape, dtype and device.
    """
    out = x.movedim(dim, -1).clone()
    n, shift = out.shape[-1], 1
    while shift < n:
        out = torch.cat([out[..., :shift], out[..., shift:] + out[..., :-shift]], dim=-1)
        shift *= 2
    return out.movedim(-1, dim).contiguous()


__all__ = ["DETERMINISTIC_ENV", "cumsum", "enable_deterministic_mode", "scan_cumsum"]
