"""``nemo-rlhf-ckpt resume-info``: which checkpoint a run of the experiment would resume
from, and why, by the jobs' own selection (:func:`~nemo_rlhf.checkpoint.policy.select_resume_checkpoint`);
notes when the SFT/RM trainers (no checksum verification) would load another one.

Leaves out loading anything and the fingerprint check a run does on resume.
"""

from __future__ import annotations

from nemo_rlhf.checkpoint import CheckpointError, find_latest_checkpoint, read_trainer_state
from nemo_rlhf.checkpoint.policy import select_resume_checkpoint
from nemo_rlhf.tools.ckpt._common import EXIT_OK, CLIError, emit, existing


def cmd_resume_info(args) -> int:
    p = existing(args.exp_dir)
    if not p.is_dir():
        raise CLIError(f"{p}: not a folder (expected an experiment folder)")
    # the trainer looks in <exp_dir>/checkpoints, which a fresh experiment may not have yet
    root = p if p.name == "checkpoints" or any(p.glob("step_*")) else p / "checkpoints"
    import logging

    logging.getLogger("nemo_rlhf.ppo").setLevel(logging.ERROR)  # the reason names what was skipped
    try:
        path, why = select_resume_checkpoint(args.resume, root)
    except CheckpointError as exc:
        raise CLIError(str(exc)) from None
    doc = {"checkpoints": str(root), "resume": args.resume, "path": str(path) if path else None,
           "reason": why, "step": None}
    if path is not None:
        doc["step"] = read_trainer_state(path).get("step", int(path.name.split("_")[1]))
        lines = [f"would resume from {path} (step {doc['step']}): {why}"]
    else:
        lines = [f"would start fresh: {why}"]
    unverified = find_latest_checkpoint(root) if args.resume == "auto" else None
    if unverified is not None and unverified != path:
        doc["sft_rm_would_load"] = str(unverified)
        lines.append(f"note: SFT/RM trainers pick the newest complete checkpoint without checksum "
                     f"verification and would load {unverified}")
    emit(args, doc, lines)
    return EXIT_OK
