"""Packed micro-batches under context parallelism: megatron's THD layout (each sequence's
slot aligned to 2 * CP and cut into 2 * CP chunks), by hand on three sequences in two
packed rows (the CP=2 forward and losses: tests/distributed/test_ppo_context_parallel_budget.py)."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.cp_packing import KEYS_IN_RANK_ORDER, cp_packed_inputs, cp_packed_layout, shard_packed
from nemo_rlhf.models.packing import pack_rows

IDS = torch.tensor([[0, 0, 11, 12, 13, 14],
                    [21, 22, 23, 24, 25, 0],
                    [0, 31, 32, 33, 0, 0]])
SPANS = [(2, 5), (0, 5), (1, 4)]  # valid columns per row (P = 3, R = 3)
BINS = [[1], [0, 2]]


def _packed(align: int):
    return pack_rows(IDS, SPANS, BINS, prompt_length=3, align=align)


def test_pack_rows_aligns_every_sequence_slot():
    end_to_end = _packed(1)
    assert end_to_end.slots == ((5, 1), (3, 3))  # the first row's tail is a slot
    pk = _packed(4)
    assert pk.slots == ((8,), (4, 4))
    assert pk.input_ids.tolist() == [[21, 22, 23, 24, 25, 0, 0, 0], [11, 12, 13, 0, 31, 32, 33, 0]]
    assert pk.segment_ids.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 2, 2, 2, 0]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 0, 0], [0, 1, 2, 0, 0, 1, 2, 0]]
    assert pk.response_index.tolist() == [0, 1, 3, 4, 6]  # as end to end
    back = pk.unpack(pk.input_ids.reshape(-1, 1).float()).squeeze(-1).long()
    assert torch.equal(back, end_to_end.unpack(end_to_end.input_ids.reshape(-1, 1).float()).squeeze(-1).long())
    with pytest.raises(ValueError, match="align=0"):
        pack_rows(IDS, SPANS, BINS, prompt_length=3, align=0)


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r_of_every_slot():
    pk = _packed(4)
    r0, r1 = cp_packed_layout(pk, 2, 0), cp_packed_layout(pk, 2, 1)
    # row 0: one slot of 8 (chunks of 2); row 1: two slots of 4 (chunks of 1)
    assert r0.positions.tolist() == [[0, 1, 6, 7], [0, 3, 4, 7]]
    assert r1.positions.tolist() == [[2, 3, 4, 5], [1, 2, 5, 6]]
    assert r0.key_positions.tolist() == [[0, 1, 6, 7, 2, 3, 4, 5], [0, 3, 4, 7, 1, 2, 5, 6]]
    assert torch.equal(r0.key_positions, r1.key_positions)
    assert cp_packed_layout(pk, 2, 1) is r1  # kept on the packed batch


def test_targets_stay_within_a_sequence_and_every_response_token_is_predicted_once():
    pk = _packed(4)
    r0, r1 = cp_packed_layout(pk, 2, 0), cp_packed_layout(pk, 2, 1)
    # the next token of the same sequence; none across a slot boundary or into padding
    assert r0.targets.tolist() == [[22, 23, 0, 0], [12, 0, 32, 0]]
    assert r1.targets.tolist() == [[24, 25, 0, 0], [13, 0, 33, 0]]
    assert r0.predicts.tolist() == [[False] * 4, [True, False, False, False]]
    assert r1.predicts.tolist() == [[True, True, False, False], [True, False, True, False]]
    assert torch.where(r1.predicts, r1.response_index, -1).tolist() == [[3, 4, -1, -1], [1, -1, 6, -1]]
    got = sorted(r0.response_index[r0.predicts].tolist() + r1.response_index[r1.predicts].tolist())
    assert got == pk.response_index.tolist()
    resp = torch.arange(9).view(3, 3)  # [rows, R]
    assert shard_packed(resp, r1).tolist() == [[3, 4, 0, 0], [1, 0, 6, 0]]


def test_the_mask_keeps_attention_within_a_sequence_in_rank_order():
    pk = _packed(4)
    ids, pos_ids, mask = cp_packed_inputs(pk, cp_packed_layout(pk, 2, 1))
    assert getattr(mask, KEYS_IN_RANK_ORDER) and mask.shape == (2, 1, 4, 8)
    assert ids.tolist() == [[23, 24, 25, 0], [12, 13, 32, 33]]
    assert pos_ids.tolist() == [[2, 3, 4, 0], [1, 2, 1, 2]]
    allowed = ~mask[1, 0]  # keys: packed positions 0, 3, 4, 7 | 1, 2, 5, 6
    assert allowed[0].tolist() == [True, False, False, False, True, False, False, False]  # pos 1: 0, 1
    assert allowed[2].tolist() == [False, False, True, False, False, False, True, False]  # pos 5: 4, 5
    assert allowed[3].tolist() == [False, False, True, False, False, False, True, True]  # pos 6: 4, 5, 6


def test_a_batch_packed_without_alignment_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"ppo\.sequence_packing under parallel\.context_parallel_size=2"):
        cp_packed_layout(_packed(1), 2, 0)
