"""The critic's error by response position: how well the value model holds along a long
response (issue #52, "the critic at length").

``value_error_pos_<lo>-<hi>`` is the mean absolute error ``|V(s_t) - R_t|`` of the critic's
values against its targets (the returns: ``lam_critic``'s, see :mod:`.gae`) over the policy
tokens whose response position ``t`` (the column of the ``[batch, response_len]`` response,
0 = the first response token; environment tokens of a holed row are skipped but counted in
the position) lies in ``[lo, hi]``. The buckets are log2-spaced: ``0-1``, ``2-3``, ``4-7``,
``8-15``, ... (bucket ``k >= 1`` holds ``[2^k, 2^(k+1) - 1]``), :data:`POSITION_BUCKETS` of
them, the same on every rank, so the per-bucket sums and counts of
:func:`value_error_by_position_sums` can be summed over data-parallel ranks in one
all-reduce and turned into means by :func:`value_error_by_position_from_sums` (a bucket no
token reached on any rank gives no metric).

Beside it the trainer logs ``explained_variance`` (``losses.explained_variance_sums``),
``1 - Var[R - V] / Var[R]`` over all policy tokens.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from nemo_rlhf.algorithms.ppo.core import _bool_mask, _check_2d, _check_same_shape, _fp32, _select

__all__ = ["POSITION_BUCKETS", "position_bucket_names", "value_error_by_position_from_sums",
           "value_error_by_position_sums"]

#: Number of log2 position buckets (the last holds every position >= 2^31).
POSITION_BUCKETS = 32


def position_bucket_names(n_buckets: int = POSITION_BUCKETS) -> list[str]:
    """The buckets' ``"<lo>-<hi>"`` names (inclusive): ``["0-1", "2-3", "4-7", ...]``; the
    last one is open-ended and named from its lower edge, ``"<lo>-"``."""
    names = ["0-1"] + [f"{2 ** k}-{2 ** (k + 1) - 1}" for k in range(1, n_buckets)]
    names[-1] = f"{2 ** (n_buckets - 1)}-" if n_buckets > 1 else "0-"
    return names


def value_error_by_position_sums(values: torch.Tensor, returns: torch.Tensor,
                                 response_mask: torch.Tensor,
                                 n_buckets: int = POSITION_BUCKETS) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per position bucket: the sum of ``|V - R|`` over this rank's policy tokens, and their
    number.

    Args:
        values: ``[batch, response_len]`` the critic's values (any float dtype; masked
            positions are not read, NaN there is fine).
        returns: ``[batch, response_len]`` its targets.
        response_mask: ``[batch, response_len]`` bool or 0/1 (the tokens that count).
        n_buckets: number of log2 buckets (>= 1; every rank must pass the same).

    Returns:
        ``(error_sums, counts)``, both ``[n_buckets]`` float32 on the inputs' device.

    Raises:
        ValueError: shape mismatch, or ``n_buckets < 1``.
    """
    if n_buckets < 1:
        raise ValueError(f"n_buckets must be >= 1, got {n_buckets}")
    _check_2d(response_mask)
    v = _fp32(values, "values").detach()
    r = _fp32(returns, "returns").detach()
    _check_same_shape(response_mask, "response_mask", values=v, returns=r)
    mask = _bool_mask(response_mask)
    err = _select(mask, (v - r).abs())
    length = mask.shape[1]
    positions = torch.arange(length, device=mask.device)
    edges = torch.tensor([2 ** k for k in range(1, n_buckets)], dtype=positions.dtype, device=mask.device)
    bucket = torch.searchsorted(edges, positions, right=True)  # 0,1 -> 0; 2,3 -> 1; 4..7 -> 2
    zeros = torch.zeros(n_buckets, dtype=torch.float32, device=mask.device)
    sums = zeros.index_add(0, bucket, err.sum(dim=0))
    counts = zeros.index_add(0, bucket, mask.sum(dim=0).to(torch.float32))
    return sums, counts


def value_error_by_position_from_sums(error_sums: torch.Tensor, counts: torch.Tensor,
                                      prefix: str = "critic/value_error_pos_") -> Dict[str, float]:
    """``{prefix + "<lo>-<hi>": mean |V - R|}`` for every bucket with a token, from
    :func:`value_error_by_position_sums` (possibly summed over ranks)."""
    names = position_bucket_names(error_sums.numel())
    return {prefix + name: s / n for name, s, n in zip(names, error_sums.tolist(), counts.tolist()) if n > 0}
