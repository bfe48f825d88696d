"""Resume for the PPO job (built on :mod:`nemo_rlhf.checkpoint`; retention:
:func:`nemo_rlhf.checkpoint.prune_checkpoints`)."""

from __future__ import annotations

import logging
from pathlib import Path

from nemo_rlhf.checkpoint import (
    CheckpointError,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_metadata,
    verify_checkpoint,
)

log = logging.getLogger("nemo_rlhf.ppo")


def select_resume_checkpoint(resume: str, ckpt_root: Path):
    """What a resume would load: ``(path or None, reason)``.

    ``resume``: ``auto`` (newest complete checkpoint under ``ckpt_root``), ``none``, or a
    checkpoint path.

    Raises:
        CheckpointError: an explicit path that is not a complete checkpoint.
    """
    if resume == "none":
        return None, "resume disabled (exp_manager.resume=none)"
    if resume != "auto":
        read_metadata(resume)  # raises with the path if incomplete
        return Path(resume), f"explicit exp_manager.resume={resume}"
    newest = find_latest_checkpoint(ckpt_root)
    if newest is None:
        return None, f"no complete checkpoint under {ckpt_root}"
    incomplete = [p.name for s, p, ok in list_checkpoints(ckpt_root) if not ok]
    candidates = [p for s, p, ok in reversed(list_checkpoints(ckpt_root)) if ok and s <= _step(newest)]
    skipped = []
    for path in candidates:
        problems = verify_checkpoint(path)
        if not problems:
            why = f"newest complete checkpoint under {ckpt_root}"
            if incomplete:
                why += f" (ignored incomplete: {incomplete})"
            if skipped:
                why += f" (skipped corrupt: {skipped})"
            return path, why
        log.warning("checkpoint %s is corrupt, falling back to the previous one: %s", path,
                    "; ".join(problems[:5]))
        skipped.append(path.name)
    return None, f"every complete checkpoint under {ckpt_root} is corrupt: {skipped}"


def _step(path: Path) -> int:
    return int(Path(path).name.split("_")[1])


def fingerprint_diff(saved: dict, current: dict) -> list[str]:
    """What differs between a checkpoint's fingerprint and the run's, one line per item:
    ``"model.num_layers: saved 2, now 4"`` (nested dicts are compared key by key)."""
    out = []
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k), current.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{k}.{sub}: saved {a.get(sub)!r}, now {b.get(sub)!r}"
                    for sub in sorted(set(a) | set(b)) if a.get(sub) != b.get(sub)]
        else:
            out.append(f"{k}: saved {a!r}, now {b!r}")
    return out


def resume(cfg, trainer, ckpt_root: Path, guard=None) -> None:
    """Load the checkpoint chosen by ``exp_manager.resume`` into the trainer, if any.

    Raises:
        CheckpointError: fingerprint mismatch (unless ``exp_manager.ignore_fingerprint``).
    """
    import torch.distributed as dist

    choice = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        choice = [select_resume_checkpoint(cfg.exp_manager.resume, ckpt_root)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    path, why = choice[0]
    if path is None:
        log.info("starting fresh: %s", why)
        return
    meta = read_metadata(path)
    diff = fingerprint_diff(meta.get("fingerprint") or {}, trainer.fingerprint)
    if diff and cfg.exp_manager.ignore_fingerprint:
        log.warning("loading %s despite fingerprint differences: %s", path, "; ".join(diff))
    elif diff:
        raise CheckpointError(
            f"{path} does not match this run: " + "; ".join(diff) +
            " (set exp_manager.ignore_fingerprint=true to load it anyway)")
    state = load_checkpoint(path, trainer.model, trainer.optimizer, critic=trainer.critic)
    trainer.load_state_dict(state)
    if guard is not None and state.get("guard"):
        guard.load_state_dict(state["guard"])
    log.info("resumed from %s at step %d (%s)", path, trainer.step, why)


__all__ = ["CheckpointError", "fingerprint_diff", "resume", "select_resume_checkpoint"]
