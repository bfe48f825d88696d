"""Run megatron-core on CPU with gloo: the project's single device-compat shim.

megatron-core assumes CUDA in a few places (``torch.cuda.current_device()`` to place
buffers, literal ``device="cuda"`` in the pipeline schedule and dist_checkpointing,
``torch.cuda`` RNG calls in the tensor-parallel RNG tracker, streams/events/synchronize).
:func:`activate` makes the same megatron code run on CPU by

* remapping every CUDA device argument of tensor factories and ``Tensor.to``/``.cuda()``
  to the CPU: thin wrappers on the factory functions and on ``Tensor.to``/``.cuda`` (global,
  so threads such as the RM server's batch worker are covered), plus a
  ``TorchFunctionMode`` pushed once on the main thread for anything else;
* mapping the ``torch.cuda`` RNG API (seed, get/set state, default generators) onto
  ``torch.default_generator`` -- seeding included: a no-op seed leaves TP-replicated
  parameters (e.g. position embeddings) different across TP ranks;
* turning ``synchronize``, streams, events, NVTX ranges and memory queries into no-ops.

It is active **only when CUDA is absent** and nothing else in the package branches on the
device. :func:`activate` raises ``RuntimeError`` if CUDA is available (see the test that
pins this), so the shim can never silently change behaviour on a GPU cluster.

Simplified: pinned memory requests are dropped (there is no device to pin for), and
CUDA graphs, symmetric memory and TE are not emulated (they are GPU-only features the
local layer spec does not use).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE = False
_LOCK = threading.Lock()

_FACTORIES = (
    "empty", "zeros", "ones", "full", "arange", "tensor", "rand", "randn", "randint",
    "randperm", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
    "randn_like", "as_tensor", "linspace", "eye", "empty_strided", "tril_indices",
    "triu_indices",
)


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare int means a CUDA ordinal for torch factories
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


_TARGET: "str | torch.device" = "cpu"
"""Where CUDA device arguments go: the host, or the device guard's emulated accelerator."""


def set_target_device(device) -> None:
    """Map CUDA device arguments to ``device`` instead of ``"cpu"`` (the device guard's
    emulated accelerator, :mod:`nemo_rlhf.distributed.device_guard`)."""
    global _TARGET
    _TARGET = device


def _fix_kwargs(kwargs: dict) -> dict:
    if _is_cuda_device(kwargs.get("device")):
        kwargs["device"] = _TARGET
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU in factory calls and ``Tensor.to``."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = _fix_kwargs(dict(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name == "to" and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _TARGET) + tuple(args[2:])
        return func(*args, **kwargs)


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **_fix_kwargs(kwargs))

    return wrapper


class _NoOp:
    """Stand-in for CUDA streams, events and context managers."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def elapsed_time(self, other) -> float:
        return 0.0

    def query(self) -> bool:
        return True


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self if _TARGET == "cpu" else self.to(_TARGET)


_ORIG_TO = torch.Tensor.to


def _tensor_to(self, *args, **kwargs):
    """``Tensor.to`` with CUDA devices mapped to the CPU (on every thread)."""
    if args and _is_cuda_device(args[0]):
        args = (_TARGET,) + tuple(args[1:])
    if _is_cuda_device(kwargs.get("device")):
        kwargs["device"] = _TARGET
    return _ORIG_TO(self, *args, **kwargs)


def is_active() -> bool:
    """Whether :func:`activate` has patched this process."""
    return _ACTIVE


def activate() -> None:
    """Patch torch so megatron-core runs on CPU. Idempotent.

    Raises:
        RuntimeError: if CUDA is available (the shim must never run on a GPU machine).
    """
    global _ACTIVE
    if torch.cuda.is_available():
        raise RuntimeError(
            "nemo_rlhf.distributed.cpu_compat must not be activated when CUDA is available"
        )
    with _LOCK:
        if _ACTIVE:
            return
        cuda = torch.cuda
        gen = torch.default_generator

        def manual_seed(seed: int) -> None:
            gen.manual_seed(int(seed))

        def get_rng_state(device="cuda"):
            return gen.get_state()

        def set_rng_state(state, device="cuda"):
            gen.set_state(state)

        cuda.current_device = lambda: 0
        cuda.device_count = lambda: 1
        cuda.set_device = lambda *a, **k: None
        cuda.synchronize = lambda *a, **k: None
        cuda.empty_cache = lambda: None
        cuda.memory_allocated = lambda *a, **k: 0
        cuda.max_memory_allocated = lambda *a, **k: 0
        cuda.memory_reserved = lambda *a, **k: 0
        cuda.reset_peak_memory_stats = lambda *a, **k: None
        cuda.memory_stats = lambda *a, **k: {}
        cuda.Stream = _NoOp
        cuda.Event = _NoOp
        cuda.current_stream = lambda *a, **k: _NoOp()
        cuda.default_stream = lambda *a, **k: _NoOp()
        cuda.stream = lambda *a, **k: contextlib.nullcontext()
        cuda.nvtx = types.SimpleNamespace(
            range_push=lambda *a, **k: None,
            range_pop=lambda *a, **k: None,
            range=lambda *a, **k: contextlib.nullcontext(),
            mark=lambda *a, **k: None,
        )
        cuda.manual_seed = manual_seed
        cuda.manual_seed_all = manual_seed
        cuda.get_rng_state = get_rng_state
        cuda.set_rng_state = set_rng_state
        cuda.random.get_rng_state = get_rng_state
        cuda.random.set_rng_state = set_rng_state
        cuda.random.manual_seed = manual_seed
        cuda.default_generators = (gen,)
        # torch.cuda._lazy_call queues callbacks until CUDA init; run them now instead.
        cuda._lazy_call = lambda cb, **k: cb()
        torch.Tensor.cuda = _tensor_cuda
        torch.Tensor.to = _tensor_to
        for name in _FACTORIES:
            if hasattr(torch, name):
                setattr(torch, name, _wrap_factory(getattr(torch, name)))
        _patch_megatron_rng()
        _CpuDeviceMode().__enter__()  # pushed for the lifetime of the process
        _ACTIVE = True


def _patch_megatron_rng() -> None:
    """megatron's RNG helpers bound ``torch.cuda`` functions at import: rebind them."""
    from megatron.core.tensor_parallel import random as mrandom

    def _get(device="cuda", clone=False, graph_safe=False):
        state = torch.default_generator.get_state()
        return state.clone() if clone else state

    def _set(new_state, device=-1, graph_safe=False):
        torch.default_generator.set_state(new_state)

    mrandom._get_cuda_rng_state = _get
    mrandom._set_cuda_rng_state = _set
    mrandom._lazy_call = lambda cb: cb()


@contextlib.contextmanager
def suspended():
    """Suspend the shim's ``TorchFunctionMode`` on this thread for the ``with`` block.

    The mode routes every torch call and tensor attribute access through a Python
    ``__torch_function__``; a loop of many small ops whose allocations all go through the
    (still patched) factory functions and ``Tensor.to`` can run without it -- the rollout's
    decoding loop does (the mode cost about a third of a decode step). Nothing happens when
    the shim is inactive or when another mode is innermost (that one is left alone); the
    mode is pushed back on exit, exceptions included.
    """
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

    stack = _get_current_function_mode_stack()
    if _ACTIVE and stack and isinstance(stack[-1], _CpuDeviceMode):
        with _pop_mode_temporarily():
            yield
    else:
        yield


def activate_if_no_cuda() -> bool:
    """Activate the shim when CUDA is absent; return whether it is active."""
    if not torch.cuda.is_available():
        activate()
    return _ACTIVE
