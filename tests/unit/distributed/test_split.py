"""The one chunker and the one data-parallel split (``nemo_rlhf.distributed.split``, #50):
their edge cases, and that they cut exactly as the hand-written loops they replace did (a
change of order or of a rank's share would change metrics)."""

from __future__ import annotations

import pytest

from nemo_rlhf.distributed.split import chunk_slices, chunks, dp_shard, dp_slice


@pytest.mark.parametrize("n, size, want", [
    (0, 3, []),
    (1, 3, [slice(0, 1)]),
    (3, 3, [slice(0, 3)]),
    (7, 3, [slice(0, 3), slice(3, 6), slice(6, 7)]),
    (6, 1, [slice(i, i + 1) for i in range(6)]),
    (2, 5, [slice(0, 2)]),
])
def test_chunk_slices_cut_in_order_the_last_one_shorter(n, size, want):
    assert chunk_slices(n, size) == want
    # what the replaced loops cut: items[i:i + size] for i in range(0, n, size)
    items = list(range(n))
    assert [items[s] for s in chunk_slices(n, size)] == [items[i:i + size] for i in range(0, n, size)]
    assert chunks(items, size) == [items[i:i + size] for i in range(0, n, size)]


@pytest.mark.parametrize("size", [0, -2, 1.5, True])
def test_a_chunk_size_below_one_is_refused_naming_it(size):
    with pytest.raises(ValueError, match=rf"chunk size={size!r}: must be an integer >= 1"):
        chunk_slices(4, size)
    with pytest.raises(ValueError, match="n=-1"):
        chunk_slices(-1, 2)


def test_chunks_of_a_tuple_and_a_tensor_keep_the_order():
    import torch

    assert chunks((5, 4, 3, 2, 1), 2) == [[5, 4], [3, 2], [1]]
    t = torch.arange(5)
    assert [t[s].tolist() for s in chunk_slices(len(t), 2)] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("n, dp", [(0, 1), (0, 3), (2, 3), (7, 3), (8, 4), (9, 2), (1, 1), (5, 8)])
def test_dp_shares_are_contiguous_in_rank_order_and_differ_by_at_most_one(n, dp):
    items = list(range(n))
    shares = [dp_shard(items, r, dp) for r in range(dp)]
    assert sum(shares, []) == items
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    # the formula of the loops it replaces (trainers.common.dp_shard, the RM scorer's, evaluate's)
    for r in range(dp):
        assert dp_slice(n, r, dp) == slice(n * r // dp, n * (r + 1) // dp)


def test_with_dp_dividing_n_each_rank_takes_n_over_dp_from_rank_times_that():
    """``dp_group_slice``'s old ``[r * per, (r + 1) * per)`` is the same cut."""
    n, dp = 12, 4
    per = n // dp
    assert [dp_slice(n, r, dp) for r in range(dp)] == [slice(r * per, (r + 1) * per) for r in range(dp)]


def test_with_fewer_items_than_ranks_some_ranks_get_none():
    assert [dp_shard(["a", "b"], r, 3) for r in range(3)] == [[], ["a"], ["b"]]


@pytest.mark.parametrize("rank, dp", [(-1, 2), (2, 2), (0, 0)])
def test_a_rank_outside_the_group_is_refused(rank, dp):
    with pytest.raises(ValueError, match=rf"dp_rank={rank}, dp={dp}"):
        dp_slice(4, rank, dp)
