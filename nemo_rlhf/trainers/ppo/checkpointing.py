"""Resume and retention for the PPO job (built on :mod:`nemo_rlhf.checkpoint`)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from nemo_rlhf.checkpoint import (
    CheckpointError,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_metadata,
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
    path = find_latest_checkpoint(ckpt_root)
    if path is None:
        return None, f"no complete checkpoint under {ckpt_root}"
    incomplete = [p.name for s, p, ok in list_checkpoints(ckpt_root) if not ok]
    why = f"newest complete checkpoint under {ckpt_root}"
    if incomplete:
        why += f" (ignored incomplete: {incomplete})"
    return path, why


def fingerprint_diff(saved: dict, current: dict) -> list[str]:
    """Keys whose fingerprint differs between a checkpoint and the run."""
    return [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]


def resume(cfg, trainer, ckpt_root: Path, guard=None) -> None:
    """Load the checkpoint chosen by ``exp_manager.resume`` into the trainer, if any.

    Raises:
        CheckpointError: fingerprint mismatch (unless ``exp_manager.ignore_fingerprint``).
    """
    path, why = select_resume_checkpoint(cfg.exp_manager.resume, ckpt_root)
    if path is None:
        log.info("starting fresh: %s", why)
        return
    meta = read_metadata(path)
    diff = fingerprint_diff(meta.get("fingerprint") or {}, trainer.fingerprint)
    if diff and not cfg.exp_manager.ignore_fingerprint:
        raise CheckpointError(
            f"{path} does not match this run: fingerprint differs in {diff} "
            f"(saved {[meta['fingerprint'].get(k) for k in diff]}, now "
            f"{[trainer.fingerprint.get(k) for k in diff]}); set "
            "exp_manager.ignore_fingerprint=true to load it anyway")
    state = load_checkpoint(path, trainer.model, trainer.optimizer)
    trainer.load_state_dict(state)
    if guard is not None and state.get("guard"):
        guard.load_state_dict(state["guard"])
    log.info("resumed from %s at step %d (%s)", path, trainer.step, why)


def prune(ckpt_root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (and stale temps).

    Never deletes the newest complete checkpoint. Returns the deleted paths.
    """
    complete = [p for _, p, ok in list_checkpoints(ckpt_root) if ok]
    doomed = complete[:-max(keep_last, 1)] if len(complete) > keep_last else []
    newest = complete[-1] if complete else None
    for p in doomed:
        if p != newest:
            shutil.rmtree(p, ignore_errors=True)
    return doomed


__all__ = ["CheckpointError", "fingerprint_diff", "prune", "resume", "select_resume_checkpoint"]
