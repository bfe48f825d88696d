"""PPO losses (policy, value, entropy, KL) with global normalisation, and their stats.

* Policy: clipped surrogate of Schulman et al. 2017, "Proximal Policy Optimization
  Algorithms", eq. 7; asymmetric ``clip_eps_low``/``clip_eps_high`` ("clip-higher", DAPO,
  Yu et al. 2025); dual-clip for negative advantages, Ye et al. 2020, "Mastering Complex
  Control in MOBA Games with Deep RL" (arXiv:1912.09729, dual-clip PPO; as in verl's
  ``compute_policy_loss`` with ``clip_ratio_c``).
* Value: clipped value loss of OpenAI baselines' PPO2 / TRL / verl,
  ``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``.
* Entropy: mean token entropy, returned as a bonus (the caller subtracts ``coef * bonus``).
* KL in the loss: a per-token estimate of KL(pi || pi_ref) (``kl.KL_ESTIMATORS``) as a
  loss term, the GRPO paper's choice (Shao et al. 2024, eq. 3-4, with k3) instead of the
  KL in the reward.

Aggregation (``loss_agg_mode``, verl's names; ``l`` = per-token loss, ``m`` = mask, ``b``
over the micro-batch's rows, ``T`` / ``S`` = valid tokens / sequences of the WHOLE
mini-batch, all micro-batches and data-parallel ranks, passed in; ``L`` = a constant):

* ``token-mean`` (default): ``sum_b sum_t m l / T``. Every token weighs the same (DAPO,
  Yu et al. 2025, section 3.3, "token-level policy gradient loss").
* ``seq-mean-token-sum``: ``sum_b (sum_t m l) / S``. Every sequence weighs its summed loss.
* ``seq-mean-token-mean``: ``sum_b (sum_t m l / n_b) / S`` with ``n_b`` the row's valid
  tokens (a row with none adds 0). Every sequence weighs the same: the GRPO paper's
  objective (Shao et al. 2024, eq. 3, ``1/G sum_i 1/|o_i| sum_t``). When the loss sees
  only a part of each sequence (context parallelism: a CP rank holds a shard of every
  row's positions), ``sequence_tokens`` gives each token its whole sequence's ``n_b``
  and the mode sums ``m l / n_b`` token by token, so the shards' losses add up to the
  whole rows'.
* ``seq-mean-token-sum-norm``: ``sum_b sum_t m l / (S * L)``: Dr. GRPO (Liu et al. 2025,
  arXiv:2503.20783, section 3.1) removes GRPO's ``1/|o_i|`` length bias by dividing by a
  constant ``L`` (``norm_length``, e.g. the generation budget ``rollout.max_new_tokens``),
  fixed for the whole run.

Every denominator is global, so summing the micro-batch losses (and gradients) gives the
same total however the mini-batch is split into micro-batches or ranks (NeMo-RL's
LossFunction convention); a row is never split, so ``n_b`` is always the full row's count.

Stats are returned as detached 0-d fp32 tensors (no host sync), as token SUMS plus the
count so they aggregate correctly over micro-batches and ranks. Key convention:

* ``valid_tokens``: count (reduce by SUM);
* ``<name>_sum``: token sum (reduce by SUM); ``finalize_token_stats`` turns it into
  ``<name>`` = sum / valid_tokens;
* ``<name>_max`` / ``<name>_min``: reduce by MAX / MIN, reported as is.

Use ``merge_token_stats`` over micro-batches (a trainer all-reduces with the op given by
``stat_reduce_op``) and then ``finalize_token_stats``.

NaN safety: masked slots of every input are replaced by 0 with ``torch.where`` before any
arithmetic, so NaN/Inf there gives the same finite loss as a 0 there, and a zero (finite)
gradient. The policy log-ratio is clamped to [-20, 20] before ``exp`` (as verl does) so a
wild valid token cannot overflow to Inf.

Simplified / left out: no GSPO sequence-level ratios, no per-group ("seq-mean" over the
prompts) aggregation, no KL over the full vocabulary (sampled-token estimators only).
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Tuple, Union

import torch

from nemo_rlhf.algorithms.ppo.core import (
    _bool_mask,
    _check_2d,
    _check_same_shape,
    _fp32,
    _select,
    masked_sum,
)
from nemo_rlhf.algorithms.ppo.kl import KL_ESTIMATORS, kl_penalty

__all__ = [
    "DEFAULT_KL_LOSS_CLAMP",
    "DEFAULT_LOSS_AGG_MODE",
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "entropy_bonus",
    "explained_variance",
    "explained_variance_from_sums",
    "explained_variance_sums",
    "finalize_token_stats",
    "kl_loss",
    "merge_token_stats",
    "policy_loss",
    "stat_reduce_op",
    "value_loss",
]

#: Bound on ``logp - old_logp`` before ``exp`` (verl clamps to the same range).
LOG_RATIO_CLAMP = 20.0

#: The loss aggregation modes (see the module docstring for their formulas).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
#: The default mode, today's behaviour; the one place it is set (a config field can
#: default to this constant).
DEFAULT_LOSS_AGG_MODE = "token-mean"

#: Default bound (nats) on the per-token estimate of the KL loss term (verl clamps its
#: ``low_var_kl`` to the same): :func:`kl_loss`, ``PPOObjective.kl_clamp``.
DEFAULT_KL_LOSS_CLAMP = 10.0

GlobalCount = Union[int, float, torch.Tensor]
Stats = Dict[str, torch.Tensor]


def _global_count(
    count: Optional[GlobalCount], device: torch.device, name: str = "global_valid_tokens",
    mode: Optional[str] = None,
) -> torch.Tensor:
    if count is None:
        raise ValueError(f"loss_agg_mode {mode!r} needs {name} (a global count > 0), got None")
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(f"{name} must be a number or a 1-element tensor")
        return count.detach().to(device=device, dtype=torch.float32).reshape(())
    value = float(count)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be > 0, got {count}")
    return torch.tensor(value, dtype=torch.float32, device=device)


def _prepare(
    response_mask: torch.Tensor, **tensors: torch.Tensor
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Check shapes, cast to fp32, zero the masked slots (NaN-safe)."""
    _check_2d(response_mask)
    cast = {name: _fp32(t, name) for name, t in tensors.items()}
    _check_same_shape(response_mask, "response_mask", **cast)
    mask = _bool_mask(response_mask)
    return mask, {name: _select(mask, t) for name, t in cast.items()}


def _count(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum().to(torch.float32)


def _masked_extreme(x: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    fill = torch.tensor(-math.inf if largest else math.inf, dtype=x.dtype, device=x.device)
    filled = torch.where(mask, x, fill)
    if filled.numel() == 0:
        return fill
    return filled.amax() if largest else filled.amin()


def _aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_valid_tokens: Optional[GlobalCount],
    global_sequences: Optional[GlobalCount],
    norm_length: Optional[GlobalCount],
    sequence_tokens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``aggregate_loss`` on a checked fp32 ``loss_mat`` and bool ``mask``."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {list(LOSS_AGG_MODES)}")
    device = mask.device
    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / _global_count(global_valid_tokens, device, mode=mode)
    sequences = _global_count(global_sequences, device, "global_sequences", mode)
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask) / sequences
    if mode == "seq-mean-token-mean":
        if sequence_tokens is not None:  # each token's whole sequence's count (a shard of it here)
            _check_same_shape(mask, "response_mask", sequence_tokens=sequence_tokens)
            n = torch.where(mask, sequence_tokens.detach().to(torch.float32), 1.0).clamp_min(1.0)
            return masked_sum(loss_mat / n, mask) / sequences
        row_sum = masked_sum(loss_mat, mask, dim=1)
        row_tokens = mask.sum(dim=1).clamp_min(1).to(torch.float32)
        return (row_sum / row_tokens).sum() / sequences
    length = _global_count(norm_length, device, "norm_length", mode)
    return masked_sum(loss_mat, mask) / (sequences * length)


def aggregate_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = DEFAULT_LOSS_AGG_MODE,
    global_valid_tokens: Optional[GlobalCount] = None,
    global_sequences: Optional[GlobalCount] = None,
    norm_length: Optional[GlobalCount] = None,
    sequence_tokens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reduce per-token losses to the scalar loss of this micro-batch's share.

    Formulas: see the module docstring (``token-mean``, ``seq-mean-token-sum``,
    ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``). The sum of these values over
    all micro-batches and ranks of a mini-batch is the mini-batch loss.

    Args:
        loss_mat: ``[batch, response_len]`` per-token losses, any float dtype.
        response_mask: ``[batch, response_len]`` bool or 0/1.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        global_valid_tokens: ``T``, valid tokens of the mini-batch over all micro-batches
            and DP ranks (``token-mean`` only).
        global_sequences: ``S``, rows of the mini-batch over all micro-batches and DP
            ranks (the ``seq-*`` modes).
        norm_length: ``L``, the constant of ``seq-mean-token-sum-norm``.
        sequence_tokens: ``[batch, response_len]`` (any number dtype; read by
            ``seq-mean-token-mean`` only): each token's ``n_b``, the valid tokens of its
            whole sequence, for a loss that sees a shard of each sequence (context
            parallelism); None: the row's own count.
        Counts are numbers (> 0, checked) or 1-element tensors (not checked: no sync).

    Returns:
        0-d fp32 tensor (differentiable w.r.t. ``loss_mat``); masked slots never count,
        even when NaN/Inf.

    Raises:
        ValueError: unknown mode (the message lists the valid ones), a count the mode
            needs missing or <= 0, shape mismatch.
    """
    mask, t = _prepare(response_mask, loss_mat=loss_mat)
    return _aggregate(t["loss_mat"], mask, loss_agg_mode, global_valid_tokens,
                      global_sequences, norm_length, sequence_tokens)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    global_valid_tokens: GlobalCount,
    clip_eps: float = 0.2,
    clip_eps_low: Optional[float] = None,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    *,
    loss_agg_mode: str = DEFAULT_LOSS_AGG_MODE,
    global_sequences: Optional[GlobalCount] = None,
    norm_length: Optional[GlobalCount] = None,
    token_weights: Optional[torch.Tensor] = None,
    sequence_tokens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Stats]:
    """PPO clipped-surrogate policy loss, aggregated with global denominators.

    Formula (Schulman et al. 2017, eq. 7), per valid token, ``ratio = exp(logp - old_logp)``::

        objective = min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
        dual-clip (Ye et al. 2020), only where A < 0:
        objective = max(objective, dual_clip * A)
        loss_token = -objective * w      (w = token_weights, 1 by default)

    ``loss = aggregate_loss(loss_token, ...)``; with the default ``token-mean``,
    ``sum_valid(loss_token) / global_valid_tokens``. ``w`` is a constant per token, e.g.
    the rollout-mismatch correction of
    :func:`~nemo_rlhf.algorithms.ppo.rollout_correction.rollout_correction_weights`
    (truncated importance sampling, Yao et al. 2025); the denominators do not change.

    Args:
        logprobs: ``[batch, response_len]`` current log-probs (differentiated), any float.
        old_logprobs: ``[batch, response_len]`` log-probs at rollout time, any float.
        advantages: ``[batch, response_len]`` (usually whitened), any float.
        response_mask: ``[batch, response_len]`` bool or 0/1.
        global_valid_tokens: valid tokens across all micro-batches and DP ranks of the
            mini-batch (> 0; int, float or 1-element tensor, not checked if a tensor);
            read by ``token-mean`` only (may be None for the other modes).
        clip_eps: default for both clip sides.
        clip_eps_low / clip_eps_high: override the lower / upper side.
        dual_clip: constant ``c > 1`` of dual-clip PPO, or None to disable.
        loss_agg_mode: one of ``LOSS_AGG_MODES`` (module docstring); default token-mean.
        global_sequences: rows of the mini-batch over all micro-batches and DP ranks
            (the ``seq-*`` modes).
        norm_length: the constant ``L`` of ``seq-mean-token-sum-norm``.
        sequence_tokens: as in ``aggregate_loss``.
        token_weights: ``[batch, response_len]`` constant weights of the token losses
            (no gradient flows into them), or None.

    Returns:
        ``(loss, stats)``: ``loss`` is a 0-d fp32 tensor; ``stats`` (detached 0-d fp32, see
        module docstring) has ``valid_tokens``, ``clip_fraction_sum`` (tokens whose
        objective came from the clipped ratio), ``dual_clip_fraction_sum`` (tokens capped
        by dual-clip), ``approx_kl_sum`` (k3 estimate of KL(pi_old || pi) on the tokens
        pi_old sampled: ``r - 1 - log r`` with ``r = exp(new - old)``), ``ratio_mean_sum``, ``ratio_max`` and ``ratio_min`` (-inf / +inf when no
        token is valid).

    Raises:
        ValueError: shape mismatches, ``eps_low`` outside ``[0, 1)``, ``eps_high < 0``,
            ``dual_clip <= 1``, unknown ``loss_agg_mode``, a count it needs missing or
            <= 0.
    """
    eps_low = clip_eps if clip_eps_low is None else clip_eps_low
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"clip_eps_low (or clip_eps) must be in [0, 1), got {eps_low}")
    if not eps_high >= 0.0:
        raise ValueError(f"clip_eps_high (or clip_eps) must be >= 0, got {eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020), got {dual_clip}")

    mask, t = _prepare(
        response_mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages
    )
    adv = t["advantages"]
    log_ratio = (t["logprobs"] - t["old_logprobs"]).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    objective = torch.minimum(unclipped, clipped)
    clip_hit = clipped < unclipped
    dual_hit = torch.zeros_like(mask)
    if dual_clip is not None:
        floor = dual_clip * adv
        dual_hit = (adv < 0) & (objective < floor)
        objective = torch.where(dual_hit, floor, objective)
    if token_weights is not None:
        if token_weights.shape != objective.shape:
            raise ValueError(f"token_weights {tuple(token_weights.shape)} must match the log-probs "
                             f"{tuple(objective.shape)}")
        objective = objective * torch.where(mask, token_weights.detach().float(), 0.0)
    loss = _aggregate(-objective, mask, loss_agg_mode, global_valid_tokens, global_sequences,
                      norm_length, sequence_tokens)

    with torch.no_grad():
        ratio_d = ratio.detach()
        # KL(pi_old || pi) on tokens sampled from pi_old: k3 with r = pi / pi_old
        # (Schulman 2020), i.e. the estimator's "actor" is the old policy.
        approx_kl = KL_ESTIMATORS["k3"](t["old_logprobs"].detach(), t["logprobs"].detach())
        stats: Stats = {
            "valid_tokens": _count(mask),
            "clip_fraction_sum": _count(clip_hit & mask),
            "dual_clip_fraction_sum": _count(dual_hit & mask),
            "approx_kl_sum": masked_sum(approx_kl, mask),
            "ratio_mean_sum": masked_sum(ratio_d, mask),
            "ratio_max": _masked_extreme(ratio_d, mask, largest=True),
            "ratio_min": _masked_extreme(ratio_d, mask, largest=False),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    global_valid_tokens: GlobalCount,
    clip_range: Optional[float] = 0.2,
    *,
    loss_agg_mode: str = DEFAULT_LOSS_AGG_MODE,
    global_sequences: Optional[GlobalCount] = None,
    norm_length: Optional[GlobalCount] = None,
    sequence_tokens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Stats]:
    """Clipped value loss, aggregated with global denominators (``aggregate_loss``).

    Formula (OpenAI baselines PPO2, as in TRL/verl), per valid token::

        V_clip = clip(V, V_old - c, V_old + c)
        loss_token = 0.5 * max((V - R)^2, (V_clip - R)^2)      # c = clip_range
        loss_token = 0.5 * (V - R)^2                           # clip_range is None

    Args:
        values: ``[batch, response_len]`` current critic values (differentiated).
        old_values: ``[batch, response_len]`` values at rollout time.
        returns: ``[batch, response_len]`` value targets (from ``compute_gae``).
        response_mask: ``[batch, response_len]`` bool or 0/1.
        global_valid_tokens: as in ``policy_loss``.
        clip_range: ``c`` > 0, or None for the unclipped loss.
        loss_agg_mode: one of ``LOSS_AGG_MODES`` (module docstring); default token-mean.
        global_sequences: rows of the mini-batch over all micro-batches and DP ranks
            (the ``seq-*`` modes).
        norm_length: the constant ``L`` of ``seq-mean-token-sum-norm``.
        sequence_tokens: as in ``aggregate_loss``.

    Returns:
        ``(loss, stats)``: 0-d fp32 loss; stats ``valid_tokens``,
        ``value_clip_fraction_sum`` (tokens where ``|V - V_old| > c`` and the clipped term
        was strictly larger, i.e. chosen), ``value_error_sq_sum`` (``(V - R)^2``). All detached 0-d fp32.

    Raises:
        ValueError: shape mismatches, ``clip_range <= 0``, unknown ``loss_agg_mode``, a
            count it needs missing or <= 0.
    """
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range must be > 0 or None, got {clip_range}")
    mask, t = _prepare(response_mask, values=values, old_values=old_values, returns=returns)
    v, v_old, ret = t["values"], t["old_values"], t["returns"]
    err_sq = (v - ret) ** 2
    if clip_range is None:
        per_token = err_sq
        clip_hit = torch.zeros_like(mask)
    else:
        v_clipped = v_old + torch.clamp(v - v_old, -clip_range, clip_range)
        err_sq_clipped = (v_clipped - ret) ** 2
        per_token = torch.maximum(err_sq, err_sq_clipped)
        # chosen AND clipped: inside the range V_old + (V - V_old) can differ from V by one
        # fp32 rounding step, which made the clipped term "larger" on ~0.07% of unclipped tokens
        clip_hit = (err_sq_clipped > err_sq) & ((v - v_old).abs() > clip_range)
    loss = 0.5 * _aggregate(per_token, mask, loss_agg_mode, global_valid_tokens,
                            global_sequences, norm_length, sequence_tokens)
    with torch.no_grad():
        stats: Stats = {
            "valid_tokens": _count(mask),
            "value_clip_fraction_sum": _count(clip_hit & mask),
            "value_error_sq_sum": masked_sum(err_sq.detach(), mask),
        }
    return loss, stats


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    global_valid_tokens: Optional[GlobalCount],
    *,
    loss_agg_mode: str = DEFAULT_LOSS_AGG_MODE,
    global_sequences: Optional[GlobalCount] = None,
    norm_length: Optional[GlobalCount] = None,
    sequence_tokens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Token entropy aggregated like the losses (a bonus: maximise it).

    The trainer's total loss is ``policy + vf_coef * value - entropy_coef * bonus``
    (Schulman et al. 2017, eq. 9).

    Args:
        entropy: ``[batch, response_len]`` per-token entropy of the current policy.
        response_mask: ``[batch, response_len]`` bool or 0/1.
        global_valid_tokens: as in ``policy_loss``.
        loss_agg_mode: one of ``LOSS_AGG_MODES`` (module docstring); default token-mean.
        global_sequences: rows of the mini-batch over all micro-batches and DP ranks
            (the ``seq-*`` modes).
        norm_length: the constant ``L`` of ``seq-mean-token-sum-norm``.
        sequence_tokens: as in ``aggregate_loss``.

    Returns:
        0-d fp32 tensor (differentiable w.r.t. ``entropy``).

    Raises:
        ValueError: shape mismatch, unknown ``loss_agg_mode``, a count it needs missing
            or <= 0.
    """
    mask, t = _prepare(response_mask, entropy=entropy)
    return _aggregate(t["entropy"], mask, loss_agg_mode, global_valid_tokens,
                      global_sequences, norm_length, sequence_tokens)


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    global_valid_tokens: Optional[GlobalCount],
    *,
    estimator: str,
    loss_agg_mode: str = DEFAULT_LOSS_AGG_MODE,
    global_sequences: Optional[GlobalCount] = None,
    norm_length: Optional[GlobalCount] = None,
    clamp: Optional[float] = DEFAULT_KL_LOSS_CLAMP,
    sequence_tokens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Stats]:
    """KL(pi || pi_ref) as a loss term: the per-token estimate, aggregated like the losses.

    ``loss = aggregate_loss(KL_ESTIMATORS[estimator](logp, ref_logp), ...)``; the trainer
    adds ``coef * loss`` (GRPO: Shao et al. 2024, eq. 3-4, ``beta * D_KL`` with the k3
    estimator, section 4.1.1). Use it with the KL out of the reward (``beta = 0`` in
    ``compute_token_rewards``), or the KL is counted twice.

    Gradients w.r.t. ``logprobs`` (the tokens were sampled from the actor, ``r =
    exp(ref_logp - logp)``): k1 gives ``+1`` per token (``E_pi[grad log pi] = 0``, so on
    policy it only adds noise); k2 gives ``logp - ref_logp``; k3 gives ``1 - r``, which
    is 0 where the policies agree and pushes ``logp`` down where ``logp > ref_logp``.

    Args:
        logprobs: ``[batch, response_len]`` current actor log-probs (differentiated).
        ref_logprobs: ``[batch, response_len]`` reference log-probs (not differentiated).
        response_mask: ``[batch, response_len]`` bool or 0/1.
        global_valid_tokens: as in ``policy_loss``.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (``kl.KL_ESTIMATORS``).
        loss_agg_mode: one of ``LOSS_AGG_MODES`` (module docstring); default token-mean.
        global_sequences: rows of the mini-batch over all micro-batches and DP ranks
            (the ``seq-*`` modes).
        norm_length: the constant ``L`` of ``seq-mean-token-sum-norm``.
        sequence_tokens: as in ``aggregate_loss``.
        clamp: clip the per-token estimate to ``[-clamp, clamp]``; default
            :data:`DEFAULT_KL_LOSS_CLAMP` (10 nats, as verl's ``low_var_kl``): a token far
            from the reference then adds no gradient instead of a huge one. None: off
            (k3's log-ratio stays clipped, :data:`~nemo_rlhf.algorithms.ppo.kl.K3_LOG_RATIO_CLAMP`).

    Returns:
        ``(loss, stats)``: 0-d fp32 loss; stats ``valid_tokens`` and ``ref_kl_sum``
        (token sum of the estimate), detached 0-d fp32.

    Raises:
        ValueError: unknown ``estimator`` or ``loss_agg_mode`` (the message lists the valid
            names), shape mismatches, ``clamp <= 0``, a count the mode needs missing or
            <= 0.
    """
    mask, t = _prepare(response_mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    kl = kl_penalty(t["logprobs"], t["ref_logprobs"].detach(), estimator, clamp)
    loss = _aggregate(kl, mask, loss_agg_mode, global_valid_tokens, global_sequences,
                      norm_length, sequence_tokens)
    with torch.no_grad():
        stats: Stats = {"valid_tokens": _count(mask), "ref_kl_sum": masked_sum(kl.detach(), mask)}
    return loss, stats


def explained_variance_sums(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """The sums :func:`explained_variance_from_sums` needs, over this rank's valid tokens:
    ``[sum R, sum R^2, sum (R - V), sum (R - V)^2, n]``, float64 (summed over DP ranks
    with one all-reduce, they give the explained variance of the whole batch).

    Args:
        values, returns: ``[batch, response_len]``; ``response_mask`` bool or 0/1.

    Returns:
        ``[5]`` float64 on the inputs' device.

    Raises:
        ValueError: shape mismatch.
    """
    mask, t = _prepare(response_mask, values=values, returns=returns)
    with torch.no_grad():
        ret = _select(mask, t["returns"].detach()).double()
        diff = _select(mask, t["returns"].detach() - t["values"].detach()).double()
        return torch.stack([ret.sum(), (ret * ret).sum(), diff.sum(), (diff * diff).sum(),
                            mask.sum().double()])


def explained_variance_from_sums(sums: torch.Tensor) -> float:
    """``1 - Var[R - V] / Var[R]`` (unbiased variances) from :func:`explained_variance_sums`
    (possibly summed over ranks); NaN when fewer than 2 tokens or ``Var[R] == 0``, as
    :func:`explained_variance`."""
    s_r, sq_r, s_d, sq_d, n = (float(x) for x in sums.tolist())
    if n < 2:
        return math.nan
    var_r = (sq_r - s_r * s_r / n) / (n - 1)
    var_d = (sq_d - s_d * s_d / n) / (n - 1)
    return 1.0 - var_d / var_r if var_r > 0 else math.nan


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``1 - Var[R - V] / Var[R]`` over valid tokens (unbiased variances), as in OpenAI
    baselines' ``explained_variance`` and verl's ``vf_explained_var``.

    1 = perfect critic, 0 = no better than a constant, < 0 = worse. Computed on the tokens
    given (one rank's batch); no sync, no raise.

    Args:
        values: ``[batch, response_len]`` critic values.
        returns: ``[batch, response_len]`` targets.
        response_mask: ``[batch, response_len]`` bool or 0/1.

    Returns:
        Detached 0-d fp32 tensor; NaN when fewer than 2 tokens are valid or ``Var[R] == 0``.

    Raises:
        ValueError: shape mismatch.
    """
    mask, t = _prepare(response_mask, values=values, returns=returns)
    with torch.no_grad():
        ret = t["returns"].detach()
        diff = ret - t["values"].detach()
        n = _count(mask)

        def var(x: torch.Tensor) -> torch.Tensor:
            mean = masked_sum(x, mask) / n.clamp_min(1)
            centred = _select(mask, x - mean)
            return (centred * centred).sum() / (n - 1).clamp_min(1)

        var_r = var(ret)
        ev = 1.0 - var(diff) / var_r.clamp_min(torch.finfo(torch.float32).tiny)
        ok = (n >= 2) & (var_r > 0)
        return torch.where(ok, ev, torch.full_like(ev, math.nan))


# --------------------------------------------------------------------------------------
# Stats aggregation
# --------------------------------------------------------------------------------------


def stat_reduce_op(key: str) -> str:
    """How a stat key aggregates across micro-batches / ranks: ``"sum"``, ``"max"``, ``"min"``.

    Raises:
        ValueError: for a key that follows none of the conventions.
    """
    if key == "valid_tokens" or key.endswith("_sum"):
        return "sum"
    if key.endswith("_max"):
        return "max"
    if key.endswith("_min"):
        return "min"
    raise ValueError(
        f"stat key {key!r} must be 'valid_tokens' or end with '_sum', '_max' or '_min'"
    )


def merge_token_stats(stats_list: Iterable[Stats]) -> Stats:
    """Combine stats dicts from several micro-batches (SUM / MAX / MIN by key suffix).

    Every dict must have the same keys (from the same loss function).

    Raises:
        ValueError: empty input, or dicts with different keys.
    """
    stats_list = list(stats_list)
    if not stats_list:
        raise ValueError("merge_token_stats needs at least one stats dict")
    keys = set(stats_list[0])
    for s in stats_list[1:]:
        if set(s) != keys:
            raise ValueError(f"stats dicts have different keys: {sorted(keys)} vs {sorted(s)}")
    merged: Stats = {}
    for key in stats_list[0]:
        stacked = torch.stack([s[key].detach().to(torch.float32).reshape(()) for s in stats_list])
        op = stat_reduce_op(key)
        reducer = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}[op]
        merged[key] = reducer(stacked)
    return merged


def finalize_token_stats(stats: Stats) -> Dict[str, float]:
    """Turn (merged, all-reduced) stats into logged floats.

    ``<name>_sum`` becomes ``<name>`` = sum / valid_tokens (NaN when valid_tokens is 0);
    ``_max`` / ``_min`` keys and ``valid_tokens`` are reported unchanged. Reads values on
    the host (one sync).

    Raises:
        ValueError: if ``valid_tokens`` is missing.
    """
    if "valid_tokens" not in stats:
        raise ValueError("stats must contain 'valid_tokens'")
    count = float(stats["valid_tokens"])
    out: Dict[str, float] = {}
    for key, value in stats.items():
        op = stat_reduce_op(key)
        if key != "valid_tokens" and op == "sum":
            out[key[: -len("_sum")]] = float(value) / count if count > 0 else math.nan
        else:
            out[key] = float(value)
    return out
