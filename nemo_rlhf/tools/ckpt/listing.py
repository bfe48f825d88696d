"""``nemo-rlhf-ckpt list``: the checkpoints of an experiment, one row each (step, status,
size, layout, the step's key metrics from ``trainer_state.json`` and ``metrics.jsonl``),
unpublished temporary saves included.

Leaves out checking the files (``validate``) and a checkpoint's contents (``inspect``).
"""

from __future__ import annotations

import json
from pathlib import Path

from nemo_rlhf.checkpoint import list_checkpoints, read_trainer_state
from nemo_rlhf.tools.ckpt._common import (
    EXIT_OK,
    CLIError,
    ckpt_root,
    dir_size,
    emit,
    existing,
    human_size,
    layout_text,
)

KEY_METRICS = ("reward_mean", "kl_mean", "train/loss", "val/loss", "train/accuracy",
               "val/accuracy", "eval/reward", "response_length", "policy_loss", "value_loss")


def _metrics_by_step(exp_dir: Path) -> dict[int, dict]:
    """Last ``metrics.jsonl`` line of every step (a resumed run may repeat a step)."""
    out, f = {}, exp_dir / "metrics.jsonl"
    for line in f.read_text().splitlines() if f.is_file() else []:
        try:
            row = json.loads(line)
            out[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):  # a torn last line after a crash
            continue
    return out


def cmd_list(args) -> int:
    p = existing(args.path)
    root = ckpt_root(p)
    temps = sorted(root.glob(".tmp_step_*")) if root.is_dir() else []
    steps = []
    if any(root.glob("step_*")):  # cheap test before importing torch
        steps = list_checkpoints(root)
    if not steps and not temps:
        hint = "; it is one checkpoint: use inspect" if (p / "COMPLETE").is_file() else ""
        raise CLIError(f"{p}: no checkpoints (expected step_<N> folders in it or in "
                       f"{p / 'checkpoints'}){hint}")
    latest_file = root / "latest"
    latest = latest_file.read_text().strip() if latest_file.is_file() else None
    metrics = _metrics_by_step(root.parent if root.name == "checkpoints" else root)
    rows = []
    for step, path, ok in steps:
        meta, state = {}, {}
        if ok:
            try:
                meta = json.loads((path / "metadata.json").read_text())
                state = read_trainer_state(path)
            except (OSError, ValueError):
                pass
        rows.append({"step": step, "path": str(path), "status": "complete" if ok else "incomplete",
                     "latest": path.name == latest, "size_bytes": dir_size(path),
                     "parallel": meta.get("parallel"), "has_optimizer": meta.get("has_optimizer"),
                     "metrics": {k: v for k, v in {**(state.get("metrics") or {}), **state,
                                                   **metrics.get(step, {})}.items()
                                 if type(v) in (int, float) and k != "step"}})
    for t in temps:
        rows.append({"step": int(t.name.rsplit("_", 1)[1]) if t.name[10:].isdigit() else None,
                     "path": str(t), "status": "temp", "latest": False, "size_bytes": dir_size(t),
                     "parallel": None, "has_optimizer": None, "metrics": {}})
    lines = [f"checkpoints in {root} (latest -> {latest or 'none'})",
             f"  {'step':>6}  {'status':<11} {'size':>10}  {'layout':<13} metrics"]
    for r in rows:
        shown = [k for k in KEY_METRICS if k in r["metrics"]] or list(r["metrics"])[:4]
        text = " ".join(f"{k}={r['metrics'][k]:.4g}" for k in shown)
        if r["status"] == "temp":
            text = f"unpublished save ({Path(r['path']).name})"
        elif r["status"] == "incomplete":
            text = "no COMPLETE marker: never loaded"
        status = r["status"] + (" *" if r["latest"] else "")
        layout = layout_text({"parallel": r["parallel"]}) if r["parallel"] else "-"
        step = r["step"] if r["step"] is not None else "?"
        lines.append(f"  {step:>6}  {status:<11} {human_size(r['size_bytes']):>10}  {layout:<13} {text}")
    lines.append("  (* = the checkpoint 'latest' names)")
    emit(args, {"root": str(root), "latest": latest, "checkpoints": rows}, lines)
    return EXIT_OK
