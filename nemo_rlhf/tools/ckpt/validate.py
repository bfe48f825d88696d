"""``nemo-rlhf-ckpt validate``: is a checkpoint intact? Its COMPLETE marker, every file's
recorded checksum, readable ``trainer_state.json`` / ``metadata.json``, and every tensor
loaded in full and finite; with ``--deep``, every tensor shard's sha256 recomputed from the
loaded tensors and compared with the one the trainer took from memory at save
(:mod:`nemo_rlhf.checkpoint.digests`: the files hold what the model held, not only what was
written). Exit 1 with the list of problems when any is found.

Leaves out whether a run would pick it (``resume-info``) and repairing anything.
"""

from __future__ import annotations

import json
import sys

from nemo_rlhf.checkpoint import verify_checkpoint
from nemo_rlhf.checkpoint.digests import deep_problems, read_digests
from nemo_rlhf.checkpoint.io import load_full_tensors
from nemo_rlhf.tools.ckpt._common import (
    EXIT_OK,
    EXIT_PROBLEMS,
    emit,
    existing,
    first_line,
    resolve_ckpt,
)


def cmd_validate(args) -> int:
    p = existing(args.ckpt)
    looks_like = (p / "dist").is_dir() or (p / "metadata.json").is_file() or (p / "COMPLETE").is_file()
    if not looks_like:
        p = resolve_ckpt(args.ckpt)
    problems, n_tensors, n_digests = [], 0, None
    if not (p / "COMPLETE").is_file():
        problems.append("no COMPLETE marker (an unpublished or interrupted save)")
    else:
        problems += verify_checkpoint(p)
        for name in ("trainer_state.json", "metadata.json"):
            try:
                json.loads((p / name).read_text())
            except (OSError, ValueError) as exc:
                problems.append(f"{name}: unreadable ({exc})")
        try:
            import torch

            full = load_full_tensors(p)
            tensors = {k: v for k, v in full.items() if torch.is_tensor(v)}
            n_tensors = len(tensors)
            bad = [k for k, v in tensors.items()
                   if v.is_floating_point() and not torch.isfinite(v).all()]
            problems += [f"{k}: non-finite values" for k in bad]
            if getattr(args, "deep", False):
                problems += deep_problems(p, tensors)
                n_digests = len(read_digests(p) or [])
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - any load failure is the finding (torch's
            # CheckpointException derives from BaseException)
            problems.append(f"not loadable: {type(exc).__name__}: {first_line(exc)}")
    doc = {"path": str(p), "ok": not problems, "problems": problems, "tensors_loaded": n_tensors,
           **({"digests_compared": n_digests} if n_digests is not None else {})}
    if problems:
        emit(args, doc, [f"INVALID {p}:"] + [f"  - {x}" for x in problems])
        print(f"nemo-rlhf-ckpt validate: {p}: {len(problems)} problem(s)", file=sys.stderr)
        return EXIT_PROBLEMS
    deep = "" if n_digests is None else f", {n_digests} tensor digests match"
    emit(args, doc, [f"OK {p}: checksums match, {n_tensors} tensors load{deep}"])
    return EXIT_OK
