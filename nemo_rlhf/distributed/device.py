"""Moving data to ``dims.device`` at the one boundary where host data meets the model.

See the device discipline in :mod:`nemo_rlhf.distributed`.
"""

from __future__ import annotations

import dataclasses

import torch


def to_device(obj, device: torch.device, non_blocking: bool = True):
    """``obj`` with every tensor in it on ``device``.

    Walks tensors, dicts, lists, tuples and dataclass instances (a dataclass is rebuilt
    with :func:`dataclasses.replace`); anything else is returned as it is. Tensors already
    on ``device`` are not copied. Host tensors in pinned memory are copied asynchronously
    (``non_blocking``); from pageable memory the copy is synchronous, as CUDA makes it.

    Args:
        obj: a tensor or a (nested) container of them.
        device: the target, ``dims.device``.
        non_blocking: pass ``False`` when the host tensor is modified right after.

    Returns:
        The same structure with moved tensors.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return {k: to_device(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device, non_blocking) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: to_device(getattr(obj, f.name), device, non_blocking)
                   for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj
