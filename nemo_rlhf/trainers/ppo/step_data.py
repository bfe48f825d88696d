"""What flows between the six steps of a PPO step (besides the rollout's
:class:`~nemo_rlhf.rollout.RolloutBatch`): the forward-only passes' results and the
advantages. Tensors live on ``dims.device`` on the last pipeline stage; other stages
hold none of these (the trainer passes None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ForwardResults:
    """Steps 4-5a: the forward-only passes over the rollout (eval mode), per response token.

    ``old_logprobs`` are at the sampling temperature (the PPO ratio's denominator);
    ``kl_logprobs`` (actor) and ``ref_logprobs`` (reference) at ``kl.temperature``'s.
    """

    old_logprobs: torch.Tensor
    """``[B, R]`` float32, the actor before this step's updates."""
    ref_logprobs: torch.Tensor
    """``[B, R]`` float32, the frozen reference."""
    kl_logprobs: torch.Tensor
    """``[B, R]`` float32, the actor at the KL's temperature (``old_logprobs`` when equal)."""
    values: Optional[torch.Tensor]
    """``[B, R]`` float32 critic values of the states that choose each response token;
    None with a critic-free advantage estimator."""


@dataclass
class Advantages:
    """Step 5b: what the PPO updates train on."""

    advantages: torch.Tensor
    """``[B, R]`` float32 (whitened for ``gae`` when ``ppo.normalize_advantages``)."""
    returns: torch.Tensor
    """``[B, R]`` float32 value targets."""
    kl: torch.Tensor
    """``[B, R]`` float32 per-token KL estimate (``kl.estimator``) actor vs reference."""
    loss_mask: torch.Tensor
    """``[B, R]`` bool: the response tokens that train (the response mask, with the rows
    ``reward.invalid_scores=skip`` left out all False)."""


__all__ = ["Advantages", "ForwardResults"]
