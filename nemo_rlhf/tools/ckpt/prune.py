"""``nemo-rlhf-ckpt prune``: delete all but the newest ``--keep`` complete checkpoints and
stale temporary saves (:func:`~nemo_rlhf.checkpoint.policy.prune_plan` decides, the rule every
job uses; ``--dry-run`` only prints it).

Never deletes the newest complete checkpoint, the one ``latest`` names, an incomplete
``step_<N>`` folder, or a temporary save not older than the newest complete one (it may be
a save in progress). Leaves out checking what it keeps (``validate``).
"""

from __future__ import annotations

import shutil

from nemo_rlhf.checkpoint import list_checkpoints
from nemo_rlhf.checkpoint.policy import prune_plan
from nemo_rlhf.tools.ckpt._common import EXIT_OK, CLIError, ckpt_root, emit, existing


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
