"""Writing and loading distributed, reshardable checkpoints, with atomic publication.

The folder layout, and finding, reading and verifying a checkpoint: :mod:`.layout`. RNG
states: :mod:`.rng`. The optimizer's sharded state: :mod:`.optimizer_state`.

Publication: every rank writes into ``<root>/.tmp_step_<N>``, reads its shards back and
compares them with the digests it took from memory (a mismatch on any rank: nothing is
published, the folder is removed and every rank raises :class:`CheckpointError` naming the
tensors); after a barrier rank 0 writes ``metadata.json`` and ``COMPLETE``, renames the folder
to ``step_<N>`` and then replaces ``<root>/latest`` (a one-line text file) by an atomic
rename. A crash at any point leaves either the previous checkpoint or the new one; a folder
without ``COMPLETE`` is never picked (:func:`~.layout.find_latest_checkpoint`).

LoRA (``model.lora.enabled`` with a base checkpoint): ``dist/`` holds the adapters and the
heads only, and ``metadata.json``'s ``lora_base`` names the base checkpoint (its resolved
path and :func:`~.layout.checkpoint_content_hash`); loading one loads that base first and
refuses a base whose content changed (:func:`load_model_weights`).

Simplified: one shared filesystem is assumed (every rank sees ``root``); asynchronous
saving is not used.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from nemo_rlhf.checkpoint.digests import DIGESTS_SUBDIR, read_back_problems, shard_digests, write_rank_digests
from nemo_rlhf.checkpoint.faults import fault_requested, maybe_crash, plant_change, plant_overwrite
from nemo_rlhf.checkpoint.layout import (COMPLETE, LATEST, CheckpointError, atomic_write_text,
                                         checkpoint_content_hash, copy_tokenizer, file_checksums,
                                         read_metadata, read_trainer_state, resolve_checkpoint, step_dir)
from nemo_rlhf.checkpoint.optimizer_state import (ADAMW_FORMAT, gather_param_steps, materialize_adam_state,
                                                  optimizer_format, optimizer_sharded_state_dict,
                                                  restore_optimizer)
from nemo_rlhf.checkpoint.rng import rng_state, set_rng_state
from nemo_rlhf.distributed import cpu_compat
from nemo_rlhf.models.engine import unwrap
from nemo_rlhf.models.heads import HEAD_NAMES, is_head_key, is_head_param
from nemo_rlhf.models.lora_keys import has_adapters, is_adapter_param

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# --- sharded state --------------------------------------------------------------------

CRITIC = "critic"
"""Prefix of a separate critic's tensors (``critic.mode=separate``) and of its optimizer's
entries (``critic_optimizer``), beside the actor's ``model.`` / ``optimizer``."""


def _model_sharded_state_dict(model, prefix: str = "model.", adapters_only: bool = False) -> dict:
    """The stage's sharded tensors under ``prefix``; ``adapters_only``: only the LoRA
    adapters' and the heads' (the frozen base is the base checkpoint's)."""
    sd = unwrap(model).sharded_state_dict(prefix=prefix)
    if adapters_only:
        sd = {k: v for k, v in sd.items() if _trainable_key(k[len(prefix):])}
    return sd


def _trainable_key(name: str) -> bool:
    """A LoRA run's trained tensors: adapters and heads (a state-dict name without prefix)."""
    return is_adapter_param(name) or is_head_param(name)


def lora_base_record(model, base: Optional[str]) -> Optional[dict]:
    """``{"path", "hash"}`` of the base checkpoint a LoRA stage was built on, or None: the
    model has no adapters, or no base (a random initialisation is saved whole)."""
    if not base or not has_adapters(unwrap(model)):
        return None
    resolved = resolve_checkpoint(base)
    return {"path": str(resolved.resolve()), "hash": checkpoint_content_hash(resolved)}


def _parts(model, optimizer, critic) -> list[tuple[str, object, object]]:
    """``(name, model, optimizer)`` of what a checkpoint holds: ``model`` (the actor or a
    single model) and, in separate-critic runs, ``critic``."""
    parts = [("model", model, optimizer)]
    if critic is not None:
        parts.append((CRITIC, critic[0], critic[1]))
    return parts


def _opt_key(name: str) -> str:
    return "optimizer" if name == "model" else f"{name}_optimizer"


def save_checkpoint(
    root: Path,
    step: int,
    model,
    optimizer=None,
    trainer_state: Optional[dict] = None,
    config: Optional[dict] = None,
    dims=None,
    fingerprint: Optional[dict] = None,
    critic: Optional[tuple] = None,
    verify: bool = True,
    lora_base: Optional[str] = None,
) -> Path:
    """Write ``<root>/step_<step>`` on every rank, verify it and publish it atomically.

    Args:
        root: checkpoint folder (``<exp_dir>/checkpoints``), shared by all ranks.
        step: the step counter stored in the name.
        model: this rank's model stage (DDP-wrapped or bare).
        optimizer: a :class:`~nemo_rlhf.trainers.mixed_precision.MixedPrecisionOptimizer` or None.
        trainer_state: JSON-able dict (counters, sampler position, KL state, ...).
        config: the resolved run config (a plain dict), written as ``config.yaml``.
        dims: :class:`ParallelDims` (the layout is recorded in ``metadata.json``).
        fingerprint: facts a resume must match (model, tokenizer, data, reference).
        critic: ``(critic stage, its optimizer or None)`` of a separate critic
            (``critic.mode=separate``): saved under ``critic.`` / ``critic_optimizer``.
        verify: read the written shards back and compare them with the digests taken from
            memory before publishing (``exp_manager.verify_after_save``); the digests are
            written either way (``nemo-rlhf-ckpt validate --deep``).
        lora_base: the base checkpoint of a LoRA model (its ``init_from``): the adapters
            and heads are saved, not the frozen base (:func:`lora_base_record`).

    Returns:
        The published ``step_<step>`` path.

    Raises:
        CheckpointError: on every rank, with nothing published (the partial folder removed,
            ``latest`` still names the previous checkpoint): a shard read back differs from
            the tensor saved (names the tensors), or any rank's write failed (e.g. no space
            left on the device: the failing rank's message names the error, the others the
            rank). Every rank reaches the same decision: none is left waiting in a barrier.
    """
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp_step_{int(step)}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "dist").mkdir(parents=True)
        (tmp / "rng").mkdir()
    _barrier()
    sharded, part_meta = {}, {}
    opt_step, opt_steps = 0, None
    base = lora_base_record(model, lora_base)
    for name, part_model, part_opt in _parts(model, optimizer, critic):
        model_sd = _model_sharded_state_dict(part_model, f"{name}.", adapters_only=base is not None)
        sharded.update(model_sd)
        if part_opt is None:
            continue
        key = _opt_key(name)
        if optimizer_format(part_opt) == ADAMW_FORMAT:
            opt_sd, steps = optimizer_sharded_state_dict(model_sd, part_opt, name, base is not None)
            sharded[key] = opt_sd["optimizer"]
            sharded[f"{key}_masters"] = opt_sd["masters"]
            steps = gather_param_steps(steps)
            opt_steps = {**(opt_steps or {}), **steps}
            if name == "model":
                opt_step = max(steps.values(), default=0)
        else:  # megatron's DistributedOptimizer: its own reshardable layout
            sharded[key] = part_opt.sharded_state_dict(dict(model_sd), is_loading=False)
            if name == "model":
                opt_step = part_opt.scheduler.last_epoch
        part_meta[f"{key}_extra"] = {
            "scheduler": part_opt.scheduler.state_dict(),
            "scaler": part_opt.scaler.state_dict() if part_opt.scaler else None}
    tensors, digests = shard_digests(sharded)
    if fault_requested("change_after_digest", step):
        plant_change(tensors)
    failure = None
    maybe_crash("save_shards", step)
    try:
        dist_checkpointing.save(sharded, str(tmp / "dist"))
        if fault_requested("enospc", step):
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected: NEMO_RLHF_FAULT)")
        torch.save({"rng": rng_state()}, tmp / "rng" / f"rank_{_rank()}.pt")
        write_rank_digests(tmp, _rank(), digests)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - OSError, or torch's CheckpointException
        # (a BaseException) carrying another rank's OSError: every rank must reach the
        # agreement below, or the others would wait in a barrier until the timeout
        failure = f"rank {_rank()}: {type(exc).__name__}: {_first_line(exc)}"
    _fail_together(failure, tmp, dims, step)
    if fault_requested("overwrite_shard", step) and _rank() == 0:
        plant_overwrite(tmp / "dist")
    if verify:
        _verify_or_discard(tmp, digests, dims, step)
    maybe_crash("save_written", step)
    # every rank is still there before anything is published: a rank killed after its
    # shards (or a peer lost) fails this agreement on the others, nothing is published
    _fail_together(None, tmp, dims, step)
    failure = None
    if _rank() == 0:
        try:
            _publish(root, tmp, final, step, config, trainer_state, {
                "step": int(step),
                "time": time.time(),
                "parallel": dims.describe() if dims is not None else None,
                "optimizer_step": opt_step,
                "optimizer_param_steps": opt_steps,
                "has_optimizer": optimizer is not None,
                "optimizer_format": optimizer_format(optimizer) if optimizer is not None else None,
                "optimizer_extra": part_meta.get("optimizer_extra", {}),
                "has_critic": critic is not None,
                "lora_base": base,
                **{k: v for k, v in part_meta.items() if k != "optimizer_extra"},
                "fingerprint": fingerprint or {},
            })
        except OSError as exc:
            failure = f"rank 0 publishing: {type(exc).__name__}: {_first_line(exc)}"
    _fail_together(failure, tmp, dims, step)
    return final


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else repr(exc)


def _max_over_ranks(value: float, dims) -> float:
    """The largest ``value`` of all ranks (one all-reduce of a one-element tensor on
    ``dims.device``; without dims, the default group's device: the current CUDA device under
    NCCL, else the host)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    device = getattr(dims, "device", None)
    if device is None:
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flag = torch.tensor([value], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag.item())


def _fail_together(failure: Optional[str], tmp: Path, dims, step: int) -> None:
    """A synchronisation point of the save that also agrees on failure: if any rank's
    part failed (``failure``: its message), the unpublished ``tmp`` is removed and every
    rank raises :class:`CheckpointError` (the failing rank with its message; the others
    name the rank to read). A flag on ``dims.device`` is all-reduced: no host objects go
    through the collective."""
    flag = _max_over_ranks(0.0 if failure is None else 1.0 + _rank(), dims)
    if not flag:
        return
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    latest = tmp.parent / LATEST
    previous = latest.read_text().strip() if latest.is_file() else None
    raise CheckpointError(
        f"checkpoint step {int(step)} not saved: "
        + (failure or f"rank {int(flag) - 1} failed (its log has the error)")
        + f"; the partial save {tmp} was removed; "
        + (f"{latest} still names {previous}" if previous else "no earlier checkpoint in this folder"))


def _publish(root: Path, tmp: Path, final: Path, step: int, config, trainer_state, meta: dict) -> None:
    """Rank 0: write the metadata files into ``tmp``, rename it to ``final`` and point
    ``latest`` at it."""
    copy_tokenizer(config, tmp)
    meta["files"] = file_checksums(tmp)
    if fault_requested("enospc_publish", step):
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected: NEMO_RLHF_FAULT)")
    (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, default=str))
    (tmp / "trainer_state.json").write_text(json.dumps(trainer_state or {}, indent=2))
    if config is not None:
        from omegaconf import OmegaConf

        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    atomic_write_text(tmp / COMPLETE, f"{int(step)}\n")
    if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
        trash = root / f".trash_step_{int(step)}_{os.getpid()}"
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    maybe_crash("save_published", step)
    atomic_write_text(root / LATEST, final.name + "\n")


def _verify_or_discard(tmp: Path, digests: list[dict], dims, step: int) -> None:
    """Read this rank's shards back and compare; if any rank found a difference, remove
    ``tmp`` and raise :class:`CheckpointError` on every rank (the message lists what every
    rank found, read from the shared folder: no host objects through the collective)."""
    problems = read_back_problems(digests, tmp / "dist")
    if problems:
        (tmp / DIGESTS_SUBDIR / f"problems_rank_{_rank()}.txt").write_text("\n".join(problems) + "\n")
    if not _max_over_ranks(1.0 if problems else 0.0, dims):
        return
    found = []
    for f in sorted((tmp / DIGESTS_SUBDIR).glob("problems_rank_*.txt")):
        rank = f.stem.rpartition("_")[2]
        found += [f"rank {rank}: {line}" for line in f.read_text().splitlines() if line]
    _barrier()
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    shown = found[:10] + ([f"... and {len(found) - 10} more"] if len(found) > 10 else [])
    raise CheckpointError(
        f"checkpoint step {int(step)} not published: the written shards differ from the tensors "
        f"saved ({len(found)} shard(s)):\n  " + "\n  ".join(shown)
        + f"\n{tmp.parent / LATEST} still names the previous checkpoint")


def checkpoint_heads(path: Path, part: str = "model") -> set[str]:
    """Names of the heads (``value_head``, ``reward_head``) whose weights the checkpoint
    at ``path`` holds for ``part`` (e.g. ``{"reward_head"}`` for an RM checkpoint)."""
    keys = _checkpoint_keys(path)
    return {h for h in HEAD_NAMES if any(k.startswith(f"{part}.{h}.") for k in keys)}


def _checkpoint_keys(path: Path) -> set[str]:
    from megatron.core import dist_checkpointing

    return set(dist_checkpointing.load_tensors_metadata(str(Path(path) / "dist")).keys())


def _drop_missing_heads(sharded: dict, available: set[str], init_heads: bool, path: Path) -> list:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    missing = [k for k, v in sharded.items()
               if isinstance(v, ShardedTensor) and v.key not in available]
    heads = [k for k in missing if is_head_key(k)]
    other = [k for k in missing if k not in heads]
    if other:
        raise CheckpointError(
            f"{path}: checkpoint lacks model tensors {other[:8]}{'...' if len(other) > 8 else ''}"
            " (different architecture?)"
        )
    if heads and not init_heads:
        raise CheckpointError(
            f"{path}: checkpoint has no {sorted(set(k.split('.')[1] for k in heads))} weights; "
            "pass init_heads=True (e.g. `init_value_head: true`) to initialise the head "
            "instead of loading it"
        )
    for k in heads:
        sharded.pop(k)
    return heads


def _load_lora_base(path: Path, base: dict, model, override: Optional[str]) -> None:
    """Load the base of the adapters-only checkpoint ``path`` into ``model`` (see
    :func:`load_model_weights`)."""
    where = Path(override) if override else Path(base["path"])
    if not where.exists():
        raise CheckpointError(
            f"{path} holds LoRA adapters on the base checkpoint {where}, which does not exist "
            f"(moved or on another filesystem?): pass the base's new path (lora_base=..., "
            f"nemo-rlhf-ckpt --lora-base)")
    got = checkpoint_content_hash(resolve_checkpoint(where))
    if got != base["hash"]:
        raise CheckpointError(
            f"{path} holds LoRA adapters trained on a base with content hash {base['hash']}; "
            f"{where} has {got}: the adapters would be applied to other weights")
    load_model_weights(where, model, init_heads=True)


def refuse_adapter_checkpoint_as_lora_base(path, key: str) -> None:
    """A LoRA run must start from full weights: its reference is the base with the adapters
    off, so a base that is itself base + adapters would give the wrong reference.

    Raises:
        CheckpointError: ``path`` holds LoRA adapters only, naming ``key``.
    """
    if read_metadata(resolve_checkpoint(path)).get("lora_base"):
        raise CheckpointError(
            f"{key}={path} holds LoRA adapters, not full weights: a LoRA run starts from a base "
            f"(its reference is that base); merge the adapters first (nemo-rlhf-ckpt export-hf "
            f"--merge-lora, then import-hf), or start the LoRA run from the adapters' base")


def load_model_weights(path: Path, model, init_heads: bool = False,
                       skip_heads: bool = False, part: str = "model",
                       head_aliases: Optional[dict[str, str]] = None,
                       lora_base: Optional[str] = None) -> list[str]:
    """Load model weights (any TP/PP layout) from a checkpoint into this rank's stage.

    Args:
        init_heads: a value/reward head missing from the checkpoint keeps its fresh
            initialisation instead of raising.
        skip_heads: do not load head weights even if present (e.g. an RM started from an
            actor checkpoint, or a PPO critic head re-initialised on purpose).
        part: which model of the checkpoint: ``model`` (the actor, or an SFT / RM model),
            or ``critic`` (a separate critic's).
        head_aliases: ``{head of this model: head in the checkpoint}`` tried when the
            model's own head is absent, e.g. ``{"value_head": "reward_head"}``: a critic's
            value head starts from an RM's reward head.
        lora_base: an adapters-only (LoRA) checkpoint's base at another path than the one
            it recorded (a moved base); its content hash must still match.

    A LoRA checkpoint (adapters and heads only) loads its recorded base first, then the
    adapters; a full checkpoint loaded into a model with adapters leaves adapters it does
    not hold at their initialisation (B = 0: the model computes as the checkpoint).

    Returns:
        Keys of head tensors that were not loaded.

    Raises:
        CheckpointError: incomplete checkpoint, missing non-head tensors, or a missing head
            without ``init_heads``; a LoRA checkpoint into a model without adapters, or
            whose base is missing or changed.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    path = Path(path)
    base = read_metadata(path).get("lora_base")
    lora_model = has_adapters(unwrap(model))
    if base and not lora_model:
        raise CheckpointError(f"{path} holds LoRA adapters: build the model with its "
                              f"model.lora settings (config.yaml) to load it")
    if base:
        _load_lora_base(path, base, model, lora_base)
    sharded = _model_sharded_state_dict(model, f"{part}.", adapters_only=bool(base))
    available = _checkpoint_keys(path)
    if lora_model and not base:  # a full checkpoint: adapters it lacks stay initialised
        for k in [k for k, v in sharded.items() if is_adapter_param(k)
                  and not (isinstance(v, ShardedTensor) and v.key in available)]:
            sharded.pop(k)
    for v in sharded.values():
        if isinstance(v, ShardedTensor) and v.key not in available:
            for mine, theirs in (head_aliases or {}).items():
                alt = v.key.replace(f".{mine}.", f".{theirs}.", 1)
                if alt != v.key and alt in available:
                    v.key = alt
    skipped = []
    if skip_heads:
        skipped = [k for k in list(sharded) if is_head_key(k)]
        for k in skipped:
            sharded.pop(k)
    skipped += _drop_missing_heads(sharded, available, init_heads or skip_heads, path)
    loaded = dist_checkpointing.load(sharded, str(path / "dist"))
    _copy_into_model(model, loaded, f"{part}.", partial=lora_model)
    return skipped


def _copy_into_model(model, loaded: dict, prefix: str = "model.", partial: bool = False) -> None:
    """``partial``: a LoRA model, which may be loaded as base and adapters separately."""
    state = {k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}
    missing, unexpected = unwrap(model).load_state_dict(state, strict=False)
    if partial:  # the base without the adapters, or the adapters without the base
        loaded_adapters = any(is_adapter_param(k) for k in state)
        missing = [k for k in missing if is_adapter_param(k) == loaded_adapters]
    missing = [k for k in missing if not k.endswith("_extra_state")
               and not is_head_param(k)]
    if missing or unexpected:
        raise CheckpointError(f"state mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")


def load_checkpoint(path: Path, model, optimizer=None, init_heads: bool = False,
                    load_rng: bool = True, critic: Optional[tuple] = None) -> dict:
    """Load model, optimizer, scheduler and RNG from ``path``; return the trainer state.

    The checkpoint may have been written with another TP/PP/DP/EP layout (resharding is
    done by dist_checkpointing; a MoE layer's experts are one tensor per weight, sharded
    along the expert axis by EP rank). RNG states are restored only when the layout is
    unchanged (otherwise a rank has no state of its own to restore).

    Args:
        critic: ``(critic stage, its optimizer or None)`` of a separate critic, loaded from
            the checkpoint's ``critic.`` part.

    Raises:
        CheckpointError: see :func:`load_model_weights`; also a checkpoint without optimizer
            state when an optimizer is passed, optimizer state of the other format, or no
            separate critic when one is passed (and one when none is).
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    meta = read_metadata(path)
    available = _checkpoint_keys(path)
    has_critic = any(k.startswith(f"{CRITIC}.") for k in available)
    if has_critic != (critic is not None):
        raise CheckpointError(
            f"{path}: {'holds' if has_critic else 'has no'} a separate critic, this run "
            f"{'has none' if has_critic else 'has one'}: resume it with critic.mode="
            f"{'separate' if has_critic else 'shared (or shared_detached)'}, or start from "
            f"its actor weights with exp_manager.init_from")
    parts = _parts(model, optimizer, critic)
    if optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(f"{path}: holds no optimizer state")
    adapters_only = bool(meta.get("lora_base"))  # the base is the run's init_from, loaded
    if adapters_only != has_adapters(unwrap(model)) and meta.get("lora_base") is not None:
        raise CheckpointError(f"{path} holds LoRA adapters: resume it with its model.lora settings")
    sharded, formats = {}, {}
    for name, part_model, part_opt in parts:
        model_sd = _model_sharded_state_dict(part_model, f"{name}.", adapters_only=adapters_only)
        _drop_missing_heads(model_sd, available, init_heads, path)
        sharded.update(model_sd)
        if part_opt is None:
            continue
        fmt = formats[name] = optimizer_format(part_opt)
        saved = meta.get("optimizer_format") or ADAMW_FORMAT
        if saved != fmt:
            raise CheckpointError(
                f"{path}: optimizer state in the {saved!r} format, this run's optimizer writes "
                f"{fmt!r}: set optim.use_distributed_optimizer="
                f"{str(saved != ADAMW_FORMAT).lower()} to resume it (or start from its weights "
                f"with exp_manager.init_from)")
        key = _opt_key(name)
        if fmt == ADAMW_FORMAT:
            materialize_adam_state(part_opt)
            opt_sd, _ = optimizer_sharded_state_dict(model_sd, part_opt, name, adapters_only)
            sharded[key] = opt_sd["optimizer"]
            sharded[f"{key}_masters"] = opt_sd["masters"]
        else:
            sharded[key] = part_opt.sharded_state_dict(dict(model_sd), is_loading=True)
    loaded = dist_checkpointing.load(sharded, str(path / "dist"))
    for name, part_model, part_opt in parts:
        _copy_into_model(part_model, loaded, f"{name}.", partial=adapters_only)
        if part_opt is None:
            continue
        key = _opt_key(name)
        extra = meta.get(f"{key}_extra") or {}
        if formats[name] == ADAMW_FORMAT:
            restore_optimizer(part_opt, loaded[key], loaded.get(f"{key}_masters", {}), meta,
                               extra, "" if name == "model" else f"{name}.")
        else:
            if extra.get("scheduler"):
                part_opt.scheduler.load_state_dict(extra["scheduler"])
            part_opt.load_sharded(loaded[key])
    rng_file = path / "rng" / f"rank_{_rank()}.pt"
    if load_rng and rng_file.is_file() and _same_layout(meta):
        set_rng_state(torch.load(rng_file, weights_only=False)["rng"])
    return read_trainer_state(path)


def _same_layout(meta: dict) -> bool:
    from megatron.core import parallel_state as ps

    layout = meta.get("parallel") or {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    return (layout.get("world_size") == world
            and layout.get("tp") == ps.get_tensor_model_parallel_world_size()
            and layout.get("pp") == ps.get_pipeline_model_parallel_world_size()
            and layout.get("ep", 1) == ps.get_expert_model_parallel_world_size())


def load_full_tensors(path: Path) -> dict:
    """Every tensor of a checkpoint, unsharded (``{key: tensor}``; model keys start with
    ``model.``, optimizer keys with ``optimizer.``). Works outside a distributed job: a
    single-process gloo group is created for the call if none exists (offline tools).

    Raises:
        CheckpointError: not a complete checkpoint.
    """
    from megatron.core import dist_checkpointing

    read_metadata(path)
    created = False
    if not dist.is_initialized():
        import socket

        cpu_compat.activate_if_no_cuda()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        created = True
    try:
        return _flatten(dist_checkpointing.load_plain_tensors(str(Path(path) / "dist")))
    finally:
        if created:
            dist.destroy_process_group()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
