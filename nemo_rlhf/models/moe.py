"""Mixture-of-experts support around megatron-core's ``MoELayer`` (``model.num_moe_experts``).

The layers themselves are megatron's (router ``TopKRouter``, ``SequentialMLP`` experts,
the ``allgather`` token dispatcher; see :func:`nemo_rlhf.models.decode_layers.local_layer_spec`).
This module holds what megatron-core 0.16.1 lacks to run them here:

* :func:`patch_router_gemm_without_te`: megatron's ``RouterGatingLinearFunction`` reads the
  module global ``te_general_gemm``, which ``moe_utils`` only defines when
  transformer-engine imports; without TE (this project's CPU runs, or a GPU without TE) the
  router's forward raises ``NameError``. Setting it to None selects megatron's own
  ``torch.mm`` branch, the same arithmetic TE would do.

Simplified: no shared experts, no grouped GEMM (CUDA kernels), no token dropping
(capacity factor), no expert bias / sigmoid routing (DeepSeek-V3's).
"""

from __future__ import annotations


def patch_router_gemm_without_te() -> None:
    """Define ``megatron.core.transformer.moe.moe_utils.te_general_gemm = None`` when
    transformer-engine did not import (idempotent; a no-op where TE defined it)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
