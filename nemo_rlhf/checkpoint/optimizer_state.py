"""Optimizer state in a checkpoint, in the ``adamw`` format of
:class:`~nemo_rlhf.trainers.mixed_precision.MixedPrecisionOptimizer`: Adam moments and fp32
masters as megatron ShardedTensors keyed like the model's parameters (so they reshard with
them), and each parameter's Adam step count by a layout-independent name
(:func:`global_param_names`), recorded in ``metadata.json``. Megatron's DistributedOptimizer
writes its own reshardable layout (``megatron_distributed``) and is not handled here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_rlhf.models.engine import unwrap

ADAMW_FORMAT = "adamw"
"""``optimizer_format`` of :class:`~nemo_rlhf.trainers.mixed_precision.MixedPrecisionOptimizer`'s
state (Adam moments and fp32 masters keyed like the model params); megatron's
DistributedOptimizer writes ``megatron_distributed``."""


def optimizer_format(optimizer) -> str:
    return getattr(optimizer, "checkpoint_format", ADAMW_FORMAT)


def global_param_names(model, params, prefix: str = "") -> list[str]:
    """Names of ``params`` that do not depend on the layout: the bare model's parameter
    names with each transformer layer's local index replaced by its global one (a PP
    stage's ``decoder.layers.0`` is global layer ``layer_number - 1``) and, under expert
    parallelism, each MoE expert's local index by its global one (EP rank ``r``'s
    ``local_experts.0`` is expert ``r * E / EP``); TP shards of one parameter share its name."""
    bare = unwrap(model)
    prefixes = {}
    for mname, mod in bare.named_modules():
        head, _, idx = mname.rpartition(".")
        if head.endswith("layers") and idx.isdigit() and hasattr(mod, "layer_number"):
            prefixes[mname + "."] = f"{head}.{int(mod.layer_number) - 1}."
    experts = {}  # megatron SequentialMLP: "<its name>.local_experts." -> first global index
    for mname, mod in bare.named_modules():
        group = getattr(mod, "ep_group", None)
        if hasattr(mod, "local_experts") and group is not None and dist.get_world_size(group) > 1:
            experts[mname + ".local_experts."] = dist.get_rank(group) * len(mod.local_experts)
    by_id = {}
    for name, p in bare.named_parameters():
        for local, first in experts.items():
            if name.startswith(local):
                idx, _, rest = name[len(local):].partition(".")
                name = f"{local}{first + int(idx)}.{rest}"
                break
        for local, global_ in prefixes.items():
            if name.startswith(local):
                name = global_ + name[len(local):]
                break
        by_id.setdefault(id(p), name)
    return [prefix + by_id.get(id(p), f"<unnamed {i}>") for i, p in enumerate(params)]


def gather_param_steps(steps: dict[str, int]) -> dict[str, int]:
    """Every rank's ``{global parameter name: Adam step count}`` merged (host objects)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return steps
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, steps)
    merged = {}
    for part in parts:
        merged.update(part)
    return dict(sorted(merged.items()))


def optimizer_sharded_state_dict(model_sd: dict, optimizer, name: str = "model",
                                  adapters_only: bool = False) -> tuple[dict, dict[str, int]]:
    """Adam moments and fp32 masters as ShardedTensors keyed like the model params, and
    this stage's Adam step count per parameter, by :func:`global_param_names` (0: never
    stepped, e.g. the backbone during a critic warm-up; a critic's names start with
    ``critic.``)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

    opt = optimizer.optimizer
    ordered = optimizer.ordered_params
    id_map = get_param_id_to_sharded_param_map(model_sd, ordered)
    sd = opt.state_dict()
    names = global_param_names(optimizer.model, ordered, "" if name == "model" else f"{name}.")
    steps = {names[i]: int(sd["state"][i]["step"]) if "step" in sd["state"].get(i, {}) else 0
             for i in range(len(ordered))}
    # A parameter not stepped yet (the backbone during a critic warm-up) has no Adam state:
    # zero moments stand in for it (what AdamW starts from), so the checkpoint covers every
    # parameter the load template asks for.
    for i, p in enumerate(ordered):
        if "exp_avg" not in sd["state"].get(i, {}):
            sd["state"][i] = {"exp_avg": torch.zeros_like(p, dtype=torch.float32),
                              "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}
    # Frozen parameters (e.g. rm.freeze_layers) have no optimizer state, but megatron stacks
    # the layers of one tensor name into one ShardedTensor that must be covered whole: they
    # get zero moments under ids after the optimizer's own (dropped again on load).
    # (adapters_only: the frozen base is not in model_sd, nothing to cover)
    frozen = [] if adapters_only else _frozen_params(optimizer, ordered)
    # (no frozen parameters: no map; megatron warns about an empty one on every save)
    frozen_map = get_param_id_to_sharded_param_map(model_sd, frozen) if frozen else {}
    for j, p in enumerate(frozen):
        if j in frozen_map:
            sd["state"][len(ordered) + j] = {"exp_avg": torch.zeros_like(p, dtype=torch.float32),
                                             "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}
            id_map[len(ordered) + j] = frozen_map[j]
    optim_state_to_sharding_state(sd, id_map, exclude_keys=("step",))
    out = {"optimizer": sd}
    masters = {}
    for i, (p, m) in enumerate(zip(ordered, optimizer.ordered_masters)):
        if m is not p and i in id_map:
            masters[i] = make_sharded_optimizer_tensor(id_map[i], m, prefix="optimizer.master")
    if masters:
        # a frozen parameter stands in for the master it would have if trained: only a
        # bf16/fp16 one (an fp32 parameter is its own master and has no entry, so a layer
        # stack of fp32 norm weights would be covered only by its frozen layers)
        for j, p in enumerate(frozen):
            if len(ordered) + j in id_map and p.dtype != torch.float32:
                masters[len(ordered) + j] = make_sharded_optimizer_tensor(
                    id_map[len(ordered) + j], p.detach().float(), prefix="optimizer.master")
    out["masters"] = masters
    return out, steps


def _frozen_params(optimizer, ordered) -> list:
    """Model parameters the optimizer does not update (``requires_grad=False``)."""
    trained = {id(p) for p in ordered}
    return [p for p in unwrap(optimizer.model).parameters() if id(p) not in trained]


def materialize_adam_state(optimizer) -> None:
    opt = optimizer.optimizer
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if "exp_avg" not in st:
                st["step"] = torch.tensor(0.0)  # host, as torch's AdamW keeps it
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def restore_optimizer(optimizer, sd: dict, masters: dict, meta: dict, extra: dict,
                       name_prefix: str = "") -> None:
    opt = optimizer.optimizer
    n = len(optimizer.ordered_params)
    # per parameter, by its layout-independent name (one that never stepped restarts from
    # 0, as it would have); checkpoints without the table hold one count for all
    table = meta.get("optimizer_param_steps") or {}
    names = global_param_names(optimizer.model, optimizer.ordered_params, name_prefix)
    default = meta.get("optimizer_step", 0)
    state = {pid: st for pid, st in sd["state"].items() if int(pid) < n}  # not frozen placeholders
    for pid, st in state.items():
        step = table.get(names[int(pid)], default)
        st["step"] = torch.tensor(float(step))  # host, as torch's AdamW keeps it
    # the saved param_groups carry the learning rate the schedule had reached
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
    with torch.no_grad():
        for i, m in masters.items():
            if int(i) < n:
                optimizer.ordered_masters[int(i)].copy_(m)
    if extra.get("scheduler"):
        optimizer.scheduler.load_state_dict(extra["scheduler"])
    if extra.get("scaler") and optimizer.scaler is not None:
        optimizer.scaler.load_state_dict(extra["scaler"])

