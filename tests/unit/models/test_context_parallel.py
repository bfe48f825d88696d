"""The host-side pieces of context parallelism: megatron's load-balanced chunk layout,
sharding, the globally shifted next-token targets, and the jobs that refuse CP > 1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_rlhf.distributed.parallel import ParallelConfig
from nemo_rlhf.models.context_parallel import (cp_next_token_targets, cp_positions,
                                               refuse_context_parallel, shard_sequence)


def _dims(cp: int, cp_rank: int):
    return SimpleNamespace(cp=cp, cp_rank=cp_rank)


def test_positions_are_chunks_r_and_2cp_minus_1_minus_r():
    # S=8, CP=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # CP=3, S=12: chunks of 2; rank 1 holds chunks 1 and 4
    assert cp_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert sorted(torch.cat([cp_positions(12, 3, r) for r in range(3)]).tolist()) == list(range(12))
    assert cp_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]


def test_length_not_divisible_by_2cp_names_the_key():
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2 \* "
                                         r"parallel\.context_parallel_size = 4"):
        cp_positions(10, 2, 0)


def test_shard_selects_the_ranks_positions_along_dim():
    t = torch.arange(16).view(2, 8)
    assert shard_sequence(t, _dims(2, 1)).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert shard_sequence(t, _dims(1, 0)) is t
    m = torch.arange(64).view(1, 1, 8, 8)
    assert shard_sequence(m, _dims(2, 0), dim=2)[0, 0, :, 0].tolist() == [0, 8, 48, 56]


def test_targets_are_shifted_before_sharding():
    # the target of a chunk's last token is the first token of the next chunk, held by
    # another rank: ids 10..17, rank 0 holds positions 0,1,6,7 -> targets 11,12,17,(none)
    ids = torch.arange(10, 18).view(1, 8)
    targets, has = cp_next_token_targets(ids, _dims(2, 0))
    assert targets.tolist() == [[11, 12, 17, 0]]
    assert has.tolist() == [[True, True, True, False]]
    targets, has = cp_next_token_targets(ids, _dims(2, 1))  # positions 2..5
    assert targets.tolist() == [[13, 14, 15, 16]]
    assert has.all()


@pytest.mark.parametrize("job", ["PPO trainer", "RM server"])
def test_jobs_not_wired_refuse_cp_naming_the_key(job):
    refuse_context_parallel(ParallelConfig(), job)  # CP=1: nothing to refuse
    with pytest.raises(ValueError, match=rf"parallel\.context_parallel_size=2 in the {job}: context "
                                         rf"parallelism is not wired into the {job} yet.*set "
                                         rf"parallel\.context_parallel_size=1"):
        refuse_context_parallel(ParallelConfig(context_parallel_size=2), job)
