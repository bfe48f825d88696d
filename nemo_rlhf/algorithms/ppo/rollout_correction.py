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

How far apart the two engines are is logged every step, with or without a correction:
:func:`rollout_train_k3` is the k3 estimate of ``KL(pi_rollout || pi_train)`` per policy
token (J. Schulman, "Approximating KL Divergence", 2020: with ``x ~ q`` and ``r = p(x) /
q(x)``, ``k3 = (r - 1) - log r`` is unbiased for ``KL(q || p)`` and never negative; here
``q`` is the rollout engine that sampled, ``p`` the training engine, ``log r = d =
logp_train - logp_rollout``, so ``k3 = exp(d) - d - 1``); :func:`rollout_correction_row_counts`
counts the rows a correction masks or caps (the share of sequences it touches, next to the
token shares of :func:`rollout_correction_weights`' stats).

Pure tensor functions in fp32, no distributed calls: statistics are returned as sums and
extremes for the trainer's reduction (the :mod:`.losses` key convention).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from nemo_rlhf.algorithms.ppo.kl import K3_LOG_RATIO_CLAMP
from nemo_rlhf.algorithms.ppo.losses import Stats

IS_MODES = ("truncate", "mask")
"""How the importance weight is limited at the cap: ``truncate`` (``min(rho, C)``, TIS) or
``mask`` (``rho`` if ``rho <= C`` else 0, AReaL's decoupled objective)."""


def _correction_masks(caller: str, train_logprobs, rollout_logprobs, response_mask,
                      tis_cap, mask_threshold, is_mode):
    """The checks and masks both public functions share: ``(mask [B, R] bool, log_ratio
    [B, R] fp32 (0 off the mask), keep [B] bool (rows under the threshold), raw [B, R]
    (``exp(log_ratio)``, None without ``tis_cap``), capped [B, R] bool (raw above the cap))``."""
    if train_logprobs.shape != rollout_logprobs.shape or train_logprobs.shape != response_mask.shape:
        raise ValueError(f"{caller}: train_logprobs {tuple(train_logprobs.shape)}, "
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
    keep = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    if mask_threshold is not None:
        keep = log_ratio.abs().max(dim=1).values <= mask_threshold
    raw, capped = None, torch.zeros_like(mask)
    if tis_cap is not None:
        raw = torch.exp(log_ratio.clamp(max=20.0))
        capped = raw > tis_cap
    return mask, log_ratio, keep, raw, capped


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
    mask, log_ratio, keep, raw, capped = _correction_masks(
        "rollout_correction_weights", train_logprobs, rollout_logprobs, response_mask,
        tis_cap, mask_threshold, is_mode)
    mismatch = log_ratio.abs()
    zero = torch.zeros((), dtype=torch.float32, device=log_ratio.device)
    kept = mask & keep.unsqueeze(1)
    if tis_cap is None:
        weight = torch.ones_like(log_ratio)
    else:
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


def rollout_correction_row_counts(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tis_cap: Optional[float] = None,
    mask_threshold: Optional[float] = None,
    is_mode: str = "truncate",
) -> Stats:
    """How many rows (sequences) the correction of :func:`rollout_correction_weights` (same
    arguments, same rules) touches: the row shares its token stats do not give.

    Only the mask's tokens (policy tokens; a multi-turn row's environment tokens are holes
    in it) are read; a row without any is not counted.

    Returns:
        detached 0-d fp32 counts, all summed over ranks: ``rows`` (rows with at least one
        policy token), ``masked_rows`` (of those, rows masked whole by ``mask_threshold``)
        and ``capped_rows`` (of the rows not masked, rows with at least one token whose
        weight ``exp(train - rollout)`` exceeds ``tis_cap``: truncated to it (``truncate``)
        or dropped (``mask``); 0 without ``tis_cap``).

    Raises:
        ValueError: as :func:`rollout_correction_weights`.
    """
    mask, _, keep, _, capped = _correction_masks(
        "rollout_correction_row_counts", train_logprobs, rollout_logprobs, response_mask,
        tis_cap, mask_threshold, is_mode)
    rows = mask.any(dim=1)
    return {"rows": rows.sum().float(), "masked_rows": (rows & ~keep).sum().float(),
            "capped_rows": (rows & keep & (capped & mask).any(dim=1)).sum().float()}


def rollout_train_k3(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(pi_rollout || pi_train)`` on the sampled tokens.

    ``k3 = exp(d) - d - 1`` with ``d = logp_train - logp_rollout`` (Schulman 2020, samples
    from the rollout engine; see the module docstring), ``d`` clipped to
    ``+-K3_LOG_RATIO_CLAMP`` (20) as :func:`~nemo_rlhf.algorithms.ppo.kl.kl_penalty`'s k3,
    evaluated as ``expm1(d) - d`` in float64: two engines agree to ~1e-7 nats, where fp32's
    ``exp(d) - d - 1`` cancels to 0 or to a negative rounding error (k3 ~ ``d^2 / 2``).

    Args:
        train_logprobs: ``[batch, response_len]`` the training engine's log-probs, any float.
        rollout_logprobs: ``[batch, response_len]`` the rollout engine's, any float.
        response_mask: ``[batch, response_len]`` bool or 0/1: the policy tokens.

    Returns:
        ``[batch, response_len]`` float64, >= 0, 0 off the mask (padding, environment tokens).

    Raises:
        ValueError: shapes that differ.
    """
    if response_mask.shape != train_logprobs.shape:
        raise ValueError(f"rollout_train_k3: response_mask {tuple(response_mask.shape)} and "
                         f"train_logprobs {tuple(train_logprobs.shape)} must have the same shape")
    if rollout_logprobs.shape != train_logprobs.shape:
        raise ValueError(f"rollout_train_k3: rollout_logprobs {tuple(rollout_logprobs.shape)} and "
                         f"train_logprobs {tuple(train_logprobs.shape)} must have the same shape")
    d = (train_logprobs.double() - rollout_logprobs.double()).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    k3 = torch.expm1(d) - d
    return torch.where(response_mask.bool(), k3, torch.zeros((), dtype=k3.dtype, device=k3.device))


__all__ = ["IS_MODES", "rollout_correction_row_counts", "rollout_correction_weights", "rollout_train_k3"]
