"""A live megatron model's weights as full (unsharded) tensors, and back.

Keyed like this project's distributed checkpoints (``load_full_tensors`` without the
``model.`` prefix): layer tensors stacked on a leading layer axis, a MoE layer's experts on
a second one (:mod:`nemo_rlhf.models.hf_mapping` documents the layout). What the rollout
engines send to vLLM or to a rollout worker (:func:`gather_full_tensors`, collective over
the TP and EP groups) and what a worker loads (:func:`fill_model`).
"""

from __future__ import annotations

import re
from typing import Callable

import torch
import torch.distributed as dist

from nemo_rlhf.models.hf_mapping import L


_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(?:mlp\.experts\.local_experts\.(\d+)\.)?")


def _stack_index(name: str, key: str) -> tuple:
    """Where a state-dict entry goes in its full tensor: ``()`` (not stacked), ``(layer,)``
    or, for a MoE expert's weight, ``(layer, expert)`` (the local expert index: the global
    one at expert-parallel size 1; :func:`gather_full_tensors` maps it at EP > 1)."""
    m = _LAYER_RE.match(name) if key.startswith(L) else None
    if m is None:
        return ()
    return (int(m.group(1)),) if m.group(2) is None else (int(m.group(1)), int(m.group(2)))


def _stacked(parts: dict) -> torch.Tensor:
    """``{index tuple: tensor}`` -> one tensor, stacked along the index axes in order."""
    if list(parts) == [()]:
        return parts[()]
    heads = sorted({i[0] for i in parts})
    return torch.stack([_stacked({i[1:]: t for i, t in parts.items() if i[0] == h}) for h in heads])


def _model_entries(model):
    """``(state-dict name, dist key, stack index, tensor)`` of a TP=1, PP=1 model, read
    through its sharded state dict (so whichever layer spec built it, local or TE); the
    index is :func:`_stack_index`'s."""
    for name, sh in model.sharded_state_dict(prefix="").items():
        key, data = getattr(sh, "key", None), getattr(sh, "data", None)
        if key is None or not torch.is_tensor(data) or name.endswith("_extra_state"):
            continue
        yield name, key, _stack_index(name, key), data


def model_full_tensors(model) -> dict:
    """A TP=1, PP=1 model's weights as full tensors keyed like a dist checkpoint (layers,
    and a MoE layer's experts, stacked): the input of :func:`~nemo_rlhf.models.hf_mapping.megatron_to_hf` for a model in
    memory."""
    parts: dict = {}
    for _, key, index, data in _model_entries(model):
        parts.setdefault(key, {})[index] = data.detach()
    return {k: _stacked(v) for k, v in parts.items()}


def _tp_gather(data: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(data) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, data.contiguous(), group=group)
    return parts


def gather_full_tensors(model, tp_group=None, skip: Callable[[str], bool] = lambda key: False,
                        ep_group=None) -> dict:
    """This model's weights as full tensors (like :func:`model_full_tensors`), its TP shards
    gathered over ``tp_group`` and, for a MoE model at expert-parallel size > 1, its experts
    over ``ep_group`` (EP rank ``r``'s local expert ``i`` is expert ``r * E / EP + i``):
    every rank of the groups returns the same dict.

    A tensor split across TP (vocab-parallel embedding and output layer, column-parallel
    QKV / fc1, row-parallel proj / fc2) is all-gathered along the axis its sharded state
    dict fragments; megatron's SwiGLU ``linear_fc1`` shard is ``[gate_r; up_r]`` per rank
    (its ``ShardedTensorFactory``), so the halves are regrouped to ``[gate; up]``.
    Replicated tensors (norms) are taken as they are. The tensors live where the model's
    do (a device all-gather under NCCL).

    Args:
        model: a megatron ``GPTModel`` / actor stage at PP=1 (unwrapped).
        tp_group: the TP group (None or size 1: no communication).
        skip: dist keys not to gather (e.g. the value head).
        ep_group: the expert-parallel group (``dims.ep_group``; None or size 1: the experts
            are all local).

    Raises:
        ValueError: a tensor fragmented along more than one axis (not a TP layout).
    """
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    if tp == 1 and ep == 1:
        return {k: v for k, v in model_full_tensors(model).items() if not skip(k)}
    entries = [(name, sh) for name, sh in model.sharded_state_dict(prefix="").items()
               if getattr(sh, "key", None) is not None and torch.is_tensor(getattr(sh, "data", None))
               and not name.endswith("_extra_state") and not skip(sh.key)]
    local_experts = 1 + max((_stack_index(n, sh.key)[1:] or (-1,))[0] for n, sh in entries)
    parts: dict = {}
    for name, sh in entries:
        key, data = sh.key, sh.data.detach()
        index = _stack_index(name, key)
        full = data if tp == 1 else _tp_full(sh, data, tp_group)
        if ep > 1 and len(index) == 2:  # (layer, local expert): every EP rank's
            for r, t in enumerate(_tp_gather(full, ep_group)):
                parts.setdefault(key, {})[(index[0], r * local_experts + index[1])] = t
        else:
            parts.setdefault(key, {})[index] = full
    return {k: _stacked(v) for k, v in parts.items()}


def _tp_full(sh, data: torch.Tensor, tp_group) -> torch.Tensor:
    """One sharded-state-dict entry's TP shards gathered into its full tensor.

    Raises:
        ValueError: fragmented along more than one axis (not a TP layout).
    """
    if type(sh).__name__ == "ShardedTensorFactory":  # SwiGLU fc1: [gate_r; up_r] per rank
        halves = [p.chunk(2, dim=0) for p in _tp_gather(data, tp_group)]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    pre = sh.prepend_axis_num
    axes = [i - pre for i, f in enumerate(sh.axis_fragmentations) if f > 1 and i >= pre]
    if len(axes) > 1:
        raise ValueError(f"{sh.key}: fragmented along axes {axes}; only one TP axis is expected")
    return torch.cat(_tp_gather(data, tp_group), dim=axes[0]) if axes else data


def fill_model(model, tensors: dict) -> None:
    """Copy full tensors (dist-checkpoint keys, see the module docstring) into a TP=1,
    PP=1 model (inverse of :func:`model_full_tensors`).

    Raises:
        ValueError: a tensor the model needs is missing, has the wrong shape, or is unused.
    """
    state, used = {}, set()
    for name, key, index, _ in _model_entries(model):
        if key not in tensors:
            raise ValueError(f"the conversion produced no {key} (needed by the model)")
        state[name] = tensors[key][index] if index else tensors[key]
        used.add(key)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        first = next((x for x in str(exc).splitlines() if "size mismatch" in x), str(exc))
        raise ValueError(f"HF weights do not fit config.json: {first.strip()}") from None
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected or set(tensors) - used:
        raise ValueError(f"state mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}, "
                         f"unused {sorted(set(tensors) - used)[:4]}")

