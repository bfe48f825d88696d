"""One resume and retention policy for every job (PPO, SFT, RM) and ``nemo-rlhf-ckpt``.

* **Resume** (:func:`select_resume_checkpoint`): ``exp_manager.resume`` is ``auto`` (the
  newest complete checkpoint under ``<exp_dir>/checkpoints`` whose shards verify; a
  corrupt one is skipped with a warning, falling back to the previous), ``none``, or a
  checkpoint path. :func:`check_fingerprint` refuses a checkpoint whose fingerprint
  (model, tokenizer, data, reference) differs from the run's, naming each difference,
  unless ``exp_manager.ignore_fingerprint``.
* **Retention** (:func:`prune_plan` / :func:`prune`): keep the newest ``keep`` complete
  checkpoints, always the newest complete one and the one ``latest`` names; delete
  leftovers of re-saves and unpublished saves older than the newest complete one; never
  touch an incomplete ``step_*`` folder or a save that may be in progress.

Simplified: one shared filesystem is assumed (every rank sees the checkpoint folder); the
choice is made on global rank 0 and broadcast by the caller.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from nemo_rlhf.checkpoint.layout import (
    LATEST,
    CheckpointError,
    find_latest_checkpoint,
    is_complete,
    list_checkpoints,
    read_metadata,
    verify_checkpoint,
)

log = logging.getLogger("nemo_rlhf.checkpoint")

RESUME_CHOICES = ("auto", "none")
"""``exp_manager.resume`` values besides a checkpoint path."""


def select_resume_checkpoint(resume: str, ckpt_root: Path) -> tuple[Optional[Path], str]:
    """What a resume would load: ``(path or None, reason)``.

    Args:
        resume: ``auto``, ``none`` or a checkpoint path (``exp_manager.resume``).
        ckpt_root: ``<exp_dir>/checkpoints``.

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
    candidates = [p for s, p, ok in reversed(list_checkpoints(ckpt_root))
                  if ok and s <= _step(newest)]
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


def check_fingerprint(path: Path, current: dict, ignore: bool = False) -> None:
    """Refuse ``path`` when its fingerprint differs from ``current``.

    Raises:
        CheckpointError: naming each difference and ``exp_manager.ignore_fingerprint``
            (with ``ignore`` the differences are logged instead).
    """
    diff = fingerprint_diff(read_metadata(path).get("fingerprint") or {}, current)
    if diff and ignore:
        log.warning("loading %s despite fingerprint differences: %s", path, "; ".join(diff))
    elif diff:
        raise CheckpointError(
            f"{path} does not match this run: " + "; ".join(diff) +
            " (set exp_manager.ignore_fingerprint=true to load it anyway)")


def resume_run(resume: str, ckpt_root: Path, fingerprint: dict,
               load: Callable[[Path], dict], ignore_fingerprint: bool = False
               ) -> tuple[Optional[Path], str, Optional[dict]]:
    """The resume step of every job: choose (:func:`select_resume_checkpoint`, on global
    rank 0, broadcast to all ranks as a host object), check the fingerprint, load.

    Args:
        resume, ckpt_root: see :func:`select_resume_checkpoint`.
        fingerprint: the run's (see :func:`check_fingerprint`).
        load: ``path -> trainer state`` (``load_checkpoint`` with the run's models and
            optimizers); called on every rank.
        ignore_fingerprint: ``exp_manager.ignore_fingerprint``.

    Returns:
        ``(path, reason, trainer state)``; ``(None, reason, None)`` for a fresh start.

    Raises:
        CheckpointError: see :func:`select_resume_checkpoint` and :func:`check_fingerprint`.
    """
    choice = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        choice = [select_resume_checkpoint(resume, ckpt_root)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    path, why = choice[0]
    if path is None:
        return None, why, None
    check_fingerprint(path, fingerprint, ignore_fingerprint)
    return path, why, load(path)


def prune_plan(root: Path, keep: int) -> tuple[list, list]:
    """``(delete, kept)``, each ``[(path, reason)]`` (the retention rule of the module
    docstring; nothing is deleted here)."""
    root = Path(root)
    steps = list_checkpoints(root)
    complete = [p for _, p, ok in steps if ok]
    latest_file = root / LATEST
    named = root / latest_file.read_text().strip() if latest_file.is_file() else None
    protected = set(complete[-keep:]) | ({complete[-1]} if complete else set())
    if named is not None and is_complete(named):
        protected.add(named)
    newest_step = _step(complete[-1]) if complete else None
    delete, kept = [], []
    for _, p, ok in steps:
        if not ok:
            kept.append((p, "incomplete step folder: not touched"))
        elif p == complete[-1]:
            kept.append((p, "newest complete"))
        elif p in complete[-keep:]:
            kept.append((p, f"within --keep {keep}"))
        elif p in protected:
            kept.append((p, "named by 'latest'"))
        else:
            delete.append((p, f"older than the newest {keep} complete"))
    for t in sorted(root.glob(".tmp_step_*")) + sorted(root.glob(".trash_step_*")):
        m = re.match(r"\.(tmp|trash)_step_(\d+)", t.name)
        step = int(m.group(2)) if m else None
        if m and m.group(1) == "trash" and is_complete(root / f"step_{step}"):
            delete.append((t, f"leftover of re-saving step {step}"))
        elif step is not None and newest_step is not None and step < newest_step:
            delete.append((t, f"unpublished save older than step_{newest_step}"))
        else:
            kept.append((t, "unpublished save not older than the newest complete: may be in progress"))
    return delete, kept


def prune(root: Path, keep: int) -> list[Path]:
    """Apply :func:`prune_plan`; return the deleted paths. Call on one rank."""
    delete, _ = prune_plan(root, keep)
    for p, _why in delete:
        shutil.rmtree(p, ignore_errors=True)
    return [p for p, _ in delete]


__all__ = ["RESUME_CHOICES", "check_fingerprint", "fingerprint_diff", "prune", "prune_plan",
           "resume_run", "select_resume_checkpoint"]
