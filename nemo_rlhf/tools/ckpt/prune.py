"""``nemo-rlhf-ckpt prune``: delete all but the newest ``--keep`` complete checkpoints and
stale temporary saves (:func:`prune_plan` decides, ``--dry-run`` only prints it).

Never deletes the newest complete checkpoint, the one ``latest`` names, an incomplete
``step_<N>`` folder, or a temporary save not older than the newest complete one (it may be
a save in progress). Leaves out checking what it keeps (``validate``).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from nemo_rlhf.checkpoint import is_complete, list_checkpoints
from nemo_rlhf.tools.ckpt._common import EXIT_OK, CLIError, ckpt_root, emit, existing


def prune_plan(root: Path, keep: int) -> tuple[list, list]:
    """``(delete, kept)``, each ``[(path, reason)]``; the newest complete checkpoint and
    the one ``latest`` names are always kept, temps newer than it too (a save may be in
    progress)."""
    steps = list_checkpoints(root)
    complete = [p for _, p, ok in steps if ok]
    latest_file = root / "latest"
    named = root / latest_file.read_text().strip() if latest_file.is_file() else None
    protected = set(complete[-keep:]) | ({complete[-1]} if complete else set())
    if named is not None and is_complete(named):
        protected.add(named)
    newest_step = int(complete[-1].name[5:]) if complete else None
    delete, kept = [], []
    for step, p, ok in steps:
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


def cmd_prune(args) -> int:
    p = existing(args.exp_dir)
    if args.keep < 1:
        raise CLIError(f"--keep {args.keep}: must be >= 1 (the newest complete checkpoint is "
                       "never deleted)")
    root = ckpt_root(p)
    if not list_checkpoints(root) and not list(root.glob(".tmp_step_*")):
        raise CLIError(f"{p}: no checkpoints to prune")
    delete, kept = prune_plan(root, args.keep)
    if not args.dry_run:
        for path, _ in delete:
            (path / "COMPLETE").unlink(missing_ok=True)  # never half-deleted yet "complete"
            shutil.rmtree(path)
    verb = "would delete" if args.dry_run else "deleted"
    lines = [f"{verb} {path} ({why})" for path, why in delete]
    lines += [f"kept {path} ({why})" for path, why in kept]
    emit(args, {"dry_run": args.dry_run, "deleted" if not args.dry_run else "would_delete":
                [str(x) for x, _ in delete], "kept": [str(x) for x, _ in kept]}, lines)
    return EXIT_OK
