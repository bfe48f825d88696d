"""Supervised fine-tuning: next-token cross-entropy on response tokens only.

The loss of a step is ``-sum(log p(response token)) / N`` where ``N`` is the number of
response tokens (EOS included) in the whole global batch, across micro-batches and DP
ranks, so splitting the batch differently leaves the loss and the gradient unchanged.
BOS, prompt and padding positions never enter the loss (``loss_mask`` from lengths). A
multi-turn demonstration (an SFT row with ``segments``, :mod:`nemo_rlhf.data.datasets`)
trains on its policy tokens only: the environment's tokens (a tool's output) are in the
input but masked out of the loss and of ``N`` (``N`` counts policy tokens), as PPO's
``response_mask`` masks them (docs/multi-turn.md).
Log-probs come from the vocab-parallel logits (:func:`vocab_parallel_logprobs`) in fp32.

Validation: the same token-weighted loss over the whole validation file, and greedy
sample generations on its first ``sft.num_sample_prompts`` prompts (console and
TensorBoard text). Simplified: no sequence packing; the value head exists in the model
(the checkpoint serves PPO's actor-critic) but is not computed or trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from nemo_rlhf.checkpoint import load_model_weights, refuse_adapter_checkpoint_as_lora_base, resolve_checkpoint
from nemo_rlhf.data.datasets import (
    DataConfig,
    collate_sft,
    load_sft_dataset,
    sft_length,
    sft_loss_tokens,
)
from nemo_rlhf.distributed.parallel import ParallelConfig
from nemo_rlhf.distributed.split import dp_shard
from nemo_rlhf.metrics.trackers import LoggerConfig
from nemo_rlhf.models.config import ModelConfig
from nemo_rlhf.models.engine import forward_backward
from nemo_rlhf.models.vocab_parallel import vocab_parallel_logprobs
from nemo_rlhf.rollout import RolloutConfig, generate
from nemo_rlhf.trainers.mixed_precision import OptimizerConfig
from nemo_rlhf.trainers.collectives import reduce_from_last_stage
from nemo_rlhf.trainers.common import forward_calls
from nemo_rlhf.trainers.supervised import (
    SupervisedExpManagerConfig,
    SupervisedTrainer,
    SupervisedTrainerConfig,
)


@dataclass
class SFTConfig:
    """SFT-specific settings (config section ``sft``)."""

    num_sample_prompts: int = 4
    """Validation prompts decoded greedily and printed at each validation (0: none)."""
    sample_max_new_tokens: int = 8
    """Longest sample generation in tokens."""
    init_from: Optional[str] = None
    """Checkpoint (folder, or a ``checkpoints`` root: its newest) whose weights start the
    run; its value/reward head is not loaded."""

    def __post_init__(self) -> None:
        for key in ("num_sample_prompts", "sample_max_new_tokens"):
            if getattr(self, key) < 0:
                raise ValueError(f"sft.{key}={getattr(self, key)}: must be >= 0")


@dataclass
class SFTRunConfig:
    """The whole SFT job (``conf/sft.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: SupervisedTrainerConfig = field(default_factory=SupervisedTrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    exp_manager: SupervisedExpManagerConfig = field(default_factory=SupervisedExpManagerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """W&B / MLflow beside TensorBoard (:mod:`nemo_rlhf.metrics.trackers`)."""


def register_configs() -> None:
    """Store :class:`SFTRunConfig` in Hydra's ConfigStore as ``sft_schema``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="sft_schema", node=SFTRunConfig)


# --------------------------------------------------------------------------- the loss
def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """Masked negative log-likelihood divided by a global token count.

    Args:
        logprobs: ``[batch, seq-1]`` float32, log p(token t+1 | tokens <= t).
        loss_mask: ``[batch, seq-1]`` float, 1.0 where token t+1 is a response token the
            loss trains on (a policy token; 0.0 on environment tokens).
        num_tokens: such tokens in the whole global batch (all micro-batches, all DP
            ranks): :func:`~nemo_rlhf.data.datasets.sft_loss_tokens` summed.

    Returns:
        Scalar: this micro-batch's share of the global mean NLL.
    """
    return -(logprobs * loss_mask).sum() / num_tokens


def make_sft_loss_fn(dims, vocab_size: int, num_tokens: float):
    """``(output, micro_batch) -> (loss, stats)`` for :func:`engine.forward_backward`.

    ``stats``: ``loss`` (this micro-batch's share) and ``tokens`` (its response tokens).
    """
    def loss_fn(output, mb):
        logits_BSV = output[0] if isinstance(output, tuple) else output
        lp, _ = vocab_parallel_logprobs(logits_BSV[:, :-1], mb["input_ids"][:, 1:], dims.tp_group,
                                        dims.tp_rank, vocab_size=vocab_size, compute_entropy=False)
        mask = mb["loss_mask"][:, 1:]
        loss = sft_loss(lp, mask, num_tokens)
        return loss, {"loss": loss.detach(), "tokens": mask.sum().detach()}

    return loss_fn


# --------------------------------------------------------------------------- trainer
class SFTTrainer(SupervisedTrainer):
    """SFT on an actor-critic model (the checkpoint is what RM and PPO start from)."""

    model_kind = "actor_critic"
    job = "sft"

    def load_datasets(self):
        d = self.cfg.data
        train = load_sft_dataset(d.train_file, self.tokenizer, d)
        val = load_sft_dataset(d.val_file, self.tokenizer, d) if d.val_file else None
        return train, val

    def base_checkpoint(self):
        return self.cfg.sft.init_from

    def init_weights(self, model) -> None:
        if self.cfg.sft.init_from:
            path = resolve_checkpoint(self.cfg.sft.init_from)
            if self.model_cfg.lora.enabled:
                refuse_adapter_checkpoint_as_lora_base(path, "sft.init_from")
            skipped = load_model_weights(path, model, skip_heads=True)
            self.print(f"initialised from {path} (heads not loaded: {skipped or 'none'})")

    def _forward(self, samples, num_tokens: float, forward_only: bool,
                 routed_tokens: Optional[float] = None) -> float:
        """Run ``samples`` (this rank's) in micro-batches; return the summed loss share.
        ``routed_tokens``: the global batch's tokens, the MoE router losses' denominator."""
        mbs, pad = self.cfg.trainer.micro_batch_size, self.tokenizer.pad_id
        length = max((sft_length(s) for s in samples), default=0)
        loss_fn = make_sft_loss_fn(self.dims, self.tokenizer.vocab_size, num_tokens)
        total = 0.0
        for call, variable_shapes in forward_calls(samples, mbs, self.dims.ep > 1):
            stats = forward_backward(self.model, [collate_sft(g, pad, length) for g in call],
                                     loss_fn, forward_only=forward_only,
                                     device=self.dims.device, routed_tokens=routed_tokens,
                                     variable_shapes=variable_shapes,
                                     with_values=False)  # SFT trains the LM only
            total += sum(float(s["loss"]) for s in stats)
        return total

    def train_batch(self, global_batch: list, local: list) -> dict[str, float]:
        num_tokens = sum(sft_loss_tokens(s) for s in global_batch)
        self.optimizer.zero_grad()
        loss = self._forward(local, num_tokens, forward_only=False,
                             routed_tokens=sum(sft_length(s) for s in global_batch))
        opt = self.optimizer_step()
        sums = reduce_from_last_stage({"loss": loss}, self.dims, ["loss"])
        return {"train/loss": sums["loss"], "lr": opt["lr"], "grad_norm": opt["grad_norm"]}

    def validation_metrics(self) -> dict[str, float]:
        if self.val_ds is None or len(self.val_ds) == 0:
            return {}
        self.model.eval()
        try:
            num_tokens = sum(sft_loss_tokens(s) for s in self.val_ds.samples)
            local = dp_shard(self.val_ds.samples, self.dims.dp_rank, self.dims.dp)
            with torch.no_grad():
                # (under expert parallelism a rank without rows still joins the MoE layers' calls)
                loss = self._forward(local, num_tokens, forward_only=True) if local or self.dims.ep > 1 else 0.0
            out = {"val/loss": reduce_from_last_stage({"loss": loss}, self.dims, ["loss"])["loss"]}
            self.log_samples()
        finally:
            self.model.train()
        return out

    def log_samples(self) -> None:
        """Greedy generations on the first validation prompts (console + TensorBoard)."""
        n, new = self.cfg.sft.num_sample_prompts, self.cfg.sft.sample_max_new_tokens
        limit = self.model_cfg.max_position_embeddings
        samples = [s for s in self.val_ds.samples[:n] if len(s.prompt_ids) + new <= limit]
        if not samples or new == 0:
            return
        batch = generate(self.model, self.dims, [s.prompt_ids for s in samples],
                         RolloutConfig(max_new_tokens=new, greedy=True),
                         eos_token_id=self.tokenizer.eos_id, pad_token_id=self.tokenizer.pad_id,
                         vocab_size=self.tokenizer.vocab_size, max_sequence_length=limit)
        lines = [f"samples at step {self.step} (greedy):"]
        for s, ids, mask in zip(samples, batch.response_ids.tolist(), batch.response_mask.tolist()):
            got = self.tokenizer.decode([t for t, m in zip(ids, mask) if m])
            want = self.tokenizer.decode(s.response_ids)
            lines.append(f"  {self.tokenizer.decode(s.prompt_ids)!r} -> {got!r} (reference {want!r})")
        self.logger.log_text("samples", "\n".join(lines), self.step)


def run_sft(cfg: SFTRunConfig, signals=None) -> int:
    """Build an :class:`SFTTrainer` and fit it; return the exit code (0, or the requeue code
    after a signal / ``trainer.max_time_per_run``)."""
    trainer = SFTTrainer(cfg, signals)
    trainer.fit()
    return trainer.exit_code


__all__ = ["SFTConfig", "SFTRunConfig", "SFTTrainer", "make_sft_loss_fn", "register_configs",
           "run_sft", "sft_loss"]
