"""Masked statistics and input checks shared by the PPO math modules.

Everything in ``nemo_rlhf.algorithms.ppo`` is a pure function of tensors: no distributed
calls, no trainer config objects, no I/O (``advantages.AdvantageConfig`` is a dataclass of
plain values, the one place the estimators' defaults live). Token tensors are
batch-first ``[batch, response_len]`` and come with a ``response_mask`` of the same shape
(bool, or 0/1 of any dtype; nonzero = valid response token). Float inputs of any dtype
(fp16, bf16, fp64, ...) are cast to fp32 and all arithmetic happens in fp32; outputs are
fp32.

The mask may have holes: in a multi-turn trajectory (#51) it is 1 on the policy's tokens
and 0 on the environment's tokens between them (and on padding). Every function of this
package treats a 0 inside a row exactly like padding: numerators and denominators count
policy tokens only (``masked_mean``, ``masked_whiten``, the loss aggregations), GAE and the
discounted returns step from one policy token to the next (``gae``), the sequence score
goes on the row's last policy token (``token_rewards``). ``tests/unit/algorithms/ppo/
test_holed_mask.py`` checks each against hand-computed values.

Masked positions are removed with ``torch.where`` selection, never by multiplying with
the mask, so a NaN/Inf sitting in a padded slot cannot reach an output or a gradient
(``0 * nan`` is ``nan``; ``where(mask, nan, 0)`` is ``0`` and its gradient is ``0``).

Simplified / left out (on purpose):

* No data-parallel logic here. Where statistics must span ranks (whitening), a
  ``reduce_fn`` hook is accepted and the caller supplies the all-reduce.
* Mask values are not checked to be exactly 0/1 (that would cost a device sync);
  any nonzero entry counts as valid.
* ``masked_mean`` of an empty selection is 0 (mirrors verl's ``+eps`` denominator), while
  ``masked_var`` / ``masked_whiten`` raise on too few valid elements, since a variance of
  zero or one sample has no meaning and silently returning one hides data bugs.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

__all__ = [
    "ReduceFn",
    "last_valid_index",
    "masked_mean",
    "masked_sum",
    "masked_spread",
    "masked_var",
    "masked_whiten",
]

#: Hook to all-reduce whitening statistics across data-parallel ranks:
#: ``(sum, sum_sq, count) -> (sum, sum_sq, count)``, each a 0-d fp32 tensor; it must return
#: the element-wise SUM over ranks (e.g. ``torch.stack`` + ``all_reduce(SUM)`` + unbind).
ReduceFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]


# --------------------------------------------------------------------------------------
# Input helpers (private, used by every module in this package)
# --------------------------------------------------------------------------------------


def _fp32(x: torch.Tensor, name: str) -> torch.Tensor:
    """Cast a floating tensor to fp32; reject non-tensors and non-float dtypes."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_complex():
        raise TypeError(f"{name} must be a real tensor, got dtype {x.dtype}")
    return x.to(torch.float32)


def _bool_mask(mask: torch.Tensor, name: str = "response_mask") -> torch.Tensor:
    """Return ``mask`` as a bool tensor (nonzero = valid)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    return mask if mask.dtype == torch.bool else mask != 0


def _check_2d(mask: torch.Tensor, name: str = "response_mask") -> None:
    if mask.dim() != 2:
        raise ValueError(
            f"{name} must be 2-D [batch, response_len], got shape {tuple(mask.shape)}"
        )


def _check_same_shape(ref: torch.Tensor, ref_name: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has shape "
                f"{tuple(ref.shape)}; they must match"
            )


def _select(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` on valid positions, exact 0 elsewhere (NaN/Inf-safe, gradient-safe)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


# --------------------------------------------------------------------------------------
# Public masked helpers
# --------------------------------------------------------------------------------------


def last_valid_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last valid token of each row.

    Works for right-padded (``1 1 1 0 0``), left-padded (``0 0 1 1 1``) and any other
    masks: it is the largest ``t`` with ``response_mask[b, t]`` true.

    Args:
        response_mask: ``[batch, response_len]`` bool or 0/1.

    Returns:
        ``[batch]`` int64; ``-1`` for a row with no valid token.

    Raises:
        ValueError: if ``response_mask`` is not 2-D.
    """
    _check_2d(response_mask)
    mask = _bool_mask(response_mask)
    batch, length = mask.shape
    if length == 0:
        return torch.full((batch,), -1, dtype=torch.long, device=mask.device)
    positions = torch.arange(length, device=mask.device).expand(batch, length)
    minus_one = torch.full_like(positions, -1)
    return torch.where(mask, positions, minus_one).amax(dim=1)


def masked_sum(
    x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None
) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is true, in fp32.

    Args:
        x: any shape, any float dtype.
        mask: same shape as ``x``, bool or 0/1.
        dim: reduce over this dimension; ``None`` reduces over all elements.

    Returns:
        fp32 tensor: 0-d when ``dim`` is None, else ``x.shape`` without ``dim``.

    Raises:
        ValueError: if the shapes differ.
    """
    x32 = _fp32(x, "x")
    _check_same_shape(x32, "x", mask=mask)
    m = _bool_mask(mask, "mask")
    selected = _select(m, x32)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None
) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is true, in fp32.

    Mirrors verl's ``masked_mean``, except that an empty selection gives exactly 0
    (verl divides by ``count + 1e-8``, which also gives 0).

    Args:
        x: any shape (typically ``[batch, response_len]``), any float dtype.
        mask: same shape as ``x``, bool or 0/1.
        dim: reduce over this dimension; ``None`` reduces over all elements.

    Returns:
        fp32 tensor: 0-d when ``dim`` is None, else ``x.shape`` without ``dim``.

    Raises:
        ValueError: if the shapes differ.
    """
    m = _bool_mask(mask, "mask")
    total = masked_sum(x, m, dim=dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp_min(1).to(torch.float32)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all positions where ``mask`` is true, in fp32.

    Two-pass (mean first, then centred squares) for accuracy in fp32. Mirrors verl's /
    TRL's ``masked_var`` (Bessel correction when ``unbiased``).

    Args:
        x: any shape, any float dtype.
        mask: same shape as ``x``, bool or 0/1.
        unbiased: divide by ``n - 1`` instead of ``n``.

    Returns:
        0-d fp32 tensor.

    Raises:
        ValueError: if the shapes differ, if no element is valid, or if ``unbiased`` and
            only one element is valid. (Checking this reads the count on the host.)
    """
    m = _bool_mask(mask, "mask")
    count = int(m.sum().item())
    if count == 0:
        raise ValueError("masked_var: the mask selects no element")
    if unbiased and count < 2:
        raise ValueError("masked_var: unbiased variance needs at least 2 valid elements, got 1")
    mean = masked_mean(x, m)
    centred = _fp32(x, "x") - mean
    sq = masked_sum(centred * centred, m)
    return sq / (count - 1 if unbiased else count)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    reduce_fn: Optional[ReduceFn] = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten ``x`` with the mean and (unbiased) variance of its valid positions.

    ``out = (x - mean) / sqrt(var + eps)`` on valid positions and 0 on masked ones. With
    ``shift_mean=False`` the mean is added back (``out + mean``): the scale is normalised
    but the sign/offset of the data is kept. This mirrors TRL's / verl's ``masked_whiten``
    (the usual advantage normalisation of PPO implementations, e.g. OpenAI baselines).

    Statistics (``sum``, ``sum_sq``, ``count`` as 0-d fp32 tensors) pass through
    ``reduce_fn`` so a trainer can all-reduce them across data-parallel ranks. It is
    called twice, in the same order on every rank: first with the statistics of ``x``
    (to get the global mean ``mu``), then with the statistics of ``x - mu`` (the corrected
    two-pass variance ``(S2 - S1^2 / n) / (n - 1)``, accurate in fp32 even when the mean
    is large compared with the spread). Every rank must call ``masked_whiten``.

    Args:
        x: any shape (typically ``[batch, response_len]``), any float dtype.
        mask: same shape as ``x``, bool or 0/1.
        shift_mean: subtract the mean (True) or keep it (False, see above).
        reduce_fn: optional ``(sum, sum_sq, count) -> (sum, sum_sq, count)`` SUM-reducer.
        eps: added to the variance before the square root.

    Returns:
        fp32 tensor shaped like ``x``; masked positions are exactly 0.

    Raises:
        ValueError: if the shapes differ or fewer than 2 elements are valid in total
            (after ``reduce_fn``). Checking this reads the count on the host.
    """
    x32 = _fp32(x, "x")
    _check_same_shape(x32, "x", mask=mask)
    m = _bool_mask(mask, "mask")
    reduce = reduce_fn if reduce_fn is not None else (lambda s, s2, n: (s, s2, n))

    local_count = m.sum().to(torch.float32)
    xs = _select(m, x32)
    total, _, count = reduce(xs.sum(), (xs * xs).sum(), local_count)
    n = float(count.item())
    if n < 2:
        raise ValueError(
            f"masked_whiten needs at least 2 valid elements in total to estimate a "
            f"variance, got {n:g}"
        )
    mean = total / count
    centred = _select(m, x32 - mean)
    c_sum, c_sq, count = reduce(centred.sum(), (centred * centred).sum(), local_count)
    var = ((c_sq - c_sum * c_sum / count) / (count - 1)).clamp_min(0.0)
    whitened = (x32 - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _select(m, whitened)


def masked_spread(
    x: torch.Tensor,
    mask: torch.Tensor,
    reduce_max_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """``max(x) - min(x)`` over the valid elements of ``x``: 0 exactly when they are all
    equal (no rounding: no variance is formed), 0 when no element is valid.

    The maximum and the negated minimum pass through ``reduce_max_fn`` (one call, a ``[2]``
    fp32 tensor reduced by MAX) so a trainer can take them over data-parallel ranks; a rank
    with no valid element contributes ``-inf`` and does not move the result. Every rank
    must call it. PPO uses it to tell a rollout whose sequence rewards all agree (nothing
    for the policy to learn from the reward) from one whose rewards vary.

    Args:
        x: ``[batch]`` (any shape) float; e.g. each sequence's task reward.
        mask: same shape as ``x``, bool or 0/1.
        reduce_max_fn: optional ``[2] fp32 -> [2] fp32`` element-wise MAX-reducer.

    Returns:
        0-d fp32 tensor on ``x``'s device, ``>= 0``.

    Raises:
        ValueError: if the shapes differ.
    """
    x32 = _fp32(x, "x")
    _check_same_shape(x32, "x", mask=mask)
    m = _bool_mask(mask, "mask")
    neg_inf = torch.full((1,), float("-inf"), dtype=torch.float32, device=x32.device)
    hi = torch.cat([torch.where(m, x32, neg_inf).flatten(), neg_inf]).max()
    lo_neg = torch.cat([torch.where(m, -x32, neg_inf).flatten(), neg_inf]).max()
    both = torch.stack([hi, lo_neg])
    if reduce_max_fn is not None:
        both = reduce_max_fn(both)
    spread = both[0] + both[1]
    return torch.where(torch.isfinite(spread), spread, torch.zeros_like(spread))
