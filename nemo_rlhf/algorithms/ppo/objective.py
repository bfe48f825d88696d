"""The PPO objective of one micro-batch: the losses of :mod:`.losses` assembled into one.

``loss = vf_coef * value_loss + policy_loss - entropy_coef * entropy + kl_loss_coef * kl_loss``
(Schulman et al. 2017, eq. 9, plus the KL-in-the-loss term GRPO recipes use, Shao et al.
2024), every term aggregated by ``loss_agg_mode`` over the *global* counts of the
mini-batch (all micro-batches and DP ranks), so summing the micro-batch losses gives the
mini-batch loss whatever the split. Pure tensor math in fp32, no distributed calls.

Which terms are present: the value term when ``values`` are given (a critic on the
actor's backbone; a separate critic's loss is :func:`critic_loss`); the policy, entropy
and KL terms unless ``policy=False`` (a critic warm-up on a shared backbone), the KL term
when ``kl_loss_coef > 0``. The policy and entropy statistics are reported either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from nemo_rlhf.algorithms.ppo.core import masked_sum
from nemo_rlhf.algorithms.ppo.losses import (
    DEFAULT_KL_LOSS_CLAMP,
    DEFAULT_LOSS_AGG_MODE,
    GlobalCount,
    Stats,
    entropy_bonus,
    kl_loss,
    policy_loss,
    value_loss,
)


@dataclass(frozen=True)
class PPOObjective:
    """Coefficients and rules of the objective (from ``ppo.*`` and ``kl.*``)."""

    clip_eps: float = 0.2
    """Policy ratio clip (``ppo.clip_eps``)."""
    clip_eps_low: Optional[float] = None
    """Asymmetric lower clip (None: ``clip_eps``)."""
    clip_eps_high: Optional[float] = None
    """Asymmetric upper clip (None: ``clip_eps``)."""
    dual_clip: Optional[float] = None
    """Dual-clip constant for negative advantages (None: off)."""
    value_clip: Optional[float] = 0.2
    """Value clip around the old values (None: off)."""
    value_loss_coef: float = 0.5
    """``vf_coef`` of the value term on a shared backbone."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL(actor || reference) term (0: off)."""
    kl_estimator: str = "k3"
    """Estimator of the KL term (``k1``, ``k2``, ``k3``)."""
    kl_clamp: Optional[float] = DEFAULT_KL_LOSS_CLAMP
    """Bound on the KL term's per-token estimate (``kl.clamp`` when set; None: off)."""
    loss_agg_mode: str = DEFAULT_LOSS_AGG_MODE
    """Token-loss aggregation (:func:`~nemo_rlhf.algorithms.ppo.losses.aggregate_loss`)."""
    norm_length: Optional[int] = None
    """Horizon of ``seq-mean-token-sum-norm`` (the rollout's ``max_new_tokens``)."""


def ppo_loss(
    objective: PPOObjective,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    global_valid_tokens: GlobalCount,
    global_sequences: Optional[GlobalCount],
    *,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    values: Optional[torch.Tensor] = None,
    old_values: Optional[torch.Tensor] = None,
    returns: Optional[torch.Tensor] = None,
    kl_logprobs: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    policy: bool = True,
    rollout_weights: Optional[torch.Tensor] = None,
    sequence_tokens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Stats]:
    """One micro-batch's loss and statistics.

    Args:
        objective: :class:`PPOObjective`.
        logprobs, entropy: ``[B, R]`` float32 of the current policy (differentiable).
        response_mask: ``[B, R]`` bool.
        global_valid_tokens, global_sequences: the mini-batch's global counts (scalars).
        old_logprobs, advantages: ``[B, R]`` from the rollout's forward-only pass and the
            advantage estimator.
        values, old_values, returns: ``[B, R]`` of a critic on the actor's backbone (None:
            no value term).
        kl_logprobs, ref_logprobs: ``[B, R]`` actor and reference log-probs at the KL's
            temperature; needed when ``objective.kl_loss_coef > 0`` and ``policy``.
        policy: include the policy, entropy and KL terms (False: a critic warm-up).
        rollout_weights: ``[B, R]`` constant weights of the policy term's tokens (the
            rollout-mismatch correction,
            :func:`~nemo_rlhf.algorithms.ppo.rollout_correction.rollout_correction_weights`),
            or None.
        sequence_tokens: ``[B, R]`` each token's whole sequence's valid-token count, for
            ``seq-mean-token-mean`` when ``[B, R]`` is a shard of each sequence (context
            parallelism; :func:`~nemo_rlhf.algorithms.ppo.losses.aggregate_loss`), or None.

    Returns:
        ``(loss, stats)``: ``loss`` a scalar float32; ``stats`` the policy and value
        losses' statistics plus ``value_loss_sum`` and ``policy_loss_sum`` (the loss terms
        times the global token count, so
        :func:`~nemo_rlhf.algorithms.ppo.losses.finalize_token_stats` reports the terms as
        aggregated by ``loss_agg_mode``), and ``entropy_sum`` and ``kl_loss_sum``: token
        sums of the entropy and of the KL term's (clamped) per-token estimate, which
        ``finalize_token_stats`` turns into nats per token whatever ``loss_agg_mode``
        (the unit the guards and the docs read).

    Raises:
        ValueError: the KL term without ``kl_logprobs``/``ref_logprobs``, or a value term
            without ``old_values``/``returns``.
    """
    o = objective
    agg = dict(loss_agg_mode=o.loss_agg_mode, global_sequences=global_sequences,
               norm_length=o.norm_length, sequence_tokens=sequence_tokens)
    pl, pstats = policy_loss(logprobs, old_logprobs, advantages, response_mask,
                             global_valid_tokens, clip_eps=o.clip_eps, clip_eps_low=o.clip_eps_low,
                             clip_eps_high=o.clip_eps_high, dual_clip=o.dual_clip,
                             token_weights=rollout_weights, **agg)
    ent = entropy_bonus(entropy, response_mask, global_valid_tokens, **agg)
    loss = torch.zeros((), device=logprobs.device)
    stats = dict(pstats)
    scale = torch.as_tensor(global_valid_tokens, device=logprobs.device).float()
    if values is not None:
        if old_values is None or returns is None:
            raise ValueError("ppo_loss: the value term needs old_values and returns")
        vl, vstats = value_loss(values, old_values, returns, response_mask, global_valid_tokens,
                                clip_range=o.value_clip, **agg)
        loss = loss + o.value_loss_coef * vl
        stats.update({k: v for k, v in vstats.items() if k != "valid_tokens"})
        stats["value_loss_sum"] = vl.detach() * scale
    if policy:
        loss = loss + pl - o.entropy_coef * ent
        if o.kl_loss_coef > 0:
            if kl_logprobs is None or ref_logprobs is None:
                raise ValueError("ppo_loss: kl_loss_coef > 0 needs kl_logprobs and ref_logprobs")
            kll, kstats = kl_loss(kl_logprobs, ref_logprobs, response_mask, global_valid_tokens,
                                  estimator=o.kl_estimator, clamp=o.kl_clamp, **agg)
            loss = loss + o.kl_loss_coef * kll
            stats["kl_loss_sum"] = kstats["ref_kl_sum"]
    stats["policy_loss_sum"] = pl.detach() * scale
    with torch.no_grad():
        stats["entropy_sum"] = masked_sum(entropy.detach(), response_mask.bool())
    return loss, stats


def critic_loss(
    objective: PPOObjective,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    global_valid_tokens: GlobalCount,
    global_sequences: Optional[GlobalCount],
    sequence_tokens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Stats]:
    """A separate critic's loss: the clipped value loss alone (``vf_coef`` weighs the value
    term against the policy's only on a shared backbone).

    Args:
        values, old_values, returns: ``[B, R]`` float32; ``response_mask`` ``[B, R]`` bool.
        sequence_tokens: as in :func:`ppo_loss`.

    Returns:
        ``(loss, stats)`` with the value loss's statistics (``valid_tokens`` included) and
        ``value_loss_sum``.
    """
    vl, vstats = value_loss(values, old_values, returns, response_mask, global_valid_tokens,
                            clip_range=objective.value_clip, loss_agg_mode=objective.loss_agg_mode,
                            global_sequences=global_sequences, norm_length=objective.norm_length,
                            sequence_tokens=sequence_tokens)
    scale = torch.as_tensor(global_valid_tokens, device=values.device).float()
    return vl, {**vstats, "value_loss_sum": vl.detach() * scale}


__all__ = ["PPOObjective", "critic_loss", "ppo_loss"]
