"""SFT and RM training on the shared run skeleton: :class:`SupervisedTrainer` and the
``trainer`` / ``exp_manager`` sections of the two jobs.

The loop is :func:`nemo_rlhf.trainers.loop.fit` (the PPO job's too); the data order is
:class:`nemo_rlhf.data.sampler.ResumableSampler` (a seeded permutation per epoch, global
batches running across epoch boundaries, its position in every checkpoint); metrics go
through :class:`nemo_rlhf.metrics.MetricsLogger`; resume and retention are
:mod:`nemo_rlhf.checkpoint.policy`.

Simplified: no data loader workers (datasets are small, tokenized up front).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from nemo_rlhf.checkpoint import checkpoint_content_hash, load_checkpoint, resolve_checkpoint, save_checkpoint
from nemo_rlhf.checkpoint.policy import prune, resume_run
from nemo_rlhf.data.sampler import ResumableSampler
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed.split import dp_shard
from nemo_rlhf.metrics.logger import MetricsLogger
from nemo_rlhf.metrics.timers import Timers
from nemo_rlhf.models.actor_critic import build_model
from nemo_rlhf.models.config import agree_on_precision
from nemo_rlhf.models.engine import finalize_grads, wrap_ddp
from nemo_rlhf.trainers.common import setup_run, to_plain
from nemo_rlhf.trainers.config import ExpManagerConfig, TrainerConfig
from nemo_rlhf.trainers.loop import Experiment, Signals, fit
from nemo_rlhf.trainers.optimizers import build_optimizer, validate_optimizer


@dataclass
class SupervisedTrainerConfig(TrainerConfig):
    """Loop control of SFT and RM (config section ``trainer``): the shared keys plus batch
    sizes and the logging interval."""

    global_batch_size: int = 32
    """Examples (SFT rows / RM pairs) per optimizer step, across all DP ranks."""
    micro_batch_size: int = 8
    """Examples per forward on one rank; divides ``global_batch_size / dp``."""
    log_every_n_steps: int = 10
    """Console / TensorBoard interval in steps."""
    val_at_start: bool = False
    """Validate once before the first step of a run that starts at step 0 (logged as step 0):
    the starting model's numbers on the same validation sets as the end's (the demo's RM
    refresh compares the RM before and after a round this way). A resumed run does not."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("max_steps", "global_batch_size", "micro_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.{key}={getattr(self, key)}: must be >= 1")
        if self.log_every_n_steps < 0:
            raise ValueError(f"trainer.log_every_n_steps={self.log_every_n_steps}: must be >= 0")

    def validate(self, dp: int) -> None:
        """Batch sizes against the data-parallel size.

        Raises:
            ValueError: naming ``trainer.global_batch_size`` / ``micro_batch_size``, the
                values and the valid ones.
        """
        if self.global_batch_size % dp:
            raise ValueError(
                f"trainer.global_batch_size={self.global_batch_size} is not divisible by the "
                f"data-parallel size {dp}; use a multiple of {dp}")
        per_rank = self.global_batch_size // dp
        if per_rank % self.micro_batch_size:
            valid = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
            raise ValueError(
                f"trainer.micro_batch_size={self.micro_batch_size} does not divide the per-rank "
                f"batch global_batch_size/dp={per_rank}; valid micro_batch_size values: {valid}")


@dataclass
class SupervisedExpManagerConfig(ExpManagerConfig):
    """Where an SFT/RM run writes (config section ``exp_manager``): the shared keys plus
    switches for the sinks."""

    tensorboard: bool = True
    """Write TensorBoard event files (``<exp_dir>/tensorboard``)."""
    checkpoints: bool = True
    """Write checkpoints (false: dry runs and tests; then ``resume=auto`` finds none)."""


class SupervisedTrainer:
    """The SFT / RM job on the shared run skeleton (:func:`nemo_rlhf.trainers.loop.fit`):
    build, resume, then :meth:`fit` (train, validate, log, save, requeue on signals).

    Subclasses set ``model_kind`` and ``job`` (the progress bar's label) and implement
    :meth:`load_datasets`, :meth:`train_batch` (one optimizer step on a global batch;
    returns global metrics) and :meth:`validation_metrics`; :meth:`on_fit_end`,
    :meth:`init_weights` and :meth:`trainer_state` are optional.

    Args:
        cfg: the run config (a dataclass with ``model``, ``parallel``, ``optim``, ``data``,
            ``trainer`` and ``exp_manager``).
        signals: the :class:`~nemo_rlhf.trainers.loop.Signals` the entry point installed
            (None: installed here).
    """

    model_kind = "actor_critic"
    job = "train"

    def __init__(self, cfg, signals: Optional[Signals] = None):
        self.cfg = cfg
        self.signals = signals or Signals()
        self.tokenizer = Tokenizer(cfg.data.tokenizer_dir)
        self.dims, self.model_cfg = setup_run(cfg.parallel, cfg.model, self.tokenizer, cfg.trainer.seed)
        cfg.trainer.validate(self.dims.dp)
        cfg.trainer.precision = agree_on_precision(cfg.trainer.precision, self.dims)
        validate_optimizer(cfg.optim, self.dims)
        if cfg.data.max_seq_length > self.model_cfg.max_position_embeddings:
            raise ValueError(f"data.max_seq_length={cfg.data.max_seq_length} exceeds "
                             f"model.max_position_embeddings={self.model_cfg.max_position_embeddings}")
        self.run_config = to_plain(replace(cfg, model=self.model_cfg))  # vocab_size resolved
        self.exp = Experiment(cfg.exp_manager.exp_dir, self.dims.rank == 0, self.run_config)
        self.logger: Optional[MetricsLogger] = None
        self.timers = Timers()
        self.train_ds, self.val_ds = self.load_datasets()
        for ds in (self.train_ds, self.val_ds):
            if ds is not None and self.dims.rank == 0:
                ds.report.log()
        self.sampler = ResumableSampler(len(self.train_ds), cfg.trainer.seed)
        model = build_model(self.model_cfg, self.dims, cfg.trainer.precision, kind=self.model_kind,
                            seed=cfg.trainer.seed)
        self.init_weights(model)
        self.model = wrap_ddp(model, use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.dims, cfg.trainer.precision)
        self.step = 0
        self.last_metrics: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        """Metrics of every step run by :meth:`fit` (global values, on every rank)."""
        self.exit_code = 0
        """The exit code of the last :meth:`fit` (0, or the requeue code)."""
        self._resumed = False
        self._fit_start = time.perf_counter()
        self._validated = False
        self.resume()

    # -- what a job defines --------------------------------------------------------------
    def load_datasets(self):
        """``(train, val or None)`` tokenized datasets."""
        raise NotImplementedError

    def init_weights(self, model) -> None:
        """Change the freshly built weights before training (e.g. load a backbone)."""

    def train_batch(self, global_batch: list, local: list) -> dict[str, float]:
        """One optimizer step on ``global_batch`` (``local``: this DP rank's share);
        global metrics."""
        raise NotImplementedError

    def validation_metrics(self) -> dict[str, float]:
        """Validation metrics (global; empty without a validation set)."""
        return {}

    def on_fit_end(self) -> dict[str, float]:
        """Metrics of the last step's record (e.g. the RM's final reward statistics)."""
        return {}

    def trainer_state(self) -> dict:
        """JSON-able state stored with each checkpoint."""
        return {"step": self.step, "consumed_samples": self.sampler.consumed_samples,
                "sampler": self.sampler.state_dict(), "metrics": self.last_metrics}

    def print(self, text: str) -> None:
        """A console line on global rank 0 (above the progress bar once it is open)."""
        if self.logger is not None:
            self.logger.print(text)
        elif self.dims.rank == 0:
            print(text, flush=True)

    # -- the run (hooks of nemo_rlhf.trainers.loop.fit) -----------------------------------
    def fit(self) -> dict[str, float]:
        """Train to ``trainer.max_steps`` (or a signal / the time limit); return the last
        metrics (train, validation, final). The exit code is :attr:`exit_code`."""
        self.exit_code = fit(self)
        return self.last_metrics

    @property
    def checkpoint_dir(self) -> Path:
        """``<exp_dir>/checkpoints``."""
        return self.exp.checkpoint_dir

    def base_checkpoint(self) -> Optional[str]:
        """The checkpoint the weights start from (the job's ``init_from``), or None."""
        return None

    def lora_base(self) -> Optional[str]:
        """With ``model.lora.enabled``: the base checkpoint the adapters sit on (saved
        checkpoints hold adapters and heads only), else None."""
        return self.base_checkpoint() if self.model_cfg.lora.enabled else None

    def fingerprint(self) -> dict:
        """What a resume must match (:func:`nemo_rlhf.checkpoint.policy.check_fingerprint`):
        the model shape, the tokenizer and, with LoRA, the base's content hash."""
        out = {"model": self.model_cfg.fingerprint(), "tokenizer": self.tokenizer.describe()}
        if self.lora_base():
            out["lora_base"] = checkpoint_content_hash(resolve_checkpoint(self.lora_base()))
        return out

    def resume(self) -> None:
        """Load the checkpoint ``exp_manager.resume`` selects, once, by the policy every job
        uses (:func:`nemo_rlhf.checkpoint.policy.resume_run`: ``auto`` the newest intact one
        of this experiment, none without ``exp_manager.checkpoints``; ``none``; or a path)."""
        if self._resumed:
            return
        self._resumed = True
        em = self.cfg.exp_manager
        if em.resume == "auto" and not em.checkpoints:
            return
        path, why, state = resume_run(
            em.resume, self.checkpoint_dir, self.fingerprint(),
            lambda p: load_checkpoint(p, self.model, self.optimizer), em.ignore_fingerprint)
        if path is None:
            return
        self.step = int(state["step"])
        self.sampler.load_state_dict(
            state.get("sampler") or {"consumed_samples": self.step * self.cfg.trainer.global_batch_size})
        self.print(f"resumed from {path} at step {self.step} ({why})")

    def open_logs(self) -> None:
        t = self.cfg.trainer
        self._fit_start = time.perf_counter()
        self.logger = MetricsLogger(self.exp.dir, enabled=self.dims.rank == 0,
                                    total_steps=t.max_steps, start_step=self.step, desc=self.job,
                                    console_keys=None, tensorboard=self.cfg.exp_manager.tensorboard,
                                    trackers=getattr(self.cfg, "logger", None), run_config=self.run_config)
        if self.step >= t.max_steps:
            self.print(f"already at step {self.step} >= trainer.max_steps={t.max_steps}")

    def on_fit_start(self) -> dict:
        """With ``trainer.val_at_start`` on a run at step 0: the validation metrics of the
        starting model (logged at step 0); else nothing."""
        if self.cfg.trainer.val_at_start and self.step == 0:
            self._validated = True  # log() writes a validation step whatever the interval
            return self.validate()
        return {}

    def train_step(self) -> dict[str, float]:
        """The next global batch (:class:`~nemo_rlhf.data.sampler.ResumableSampler`), one
        optimizer step on it."""
        with self.timers("train_step"):
            idx = self.sampler.next_global_batch(self.cfg.trainer.global_batch_size)
            samples = [self.train_ds[i] for i in idx]
            return self.train_batch(samples, dp_shard(samples, self.dims.dp_rank, self.dims.dp))

    def check_health(self) -> None:
        """Nothing: a non-finite update is skipped and reported by :meth:`optimizer_step`."""

    def validate_now(self, last: bool) -> bool:
        """Every ``trainer.val_check_interval`` steps and at the end."""
        n = self.cfg.trainer.val_check_interval
        self._validated = last or bool(n and self.step % n == 0)
        return self._validated

    def validate(self) -> dict[str, float]:
        with self.timers("validation"):
            return self.validation_metrics()

    def final_metrics(self) -> dict[str, float]:
        return {**self.on_fit_end(), "timing/fit_s": time.perf_counter() - self._fit_start}

    def log(self, metrics: dict) -> None:
        """Every ``trainer.log_every_n_steps`` steps, at validations and at the end; the
        step's metrics are kept (:attr:`history`, :attr:`last_metrics`) either way."""
        if not metrics:
            return
        t = self.cfg.trainer
        metrics.update(self.timers.pop())
        if (self.step % max(t.log_every_n_steps, 1) == 0 or self.step == t.max_steps
                or self._validated):
            self.logger.log_metrics(metrics, self.step)
        self.last_metrics = metrics
        self.history.append({"step": self.step, **metrics})

    def stop_reason(self, metrics: dict) -> Optional[str]:
        return None

    def save(self) -> Optional[Path]:
        """Checkpoint the model, optimizer and :meth:`trainer_state` (all ranks); prune to
        ``exp_manager.keep_last`` (0: keep all)."""
        if not self.cfg.exp_manager.checkpoints:
            return None
        path = save_checkpoint(self.checkpoint_dir, self.step, self.model, self.optimizer,
                               self.trainer_state(), self.run_config, self.dims, self.fingerprint(),
                               verify=self.cfg.exp_manager.verify_after_save,
                               lora_base=self.lora_base())
        if self.cfg.exp_manager.keep_last and self.dims.rank == 0:
            prune(self.checkpoint_dir, self.cfg.exp_manager.keep_last)
        self.print(f"saved {path}")
        return path

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()

    def optimizer_step(self) -> dict[str, float]:
        """Finalize grads (DP all-reduce), clip and step; ``{"lr", "grad_norm"}``."""
        finalize_grads(self.model)
        lr = self.optimizer.lr
        stepped, norm = self.optimizer.step()
        if not stepped:
            self.print(f"step {self.step + 1}: non-finite grad norm {norm}; update skipped")
        return {"lr": lr, "grad_norm": norm}


__all__ = ["SupervisedExpManagerConfig", "SupervisedTrainer", "SupervisedTrainerConfig"]
