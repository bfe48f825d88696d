"""A PNG grid of a PPO run's metrics over steps, the ones the textbook chapter reads.

    python -m nemo_rlhf.tools.plot_metrics experiments/demo/ppo            # -> <exp_dir>/metrics.png
    python -m nemo_rlhf.tools.plot_metrics <exp_dir> --out run.png --metrics kl_mean entropy

Reads ``<exp_dir>/metrics.jsonl`` (one JSON object per logged line: the training metrics of
a step, and the held-out ``eval/*`` metrics on evaluation steps; lines of the same step are
merged, a later value winning, as after a resume) and draws one panel per metric:
by default the raw and normalised reward, ``kl_mean``, ``response_length``, ``entropy``,
``value_loss``, ``clip_fraction``, ``approx_kl``, ``grad_norm`` and every ``eval/*``
metric the run logged (accuracy, reward, win rate, repetition, ...). A metric the run never
logged is left out (named on stderr). Needs matplotlib (a project dependency).

Exit codes: 0 written; 2 bad input (no metrics file, a line that is not JSON: file and
line named; a ``--metrics`` name the run never logged).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nemo_rlhf.metrics.steps_table import plot_metrics

CHAPTER_METRICS = ("reward_raw_mean", "reward_mean", "kl_mean", "response_length", "entropy",
                   "value_loss", "clip_fraction", "approx_kl", "grad_norm")
"""The training metrics drawn by default, in this order (then every ``eval/*`` one)."""


def read_metric_rows(path: Path) -> list[dict]:
    """``metrics.jsonl`` as one dict per step, in step order (lines of a step merged).

    Raises:
        ValueError: a line that is not a JSON object with an integer ``step`` (names the
            file and line).
    """
    by_step: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{n}: a metrics line is a JSON object with an integer 'step'")
        by_step.setdefault(row["step"], {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def choose_metrics(rows: list[dict], wanted: list[str] | None) -> tuple[list[str], list[str]]:
    """``(metrics to draw, default metrics the run never logged)``.

    Raises:
        ValueError: a name in ``wanted`` that no row holds (lists what the run logged).
    """
    logged = {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k != "step"}
    if wanted:
        unknown = [m for m in wanted if m not in logged]
        if unknown:
            raise ValueError(f"--metrics {' '.join(unknown)}: not in the run's metrics; logged: "
                             f"{sorted(logged)}")
        return list(wanted), []
    evals = sorted(k for k in logged if k.startswith("eval/"))
    chosen = [m for m in CHAPTER_METRICS if m in logged] + evals
    return chosen, [m for m in CHAPTER_METRICS if m not in logged]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exp_dir", help="a PPO experiment folder (holds metrics.jsonl)")
    ap.add_argument("--out", help="PNG to write (default <exp_dir>/metrics.png)")
    ap.add_argument("--metrics", nargs="+", help="metric names to draw instead of the default set")
    a = ap.parse_args(argv)
    exp = Path(a.exp_dir)
    path = exp / "metrics.jsonl"
    if not path.is_file():
        print(f"error: {path} does not exist (exp_dir is the folder a PPO run writes its "
              f"metrics.jsonl to, e.g. experiments/demo/ppo)", file=sys.stderr)
        return 2
    try:
        rows = read_metric_rows(path)
        metrics, missing = choose_metrics(rows, a.metrics)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if missing:
        print(f"not logged by this run, left out: {', '.join(missing)}", file=sys.stderr)
    out = plot_metrics(rows, ["step", *metrics], a.out or exp / "metrics.png",
                       title=f"{exp} ({len(rows)} steps)")
    print(f"wrote {out} ({len(metrics)} metrics over {len(rows)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
