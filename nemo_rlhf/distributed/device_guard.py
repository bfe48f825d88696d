"""A CPU-side guard that makes host/accelerator mix-ups fail on a machine without a GPU.

On CPU every tensor lives on the host, so a tensor created without ``device=`` or a host
tensor handed to an NCCL collective works by accident and fails on CUDA. The guard
emulates the split: it is switched on with ``NEMO_RLHF_DEVICE_GUARD=1`` (read by
:func:`nemo_rlhf.distributed.initialize_distributed`, so it reaches spawned ranks and
``torchrun`` jobs alike) and then

* ``dims.device`` becomes ``torch.device("cpu", 0)``: "the accelerator". Tensors are
  tagged *host* when they are made by a factory without a device (or with ``"cpu"``), by
  ``.cpu()`` / ``.to("cpu")``, or by an op whose tensor inputs are all host tensors; every
  other tensor (model parameters, megatron's buffers, anything made on or moved to
  ``dims.device``, results of ops that touch one) counts as a device tensor, and its
  ``.device`` reads ``cpu:0``, so ``device=x.device`` keeps working as on CUDA;
* an op that mixes a host tensor of one or more dimensions with a device tensor raises
  :class:`DeviceMixError` naming the op and the innermost ``nemo_rlhf`` frame (CUDA
  allows 0-dim host tensors as scalars, host index tensors in indexing, and copies
  between devices: so does the guard); so does a host ``torch.Generator`` used with
  device tensors;
* a ``torch.distributed`` collective called on a host tensor raises when the backend
  that :func:`~nemo_rlhf.distributed.parallel.resolve_backend` picks *on a CUDA
  machine* has no host (gloo) part -- what NCCL would refuse.

``.to(dims.device)`` of a host tensor and ``.cpu()`` of a device tensor return copies, as
they do across real devices. The cost is a Python call per torch op: for tests only.

Simplified: the autograd engine's backward ops are not seen (they run in C++ on the
tensors the forward made, so the forward's check covers them); tensors created in C++
without a Python-visible factory (unpickled checkpoint tensors) count as device tensors.
"""

from __future__ import annotations

import os
import threading
import traceback

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from nemo_rlhf.distributed import cpu_compat

ENV_VAR = "NEMO_RLHF_DEVICE_GUARD"
EMULATED_DEVICE = torch.device("cpu", 0)
"""``dims.device`` while the guard is on: distinct from the host's ``torch.device("cpu")``."""

_HOST, _DEVICE = "host", "device"
_ATTR = "_nemo_rlhf_where"
_ACTIVE = False
_LOCK = threading.Lock()
_HOST_COLLECTIVES_OK = True
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                "reduce_scatter_tensor", "reduce", "send", "recv",
                "all_to_all_single", "gather", "scatter", "reduce_scatter")
# isend/irecv stay unwrapped: P2POp checks them by identity (batch_isend_irecv is checked)
# ops where a host operand next to a device one is legal on CUDA
_COPIES = {"copy_", "to", "cpu", "cuda", "new_tensor", "set_"}
# the CPU shim's replacements of Tensor.to / Tensor.cuda, as torch reports them
_SHIM_NAMES = {"_tensor_to": "to", "_tensor_cuda": "cuda"}


class DeviceMixError(RuntimeError):
    """A host tensor met a device tensor (or an NCCL collective) where CUDA would fail."""


def requested() -> bool:
    """Whether ``NEMO_RLHF_DEVICE_GUARD`` asks for the guard (``1``/``true``/``yes``)."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes")


def is_active() -> bool:
    """Whether :func:`activate` ran in this process."""
    return _ACTIVE


def _where(t) -> str:
    return getattr(t, _ATTR, _DEVICE)


def _tag(obj, where: str) -> None:
    leaves, _ = tree_flatten(obj)
    for t in leaves:
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, _ATTR, where)
            except (AttributeError, RuntimeError):  # e.g. tensors without a __dict__
                pass


def _device_kind(device) -> str | None:
    """``host`` / ``device`` for a device argument, None when absent."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return _DEVICE  # a bare ordinal is a CUDA device for torch factories
    dev = torch.device(device)
    if dev.type == "cuda" or dev == EMULATED_DEVICE:
        return _DEVICE
    return _HOST if dev.type == "cpu" else _DEVICE


def _where_called() -> str:
    """``file:line in function`` of the innermost frame in ``nemo_rlhf`` (the guard and
    the CPU shim excluded), or the innermost frame outside torch."""
    skip = {os.path.abspath(__file__), os.path.abspath(cpu_compat.__file__)}
    frames = [f for f in traceback.extract_stack()[:-2] if os.path.abspath(f.filename) not in skip]
    ours = [f for f in frames if f"{os.sep}nemo_rlhf{os.sep}" in f.filename]
    pick = ours[-1] if ours else next(
        (f for f in reversed(frames) if f"{os.sep}torch{os.sep}" not in f.filename), frames[-1])
    return f"{pick.filename}:{pick.lineno} in {pick.name}: {pick.line}"


def _op_name(func) -> str:
    name = getattr(func, "__name__", repr(func))
    if name == "__get__" and hasattr(func, "__self__"):
        return f"Tensor.{getattr(func.__self__, '__name__', '?')}"
    return name


class _GuardMode(TorchFunctionMode):
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        name = _SHIM_NAMES.get(name, name)
        if name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") == "device":
            dev = func(*args, **kwargs)
            if dev.type == "cpu" and _where(args[0]) == _DEVICE:
                return EMULATED_DEVICE
            return dev
        if name in ("to", "cpu", "cuda") and args and isinstance(args[0], torch.Tensor):
            return self._move(func, name, args, kwargs)
        if getattr(func, "__module__", "").startswith("torch.distributed"):
            return func(*args, **kwargs)  # collectives: checked by _collective
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if name == "__getitem__" and args:
            tensors = [args[0]]  # host index tensors are fine on CUDA
        elif name == "__setitem__" and len(args) == 3:
            tensors = [t for t in (args[0], args[2]) if isinstance(t, torch.Tensor)]
        gens = [g for g in leaves if isinstance(g, torch.Generator)]
        if not tensors:  # a factory: tagged by its device argument
            where = _device_kind(kwargs.get("device")) or _HOST
            if where == _HOST and any(getattr(g, _ATTR, _HOST) == _DEVICE for g in gens):
                raise DeviceMixError(
                    f"{_op_name(func)} creates a host tensor from a device generator at "
                    f"{_where_called()} (pass device=dims.device)")
            out = func(*args, **kwargs)
            _tag(out, where)
            return out
        kinds = {_where(t) for t in tensors}
        in_place = (name.endswith("_") and not name.startswith("__")) or name.startswith("__i")
        if (len(kinds) == 2 and in_place and name not in _COPIES and args
                and isinstance(args[0], torch.Tensor) and _where(args[0]) == _HOST):
            raise DeviceMixError(
                f"{_op_name(func)} writes a device result into a host tensor "
                f"{tuple(args[0].shape)} at {_where_called()} (create it on dims.device)")
        if len(kinds) == 2 and name not in _COPIES:
            host = [t for t in tensors if _where(t) == _HOST and t.dim() > 0]
            if host:
                raise DeviceMixError(
                    f"{_op_name(func)} mixes a host tensor {tuple(host[0].shape)} "
                    f"{host[0].dtype} with a device tensor at {_where_called()} (on CUDA this "
                    f"fails: create it on dims.device or move it there at the boundary)")
        if gens and _DEVICE in kinds and not all(getattr(g, _ATTR, _HOST) == _DEVICE for g in gens):
            raise DeviceMixError(
                f"{_op_name(func)} draws from a host torch.Generator for a device tensor at "
                f"{_where_called()} (create it with torch.Generator(device=dims.device))")
        out = func(*args, **kwargs)
        if name.endswith("_") and not name.startswith("__") and args and out is args[0]:
            return out  # in place: the tensor keeps its place
        _tag(out, _DEVICE if _DEVICE in kinds else _HOST)
        return out

    @staticmethod
    def _move(func, name, args, kwargs):
        src = args[0]
        if name == "cpu":
            target = _HOST
        elif name == "cuda":
            target = _DEVICE
        else:
            dev = kwargs.get("device")
            for a in args[1:]:
                if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
                    dev = a
                elif isinstance(a, torch.Tensor):
                    dev = _DEVICE if _where(a) == _DEVICE else "cpu"
            target = _device_kind(dev) if dev != _DEVICE else _DEVICE
        if target is None or target == _where(src):
            out = func(*args, **kwargs)
            if out is not src:
                _tag(out, _where(src))
            return out
        # across the emulated boundary: a copy, as between real devices
        out = src.detach().clone() if not src.requires_grad else src.clone()
        rest = {k: v for k, v in kwargs.items() if k in ("dtype", "memory_format")}
        dtypes = [a for a in args[1:] if isinstance(a, torch.dtype)]
        if dtypes or "dtype" in rest:
            out = out.to(dtype=dtypes[0] if dtypes else rest["dtype"])
        _tag(out, target)
        return out


_BASE_GENERATOR = torch._C.Generator


class _GeneratorMeta(type(_BASE_GENERATOR)):
    def __instancecheck__(cls, obj) -> bool:  # every generator is still a torch.Generator
        return isinstance(obj, _BASE_GENERATOR)


class _Generator(_BASE_GENERATOR, metaclass=_GeneratorMeta):
    """``torch.Generator`` that remembers whether it was made for ``dims.device``."""

    def __new__(cls, device="cpu"):
        gen = super().__new__(cls, device=torch.device(device).type)
        setattr(gen, _ATTR, _device_kind(device) or _HOST)
        return gen

    def __init__(self, device="cpu"):
        pass

    @property
    def device(self) -> torch.device:
        """``dims.device`` for a generator made for it (as a CUDA generator reads
        ``cuda:N``), the host's ``cpu`` otherwise."""
        return EMULATED_DEVICE if getattr(self, _ATTR, _HOST) == _DEVICE else torch.device("cpu")


def _collective(fn):
    def checked(*args, **kwargs):
        leaves, _ = tree_flatten((args, kwargs))
        ops = [o for o in leaves if isinstance(o, dist.P2POp)]
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)] + [o.tensor for o in ops]
        if not _HOST_COLLECTIVES_OK:
            for t in tensors:
                if _where(t) == _HOST:
                    raise DeviceMixError(
                        f"torch.distributed.{fn.__name__} on a host tensor {tuple(t.shape)} at "
                        f"{_where_called()}: the process-group backend chosen on CUDA "
                        f"({_CUDA_BACKEND!r}) has no gloo part, so NCCL would get a host tensor")
        return fn(*args, **kwargs)

    checked.__name__ = fn.__name__
    checked.__wrapped__ = fn
    return checked


_CUDA_BACKEND = ""


def activate(cuda_backend: str) -> None:
    """Switch the guard on for this process (idempotent). Needs the CPU shim.

    Args:
        cuda_backend: the process-group backend string this configuration would use on a
            CUDA machine (``"cpu:gloo,cuda:nccl"``, ``"nccl"``, ...); host-tensor
            collectives fail unless it has a ``cpu`` / gloo part.

    Raises:
        RuntimeError: if CUDA is available (the guard emulates a device; use the real one).
    """
    global _ACTIVE, _HOST_COLLECTIVES_OK, _CUDA_BACKEND
    if torch.cuda.is_available():
        raise RuntimeError(f"{ENV_VAR}=1: the device guard is for machines without CUDA")
    with _LOCK:
        _CUDA_BACKEND = cuda_backend
        _HOST_COLLECTIVES_OK = "gloo" in cuda_backend
        if _ACTIVE:
            return
        cpu_compat.set_target_device(EMULATED_DEVICE)
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, _collective(getattr(dist, name)))
        bi = dist.batch_isend_irecv
        dist.batch_isend_irecv = _collective(bi)
        torch.Generator = _Generator
        _GuardMode().__enter__()  # for the lifetime of the process
        _ACTIVE = True


def activate_if_requested(cuda_backend: str) -> bool:
    """:func:`activate` when ``NEMO_RLHF_DEVICE_GUARD`` asks for it; return whether active."""
    if requested() and not _ACTIVE:
        activate(cuda_backend)
    elif _ACTIVE:
        activate(cuda_backend)  # refresh the backend rule
    return _ACTIVE
