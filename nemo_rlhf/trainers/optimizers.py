"""The optimizer a run gets (:func:`build_optimizer`), and megatron-core's
``DistributedOptimizer`` (ZeRO-1) behind the trainers' optimizer interface.

``optim.use_distributed_optimizer=true`` (CUDA only) replaces
:class:`~nemo_rlhf.trainers.mixed_precision.MixedPrecisionOptimizer` by
:class:`MegatronDistributedOptimizer`: the model is wrapped in megatron DDP with
``use_distributed_optimizer=True`` (gradients reduce-scattered into per-rank shards of
the grad buffer, parameters all-gathered after the step), and megatron's optimizer keeps
the fp32 main params and Adam moments of this rank's 1/DP shard only. The interface the
trainers, checkpoints and tools use is the same: ``zero_grad()``, ``step(only=...) ->
(stepped, grad_norm)``, ``lr``, ``scheduler``, ``params``, ``names``, ``model``.

What stays this project's: the LR schedule (:func:`~nemo_rlhf.trainers.mixed_precision.lr_lambda`,
written into the param groups before every step), the skip on a non-finite gradient norm
(the norm is computed before the step, as the AdamW path does; megatron's own ``step()``
would step a bf16 model on a NaN norm), and ``only=`` for the critic warm-up.

Checkpoints: megatron's ``sharded_state_dict(model_sd, metadata={
"distrib_optim_sharding_type": "fully_sharded_model_space"})``, which dist_checkpointing
reshards to another TP/PP/DP layout; the metadata records ``optimizer_format`` so that a
resume with the other optimizer fails naming ``optim.use_distributed_optimizer``.

Simplified: the critic warm-up (``step(only=...)``) zeroes the rejected parameters'
gradients and sets weight decay to 0 for that step, so they do not move (their Adam
moments stay zero, no decay), but Adam's step counter, which megatron keeps per param
group, still advances for them. fp16 uses megatron's own dynamic grad scaler (saved with
the optimizer state). Not run on a GPU yet: ``make gpu-check`` runs it
(``ppo_tiny_distopt``: save, resume, finite metrics).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from nemo_rlhf.models.engine import unwrap
from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig, lr_lambda

CHECKPOINT_FORMAT = "megatron_distributed"
SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_sharded_model_space"}


class StepSchedule:
    """Optimizer steps taken and the LR multiplier they give (``lr_lambda``), with the
    ``state_dict`` of a ``LambdaLR`` (``last_epoch``) so checkpoints store it alike."""

    def __init__(self, cfg: OptimizerConfig):
        self.fn = lr_lambda(cfg)
        self.last_epoch = 0

    def multiplier(self) -> float:
        return self.fn(self.last_epoch)

    def step(self) -> None:
        self.last_epoch += 1

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, sd: dict) -> None:
        self.last_epoch = int(sd["last_epoch"])


def megatron_optimizer_config(cfg: OptimizerConfig, precision: str):
    """megatron's ``OptimizerConfig`` for ``cfg`` (Adam, decoupled weight decay).

    Clipping is left to :meth:`MegatronDistributedOptimizer.step` (``clip_grad=0`` here),
    which checks the norm for NaN/Inf before stepping.
    """
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    return MegatronOptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
        clip_grad=0.0, bf16=precision == "bf16-mixed", fp16=precision == "fp16-mixed",
        params_dtype={"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(
            precision, torch.float32),
        initial_loss_scale=cfg.initial_loss_scale, min_loss_scale=cfg.min_loss_scale,
        loss_scale_window=cfg.loss_scale_window, hysteresis=1,
        use_distributed_optimizer=True,
    )


class MegatronDistributedOptimizer:
    """megatron's ZeRO-1 ``DistributedOptimizer`` with the trainers' optimizer interface.

    Args:
        model: the stage wrapped by :func:`~nemo_rlhf.models.engine.wrap_ddp` with
            ``use_distributed_optimizer=True``.
        cfg: :class:`~nemo_rlhf.trainers.mixed_precision.OptimizerConfig`.
        precision: ``trainer.precision`` (``32``, ``bf16-mixed``, ``fp16-mixed``).
        megatron_optimizer: an already built megatron optimizer (tests pass a stand-in);
            None builds one with ``get_megatron_optimizer``.

    Raises:
        ValueError: without CUDA (megatron's optimizer asserts CUDA tensors).
    """

    checkpoint_format = CHECKPOINT_FORMAT

    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig, precision: str = "32",
                 megatron_optimizer=None):
        self.model = model
        self.cfg = cfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        if megatron_optimizer is None:
            if not torch.cuda.is_available():
                raise ValueError(
                    "optim.use_distributed_optimizer=true needs CUDA GPUs (megatron's "
                    "DistributedOptimizer asserts CUDA tensors, gloo has no reduce-scatter); "
                    "this run has none: set optim.use_distributed_optimizer=false")
            from megatron.core.optimizer import get_megatron_optimizer

            megatron_optimizer = get_megatron_optimizer(
                megatron_optimizer_config(cfg, precision), [model])
        self.optimizer = megatron_optimizer
        self.scheduler = StepSchedule(cfg)
        self.scaler = None
        """fp16's loss scale lives in megatron's optimizer (and its checkpoint state)."""
        if precision == "fp16-mixed":
            model_cfg = getattr(unwrap(model), "config", None)
            if model_cfg is not None:
                model_cfg.grad_scale_func = self.optimizer.scale_loss
        self._apply_lr()

    @property
    def lr(self) -> float:
        """Learning rate of the next step."""
        return self.cfg.lr * self.scheduler.multiplier()

    def _apply_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def zero_grad(self) -> None:
        """Zero megatron's grad buffers and the main params' grads."""
        if hasattr(self.model, "zero_grad_buffer"):
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self, only: Optional[Callable[[str], bool]] = None) -> tuple[bool, float]:
        """Copy the reduced grads to the main params, norm, clip, step, all-gather params.

        Args:
            only: ``name -> bool`` over parameter names; the rejected parameters' gradients
                are zeroed and weight decay is off for this step, so they do not move (see
                the module docstring for what differs from the AdamW path).

        Returns:
            ``(stepped, grad_norm)``; ``stepped`` is False (no weight changed) when fp16
            found an overflow or the norm is not finite.
        """
        decays = None
        if only is not None:
            for name, p in zip(self.names, self.params):
                grad = getattr(p, "main_grad", None)
                if grad is not None and not only(name):
                    grad.zero_()
            decays = [g.get("weight_decay", 0.0) for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["weight_decay"] = 0.0
        try:
            if self.optimizer.prepare_grads():  # fp16 overflow (the scaler was updated)
                self.zero_grad()
                return False, float("inf")
            norm = float(self.optimizer.clip_grad_norm(self.cfg.clip_grad) if self.cfg.clip_grad > 0
                         else self.optimizer.get_grad_norm())
            if not math.isfinite(norm):
                self.zero_grad()
                return False, norm
            self.optimizer.step_with_ready_grads()
        finally:
            if decays is not None:
                for g, wd in zip(self.optimizer.param_groups, decays):
                    g["weight_decay"] = wd
        self.scheduler.step()
        self._apply_lr()
        return True, norm

    # --- checkpoints (nemo_rlhf.checkpoint.io) ------------------------------------------
    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """megatron's reshardable optimizer state for dist_checkpointing."""
        return self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                                 metadata=dict(SHARDING_METADATA))

    def load_sharded(self, loaded: dict) -> None:
        """Restore from what dist_checkpointing loaded for :meth:`sharded_state_dict`."""
        self.optimizer.load_state_dict(loaded)
        self._apply_lr()


def validate_optimizer(cfg: OptimizerConfig, dims) -> None:
    """Rules of ``optim`` that need the device, checked before the model is built.

    Raises:
        ValueError: ``optim.use_distributed_optimizer=true`` on a run without CUDA, or with
            expert parallelism (megatron's optimizer would shard the experts over the
            expert-data-parallel group; not wired nor tested here).
    """
    if cfg.use_distributed_optimizer and getattr(dims, "ep", 1) > 1:
        raise ValueError(
            f"optim.use_distributed_optimizer=true with parallel.expert_model_parallel_size={dims.ep}: "
            f"megatron's DistributedOptimizer under expert parallelism is not wired here; set "
            f"optim.use_distributed_optimizer=false or parallel.expert_model_parallel_size=1")
    if cfg.use_distributed_optimizer and dims.device.type != "cuda":
        raise ValueError(
            f"optim.use_distributed_optimizer=true needs CUDA GPUs (megatron's "
            f"DistributedOptimizer asserts CUDA tensors, gloo has no reduce-scatter); this run "
            f"is on {dims.device.type}: set optim.use_distributed_optimizer=false")


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, dims, precision: str):
    """The optimizer of a DDP-wrapped stage: :class:`~nemo_rlhf.trainers.mixed_precision.MixedPrecisionOptimizer`, or with
    ``optim.use_distributed_optimizer`` megatron's ZeRO-1 optimizer
    (:class:`MegatronDistributedOptimizer`; the stage
    must be wrapped with ``wrap_ddp(..., use_distributed_optimizer=True)``).

    Raises:
        ValueError: see :func:`validate_optimizer`.
    """
    validate_optimizer(cfg, dims)
    if cfg.use_distributed_optimizer:
        return MegatronDistributedOptimizer(model, cfg, precision)
    return MixedPrecisionOptimizer(model, cfg, mp_group=dims.mp_group,
                                   fp16=precision == "fp16-mixed",
                                   expert_mp_group=dims.expert_mp_group if getattr(dims, "ep", 1) > 1 else None)


__all__ = ["CHECKPOINT_FORMAT", "MegatronDistributedOptimizer", "StepSchedule", "build_optimizer",
           "megatron_optimizer_config", "validate_optimizer"]
