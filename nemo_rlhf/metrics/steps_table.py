"""Per-checkpoint evaluation rows as a markdown table and a PNG of each metric across steps.

Used by ``python -m nemo_rlhf.evaluate`` when it evaluates more than one checkpoint. A row
is one checkpoint's result dict (:func:`nemo_rlhf.evaluate.evaluate`); a metric a row does
not hold (no RM, no reference), or holds as None / NaN, is shown as ``-`` in the table and
left out of its curve in the plot.

The plot needs matplotlib (Agg backend, no display), which is not a dependency of the
project: :func:`require_matplotlib` raises a clear ``ImportError`` naming
``pip install matplotlib``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["BASE_COLUMNS", "MISSING", "markdown_table", "plot_metrics", "require_matplotlib",
           "table_columns"]

BASE_COLUMNS = ("step", "accuracy", "rm_reward", "mean_response_length", "repetition",
                "kl_to_reference")
"""The table's columns before the extra checkers' (in this order)."""
MISSING = "-"
"""Cell text of a metric the row does not have."""

MATPLOTLIB_HINT = "pip install matplotlib"


def require_matplotlib():
    """Import matplotlib with the Agg backend; return ``matplotlib.pyplot``.

    Raises:
        ImportError: matplotlib is not importable (the message names ``pip install matplotlib``).
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(f"plotting the per-step metrics (more than one checkpoint) needs "
                          f"matplotlib, which is not installed here: {MATPLOTLIB_HINT}") from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def table_columns(extra_checkers: Sequence[str] = ()) -> list[str]:
    """:data:`BASE_COLUMNS` followed by the extra checkers' names (no duplicates)."""
    cols = list(BASE_COLUMNS)
    cols += [name for name in extra_checkers if name not in cols]
    return cols


def _value(row: dict, key: str) -> Optional[float]:
    v = row.get(key)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return None if math.isnan(float(v)) else float(v)


def _cell(row: dict, key: str) -> str:
    v = _value(row, key)
    if v is None:
        return MISSING
    if key == "step":
        return str(int(v))
    return f"{v:.4f}"


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A GitHub markdown table: one line per row (in the given order), one column per key.

    Args:
        rows: result dicts; ``row[key]`` numbers (``step`` printed as an integer, the
            others with 4 decimals); missing / None / NaN cells are :data:`MISSING`.
        columns: keys, e.g. :func:`table_columns`.

    Returns:
        The table, ending with a newline.
    """
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot_metrics(rows: Sequence[dict], columns: Sequence[str], path: str | Path,
                 title: Optional[str] = None) -> Path:
    """Write a PNG with one small subplot per metric (every column but ``step``) across steps.

    The x axis is ``row["step"]``, or the row's index where a row has no step. A metric
    that no row has is drawn as an empty panel saying so.

    Args:
        rows: result dicts in step order.
        columns: keys; ``step`` is the x axis, the others get a panel each.
        path: the PNG to write (parent folders are created).
        title: figure title (optional).

    Returns:
        ``Path(path)``.

    Raises:
        ImportError: no matplotlib (see :func:`require_matplotlib`).
    """
    plt = require_matplotlib()
    from matplotlib.ticker import MaxNLocator

    metrics = [c for c in columns if c != "step"]
    steps = [_value(r, "step") for r in rows]
    xs = [s if s is not None else float(i) for i, s in enumerate(steps)]
    ncols = min(3, max(len(metrics), 1))
    nrows = max(1, math.ceil(len(metrics) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.4 * nrows), squeeze=False)
    try:
        for ax, key in zip(axes.flat, metrics):
            pts = [(x, _value(r, key)) for x, r in zip(xs, rows) if _value(r, key) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
            else:
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
            ax.set_title(key, fontsize=9)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in list(axes.flat)[len(metrics):]:
            ax.set_visible(False)
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)
    return path
