"""Plumbing shared by the SFT, RM and PPO trainers.

* :class:`SupervisedTrainerConfig` / :class:`SupervisedExpManagerConfig`: the SFT/RM
  ``trainer`` and ``exp_manager`` sections, the shared vocabulary of
  :mod:`nemo_rlhf.trainers.config` plus their own keys;
* :func:`setup_run`: distributed init + seeds + the model config's vocabulary from the
  tokenizer, in one call at the start of a run;
* :class:`Experiment`: the experiment directory ``exp_manager.exp_dir`` with
  ``checkpoints/``, ``tensorboard/``, ``metrics.jsonl`` and ``config.yaml``; scalars go to
  TensorBoard and ``metrics.jsonl``, and a console line is printed, on global rank 0 only;
* batching: :func:`step_indices` (the global batch of a step: a seeded permutation per
  epoch, a pure function of the step, so a resumed run sees the same data),
  :func:`dp_shard` (this DP rank's contiguous slice), :func:`chunks`;
* :func:`reduce_from_last_stage`: sums metrics computed on the last pipeline stage over DP
  and hands the result to every rank (global rank 0, which logs, is a first stage).

Simplified: the last incomplete global batch of an epoch is dropped; no data loader
workers (datasets are small, tokenized up front).
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from nemo_rlhf.checkpoint import (
    load_checkpoint,
    save_checkpoint,
)
from nemo_rlhf.checkpoint.policy import prune, resume_run
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed import initialize_distributed
from nemo_rlhf.models.actor_critic import build_model
from nemo_rlhf.models.config import agree_on_precision
from nemo_rlhf.models.engine import finalize_grads, wrap_ddp
from nemo_rlhf.trainers.config import ExpManagerConfig, TrainerConfig
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


def to_plain(cfg) -> dict:
    """A dataclass config (or DictConfig) as a plain dict (for ``config.yaml``)."""
    if is_dataclass(cfg):
        return asdict(cfg)
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def setup_run(parallel, model_cfg, tokenizer, seed: int):
    """Initialise distributed state for a run; return ``(dims, model_cfg)``.

    ``model_cfg.vocab_size`` 0 is filled in from the tokenizer; a set value must agree.

    Raises:
        ValueError: ``model.vocab_size`` disagrees with the tokenizer, or a bad layout.
    """
    if model_cfg.vocab_size == 0:
        model_cfg = replace(model_cfg, vocab_size=tokenizer.vocab_size)
    elif model_cfg.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={model_cfg.vocab_size} but the tokenizer "
                         f"{tokenizer.path} has {tokenizer.vocab_size} tokens; set 0 to take it "
                         f"from the tokenizer")
    dims = initialize_distributed(parallel, seed=seed, num_layers=model_cfg.num_layers,
                                  num_attention_heads=model_cfg.num_attention_heads,
                                  num_query_groups=model_cfg.num_query_groups)
    return dims, model_cfg


# --------------------------------------------------------------------------- batching
def steps_per_epoch(n: int, global_batch_size: int) -> int:
    """Full global batches in an epoch of ``n`` examples (the remainder is dropped)."""
    return n // global_batch_size


def step_indices(n: int, global_batch_size: int, step: int, seed: int) -> list[int]:
    """Dataset indices of the global batch of ``step`` (0-based).

    A seeded permutation per epoch, so the result depends on ``(n, gbs, step, seed)``
    only: a resumed run continues the same sequence.

    Raises:
        ValueError: fewer examples than one global batch.
    """
    per_epoch = steps_per_epoch(n, global_batch_size)
    if per_epoch < 1:
        raise ValueError(f"dataset of {n} examples is smaller than trainer.global_batch_size="
                         f"{global_batch_size}")
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator(device="cpu").manual_seed(seed * 100_003 + epoch)  # host: data order
    perm = torch.randperm(n, generator=g, device="cpu")
    return perm[k * global_batch_size:(k + 1) * global_batch_size].tolist()


def dp_shard(items: Sequence, dp_rank: int, dp_size: int) -> list:
    """This DP rank's contiguous slice (sizes differ by at most one)."""
    n = len(items)
    lo, hi = n * dp_rank // dp_size, n * (dp_rank + 1) // dp_size
    return list(items[lo:hi])


def chunks(items: Sequence, size: int) -> list[list]:
    """Consecutive slices of ``size`` (the last may be shorter)."""
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def reduce_from_last_stage(values: dict[str, float], dims, keys: Sequence[str]) -> dict[str, float]:
    """Sum ``values`` over the DP ranks' last pipeline stages; return them on every rank.

    Args:
        values: this rank's partial sums (read on the last stage only; ignored elsewhere).
        keys: the metric names, the same list on every rank.

    Returns:
        ``{key: global sum}`` on every rank.
    """
    # host metadata: reduced by the gloo part of the backend map
    t = torch.tensor([float(values.get(k, 0.0)) if dims.is_last_stage else 0.0 for k in keys],
                     dtype=torch.float64, device="cpu")
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dims.dp > 1:
            dist.all_reduce(t, group=dims.dp_group)
        if dims.pp > 1:
            dist.all_reduce(t, group=dims.pp_group)
    return dict(zip(keys, t.tolist()))


# --------------------------------------------------------------------------- experiment
class Experiment:
    """The experiment directory and the run's metric sinks (writes on global rank 0).

    Args:
        cfg: :class:`SupervisedExpManagerConfig`.
        dims: :class:`ParallelDims`.
        run_config: the whole resolved config, written to ``config.yaml``.
    """

    def __init__(self, cfg: SupervisedExpManagerConfig, dims, run_config=None):
        self.cfg = cfg
        self.dir = Path(cfg.exp_dir)
        self.checkpoint_dir = self.dir / "checkpoints"
        self.is_writer = dims.rank == 0
        self.writer = None
        self._metrics_file = None
        self._timers: dict[str, float] = {}
        if self.is_writer:
            self.dir.mkdir(parents=True, exist_ok=True)
            if run_config is not None:
                from omegaconf import OmegaConf

                (self.dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(to_plain(run_config))))
            if cfg.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.dir / "tensorboard"))
            self._metrics_file = open(self.dir / "metrics.jsonl", "a")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """TensorBoard scalars and one ``metrics.jsonl`` line (rank 0)."""
        if not self.is_writer:
            return
        for k, v in scalars.items():
            if self.writer is not None and v is not None and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self._metrics_file.write(json.dumps({"step": step, **scalars}) + "\n")
        self._metrics_file.flush()

    def log_text(self, step: int, tag: str, text: str) -> None:
        """TensorBoard text and a console print (rank 0)."""
        if not self.is_writer:
            return
        if self.writer is not None:
            self.writer.add_text(tag, text.replace("\n", "  \n"), step)
        self.print(text)

    def console(self, step: int, max_steps: int, scalars: dict[str, float]) -> None:
        """One console line: ``step 10/100 | train/loss 1.2345 | lr 1.00e-03 ...`` (rank 0)."""
        parts = [f"step {step}/{max_steps}"]
        for k, v in scalars.items():
            parts.append(f"{k} {v:.3e}" if k == "lr" or (v and abs(v) < 1e-3) else f"{k} {v:.4f}")
        self.print(" | ".join(parts))

    def print(self, text: str) -> None:
        """Print on global rank 0, flushed."""
        if self.is_writer:
            print(text, flush=True)
            sys.stdout.flush()

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Accumulate wall time of a named phase (read with :meth:`pop_times`)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._timers[name] = self._timers.get(name, 0.0) + time.perf_counter() - start

    def pop_times(self) -> dict[str, float]:
        """``{"time/<phase>": seconds}`` accumulated since the last call."""
        out = {f"time/{k}": v for k, v in self._timers.items()}
        self._timers.clear()
        return out

    def close(self) -> None:
        """Flush and close the sinks."""
        if self.writer is not None:
            self.writer.close()
        if self._metrics_file is not None:
            self._metrics_file.close()


class SupervisedTrainer:
    """The SFT / RM loop: build, resume, ``fit()`` (train, log, validate, save).

    Subclasses set ``model_kind`` and implement :meth:`load_datasets`,
    :meth:`train_step` (one optimizer step; returns global metrics) and :meth:`validate`
    (returns global metrics); :meth:`on_fit_end` and :meth:`trainer_state` are optional.

    Args:
        cfg: the run config (a dataclass with ``model``, ``parallel``, ``optim``, ``data``,
            ``trainer`` and ``exp_manager``).
    """

    model_kind = "actor_critic"

    def __init__(self, cfg):
        self.cfg = cfg
        self.tokenizer = Tokenizer(cfg.data.tokenizer_dir)
        self.dims, self.model_cfg = setup_run(cfg.parallel, cfg.model, self.tokenizer, cfg.trainer.seed)
        cfg.trainer.validate(self.dims.dp)
        cfg.trainer.precision = agree_on_precision(cfg.trainer.precision, self.dims)
        validate_optimizer(cfg.optim, self.dims)
        if cfg.data.max_seq_length > self.model_cfg.max_position_embeddings:
            raise ValueError(f"data.max_seq_length={cfg.data.max_seq_length} exceeds "
                             f"model.max_position_embeddings={self.model_cfg.max_position_embeddings}")
        self.exp = Experiment(cfg.exp_manager, self.dims, replace(cfg, model=self.model_cfg))
        self.train_ds, self.val_ds = self.load_datasets()
        for ds in (self.train_ds, self.val_ds):
            if ds is not None and self.dims.rank == 0:
                ds.report.log()
        model = build_model(self.model_cfg, self.dims, cfg.trainer.precision, kind=self.model_kind,
                            seed=cfg.trainer.seed)
        self.init_weights(model)
        self.model = wrap_ddp(model, use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.dims, cfg.trainer.precision)
        self.step = 0
        self.last_metrics: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        """Metrics of every step run by :meth:`fit` (global values, on every rank)."""
        self.maybe_resume()

    # -- hooks ---------------------------------------------------------------------------
    def load_datasets(self):
        """``(train, val or None)`` tokenized datasets."""
        raise NotImplementedError

    def init_weights(self, model) -> None:
        """Change the freshly built weights before training (e.g. load a backbone)."""

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step on the global batch of ``step``; global metrics."""
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        """Validation metrics (global; empty without a validation set)."""
        return {}

    def on_fit_end(self) -> dict[str, float]:
        """Work after the last step (metrics to log); runs before the final save."""
        return {}

    def trainer_state(self) -> dict:
        """JSON-able state stored with each checkpoint."""
        return {"step": self.step, "consumed_samples": self.step * self.cfg.trainer.global_batch_size,
                "metrics": self.last_metrics}

    # -- plumbing ------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        """``<exp_dir>/checkpoints``."""
        return self.exp.checkpoint_dir

    def fingerprint(self) -> dict:
        """What a resume must match (:func:`nemo_rlhf.checkpoint.policy.check_fingerprint`)."""
        return {"model": self.model_cfg.fingerprint(), "tokenizer": self.tokenizer.describe()}

    def maybe_resume(self) -> None:
        """Load the checkpoint ``exp_manager.resume`` selects, by the policy every job uses
        (:func:`nemo_rlhf.checkpoint.policy.resume_run`: ``auto`` the newest intact one of
        this experiment, none without ``exp_manager.checkpoints``; ``none``; or a path)."""
        em = self.cfg.exp_manager
        if em.resume == "auto" and not em.checkpoints:
            return
        path, why, state = resume_run(
            em.resume, self.checkpoint_dir, self.fingerprint(),
            lambda p: load_checkpoint(p, self.model, self.optimizer), em.ignore_fingerprint)
        if path is None:
            return
        self.step = int(state["step"])
        self.exp.print(f"resumed from {path} at step {self.step} ({why})")

    def save(self) -> Optional[Path]:
        """Checkpoint the model, optimizer and :meth:`trainer_state` (all ranks)."""
        if not self.cfg.exp_manager.checkpoints:
            return None
        config = to_plain(replace(self.cfg, model=self.model_cfg))  # vocab_size resolved
        path = save_checkpoint(self.checkpoint_dir, self.step, self.model, self.optimizer,
                               self.trainer_state(), config, self.dims, self.fingerprint())
        if self.cfg.exp_manager.keep_last and self.dims.rank == 0:
            prune(self.checkpoint_dir, self.cfg.exp_manager.keep_last)
        self.exp.print(f"saved {path}")
        return path

    def batch_for_step(self, step: int) -> tuple[list, list]:
        """``(global batch samples, this DP rank's samples)`` of ``step``."""
        t = self.cfg.trainer
        idx = step_indices(len(self.train_ds), t.global_batch_size, step, t.seed)
        samples = [self.train_ds[i] for i in idx]
        return samples, dp_shard(samples, self.dims.dp_rank, self.dims.dp)

    def optimizer_step(self) -> dict[str, float]:
        """Finalize grads (DP all-reduce), clip and step; ``{"lr", "grad_norm"}``."""
        finalize_grads(self.model)
        lr = self.optimizer.lr
        stepped, norm = self.optimizer.step()
        if not stepped:
            self.exp.print(f"step {self.step + 1}: non-finite grad norm {norm}; update skipped")
        return {"lr": lr, "grad_norm": norm}

    def fit(self) -> dict[str, float]:
        """Train to ``trainer.max_steps``; return the last metrics (train, val, final)."""
        t, save_interval = self.cfg.trainer, self.cfg.exp_manager.save_interval
        if self.step >= t.max_steps:
            self.exp.print(f"already at step {self.step} >= trainer.max_steps={t.max_steps}")
        start = time.perf_counter()
        while self.step < t.max_steps:
            with self.exp.timed("train_step"):
                metrics = self.train_step(self.step)
            self.step += 1
            last = self.step == t.max_steps
            validated = bool(t.val_check_interval and self.step % t.val_check_interval == 0 and not last)
            if validated:
                with self.exp.timed("validation"):
                    metrics.update(self.validate())
            # a validation step is always logged, whatever log_every_n_steps says
            if self.step % max(t.log_every_n_steps, 1) == 0 or last or validated:
                metrics.update(self.exp.pop_times())
                self.exp.log_scalars(self.step, metrics)
                self.exp.console(self.step, t.max_steps,
                                 {k: v for k, v in metrics.items() if not k.startswith("time/")})
            self.last_metrics = metrics
            self.history.append({"step": self.step, **metrics})
            if save_interval and self.step % save_interval == 0 and not last:
                self.save()
        final = self.validate()
        final.update(self.on_fit_end())
        final["time/fit_s"] = time.perf_counter() - start
        self.exp.log_scalars(self.step, final)
        self.exp.console(self.step, t.max_steps, final)
        self.last_metrics = {**self.last_metrics, **final}
        self.save()
        self.exp.close()
        return self.last_metrics
