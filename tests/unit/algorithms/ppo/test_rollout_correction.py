"""Rollout-vs-train mismatch correction (truncated IS, AReaL's cap mask, row masking)
against hand-computed weights, and its effect on the policy loss."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rlhf.algorithms.ppo.losses import finalize_token_stats, policy_loss
from nemo_rlhf.algorithms.ppo.rollout_correction import rollout_correction_weights

TRAIN = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -0.3, -0.3, -0.3]])
ROLLOUT = torch.tensor([[-1.2, -1.0, -0.5, 9.0], [-0.4, -0.2, -0.3, -0.3]])
MASK = torch.tensor([[True, True, True, False], [True, True, True, True]])


def test_truncated_importance_weights_by_hand():
    w, stats = rollout_correction_weights(TRAIN, ROLLOUT, MASK, tis_cap=1.1)
    # row 0: log ratios 0.2, -1.0, 0 -> exp 1.2214 (capped 1.1), 0.3679, 1; padding 0
    # row 1: 0.1, -0.1, 0, 0 -> 1.1052 (capped 1.1), 0.9048, 1, 1
    expected = torch.tensor([[1.1, math.exp(-1.0), 1.0, 0.0], [1.1, math.exp(-0.1), 1.0, 1.0]])
    torch.testing.assert_close(w, expected)
    out = finalize_token_stats(stats)
    assert out["valid_tokens"] == 7
    assert out["mismatch"] == pytest.approx((0.2 + 1.0 + 0 + 0.1 + 0.1 + 0 + 0) / 7, rel=1e-5)
    assert out["mismatch_max"] == pytest.approx(1.0)
    assert out["is_truncated_fraction"] == pytest.approx(2 / 7)
    assert out["is_weight"] == pytest.approx(float(expected.sum()) / 7, rel=1e-6)
    assert out["is_weight_max"] == pytest.approx(1.1)
    assert out["masked_fraction"] == 0.0


def test_rows_with_a_token_past_the_threshold_are_masked_whole():
    w, stats = rollout_correction_weights(TRAIN, ROLLOUT, MASK, mask_threshold=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0] * 4, [1.0] * 4]))  # row 0 has |-1.0| > 0.5
    out = finalize_token_stats(stats)
    assert out["masked_fraction"] == pytest.approx(3 / 7) and out["is_weight"] == pytest.approx(4 / 7)
    # both: the kept row's weights are truncated as before
    w, _ = rollout_correction_weights(TRAIN, ROLLOUT, MASK, tis_cap=1.05, mask_threshold=0.5)
    torch.testing.assert_close(w[1], torch.tensor([1.05, math.exp(-0.1), 1.0, 1.0]))
    assert w[0].abs().max() == 0


def test_identical_engines_give_unit_weights_and_an_unchanged_policy_loss():
    lp = TRAIN.clone().requires_grad_(True)
    old, adv = TRAIN - 0.05, torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.3, 0.2, -0.1, 1.0]])
    w, stats = rollout_correction_weights(TRAIN, TRAIN, MASK, tis_cap=2.0, mask_threshold=0.1)
    assert torch.equal(w, MASK.float())
    assert finalize_token_stats(stats)["mismatch_max"] == 0.0
    plain, _ = policy_loss(lp, old, adv, MASK, 7)
    weighted, _ = policy_loss(lp, old, adv, MASK, 7, token_weights=w)
    assert torch.equal(plain, weighted)


def test_weights_scale_each_token_loss_and_its_gradient_but_not_the_denominator():
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.3, 0.2, -0.1, 1.0]])
    w, _ = rollout_correction_weights(TRAIN, ROLLOUT, MASK, tis_cap=1.1, mask_threshold=0.5)
    lp = TRAIN.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, TRAIN.detach(), adv, MASK, 7, token_weights=w)
    # at ratio 1 (old == new): loss_token = -A * w, token-mean over the 7 valid tokens
    assert float(loss.detach()) == pytest.approx(float(-(adv * w)[MASK].sum() / 7), rel=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.where(MASK, -adv * w / 7, 0.0))
    with pytest.raises(ValueError, match="token_weights"):
        policy_loss(lp, TRAIN, adv, MASK, 7, token_weights=w[:, :2])


def test_the_mask_mode_drops_the_tokens_above_the_cap_and_keeps_the_others_untruncated():
    w, stats = rollout_correction_weights(TRAIN, ROLLOUT, MASK, tis_cap=1.1, is_mode="mask")
    # row 0: exp 1.2214 > 1.1 -> dropped, 0.3679, 1; padding 0
    # row 1: exp 1.1052 > 1.1 -> dropped, 0.9048, 1, 1
    expected = torch.tensor([[0.0, math.exp(-1.0), 1.0, 0.0], [0.0, math.exp(-0.1), 1.0, 1.0]])
    torch.testing.assert_close(w, expected)
    out = finalize_token_stats(stats)
    assert out["is_masked_fraction"] == pytest.approx(2 / 7) and "is_truncated_fraction" not in out
    assert out["is_weight"] == pytest.approx((math.exp(-1.0) + 1 + math.exp(-0.1) + 2) / 7, rel=1e-6)
    assert out["is_weight_max"] == pytest.approx(1.0)  # over the tokens left in the loss
    assert out["masked_fraction"] == 0.0
    # a cap above every weight: the raw weights, exactly (truncate gives the same then)
    w_hi, _ = rollout_correction_weights(TRAIN, ROLLOUT, MASK, tis_cap=1.3, is_mode="mask")
    torch.testing.assert_close(w_hi, torch.tensor([[math.exp(0.2), math.exp(-1.0), 1.0, 0.0],
                                                   [math.exp(0.1), math.exp(-0.1), 1.0, 1.0]]))
    assert torch.equal(w_hi, rollout_correction_weights(TRAIN, ROLLOUT, MASK, tis_cap=1.3)[0])
    # with the row mask: row 0 (|-1.0| > 0.5) dropped whole, row 1's first token by the cap
    w, stats = rollout_correction_weights(TRAIN, ROLLOUT, MASK, tis_cap=1.1, mask_threshold=0.5,
                                          is_mode="mask")
    torch.testing.assert_close(w, torch.tensor([[0.0] * 4, [0.0, math.exp(-0.1), 1.0, 1.0]]))
    out = finalize_token_stats(stats)
    assert out["masked_fraction"] == pytest.approx(3 / 7) and out["is_masked_fraction"] == pytest.approx(1 / 7)


def test_the_mask_mode_loss_keeps_the_global_token_count_as_its_denominator():
    """The dropped tokens count as zero losses over the 7 valid tokens of the mini-batch (and
    its 11 when a second micro-batch holds 4 more), as in AReaL; their gradient is 0."""
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.3, 0.2, -0.1, 1.0]])
    w, _ = rollout_correction_weights(TRAIN, ROLLOUT, MASK, tis_cap=1.1, is_mode="mask")
    lp = TRAIN.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, TRAIN.detach(), adv, MASK, 11, token_weights=w)
    # at ratio 1: -A * w over the kept tokens: row 0: 2 e^-1 - 0.5, row 1: -0.2 e^-0.1 + 0.1 - 1
    by_hand = (2 * math.exp(-1.0) - 0.5 - 0.2 * math.exp(-0.1) + 0.1 - 1.0) / 11
    assert float(loss.detach()) == pytest.approx(by_hand, rel=1e-6)
    loss.backward()
    grad = torch.tensor([[0.0, 2 * math.exp(-1.0), -0.5, 0.0], [0.0, -0.2 * math.exp(-0.1), 0.1, -1.0]]) / 11
    torch.testing.assert_close(lp.grad, grad)
    assert lp.grad[0, 0] == 0 and lp.grad[1, 0] == 0  # the tokens above the cap


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="tis_cap=0.5"):
        rollout_correction_weights(TRAIN, ROLLOUT, MASK, tis_cap=0.5)
    with pytest.raises(ValueError, match="mask_threshold=0"):
        rollout_correction_weights(TRAIN, ROLLOUT, MASK, mask_threshold=0.0)
    with pytest.raises(ValueError, match="same shape"):
        rollout_correction_weights(TRAIN, ROLLOUT[:, :2], MASK)
    with pytest.raises(ValueError, match=r"is_mode='clip': valid choices are \['truncate', 'mask'\]"):
        rollout_correction_weights(TRAIN, ROLLOUT, MASK, tis_cap=2.0, is_mode="clip")
    with pytest.raises(ValueError, match="is_mode='mask' .* set tis_cap"):
        rollout_correction_weights(TRAIN, ROLLOUT, MASK, is_mode="mask")


# The mismatch's k3 KL and the rows a correction touches (#52). Same TRAIN / ROLLOUT / MASK:
# d = train - rollout = [0.2, -1.0, 0 | pad], [0.1, -0.1, 0, 0]; k3 = exp(d) - d - 1.

def test_k3_of_the_rollout_train_mismatch_by_hand():
    from nemo_rlhf.algorithms.ppo.rollout_correction import rollout_train_k3

    k3 = rollout_train_k3(TRAIN, ROLLOUT, MASK)
    d = (TRAIN.double() - ROLLOUT.double())  # the fp32 inputs' own differences
    expected = torch.where(MASK, torch.exp(d) - d - 1, 0.0)  # the padding's 9.0: 0
    torch.testing.assert_close(k3, expected)
    assert k3.dtype == torch.float64
    assert k3[0, 0] == pytest.approx(math.exp(0.2) - 1.2, rel=1e-6) and k3[0, 1] == pytest.approx(math.exp(-1.0), rel=1e-6)
    assert torch.equal(rollout_train_k3(TRAIN, TRAIN, MASK), torch.zeros(2, 4, dtype=torch.float64))
    # engines 2.4e-7 nats apart (two fp32 ulps of 1, the megatron decode vs the training
    # forward): k3 = d^2 / 2 = 2.8e-14, where fp32's exp(d) - d - 1 gives 0
    lp = torch.full((1, 1), -1.0)
    tiny = rollout_train_k3(lp + 2.384185791015625e-07, lp, torch.ones(1, 1, dtype=torch.bool))
    assert float(tiny) == pytest.approx(2.384185791015625e-07 ** 2 / 2, rel=1e-6)
    with pytest.raises(ValueError, match="same shape"):
        rollout_train_k3(TRAIN, ROLLOUT, MASK[:, :2])


def test_row_counts_of_the_correction_by_hand():
    from nemo_rlhf.algorithms.ppo.rollout_correction import rollout_correction_row_counts

    def counts(**kw):
        return {k: float(v) for k, v in rollout_correction_row_counts(TRAIN, ROLLOUT, MASK, **kw).items()}

    # cap 1.1: exp(0.2) = 1.22 (row 0) and exp(0.1) = 1.105 (row 1) exceed it: both rows capped
    assert counts(tis_cap=1.1) == {"rows": 2.0, "masked_rows": 0.0, "capped_rows": 2.0}
    # cap 1.15: only row 0's 1.22
    assert counts(tis_cap=1.15, is_mode="mask") == {"rows": 2.0, "masked_rows": 0.0, "capped_rows": 1.0}
    # threshold 0.5: row 0 (|-1.0|) masked whole; a masked row is not counted as capped
    assert counts(tis_cap=1.1, mask_threshold=0.5) == {"rows": 2.0, "masked_rows": 1.0, "capped_rows": 1.0}
    assert counts(mask_threshold=0.5) == {"rows": 2.0, "masked_rows": 1.0, "capped_rows": 0.0}
    # a row without policy tokens (an empty response) is no row of the share
    mask = torch.cat([MASK, torch.zeros(1, 4, dtype=torch.bool)])
    three = rollout_correction_row_counts(torch.cat([TRAIN, TRAIN[:1]]), torch.cat([ROLLOUT, ROLLOUT[:1] + 5]),
                                          mask, mask_threshold=0.5)
    assert float(three["rows"]) == 2.0 and float(three["masked_rows"]) == 1.0
    with pytest.raises(ValueError, match="valid choices"):
        rollout_correction_row_counts(TRAIN, ROLLOUT, MASK, tis_cap=2.0, is_mode="clip")
