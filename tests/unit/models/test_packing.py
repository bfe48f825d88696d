"""Sequence packing: bins, the packed layout and its way back, the packed planner."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.packing import first_fit_decreasing, pack_rows
from nemo_rlhf.trainers.ppo.config import PPOAlgoConfig
from nemo_rlhf.trainers.ppo.micro_batches import plan_micro_batches, take

P = 4
STARTS = [0, 2, 3, 1, 2]  # first prompt column per row (left padding before it)
LENGTHS = [3, 1, 5, 2, 0]  # response tokens per row


def test_first_fit_decreasing_places_each_item_once_within_capacity():
    assert first_fit_decreasing([3, 7, 2, 5, 1], 8) == [[1, 4], [3, 0], [2]]
    assert first_fit_decreasing([9, 2], 4) == [[0], [1]]  # too long: a bin of its own
    with pytest.raises(ValueError, match="capacity=0"):
        first_fit_decreasing([1], 0)


def test_pack_rows_lays_out_sequences_end_to_end_and_unpacks_them_back():
    ids = torch.tensor([[0, 0, 11, 12, 13, 14],
                        [21, 22, 23, 24, 25, 0],
                        [0, 31, 32, 33, 0, 0]])
    spans = [(2, 5), (0, 5), (1, 4)]  # valid columns per row (P = 3)
    pk = pack_rows(ids, spans, [[1], [0, 2]], prompt_length=3)
    assert pk.input_ids.tolist() == [[21, 22, 23, 24, 25, 0], [11, 12, 13, 31, 32, 33]]
    assert pk.segment_ids.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 2, 2, 2]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1, 2]]
    assert pk.tokens() == 12
    # every padded position gets its packed token back; padding reads as zeros
    back = pk.unpack(pk.input_ids.reshape(-1, 1).float()).squeeze(-1).long()
    assert torch.equal(back, ids * (torch.arange(6) >= torch.tensor([2, 0, 1]).unsqueeze(1))
                       * (torch.arange(6) < torch.tensor([5, 5, 4]).unsqueeze(1)))
    # valid response tokens: columns 3..b-1 of each row, flat into [rows, R = 3]
    assert pk.response_index.tolist() == [0, 1, 3, 4, 6]
    # block-diagonal causal mask: row 1's second sequence never sees the first
    allowed = ~pk.attention_mask()[1, 0]
    assert allowed[4].tolist() == [False, False, False, True, True, False]
    assert allowed[2].tolist() == [True, True, True, False, False, False]
    assert (~pk.attention_mask()[0, 0])[5].tolist() == [False] * 5 + [True]  # padding: itself only


def test_unpack_is_differentiable_into_the_packed_positions():
    ids = torch.tensor([[0, 5, 6], [7, 8, 0]])
    pk = pack_rows(ids, [(1, 3), (0, 2)], [[0, 1]], prompt_length=2)
    assert pk.input_ids.tolist() == [[5, 6, 7, 8]]
    packed = torch.arange(4, dtype=torch.float32, requires_grad=True)
    (pk.unpack(packed) * torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])).sum().backward()
    assert packed.grad.tolist() == [2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("spans, bins, match", [
    ([(0, 2)], [[0]], "must cover"),
    ([(0, 2), (0, 2)], [[0], [0]], "must cover"),
    ([(2, 3), (0, 2)], [[0, 1]], "row 0 span"),  # starts inside the response
    ([(0, 4), (0, 2)], [[0, 1]], "row 0 span"),  # beyond the columns
])
def test_pack_rows_rejects_bad_layouts(spans, bins, match):
    with pytest.raises(ValueError, match=match):
        pack_rows(torch.ones(2, 3, dtype=torch.long), spans, bins, prompt_length=2)


def test_the_packed_planner_fills_rows_and_keeps_the_budget():
    # valid tokens: row0 7, row1 3, row2 6, row3 5, row4 2; packed rows of 8 tokens
    plans = plan_micro_batches(STARTS, LENGTHS, P, [0, 1, 2, 3, 4], 8, 16, pack=True, row_length=8)
    rows = sorted(r for p in plans for r in p.rows)
    assert rows == [0, 1, 2, 3, 4]
    assert all(p.tokens <= 16 for p in plans)
    bins = [[p.rows[i] for i in b] for p in plans for b in p.bins]
    assert bins == [[0], [2, 4], [3, 1]]
    # the padded plan costs more for the same rows
    padded = plan_micro_batches(STARTS, LENGTHS, P, [0, 1, 2, 3, 4], 8, 16)
    assert sum(p.tokens for p in plans) < sum(p.tokens for p in padded)
    # row_length 0: rows as long as the longest sequence (7)
    assert [[p.rows[i] for i in b] for p in plan_micro_batches(STARTS, LENGTHS, P, [0, 1, 2, 3, 4], 8, 100,
                                                                pack=True) for b in p.bins] == \
        [[0], [2], [3, 4], [1]]


def test_take_builds_the_packed_batch_of_a_packed_plan():
    B, R = 5, 5
    attention = torch.zeros(B, P + R, dtype=torch.long)
    for r, (s, n) in enumerate(zip(STARTS, LENGTHS)):
        attention[r, s:P + n] = 1
    ids = (torch.arange(B * (P + R)).view(B, P + R) + 1) * attention
    plans = plan_micro_batches(STARTS, LENGTHS, P, list(range(B)), B, 16, pack=True, row_length=8)
    total = 0
    for plan in plans:
        mb = take(plan, {"input_ids": ids, "attention_mask": attention}, P, torch.device("cpu"))
        pk = mb["packed"]
        assert pk.padded_input_ids is mb["input_ids"] and pk.prompt_length == mb["prompt_length"]
        # the packed rows hold exactly the micro-batch's valid tokens
        assert sorted(pk.input_ids[pk.segment_ids > 0].tolist()) == \
            sorted(mb["input_ids"][mb["attention_mask"].bool()].tolist())
        total += int((pk.segment_ids > 0).sum())
    assert total == int(attention.sum())


def test_sequence_packing_needs_a_token_budget():
    with pytest.raises(ValueError, match="ppo.max_tokens_per_micro_batch"):
        PPOAlgoConfig(sequence_packing=True)
    with pytest.raises(ValueError, match="ppo.packed_row_length"):
        PPOAlgoConfig(packed_row_length=-1)
    assert PPOAlgoConfig(sequence_packing=True, max_tokens_per_micro_batch=64).sequence_packing

