"""The host-side pieces of context parallelism: megatron's load-balanced chunk layout,
sharding, the globally shifted next-token targets, and the jobs that refuse CP > 1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_rlhf.distributed.parallel import ParallelConfig
from nemo_rlhf.models.context_parallel import (cp_fused_logprobs, cp_logprob_request, cp_next_token_targets,
                                               cp_positions, cp_response_index, cp_routes, cp_token_logprobs,
                                               gather_response, pad_to_cp_multiple, refuse_context_parallel,
                                               shard_response, shard_sequence)


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


@pytest.mark.parametrize("job", ["evaluate job", "RM server"])
def test_jobs_not_wired_refuse_cp_naming_the_key(job):
    refuse_context_parallel(ParallelConfig(), job)  # CP=1: nothing to refuse
    with pytest.raises(ValueError, match=rf"parallel\.context_parallel_size=2 in the {job}: context "
                                         rf"parallelism is not wired into the {job} yet.*set "
                                         rf"parallel\.context_parallel_size=1"):
        refuse_context_parallel(ParallelConfig(context_parallel_size=2), job)


def test_response_index_maps_each_position_to_the_token_it_predicts():
    # S=8 (padded), P=3, R=4: position t predicts response token t - 2 (t = 2..5); position
    # 6 would predict token 4 (CP padding, >= R) and 7 has no target
    index, valid = cp_response_index(8, 3, 4, _dims(2, 0))  # positions 0, 1, 6, 7
    assert valid.tolist() == [False, False, False, False]
    index, valid = cp_response_index(8, 3, 4, _dims(2, 1))  # positions 2, 3, 4, 5
    assert index.tolist() == [0, 1, 2, 3] and valid.all()
    index, valid = cp_response_index(8, 2, 6, _dims(2, 0))  # P=2: positions 1, 6, 7 -> 0, 5, (6)
    assert valid.tolist() == [False, True, True, False]
    assert index[1:3].tolist() == [0, 5]


def test_shard_response_puts_r_columns_on_the_ranks_positions_zero_elsewhere():
    t = torch.tensor([[10.0, 11.0, 12.0, 13.0, 14.0, 15.0]])  # [1, R=6], P=2, S=8
    index, valid = cp_response_index(8, 2, 6, _dims(2, 0))  # positions 0, 1, 6, 7
    assert shard_response(t, index, valid).tolist() == [[0.0, 10.0, 15.0, 0.0]]
    index, valid = cp_response_index(8, 2, 6, _dims(2, 1))  # positions 2..5 -> tokens 1..4
    assert shard_response(t, index, valid).tolist() == [[11.0, 12.0, 13.0, 14.0]]
    mask = torch.tensor([[True, True, False, True, True, True]])
    assert shard_response(mask, index, valid).tolist() == [[True, False, True, True]]


def test_gather_response_at_cp1_is_the_response_slice():
    local = torch.arange(8.0).view(1, 8)  # position t's output = t
    dims = SimpleNamespace(cp=1, cp_rank=0)
    assert gather_response(local, 3, 4, dims).tolist() == [[2.0, 3.0, 4.0, 5.0]]


def test_pad_to_a_multiple_of_2cp():
    t = torch.ones(2, 5, dtype=torch.long)
    padded = pad_to_cp_multiple(t, 2, value=0)
    assert padded.shape == (2, 8) and padded[:, 5:].eq(0).all() and padded[:, :5].eq(1).all()
    assert pad_to_cp_multiple(torch.ones(1, 8), 2) .shape == (1, 8)
    assert pad_to_cp_multiple(t, 1) is t
    assert pad_to_cp_multiple(t, 3).shape == (2, 6)


def test_fused_request_selects_the_ranks_positions_that_predict_response_tokens():
    from nemo_rlhf.models.logprobs import LogprobRequest

    ids = torch.arange(10, 26).view(2, 8)  # B=2, S=8, P=3: positions 2..6 predict tokens 3..7
    req = LogprobRequest(3, (1.0,), 100, chunk_size=2)
    r0 = cp_logprob_request(req, ids, 2, 0)  # positions 0, 1, 6, 7: only 6 (7 has no target)
    assert r0.select.tolist() == [2, 6] and r0.targets.tolist() == [[11, 12, 17, 0], [19, 20, 25, 0]]
    r1 = cp_logprob_request(req, ids, 2, 1)  # positions 2..5: all
    assert r1.select.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


def test_fused_cp_logprobs_equal_the_logits_path_on_the_selected_positions():
    from nemo_rlhf.models.logprobs import LogprobRequest

    g = torch.Generator().manual_seed(0)
    B, S, H, V = 2, 8, 6, 11
    ids = torch.randint(0, V, (B, S), generator=g)
    hidden = torch.randn(S // 2, B, H, generator=g)  # rank 1's 4 positions, [s, B, H]
    weight = torch.randn(V, H, generator=g)
    one = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    dims = SimpleNamespace(cp=2, cp_rank=1, tp_group=None, tp_rank=0)
    request = cp_logprob_request(LogprobRequest(4, (0.7, 1.0), V, chunk_size=3), ids, 2, 1)
    out = cp_fused_logprobs(hidden, weight, request, one)
    logits = torch.matmul(hidden.transpose(0, 1), weight.t())  # [B, s, V]
    for t in (0.7, 1.0):
        want, ent = cp_token_logprobs(logits, ids, dims, t, vocab_size=V)
        keep = torch.tensor([False, True, True, True])  # positions 2..5; P=4: from 3 on
        torch.testing.assert_close(out.logprobs[t][:, keep], want[:, keep], atol=1e-5, rtol=0)
        assert out.logprobs[t][:, ~keep].eq(0).all()
        if t == 0.7:
            torch.testing.assert_close(out.entropy[:, keep], ent[:, keep], atol=1e-5, rtol=0)
        got, _ = cp_token_logprobs(out, ids, dims, t)  # the fused output read back as is
        assert got is out.logprobs[t]


def test_routes_are_padded_with_minus_one_and_cut_like_the_ids():
    # [B=1, S0=6, L=1, k=1]: expert = column; padded to 8 columns, CP=2: rank 0 holds 0, 1, 6, 7
    # and rank 1 holds 2-5 (columns 6 and 7 are the padding: -1, the router's own choice)
    routes = torch.arange(6).view(1, 6, 1, 1)
    assert cp_routes(routes, 8, 2, 0).flatten().tolist() == [0, 1, -1, -1]
    assert cp_routes(routes, 8, 2, 1).flatten().tolist() == [2, 3, 4, 5]
    assert cp_routes(routes, 6, 1, 0).flatten().tolist() == list(range(6))
    with pytest.raises(ValueError, match=r"routing replay under parallel\.context_parallel_size=2: the routes "
                                         r"cover 6 columns, the micro-batch 4"):
        cp_routes(routes, 4, 2, 0)
