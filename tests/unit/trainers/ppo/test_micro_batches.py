"""Token-budget micro-batches: every row once, the budget kept, padding cut, rows put back."""

from __future__ import annotations

import pytest
import torch

from types import SimpleNamespace

from nemo_rlhf.trainers.ppo.micro_batches import (pad_for_context_parallel, plan_micro_batches, row_extents,
                                                  scatter_rows, take, training_minibatches)

P = 4
# rows: first prompt column (left padding before it) and response length
STARTS = [0, 2, 3, 1, 2]
LENGTHS = [3, 1, 5, 2, 0]
HOST = torch.device("cpu")


def test_plans_cover_every_row_once_within_the_budget_longest_first():
    plans = plan_micro_batches(STARTS, LENGTHS, P, rows=[4, 0, 1, 2, 3], max_rows=8, max_tokens=18)
    # spans (P - start + max(1, len)): row0 7, row1 3, row2 6, row3 5, row4 3; rows 0 and 2
    # keep 4 + 5 columns (18 tokens; a third row would make 27), rows 3, 1, 4 keep 3 + 2
    assert [p.rows for p in plans] == [(0, 2), (3, 1, 4)]
    assert [(p.start, p.prompt_length, p.response_length) for p in plans] == [(0, 4, 5), (1, 3, 2)]
    assert [p.tokens for p in plans] == [18, 15]
    assert [p.rows for p in plan_micro_batches(STARTS, LENGTHS, P, [0, 1, 2, 3, 4], 8, 14)] == \
        [(0,), (2,), (3, 1), (4,)]
    # a row longer than the budget is a micro-batch alone; max_rows caps the rows
    assert [p.rows for p in plan_micro_batches(STARTS, LENGTHS, P, [0, 1], 8, 2)] == [(0,), (1,)]
    assert [p.rows for p in plan_micro_batches(STARTS, LENGTHS, P, [0, 1, 2, 3, 4], 2, 1000)] == \
        [(0, 2), (3, 1), (4,)]
    with pytest.raises(ValueError, match="max_tokens=0"):
        plan_micro_batches(STARTS, LENGTHS, P, [0], 1, 0)


def test_take_cuts_the_padding_and_scatter_puts_the_rows_back():
    B, R = 5, 5
    attention = torch.zeros(B, P + R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.bool)
    for r, (s, n) in enumerate(zip(STARTS, LENGTHS)):
        attention[r, s:P + n] = 1
        response_mask[r, :n] = True
    assert row_extents(attention, response_mask, P) == (STARTS, LENGTHS)
    ids = torch.arange(B * (P + R)).view(B, P + R)
    per_token = torch.arange(B * R, dtype=torch.float32).view(B, R)
    tensors = {"input_ids": ids, "attention_mask": attention, "advantages": per_token}
    plans = plan_micro_batches(STARTS, LENGTHS, P, list(range(B)), B, 18)
    mbs = [take(p, tensors, P, HOST) for p in plans]
    first = mbs[0]  # rows 0 and 2: no common left padding, longest response 5
    assert first["prompt_length"] == 4 and first["input_ids"].shape == (2, 9)
    second = mbs[1]  # rows 3, 1, 4: column 0 is padding in all three, longest response 2
    assert second["prompt_length"] == 3 and torch.equal(second["input_ids"], ids[[3, 1, 4], 1:6])
    assert torch.equal(second["advantages"], per_token[[3, 1, 4], :2])
    # every valid token survives the cut
    kept = sum(int(mb["attention_mask"].sum()) for mb in mbs)
    assert kept == int(attention.sum())
    back = scatter_rows(plans, [mb["advantages"] for mb in mbs], B, R)
    assert torch.equal(back[response_mask], per_token[response_mask])


def test_row_extents_keep_every_policy_token_of_a_holed_mask():
    # #51: a multi-turn row "P P E E P" (E: environment tokens, loss mask 0) must keep its
    # columns up to the last policy token (5), not the count of policy tokens (3), which
    # would cut the last turn out of the micro-batch.
    attention = torch.ones(2, P + 5, dtype=torch.long)
    attention[1, :2] = 0  # row 1: two prompt columns of left padding
    response_mask = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 1, 0, 0]], dtype=torch.bool)
    assert row_extents(attention, response_mask, P) == ([0, 2], [5, 3])
    starts, lengths = row_extents(attention, response_mask, P)
    per_token = torch.arange(10, dtype=torch.float32).view(2, 5)
    tensors = {"input_ids": torch.arange(2 * (P + 5)).view(2, P + 5), "attention_mask": attention,
               "response_mask": response_mask, "advantages": per_token}
    plans = plan_micro_batches(starts, lengths, P, [0, 1], 2, 100)
    mbs = [take(p, tensors, P, HOST) for p in plans]
    assert sum(int(mb["response_mask"].sum()) for mb in mbs) == 5  # every policy token kept
    back = scatter_rows(plans, [mb["advantages"] for mb in mbs], 2, 5)
    assert torch.equal(back[response_mask], per_token[response_mask])


def test_packing_keeps_the_environment_tokens_of_a_holed_row():
    # #51: packed, a holed row's span runs to its last policy token, environment tokens
    # included (the forward needs them as context); log-probs are taken on every column of
    # the span (8 = 5 + 3) and the loss mask picks the policy ones afterwards.
    attention = torch.ones(2, P + 5, dtype=torch.long)
    attention[1, :2] = 0
    attention[1, P + 3:] = 0
    response_mask = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 1, 0, 0]], dtype=torch.bool)
    ids = torch.arange(1, 1 + 2 * (P + 5)).view(2, P + 5)
    tensors = {"input_ids": ids, "attention_mask": attention, "response_mask": response_mask}
    starts, lengths = row_extents(attention, response_mask, P)
    plans = plan_micro_batches(starts, lengths, P, [0, 1], 2, 100, pack=True)
    (mb,) = [take(p, tensors, P, HOST) for p in plans]
    packed = mb["packed"]
    assert packed.response_index.numel() == 8
    kept = sorted(int(x) for x in packed.input_ids.flatten() if x > 0)
    assert kept == sorted(int(x) for x in ids[attention.bool()])  # every real token, env ones too


def test_context_parallel_pads_the_columns_to_2cp_and_keeps_the_response_tensors():
    B, S, R = 4, 9, 5  # 9 columns -> 12 at CP=2 (2 * CP = 4)
    tensors = {"input_ids": torch.arange(B * S).view(B, S), "attention_mask": torch.ones(B, S, dtype=torch.long),
               "response_mask": torch.ones(B, R, dtype=torch.bool), "advantages": torch.ones(B, R)}
    mb = pad_for_context_parallel(tensors, 2)
    assert mb["input_ids"].shape == (B, 12) and mb["attention_mask"].shape == (B, 12)
    assert torch.equal(mb["input_ids"][:, :S], tensors["input_ids"]) and mb["input_ids"][:, S:].eq(0).all()
    assert mb["attention_mask"][:, S:].eq(0).all()  # the padding is masked
    assert mb["advantages"] is tensors["advantages"] and mb["response_mask"] is tensors["response_mask"]
    assert pad_for_context_parallel(tensors, 1) is tensors
    c = SimpleNamespace(ppo_epochs=1, shuffle=False, micro_batch_size=2, max_tokens_per_micro_batch=0,
                        sequence_packing=False, packed_row_length=0)
    (micro, n_tokens, n_seqs, _, computed), = training_minibatches(
        c, tensors, B, 4, tensors["attention_mask"], tensors["response_mask"], HOST, lambda t: t, seed=0, cp=2)
    assert [m["input_ids"].shape for m in micro] == [(2, 12), (2, 12)]
    assert float(n_tokens) == B * R and float(n_seqs) == B  # the counts are the whole rows'
    assert computed == B * 12
