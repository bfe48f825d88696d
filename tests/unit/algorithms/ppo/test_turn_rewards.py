"""``turn_reward_tensor`` (#51, ``env.turn_rewards=per_turn``): rewards at chosen positions of
a holed mask, by hand. Layout (P = policy token, E = environment token, . = padding)::

    row 0:  P P E E P .     mask [1, 1, 0, 0, 1, 0]   turn 1 ends at 1, turn 2 at 4
    row 1:  P E P . . .     mask [1, 0, 1, 0, 0, 0]   turn 1 ends at 0, turn 2 at 2
"""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.algorithms.ppo import compute_token_rewards, turn_reward_tensor

MASK = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 0]], dtype=torch.bool)


def test_each_reward_sits_at_its_position_and_nothing_elsewhere():
    out = turn_reward_tensor([[(1, 0.5), (4, -1.0)], [(2, 2.0)]], MASK)
    assert out.dtype == torch.float32 and out.shape == (2, 6)
    assert out.tolist() == [[0.0, 0.5, 0.0, 0.0, -1.0, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0, 0.0]]


def test_rewards_at_one_position_add_up_and_a_row_without_any_is_zero():
    out = turn_reward_tensor([[], [(0, 0.25), (0, 0.5), (2, 1.0)]], MASK.int())
    assert out.tolist() == [[0.0] * 6, [0.75, 0.0, 1.0, 0.0, 0.0, 0.0]]
    assert turn_reward_tensor([[], []], MASK).tolist() == [[0.0] * 6] * 2


def test_added_to_the_token_rewards_the_score_stays_on_the_last_policy_token():
    # beta = 0: the token rewards are the score (3, -1) on the last policy token (4, 2)
    rewards, _ = compute_token_rewards(torch.zeros(2, 6), torch.zeros(2, 6), torch.tensor([3.0, -1.0]), MASK, 0.0)
    total = rewards + turn_reward_tensor([[(1, 0.5), (4, 1.0)], [(0, 2.0)]], MASK)
    assert total.tolist() == [[0.0, 0.5, 0.0, 0.0, 4.0, 0.0], [2.0, 0.0, -1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("placements, needle", [
    ([[(2, 1.0)], []], r"\(row, position\) \[\(0, 2\)\]: a reward must sit on a valid"),  # an environment token
    ([[], [(5, 1.0)]], r"\(row, position\) \[\(1, 5\)\]"),  # padding
    ([[(6, 1.0)], []], "row 0: position 6 is outside the response"),
    ([[], [(-1, 1.0)]], "row 1: position -1 is outside"),
    ([[(1, float("nan"))], []], "row 0: reward nan at position 1 is not finite"),
    ([[(1, 1.0)]], "placements has 1 rows, response_mask has 2"),
])
def test_bad_placements_are_refused_naming_the_row(placements, needle):
    with pytest.raises(ValueError, match=needle):
        turn_reward_tensor(placements, MASK)
