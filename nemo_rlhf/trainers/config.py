"""The ``trainer`` and ``exp_manager`` vocabulary every training job shares (PPO, SFT, RM).

:class:`TrainerConfig` and :class:`ExpManagerConfig` hold the keys all three jobs have,
with the same names, meanings and defaults; each job's subclass adds its own keys
(:class:`~nemo_rlhf.trainers.ppo.config.PPOTrainerConfig`,
:class:`~nemo_rlhf.trainers.common.SupervisedTrainerConfig`, ...). Keys that moved are
listed in :data:`nemo_rlhf.config.RENAMED_KEYS`.

Names are PPO's where the jobs differed (users' PPO command lines and Slurm scripts use
them). A shared default is the value that assumes nothing about a job: save at the end
only, delete no checkpoint, resume automatically; a job config that wants more says so
(``conf/ppo.yaml``: ``exp_manager.save_interval=25``, ``keep_last=2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from nemo_rlhf.checkpoint.policy import RESUME_CHOICES
from nemo_rlhf.config import check_choice
from nemo_rlhf.models.config import PRECISIONS


@dataclass
class TrainerConfig:
    """Loop control shared by every training job (config section ``trainer``)."""

    precision: str = "32"
    """``32``, ``bf16-mixed``, ``fp16-mixed`` or ``auto`` (resolved once at start-up)."""
    max_steps: int = 100
    """Steps to run (PPO: a rollout + ``ppo.ppo_epochs`` of updates; SFT/RM: an optimizer step)."""
    seed: int = 1234
    """Base seed (weight init, data order, sampling, every generator)."""
    val_check_interval: int = 0
    """Validate every N steps and at the end; 0: PPO never does, SFT/RM at the end only."""
    max_time_per_run: Optional[float] = None
    """Seconds; save and exit with the requeue code once a step ends past this wall time
    (None: off), as after SIGTERM / SIGUSR1."""

    def __post_init__(self) -> None:
        self.precision = str(self.precision)
        check_choice("trainer.precision", self.precision, PRECISIONS)
        for key in ("max_steps", "val_check_interval"):
            if getattr(self, key) < 0:
                raise ValueError(f"trainer.{key}={getattr(self, key)}: must be >= 0")


@dataclass
class ExpManagerConfig:
    """Experiment folder, checkpoints and resume, shared by every training job (config
    section ``exp_manager``)."""

    exp_dir: str = MISSING
    """Everything of the run goes here (``checkpoints/``, TensorBoard, metrics, config)."""
    save_interval: int = 0
    """Save every N steps (and at the end); 0: only at the end."""
    keep_last: int = 0
    """Newest complete checkpoints kept (older ones deleted after a save); 0: all, else >= 2."""
    resume: str = "auto"
    """``auto`` (the newest intact checkpoint in ``<exp_dir>/checkpoints``: checksums verified,
    a corrupt one skipped for its predecessor), ``none``, or a checkpoint path
    (:mod:`nemo_rlhf.checkpoint.policy`, the same for every job)."""
    ignore_fingerprint: bool = False
    """Resume even if the checkpoint's model/tokenizer/data fingerprint differs from the run's."""
    verify_after_save: bool = True
    """Read every saved tensor shard back and compare it with the sha256 taken from memory
    before the checkpoint is published (a mismatch stops the job, naming the tensor; the
    previous checkpoint stays the newest). false: the digests are still written, for
    ``nemo-rlhf-ckpt validate --deep``. Cost: :mod:`nemo_rlhf.checkpoint.digests`."""

    def __post_init__(self) -> None:
        for key in ("save_interval", "keep_last"):
            if getattr(self, key) < 0:
                raise ValueError(f"exp_manager.{key}={getattr(self, key)}: must be >= 0")
        if self.keep_last == 1:
            raise ValueError("exp_manager.keep_last=1: must be 0 (keep all) or >= 2 (a complete "
                             "predecessor to fall back on if the newest is corrupt)")
        if isinstance(self.resume, bool) or str(self.resume).lower() in ("true", "false", ""):
            raise ValueError(
                f"exp_manager.resume={self.resume!r}: valid choices are {list(RESUME_CHOICES)} or a "
                f"checkpoint path (a former true is 'auto', false is 'none')")
