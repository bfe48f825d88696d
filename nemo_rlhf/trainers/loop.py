"""The run skeleton every training job shares (PPO, SFT, RM): the experiment folder, the
signals that end a run for requeue, and :func:`fit`, the loop.

The loop (:func:`fit`) owns the order of things; each job says what a step, a validation,
a save are. A job is an object with:

* ``cfg`` (``cfg.trainer.max_steps``, ``cfg.trainer.max_time_per_run``,
  ``cfg.exp_manager.save_interval``), ``step`` (steps done), ``signals`` (:class:`Signals`),
  ``job`` (its name: the loop logs to ``nemo_rlhf.<job>``);
* ``resume()`` (the checkpoint ``exp_manager.resume`` selects, via
  :mod:`nemo_rlhf.checkpoint.policy`), ``open_logs()`` (the metrics sink, after resume),
  ``on_fit_start() -> dict`` (metrics logged at the starting step, e.g. PPO's step-0
  evaluation; when not empty they also go to ``stop_reason``), ``train_step() -> dict``, ``check_health()`` (raise to stop, e.g. too many
  non-finite updates), ``validate_now(last) -> bool``, ``validate() -> dict``,
  ``final_metrics() -> dict`` (the last step's extras), ``log(metrics)``,
  ``stop_reason(metrics) -> str | None`` (a guard that saves and stops), ``save()``,
  ``close()``.

Exit codes: 0 done, :data:`REQUEUE_EXIT_CODE` saved after SIGTERM/SIGUSR1 or
``trainer.max_time_per_run`` (the launchers turn it into a requeue), :data:`GUARD_EXIT_CODE`
saved and stopped by a guard.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

REQUEUE_EXIT_CODE = 42
GUARD_EXIT_CODE = 3


class Signals:
    """Records SIGTERM / SIGUSR1 (SLURM's pre-timeout signal) so the loop can finish the
    step, save and exit for requeue. Install it first, before the slow set-up."""

    def __init__(self):
        self.received: Optional[str] = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def any_rank(self) -> bool:
        """Whether any rank got a signal (one host flag all-reduce: gloo)."""
        t = torch.tensor([1.0 if self.received else 0.0], device="cpu")  # host flag: gloo
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


class Experiment:
    """The experiment folder ``exp_manager.exp_dir`` of a run, the same for every job:
    ``config.yaml`` (the resolved config, also logged at the start), ``command_lines.txt`` (one JSON line per start),
    ``checkpoints/``, and the metrics sink's ``tensorboard/`` and ``metrics.jsonl``.

    Args:
        exp_dir: the folder (created).
        writer: whether this rank writes the files (global rank 0).
        run_config: the resolved config as a plain dict (None: not written).
    """

    def __init__(self, exp_dir, writer: bool, run_config: Optional[dict] = None):
        self.dir = Path(exp_dir)
        self.checkpoint_dir = self.dir / "checkpoints"
        self.writer = writer
        if writer:
            self.dir.mkdir(parents=True, exist_ok=True)
            if run_config is not None:
                from omegaconf import OmegaConf

                text = OmegaConf.to_yaml(OmegaConf.create(run_config))
                (self.dir / "config.yaml").write_text(text)
                logging.getLogger("nemo_rlhf").info("resolved config (%s):\n%s", self.dir / "config.yaml", text)
            with open(self.dir / "command_lines.txt", "a") as f:
                f.write(json.dumps({"time": time.time(), "argv": sys.argv}) + "\n")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()


def fit(job) -> int:
    """Train ``job`` to ``trainer.max_steps`` (or a signal, the time limit, a guard);
    return the exit code. See the module docstring for what ``job`` provides."""
    t, em = job.cfg.trainer, job.cfg.exp_manager
    log = logging.getLogger(f"nemo_rlhf.{job.job}")
    start = time.time()
    job.resume()
    job.open_logs()
    start_metrics = job.on_fit_start()
    job.log(start_metrics)
    code = 0
    # the guards see every evaluation, the starting one (PPO's step 0) included
    stop = job.stop_reason(start_metrics) if start_metrics else None
    if stop:
        job.save()
        log.error("stopping: %s", stop)
        code = GUARD_EXIT_CODE
    while code == 0 and job.step < t.max_steps:
        metrics = job.train_step()
        job.step += 1
        last = job.step == t.max_steps
        job.check_health()
        if job.validate_now(last):
            metrics.update(job.validate())
        if last:
            metrics.update(job.final_metrics())
        job.log(metrics)
        stop = job.stop_reason(metrics)
        out_of_time = t.max_time_per_run is not None and time.time() - start > t.max_time_per_run
        signalled = job.signals.any_rank()
        periodic = em.save_interval and job.step % em.save_interval == 0
        if periodic or last or signalled or out_of_time or stop:
            job.save()
        if stop:
            log.error("stopping: %s", stop)
            code = GUARD_EXIT_CODE
            break
        if signalled or out_of_time:
            log.warning("saved step %d after %s; exiting with requeue code %d", job.step,
                        job.signals.received or "trainer.max_time_per_run", REQUEUE_EXIT_CODE)
            code = REQUEUE_EXIT_CODE
            break
    job.close()
    return code


__all__ = ["Experiment", "GUARD_EXIT_CODE", "REQUEUE_EXIT_CODE", "Signals", "fit"]
