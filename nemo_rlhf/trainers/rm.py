"""Reward-model training: Bradley-Terry loss on preference pairs.

The RM is the GPT backbone with a scalar head (:class:`RewardModel`); a sequence's reward
is the head's output at its last valid token (the response's EOS unless truncated). The
loss of a step is ``sum_pairs -log sigmoid(r_chosen - r_rejected) / N`` with ``N`` the
pairs in the whole global batch (Ouyang et al. 2022, sec. 3.5). Metrics: accuracy
(``r_chosen > r_rejected``; a tie counts as wrong), mean margin, mean/std of the rewards.

At the end the mean and std of the rewards over the whole training set (chosen and
rejected responses together) are computed and stored in the checkpoint's trainer state
as ``reward_mean`` / ``reward_std`` (the PPO side's ``fixed`` normalisation reads them).

``rm.init_from`` starts from an SFT (or any actor) checkpoint: backbone and output-layer
weights are loaded, the checkpoint's value head is not, and the reward head keeps its fresh
initialisation (``model.value_head_init_std``; 0 = zeros). From an RM checkpoint (one that
holds a reward head) the head is loaded too: the RM continues from it, e.g. on a data set
grown with new pairs (the demo's RM refresh), with a fresh optimizer and schedule. Simplified: one pair per row
(no ranking of K responses, InstructGPT's K-choose-2 batching).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from nemo_rlhf.checkpoint import (checkpoint_heads, load_model_weights, refuse_adapter_checkpoint_as_lora_base,
                                  resolve_checkpoint)
from nemo_rlhf.data.datasets import (
    DataConfig,
    collate_preference,
    load_preference_dataset,
    pair_tokens,
    preference_length,
)
from nemo_rlhf.distributed.parallel import ParallelConfig
from nemo_rlhf.distributed.split import dp_shard
from nemo_rlhf.models.actor_critic import gather_last_token
from nemo_rlhf.metrics.trackers import LoggerConfig
from nemo_rlhf.models.config import ModelConfig
from nemo_rlhf.models.engine import forward_backward
from nemo_rlhf.trainers.mixed_precision import OptimizerConfig
from nemo_rlhf.trainers.collectives import reduce_from_last_stage
from nemo_rlhf.trainers.common import forward_calls
from nemo_rlhf.trainers.supervised import (
    SupervisedExpManagerConfig,
    SupervisedTrainer,
    SupervisedTrainerConfig,
)

PAIR_KEYS = ("loss", "correct", "margin", "reward_sum", "reward_sq")


@dataclass
class RMConfig:
    """RM-specific settings (config section ``rm``)."""

    init_from: Optional[str] = None
    """SFT checkpoint (folder, or a ``checkpoints`` root: its newest) whose backbone starts
    the RM; the reward head is freshly initialised. An RM checkpoint: backbone and reward
    head are loaded (training continues from that RM). None: random init."""
    freeze_layers: int = 0
    """Keep the embedding and the first ``freeze_layers`` transformer layers fixed (as
    loaded from ``init_from``) and train the layers above them and the reward head: a
    pretrained backbone's features with the cost of back-propagating through the top
    layers only. 0 trains everything; at most ``model.num_layers``."""

    extra_val_files: dict[str, str] = field(default_factory=dict)
    """More held-out preference files, ``{name: path}``, each evaluated with the validation
    set and logged as ``val_<name>/accuracy`` etc. (e.g. ``{same_form: pairs.jsonl}``: pairs
    whose responses differ only in the answer, which tell whether the RM scores the content
    or the form). On the command line: ``+rm.extra_val_files.same_form=pairs.jsonl`` (Hydra
    refuses new keys given as ``rm.extra_val_files={...}``)."""

    reward_stats_max_pairs: Optional[int] = None
    """The reward mean/std stored with the final checkpoint are computed over at most this
    many training pairs, evenly spaced through the file (a forward pass over every pair
    costs minutes on a CPU); None: all of them."""

    def __post_init__(self) -> None:
        if self.reward_stats_max_pairs is not None and self.reward_stats_max_pairs < 1:
            raise ValueError(f"rm.reward_stats_max_pairs={self.reward_stats_max_pairs}: must be "
                             f">= 1, or null for every training pair")
        for name in self.extra_val_files:
            if not str(name).isidentifier():
                raise ValueError(f"rm.extra_val_files: name {name!r} must be an identifier "
                                 f"(it becomes the metric prefix val_<name>/)")
        if self.freeze_layers < 0:
            raise ValueError(f"rm.freeze_layers={self.freeze_layers}: must be >= 0")


@dataclass
class RMRunConfig:
    """The whole RM job (``conf/rm.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: SupervisedTrainerConfig = field(default_factory=SupervisedTrainerConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    exp_manager: SupervisedExpManagerConfig = field(default_factory=SupervisedExpManagerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """W&B / MLflow beside TensorBoard (:mod:`nemo_rlhf.metrics.trackers`)."""


def register_configs() -> None:
    """Store :class:`RMRunConfig` in Hydra's ConfigStore as ``rm_schema``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="rm_schema", node=RMRunConfig)


# --------------------------------------------------------------------------- the loss
def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor,
                       num_pairs: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry loss of a micro-batch, divided by the global pair count.

    Args:
        r_chosen: ``[pairs]`` float32 rewards of the chosen responses.
        r_rejected: ``[pairs]`` float32 rewards of the rejected responses.
        num_pairs: pairs in the whole global batch (all micro-batches and DP ranks).

    Returns:
        ``(loss, stats)``: ``loss = sum(-log sigmoid(r_c - r_r)) / num_pairs``; ``stats``
        holds sums over this micro-batch (detached): ``correct`` (pairs with
        ``r_c > r_r``), ``margin`` (sum of ``r_c - r_r``), ``reward_sum`` and
        ``reward_sq`` (over both sides, for the mean and std).
    """
    diff = r_chosen.float() - r_rejected.float()
    loss = -F.logsigmoid(diff).sum() / num_pairs
    both = torch.cat([r_chosen, r_rejected]).detach().double()
    stats = {"correct": (diff > 0).sum().detach(), "margin": diff.sum().detach(),
             "reward_sum": both.sum(), "reward_sq": (both * both).sum()}
    return loss, stats


def make_rm_loss_fn(num_pairs: float):
    """``(rewards [2m, seq], micro_batch) -> (loss, stats)`` for ``forward_backward``.

    Rows ``0..m-1`` of the micro-batch are chosen, ``m..2m-1`` rejected
    (:func:`collate_preference`).
    """
    def loss_fn(rewards_BS, mb):
        scores = gather_last_token(rewards_BS, mb["lengths"])
        m = scores.shape[0] // 2
        loss, stats = bradley_terry_loss(scores[:m], scores[m:], num_pairs)
        return loss, {"loss": loss.detach(), **stats}

    return loss_fn


def pair_metrics(sums: dict[str, float], num_pairs: int, prefix: str) -> dict[str, float]:
    """Global sums -> ``{prefix}loss, accuracy, margin, reward_mean, reward_std``."""
    n_resp = 2 * num_pairs
    mean = sums["reward_sum"] / n_resp
    var = max(sums["reward_sq"] / n_resp - mean * mean, 0.0)
    return {f"{prefix}loss": sums["loss"], f"{prefix}accuracy": sums["correct"] / num_pairs,
            f"{prefix}margin": sums["margin"] / num_pairs, f"{prefix}reward_mean": mean,
            f"{prefix}reward_std": math.sqrt(var)}


# --------------------------------------------------------------------------- trainer
class RMTrainer(SupervisedTrainer):
    """Trains a :class:`RewardModel`; stores reward statistics with the final checkpoint."""

    model_kind = "reward"
    job = "rm"

    def __init__(self, cfg: RMRunConfig, signals=None):
        self.reward_stats: dict[str, float] = {}
        self.extra_val: dict = {}
        super().__init__(cfg, signals)

    def load_datasets(self):
        d = self.cfg.data
        train = load_preference_dataset(d.train_file, self.tokenizer, d)
        val = load_preference_dataset(d.val_file, self.tokenizer, d) if d.val_file else None
        self.extra_val = {name: load_preference_dataset(path, self.tokenizer, d)
                          for name, path in self.cfg.rm.extra_val_files.items()}
        return train, val

    def init_weights(self, model) -> None:
        self._load_backbone(model)
        n = self.cfg.rm.freeze_layers
        if n:
            if n > self.model_cfg.num_layers:
                raise ValueError(f"rm.freeze_layers={n} exceeds model.num_layers={self.model_cfg.num_layers}")
            if not self.cfg.rm.init_from:
                raise ValueError(f"rm.freeze_layers={n} without rm.init_from would freeze random weights")
            frozen = 0
            for name, p in model.named_parameters():
                if name.startswith("embedding."):
                    p.requires_grad_(False)
                    frozen += p.numel()
            for layer in getattr(model.decoder, "layers", []):
                if layer.layer_number <= n:  # global 1-based index, whatever the PP stage
                    for p in layer.parameters():
                        p.requires_grad_(False)
                        frozen += p.numel()
            self.print(f"rm.freeze_layers={n}: {frozen:,} parameters frozen on this rank")

    def base_checkpoint(self):
        return self.cfg.rm.init_from

    def _load_backbone(self, model) -> None:
        if not self.cfg.rm.init_from:
            return
        path = resolve_checkpoint(self.cfg.rm.init_from)
        if self.model_cfg.lora.enabled:
            refuse_adapter_checkpoint_as_lora_base(path, "rm.init_from")
        if "reward_head" in checkpoint_heads(path):
            load_model_weights(path, model)
            self.print(f"RM loaded from the reward model {path}, reward head included: "
                       f"training continues from it")
            return
        skipped = load_model_weights(path, model, skip_heads=True)
        self.print(f"RM backbone loaded from {path}; reward head freshly initialised "
                       f"(model.value_head_init_std={self.model_cfg.value_head_init_std}), "
                       f"not loaded: {skipped or 'none'}")

    def _forward(self, pairs, num_pairs: float, forward_only: bool,
                 routed_tokens: Optional[float] = None) -> dict[str, float]:
        """Run this rank's ``pairs`` in micro-batches; return summed stats (last stage).
        ``routed_tokens``: the global batch's tokens (both sides of every pair), the MoE
        router losses' denominator."""
        mbs, pad = self.cfg.trainer.micro_batch_size, self.tokenizer.pad_id
        sums = dict.fromkeys(PAIR_KEYS, 0.0)
        length = max((preference_length(p) for p in pairs), default=0)
        loss_fn = make_rm_loss_fn(num_pairs)
        # (under expert parallelism a rank without pairs still joins the MoE layers' calls)
        for call, variable_shapes in forward_calls(pairs, mbs, self.dims.ep > 1):
            stats = forward_backward(self.model, [collate_preference(g, pad, length) for g in call],
                                     loss_fn, forward_only=forward_only, device=self.dims.device,
                                     routed_tokens=routed_tokens, variable_shapes=variable_shapes)
            for s in stats:
                for k in PAIR_KEYS:
                    sums[k] += float(s[k])
        return sums

    def train_batch(self, global_batch: list, local: list) -> dict[str, float]:
        self.optimizer.zero_grad()
        sums = self._forward(local, len(global_batch), forward_only=False,
                             routed_tokens=sum(pair_tokens(p) for p in global_batch))
        opt = self.optimizer_step()
        sums = reduce_from_last_stage(sums, self.dims, PAIR_KEYS)
        return {**pair_metrics(sums, len(global_batch), "train/"), **opt}

    def evaluate_pairs(self, samples, prefix: str) -> dict[str, float]:
        """Forward-only metrics over a whole preference dataset (sharded by DP)."""
        self.model.eval()
        try:
            local = dp_shard(samples, self.dims.dp_rank, self.dims.dp)
            with torch.no_grad():
                sums = self._forward(local, len(samples), forward_only=True)
        finally:
            self.model.train()
        return pair_metrics(reduce_from_last_stage(sums, self.dims, PAIR_KEYS), len(samples), prefix)

    def validation_metrics(self) -> dict[str, float]:
        metrics = {}
        if self.val_ds is not None and len(self.val_ds):
            metrics.update(self.evaluate_pairs(self.val_ds.samples, "val/"))
        for name, ds in self.extra_val.items():
            if len(ds):
                metrics.update(self.evaluate_pairs(ds.samples, f"val_{name}/"))
        return metrics

    def on_fit_end(self) -> dict[str, float]:
        """Reward mean/std over the training set, or ``rm.reward_stats_max_pairs`` of it
        (stored in the checkpoint)."""
        samples, cap = self.train_ds.samples, self.cfg.rm.reward_stats_max_pairs
        if cap is not None and len(samples) > cap:
            samples = samples[::math.ceil(len(samples) / cap)]
        m = self.evaluate_pairs(samples, "final/train_")
        self.reward_stats = {"reward_mean": m["final/train_reward_mean"],
                             "reward_std": m["final/train_reward_std"],
                             "reward_stats_count": 2 * len(samples)}
        return m

    def trainer_state(self) -> dict:
        return {**super().trainer_state(), **self.reward_stats}


def run_rm(cfg: RMRunConfig, signals=None) -> int:
    """Build an :class:`RMTrainer` and fit it; return the exit code (0, or the requeue code
    after a signal / ``trainer.max_time_per_run``)."""
    trainer = RMTrainer(cfg, signals)
    trainer.fit()
    return trainer.exit_code


__all__ = ["RMConfig", "RMRunConfig", "RMTrainer", "bradley_terry_loss", "make_rm_loss_fn",
           "pair_metrics", "register_configs", "run_rm"]
