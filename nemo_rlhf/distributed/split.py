"""How work is cut: the one chunker and the one data-parallel split of the package.

* :func:`chunk_slices` / :func:`chunks`: ``[0, n)`` in consecutive pieces of ``size``, in
  order, the last one shorter (micro-batches, mini-batches, request chunks, token chunks).
* :func:`dp_slice` / :func:`dp_shard`: a DP rank's contiguous share of ``n`` items, rank
  ``r`` taking ``[n * r // dp, n * (r + 1) // dp)``: shares differ by at most one item,
  and concatenated in rank order they are the items in their order (so the rank of an item, and everything seeded by it, depends on ``n`` and
  ``dp`` alone).

Both keep the items' order: a caller's order of items decides which rows meet in one
micro-batch and which rank samples them, so a change of order changes metrics.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["chunk_slices", "chunks", "dp_shard", "dp_slice"]


def chunk_slices(n: int, size: int) -> list[slice]:
    """``[0, n)`` in consecutive slices of ``size`` items, in order (the last may be shorter).

    Args:
        n: the number of items, >= 0.
        size: items per slice, >= 1.

    Returns:
        ``ceil(n / size)`` slices ``slice(i, min(i + size, n))`` (``[]`` for ``n == 0``).

    Raises:
        ValueError: ``size < 1`` or ``n < 0``, naming the value.
    """
    if isinstance(size, bool) or int(size) != size or size < 1:
        raise ValueError(f"chunk size={size!r}: must be an integer >= 1")
    if n < 0:
        raise ValueError(f"chunk_slices: n={n}: must be >= 0")
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def chunks(items: Sequence, size: int) -> list[list]:
    """``items`` in consecutive lists of ``size`` (the last may be shorter), in order.

    Raises:
        ValueError: ``size < 1`` (:func:`chunk_slices`).
    """
    return [list(items[s]) for s in chunk_slices(len(items), size)]


def dp_slice(n: int, dp_rank: int, dp: int) -> slice:
    """Data-parallel rank ``dp_rank``'s contiguous share of ``n`` items:
    ``slice(n * dp_rank // dp, n * (dp_rank + 1) // dp)``.

    Shares differ by at most one item; a rank may get none when ``n < dp``. When ``dp`` divides ``n`` every rank gets ``n // dp`` items,
    rank ``r`` those from ``r * n // dp``.

    Raises:
        ValueError: ``dp < 1``, ``dp_rank`` outside ``[0, dp)`` or ``n < 0``.
    """
    if dp < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank}, dp={dp}: need dp >= 1 and 0 <= dp_rank < dp")
    if n < 0:
        raise ValueError(f"dp_slice: n={n}: must be >= 0")
    return slice(n * dp_rank // dp, n * (dp_rank + 1) // dp)


def dp_shard(items: Sequence, dp_rank: int, dp: int) -> list:
    """This DP rank's contiguous share of ``items`` (:func:`dp_slice`), as a list."""
    return list(items[dp_slice(len(items), dp_rank, dp)])
