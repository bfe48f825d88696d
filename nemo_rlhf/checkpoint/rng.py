"""Per-rank RNG state of a checkpoint (``rng/rank_<r>.pt``): python, numpy, torch CPU and
CUDA, and megatron's TP-tracker states, restored on a resume at the same layout (a rank at
another layout has no state of its own to restore)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """Python, numpy, torch CPU (and CUDA) and megatron TP-tracker RNG states."""
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    try:
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:  # noqa: BLE001 - tracker not initialised (single-process tools)
        state["tracker"] = None
    return state


def set_rng_state(state: dict) -> None:
    """Inverse of :func:`rng_state`."""
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state.get("tracker") is not None:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])

