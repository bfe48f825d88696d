"""TensorBoard + console + tqdm progress for the reporting rank.

Scalars go to ``<exp_dir>/tensorboard`` (``SummaryWriter``), one tag per metric key (keys
without a ``/`` are put under ``train/``), and as JSON lines to ``<exp_dir>/metrics.jsonl``
(appended; a resumed run continues the file, so a step may appear twice after a crash:
the last line of a step is the one that counts). The console line shows the metrics PPO users
read first (reward_mean, kl_mean, response_length, entropy, value_loss, clip_fraction,
approx_kl, grad_norm); sample tables go to the console and TensorBoard's text tab.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

CONSOLE_KEYS = ("reward_mean", "kl_mean", "beta", "response_length", "entropy", "policy_loss",
                "value_loss", "clip_fraction", "approx_kl", "grad_norm", "eval/accuracy",
                "eval/reward", "timing/step_s")


class MetricsLogger:
    """Writes metrics only where ``enabled`` (the reporting rank); a no-op elsewhere."""

    def __init__(self, exp_dir: Path, enabled: bool, total_steps: int = 0, start_step: int = 0):
        self.enabled = enabled
        self.writer = None
        self.bar = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            from tqdm import tqdm

            self.writer = SummaryWriter(str(Path(exp_dir) / "tensorboard"))
            self.jsonl = open(Path(exp_dir) / "metrics.jsonl", "a")
            self.bar = tqdm(total=total_steps, initial=start_step, desc="ppo", unit="step",
                            dynamic_ncols=True, leave=True)

    def log_metrics(self, metrics: dict, step: int) -> None:
        """Scalars to TensorBoard, a console line, and the progress bar."""
        if not self.enabled or not metrics:
            return
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                self.writer.add_scalar(k if "/" in k else f"train/{k}", float(v), step)
        self.writer.flush()
        self.jsonl.write(json.dumps({"step": step, **{k: v for k, v in metrics.items()
                                                      if isinstance(v, (int, float))}}) + "\n")
        self.jsonl.flush()
        parts = [f"{k if k.startswith('eval/') else k.split('/')[-1]}={metrics[k]:.4g}"
                 for k in CONSOLE_KEYS if k in metrics and isinstance(metrics[k], (int, float))]
        line = f"step {step}: " + " ".join(parts)
        if self.bar is not None:
            if step > self.bar.n:
                self.bar.update(step - self.bar.n)
            self.bar.write(line)

    def log_samples(self, rows: list[dict], step: int) -> None:
        """A table of prompt / response / reward rows."""
        if not self.enabled or not rows:
            return
        lines = [f"samples at step {step}:"]
        lines += [f"  {r['prompt']!r} -> {r['response']!r}  reward={r['reward']:.3f}" for r in rows]
        text = "\n".join(lines)
        self.bar.write(text)
        md = "| prompt | response | reward |\n|---|---|---|\n" + "\n".join(
            f"| {r['prompt']} | {r['response']} | {r['reward']:.3f} |" for r in rows)
        self.writer.add_text("samples", md, step)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.writer.close()
            self.jsonl.close()
