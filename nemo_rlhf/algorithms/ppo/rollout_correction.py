"""Rollout-vs-train mismatch correction: importance weights (truncated or masked at a cap)
and row masking.

The rollout engine samples tokens from its own numerics (a KV-cache decode, another
kernel, vLLM) or, with ``rollout.mode=async``, from an older policy, so the probabilities it
sampled from, ``pi_rollout`` (the behaviour policy), are not the training engine's
``pi_old`` (the proximal policy) that PPO's ratio is taken against (the old log-probs are
recomputed by the training engine, so the ratio is 1 on the first mini-batch). PPO's
update is then off-policy. Each token's policy loss gets the constant importance weight
``rho_t = exp(logp_old_train_t - logp_rollout_t)`` limited at a cap ``C >= 1``, by one of
two rules (``is_mode``):

* ``truncate`` -- truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training", fengyao.notion.site/off-policy-rl;
  verl's ``rollout_is`` in its truncate mode)::

      w_t = min(rho_t, C)

* ``mask`` -- the decoupled PPO objective's behaviour weight as AReaL's code applies it
  (Fu et al. 2025; its ``behav_imp_weight_cap``): a token whose weight exceeds the cap is
  dropped, the others keep their untruncated weight::

      w_t = rho_t if rho_t <= C else 0

and the peers (verl's ``rollout_is``) also drop whole rows whose mismatch is too large to
correct. Here a row is masked when any of its tokens has ``|logp_old_train - logp_rollout|
> mask_threshold`` nats (one catastrophic token is enough). Both weights are constants
(no gradient) multiplying the per-token policy loss; the global token denominators are
unchanged, so a masked token counts as a zero loss, not as a removed one (as in AReaL,
whose denominator is the loss mask's count before the cap).

Pure tensor functions in fp32, no distributed calls: statistics are returned as sums and
extremes for the trainer's reduction (the :mod:`.losses` key convention).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from nemo_rlhf.algorithms.ppo.losses import Stats

IS_MODES = ("truncate", "mask")
"""How the importance weight is limited at the cap: ``truncate`` (``min(rho, C)``, TIS) or
``mask`` (``rho`` if ``rho <= C`` else 0, AReaL's decoupled objective)."""


def rollout_correction_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tis_cap: Optional[float] = None,
    mask_threshold: Optional[float] = None,
    is_mode: str = "truncate",
) -> Tuple[torch.Tensor, Stats]:
    """Per-token weights of the policy loss that correct for the rollout engine's mismatch.

    Args:
        train_logprobs: ``[batch, response_len]`` the training engine's old log-probs of
            the sampled tokens (before this step's updates), any float.
        rollout_logprobs: ``[batch, response_len]`` the rollout engine's log-probs of the
            same tokens, at the same temperature, any float.
        response_mask: ``[batch, response_len]`` bool or 0/1.
        tis_cap: the cap ``C >= 1`` of the importance weight ``exp(train - rollout)``
            (None: no importance weight, 1).
        mask_threshold: rows with a token whose ``|train - rollout|`` exceeds it (nats, > 0)
            get weight 0 (None: no masking).
        is_mode: one of :data:`IS_MODES`: ``truncate`` clips a weight above the cap to the
            cap; ``mask`` sets it to 0 (the token drops out of the policy loss). ``mask``
            needs ``tis_cap``.

    Returns:
        ``(weights [batch, response_len] float32, stats)``; weights are 0 on padding, on
        masked rows and (``mask``) on tokens above the cap. ``stats`` (detached 0-d fp32):
        ``valid_tokens``, ``mismatch_sum`` (|log ratio|), ``mismatch_max``,
        ``is_weight_sum`` (the weights over the valid tokens, 0 on masked rows and tokens;
        1 per kept token when ``tis_cap`` is None) and ``is_weight_max`` (over the kept
        tokens), ``is_truncated_fraction_sum`` (``truncate``: kept-row tokens whose weight
        was clipped to the cap) or ``is_masked_fraction_sum`` (``mask``: kept-row tokens
        dropped for a weight above the cap), and ``masked_fraction_sum`` (valid tokens of
        masked rows): the :mod:`.losses` convention, so ``finalize_token_stats`` reports
        means and fractions per valid token.

    Raises:
        ValueError: shape mismatch, ``tis_cap < 1``, ``mask_threshold <= 0``, an
            ``is_mode`` not in :data:`IS_MODES`, or ``is_mode="mask"`` without ``tis_cap``.
    """
    if train_logprobs.shape != rollout_logprobs.shape or train_logprobs.shape != response_mask.shape:
        raise ValueError(f"rollout_correction_weights: train_logprobs {tuple(train_logprobs.shape)}, "
                         f"rollout_logprobs {tuple(rollout_logprobs.shape)} and response_mask "
                         f"{tuple(response_mask.shape)} must have the same shape")
    if tis_cap is not None and not tis_cap >= 1.0:
        raise ValueError(f"tis_cap={tis_cap}: must be >= 1 (None: off)")
    if mask_threshold is not None and not mask_threshold > 0.0:
        raise ValueError(f"mask_threshold={mask_threshold}: must be > 0 nats (None: off)")
    if is_mode not in IS_MODES:
        raise ValueError(f"is_mode={is_mode!r}: valid choices are {list(IS_MODES)}")
    if is_mode == "mask" and tis_cap is None:
        raise ValueError("is_mode='mask' drops the tokens whose weight exceeds tis_cap: set tis_cap")
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=train_logprobs.device)
    log_ratio = torch.where(mask, train_logprobs.float() - rollout_logprobs.float(), zero)
    mismatch = log_ratio.abs()
    keep = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    if mask_threshold is not None:
        keep = mismatch.max(dim=1).values <= mask_threshold
    kept = mask & keep.unsqueeze(1)
    if tis_cap is None:
        weight = torch.ones_like(log_ratio)
        capped = torch.zeros_like(mask)
    else:
        raw = torch.exp(log_ratio.clamp(max=20.0))
        capped = raw > tis_cap
        weight = raw.clamp(max=tis_cap) if is_mode == "truncate" else torch.where(capped, zero, raw)
    weights = torch.where(kept, weight, zero)
    counted = kept if is_mode == "truncate" else kept & ~capped  # the tokens left in the loss
    neg_inf = torch.tensor(float("-inf"), device=weights.device)
    stats: Stats = {
        "valid_tokens": mask.sum().float(),
        "mismatch_sum": mismatch.sum(),
        "mismatch_max": torch.where(mask, mismatch, neg_inf).max() if mask.any() else neg_inf,
        "is_weight_sum": weights.sum(),
        "is_weight_max": torch.where(counted, weights, neg_inf).max() if counted.any() else neg_inf,
        f"is_{'truncated' if is_mode == 'truncate' else 'masked'}_fraction_sum": (capped & kept).sum().float(),
        "masked_fraction_sum": (mask & ~keep.unsqueeze(1)).sum().float(),
    }
    return weights.detach(), {k: v.detach() for k, v in stats.items()}


__all__ = ["IS_MODES", "rollout_correction_weights"]
