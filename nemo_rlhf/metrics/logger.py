"""The metrics sink of every job: TensorBoard, ``metrics.jsonl``, W&B / MLflow when enabled
(:mod:`nemo_rlhf.metrics.trackers`), a console line, a progress bar.

Scalars go to ``<exp_dir>/tensorboard`` (``SummaryWriter``), one tag per metric key (keys
without a ``/`` are put under ``train/``), and as JSON lines to ``<exp_dir>/metrics.jsonl``
(appended; a resumed run continues the file, so a step may appear twice after a crash:
the last line of a step is the one that counts). The console line shows the job's
``console_keys`` (PPO: the metrics users read first, :data:`PPO_CONSOLE_KEYS`; SFT/RM: every
metric but the timers) above a tqdm progress bar; sample tables and text go to the console
and TensorBoard's text tab.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence

from nemo_rlhf.metrics.trackers import open_trackers

PPO_CONSOLE_KEYS = ("reward_raw_mean", "reward_mean", "kl_mean", "kl_per_token", "kl_coef",
                    "response_length", "truncated_fraction", "entropy", "policy_loss", "value_loss",
                    "explained_variance", "clip_fraction", "approx_kl", "grad_norm",
                    "eval/accuracy", "eval/reward", "timing/step_s")
"""The PPO job's console line: ``reward_raw_mean`` is the reward sources' raw score (the RM's
output), ``reward_mean`` the same after ``reward.normalization`` (about 0 with ``running``);
``kl_mean`` is nats per sequence, ``kl_per_token`` the same per response token."""
CONSOLE_KEYS = PPO_CONSOLE_KEYS


def console_name(key: str) -> str:
    """A metric's name on the console line: the key as logged (its prefix tells
    ``val/accuracy`` from ``val_same_form/accuracy``), less a ``timing/`` prefix (PPO's
    ``step_s``)."""
    return key[len("timing/"):] if key.startswith("timing/") else key


class MetricsLogger:
    """Writes metrics only where ``enabled`` (the reporting rank); a no-op elsewhere.

    Args:
        exp_dir: the experiment folder (created by the caller).
        enabled: whether this rank writes.
        total_steps / start_step: the progress bar's range.
        desc: the progress bar's label (the job: ``ppo``, ``sft``, ``rm``).
        console_keys: keys of the console line, in order; None: every scalar except
            ``timing/*`` and ``memory/*``.
        tensorboard: write TensorBoard event files.
        trackers: the ``logger`` section (:class:`~nemo_rlhf.metrics.trackers.LoggerConfig`):
            W&B / MLflow runs that get every TensorBoard scalar too; None: none.
        run_config: the resolved config, the trackers' run config / params.
    """

    def __init__(self, exp_dir: Path, enabled: bool, total_steps: int = 0, start_step: int = 0,
                 desc: str = "ppo", console_keys: Optional[Sequence[str]] = PPO_CONSOLE_KEYS,
                 tensorboard: bool = True, trackers=None, run_config: Optional[dict] = None):
        self.enabled = enabled
        self.console_keys = console_keys
        self.writer = None
        self.bar = None
        self.trackers = []
        if enabled:
            self.trackers = open_trackers(trackers, Path(exp_dir), run_config)
            from torch.utils.tensorboard import SummaryWriter
            from tqdm import tqdm

            if tensorboard:
                self.writer = SummaryWriter(str(Path(exp_dir) / "tensorboard"))
            self.jsonl = open(Path(exp_dir) / "metrics.jsonl", "a")
            self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, unit="step",
                            dynamic_ncols=True, leave=True)

    def _keys(self, metrics: dict) -> list[str]:
        if self.console_keys is None:
            return [k for k in metrics if not k.startswith(("timing/", "memory/"))]
        return [k for k in self.console_keys if k in metrics]

    def log_metrics(self, metrics: dict, step: int) -> None:
        """Scalars to TensorBoard and ``metrics.jsonl``, a console line, the progress bar."""
        if not self.enabled or not metrics:
            return
        scalars = {k if "/" in k else f"train/{k}": float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        for tracker in self.trackers:
            tracker.log_metrics(scalars, step)
        self.jsonl.write(json.dumps({"step": step, **{k: v for k, v in metrics.items()
                                                      if isinstance(v, (int, float))}}) + "\n")
        self.jsonl.flush()
        parts = [f"{console_name(k)}={metrics[k]:.4g}" for k in self._keys(metrics)
                 if isinstance(metrics[k], (int, float))]
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        self.bar.write(f"step {step}: " + " ".join(parts))

    def log_samples(self, rows: list[dict], step: int) -> None:
        """A table of prompt / response / reward rows."""
        if not self.enabled or not rows:
            return
        lines = [f"samples at step {step}:"]
        lines += [f"  {r['prompt']!r} -> {r['response']!r}  reward={r['reward']:.3f}" for r in rows]
        self.bar.write("\n".join(lines))
        if self.writer is not None:
            md = "| prompt | response | reward |\n|---|---|---|\n" + "\n".join(
                f"| {r['prompt']} | {r['response']} | {r['reward']:.3f} |" for r in rows)
            self.writer.add_text("samples", md, step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Free text to the console and TensorBoard's text tab."""
        if not self.enabled:
            return
        if self.writer is not None:
            self.writer.add_text(tag, text.replace("\n", "  \n"), step)
        self.print(text)

    def print(self, text: str) -> None:
        """A console line above the progress bar (this rank only, if enabled)."""
        if self.enabled:
            self.bar.write(text)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            if self.writer is not None:
                self.writer.close()
            self.jsonl.close()
            for tracker in self.trackers:
                tracker.close()
