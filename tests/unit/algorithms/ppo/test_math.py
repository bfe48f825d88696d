"""Worked examples and behaviour tests for nemo_rlhf.algorithms.ppo (fp32).

Tests marked ``device`` build their inputs on the ``test_device`` fixture (the host by
default, a GPU under ``NEMO_RLHF_TEST_DEVICE=cuda``): the same worked numbers must come out
on any device, and the outputs must stay on it."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from nemo_rlhf.algorithms.ppo import (
    compute_gae,
    compute_gae_reference,
    compute_token_rewards,
    drop_empty_responses,
    entropy_bonus,
    explained_variance,
    finalize_token_stats,
    last_valid_index,
    masked_mean,
    masked_spread,
    masked_var,
    masked_whiten,
    merge_token_stats,
    policy_loss,
    value_loss,
)

NAN = float("nan")


def t(rows, dtype=torch.float32, device=None):
    return torch.tensor(rows, dtype=dtype, device=device)


def close(actual, expected, atol=1e-6):
    """``actual`` (a tensor on any device, or numbers) equals ``expected`` (numbers)."""
    actual = torch.as_tensor(actual, dtype=torch.float32)
    torch.testing.assert_close(
        actual,
        torch.as_tensor(expected, dtype=torch.float32, device=actual.device),
        atol=atol,
        rtol=0,
    )


def on(device, *tensors) -> None:
    """Every tensor lives on ``device`` (results do not fall back to the host)."""
    for x in tensors:
        assert x.device == device, (x.device, device)


# --------------------------------------------------------------------------------------
# Worked numbers
# --------------------------------------------------------------------------------------


@pytest.mark.device
def test_kl_reward_worked_numbers_per_token_penalty(test_device):
    d = test_device
    # Token 0 of each row is the worked token; token 1 carries the (zero) score.
    # Row: logp -1.2, ref -1.6 -> k1 = 0.4; beta 0.05 -> r = -0.02.
    rewards, kl = compute_token_rewards(
        t([[-1.2, -1.0]], device=d), t([[-1.6, -1.0]], device=d), t([0.0], device=d),
        t([[1, 1]], device=d), beta=0.05
    )
    on(d, rewards, kl)
    close(kl, [[0.4, 0.0]])
    close(rewards, [[-0.02, 0.0]])
    # logp -2.0, ref -2.4 -> k1 = 0.4; beta 0.1 -> r = -0.04.
    rewards, _ = compute_token_rewards(
        t([[-2.0, -1.0]], device=d), t([[-2.4, -1.0]], device=d), t([0.0], device=d),
        t([[1, 1]], device=d), beta=0.1
    )
    close(rewards, [[-0.04, 0.0]])


def _one_token_policy(new_prob, old_prob, adv, device=None, **kw):
    return policy_loss(
        t([[math.log(new_prob)]], device=device),
        t([[math.log(old_prob)]], device=device),
        t([[adv]], device=device),
        t([[1]], device=device),
        global_valid_tokens=1,
        **kw,
    )


@pytest.mark.device
def test_policy_loss_worked_positive_advantage_is_clipped(test_device):
    # ratio = 0.13 / 0.10 = 1.3 -> clip to 1.2; objective min(1.3*2, 1.2*2) = 2.4.
    loss, stats = _one_token_policy(0.13, 0.10, 2.0, device=test_device, clip_eps=0.2)
    on(test_device, loss)
    close(loss, -2.4, atol=1e-5)
    out = finalize_token_stats(stats)
    assert out["clip_fraction"] == 1.0
    assert out["ratio_mean"] == pytest.approx(1.3, abs=1e-5)
    # KL(pi_old || pi) on a token pi_old sampled, k3 with r = pi / pi_old = 1.3:
    # r - 1 - log r = 0.3 - log(1.3) (the reversed ratio gave 1/1.3 + log(1.3) - 1, 11% less)
    assert out["approx_kl"] == pytest.approx(0.3 - math.log(1.3), abs=1e-6)


def test_policy_loss_worked_negative_advantage_is_not_clipped():
    # objective min(1.3 * -2, 1.2 * -2) = min(-2.6, -2.4) = -2.6 -> loss 2.6.
    loss, stats = _one_token_policy(0.13, 0.10, -2.0, clip_eps=0.2)
    close(loss, 2.6, atol=1e-5)
    assert finalize_token_stats(stats)["clip_fraction"] == 0.0


@pytest.mark.device
def test_policy_loss_dual_clip_caps_negative_advantage(test_device):
    d = test_device
    # ratio 4, A = -2: min(-8, 1.2 * -2) = -8; dual-clip c=3: max(-8, 3 * -2) = -6.
    loss, _ = _one_token_policy(0.4, 0.1, -2.0, device=d)
    close(loss, 8.0, atol=1e-5)
    loss, stats = _one_token_policy(0.4, 0.1, -2.0, device=d, dual_clip=3.0)
    close(loss, 6.0, atol=1e-5)
    assert finalize_token_stats(stats)["dual_clip_fraction"] == 1.0
    # Dual-clip never touches A > 0: ratio 4, A = 2 -> min(8, 2.4) = 2.4.
    loss, _ = _one_token_policy(0.4, 0.1, 2.0, device=d, dual_clip=3.0)
    close(loss, -2.4, atol=1e-5)


def test_policy_loss_asymmetric_clip():
    # ratio 1.3, A = 2, eps_high 0.28 -> clip to 1.28 -> objective 2.56.
    loss, _ = _one_token_policy(0.13, 0.10, 2.0, clip_eps_low=0.2, clip_eps_high=0.28)
    close(loss, -2.56, atol=1e-5)
    # ratio 0.5, A = -2, eps_low 0.2 -> min(-1.0, 0.8 * -2 = -1.6) = -1.6.
    loss, _ = _one_token_policy(0.05, 0.10, -2.0, clip_eps_low=0.2, clip_eps_high=0.28)
    close(loss, 1.6, atol=1e-5)


@pytest.mark.parametrize("dual_clip", [1.0, 0.5, -3.0])
def test_policy_loss_dual_clip_must_exceed_one(dual_clip):
    with pytest.raises(ValueError, match="dual_clip"):
        _one_token_policy(0.4, 0.1, -2.0, dual_clip=dual_clip)


@pytest.mark.device
def test_gae_worked_three_tokens_gamma_1_lambda_095(test_device):
    # r = [0.0, -0.1, 1.0], V = [0.5, 0.4, 0.6], V after the last token = 0.
    # deltas: d2 = 1.0 + 1*0   - 0.6 =  0.4
    #         d1 = -0.1 + 1*0.6 - 0.4 =  0.1
    #         d0 = 0.0 + 1*0.4 - 0.5 = -0.1
    # recursion A_t = d_t + gamma*lam*A_{t+1}:
    #         A2 = 0.4
    #         A1 = 0.1 + 0.95 * 0.4   = 0.48
    #         A0 = -0.1 + 0.95 * 0.48 = 0.356
    # returns = A + V = [0.856, 0.88, 1.0]
    d = test_device
    rewards, values = t([[0.0, -0.1, 1.0]], device=d), t([[0.5, 0.4, 0.6]], device=d)
    for fn in (compute_gae, compute_gae_reference):
        adv, ret = fn(rewards, values, t([[1, 1, 1]], device=d), gamma=1.0, lam=0.95)
        on(d, adv, ret)
        close(adv, [[0.356, 0.48, 0.4]])
        close(ret, [[0.856, 0.88, 1.0]])


def test_gae_padding_is_skipped_and_never_bootstrapped():
    expected_adv = [0.356, 0.48, 0.4]
    # Right-padded: huge value / NaN in the padding must not be bootstrapped.
    adv, ret = compute_gae(
        t([[0.0, -0.1, 1.0, NAN, 5.0]]),
        t([[0.5, 0.4, 0.6, 99.0, NAN]]),
        t([[1, 1, 1, 0, 0]]),
        gamma=1.0,
        lam=0.95,
    )
    close(adv, [expected_adv + [0.0, 0.0]])
    close(ret, [[0.856, 0.88, 1.0, 0.0, 0.0]])
    # Left-padded: same numbers shifted right.
    adv, ret = compute_gae(
        t([[7.0, NAN, 0.0, -0.1, 1.0]]),
        t([[NAN, 3.0, 0.5, 0.4, 0.6]]),
        t([[0, 0, 1, 1, 1]]),
        gamma=1.0,
        lam=0.95,
    )
    close(adv, [[0.0, 0.0] + expected_adv])
    close(ret, [[0.0, 0.0, 0.856, 0.88, 1.0]])


def test_gae_discount_gamma_below_one():
    # gamma 0.5, lam 1: d1 = 1 - 0.6 = 0.4; d0 = 0 + 0.5*0.6 - 0.5 = -0.2; A0 = -0.2 + 0.5*0.4
    adv, _ = compute_gae(t([[0.0, 1.0]]), t([[0.5, 0.6]]), t([[1, 1]]), gamma=0.5, lam=1.0)
    close(adv, [[0.0, 0.4]])


@pytest.mark.parametrize("gamma,lam", [(1.1, 0.95), (1.0, -0.1), (-0.5, 0.5)])
def test_gae_rejects_coefficients_outside_unit_interval(gamma, lam):
    with pytest.raises(ValueError):
        compute_gae(t([[1.0]]), t([[0.0]]), t([[1]]), gamma=gamma, lam=lam)


def test_gae_outputs_are_detached():
    values = t([[0.5, 0.4]]).requires_grad_()
    adv, ret = compute_gae(t([[0.0, 1.0]]), values, t([[1, 1]]), gamma=1.0, lam=0.95)
    assert not adv.requires_grad and not ret.requires_grad


@pytest.mark.device
def test_value_loss_worked_numbers(test_device):
    def t(rows):
        return torch.tensor(rows, dtype=torch.float32, device=test_device)

    # V=1.5, V_old=1.0, R=2.0, c=0.2: V_clip=1.2; max(0.25, 0.64) -> 0.5*0.64 = 0.32.
    loss, stats = value_loss(t([[1.5]]), t([[1.0]]), t([[2.0]]), t([[1]]), 1, clip_range=0.2)
    on(test_device, loss)
    close(loss, 0.32)
    assert finalize_token_stats(stats)["value_clip_fraction"] == 1.0
    # Inside the clip range: V=1.1 -> 0.5 * 0.9^2 = 0.405, not clipped.
    loss, stats = value_loss(t([[1.1]]), t([[1.0]]), t([[2.0]]), t([[1]]), 1, clip_range=0.2)
    close(loss, 0.405)
    assert finalize_token_stats(stats)["value_clip_fraction"] == 0.0
    # Inside the range, where V_old + (V - V_old) rounds to one fp32 step from V and the
    # "clipped" term comes out larger by that step: not a clip (it was counted as one)
    v, v_old, ret = -0.011422981508076191, 0.037389613687992096, -0.013237196952104568
    assert (t([[v_old]]) + (t([[v]]) - t([[v_old]])) - t([[ret]])) ** 2 > (t([[v]]) - t([[ret]])) ** 2
    _, stats = value_loss(t([[v]]), t([[v_old]]), t([[ret]]), t([[1]]), 1, clip_range=0.2)
    assert finalize_token_stats(stats)["value_clip_fraction"] == 0.0
    # No clipping: 0.5 * (1.5 - 2)^2 = 0.125.
    loss, _ = value_loss(t([[1.5]]), t([[1.0]]), t([[2.0]]), t([[1]]), 1, clip_range=None)
    close(loss, 0.125)
    with pytest.raises(ValueError, match="clip_range"):
        value_loss(t([[1.5]]), t([[1.0]]), t([[2.0]]), t([[1]]), 1, clip_range=0.0)


def test_losses_divide_by_global_count_not_local():
    mask = t([[1, 1, 0]])
    ent = entropy_bonus(t([[1.0, 3.0, NAN]]), mask, global_valid_tokens=8)
    close(ent, 0.5)  # (1 + 3) / 8
    loss, _ = value_loss(t([[1.0, 1.0, 0.0]]), t([[1.0, 1.0, 0.0]]), t([[2.0, 3.0, 0.0]]), mask, 10)
    close(loss, 0.5 * (1.0 + 4.0) / 10)
    with pytest.raises(ValueError, match="global_valid_tokens"):
        entropy_bonus(t([[1.0]]), t([[1]]), global_valid_tokens=0)


def test_explained_variance():
    mask = t([[1, 1, 1, 0]])
    returns = t([[1.0, 2.0, 3.0, NAN]])
    close(explained_variance(returns, returns, mask), 1.0)
    close(explained_variance(t([[0.0, 0.0, 0.0, 5.0]]), returns, mask), 0.0)
    # V = R - [1, -1, 0]: Var[R - V] = 1 (unbiased), Var[R] = 1 -> 0.
    close(explained_variance(t([[0.0, 3.0, 3.0, 0.0]]), returns, mask), 0.0)
    # Var[R - V] = 0.25 * 1 -> 0.75.
    close(explained_variance(t([[0.5, 2.5, 3.0, 0.0]]), returns, mask), 0.75)
    assert math.isnan(float(explained_variance(returns, t([[2.0, 2.0, 2.0, 0.0]]), mask)))


def test_explained_variance_from_sums_over_row_splits_equals_the_whole_batch():
    # the trainer sums explained_variance_sums over DP ranks: two halves == the whole batch
    from nemo_rlhf.algorithms.ppo import explained_variance_from_sums, explained_variance_sums

    gen = torch.Generator().manual_seed(0)
    values, returns = torch.randn(6, 5, generator=gen), torch.randn(6, 5, generator=gen) * 2
    mask = torch.rand(6, 5, generator=gen) > 0.3
    whole = float(explained_variance(values, returns, mask))
    halves = (explained_variance_sums(values[:2], returns[:2], mask[:2])
              + explained_variance_sums(values[2:], returns[2:], mask[2:]))
    assert explained_variance_from_sums(halves) == pytest.approx(whole, abs=1e-6)
    # rank 0's rows alone (what was logged under DP) give another number
    assert abs(float(explained_variance(values[:2], returns[:2], mask[:2])) - whole) > 1e-2
    mask1 = t([[1, 1, 1, 0]]).bool()
    r = t([[1.0, 2.0, 3.0, NAN]])
    assert explained_variance_from_sums(explained_variance_sums(t([[0.5, 2.5, 3.0, 0.0]]), r, mask1)) \
        == pytest.approx(0.75, abs=1e-9)
    assert math.isnan(explained_variance_from_sums(explained_variance_sums(r, t([[2.0, 2.0, 2.0, 0.0]]), mask1)))


# --------------------------------------------------------------------------------------
# Reward placement
# --------------------------------------------------------------------------------------


def _no_kl(batch, length):
    zeros = torch.zeros(batch, length)
    return zeros, zeros.clone()


def test_reward_on_eos_token_of_response_that_ended():
    # tokens: [a, b, EOS, pad, pad]; the EOS is part of the response mask.
    lp, ref = _no_kl(1, 5)
    rewards, _ = compute_token_rewards(
        lp, ref, t([1.5]), t([[1, 1, 1, 0, 0]]), beta=0.1,
        ended=torch.tensor([True]), missing_eos_penalty=-1.0,
    )
    close(rewards, [[0.0, 0.0, 1.5, 0.0, 0.0]])


@pytest.mark.device
def test_truncated_response_scored_on_last_generated_token_with_penalty(test_device):
    d = test_device
    lp, ref = (x.to(d) for x in _no_kl(2, 4))
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0]], device=d)
    rewards, kl = compute_token_rewards(
        lp, ref, t([0.5, 0.5], device=d), mask, beta=0.1,
        ended=torch.tensor([False, True], device=d), missing_eos_penalty=-1.0,
    )
    on(d, rewards, kl)
    close(rewards, [[0.0, 0.0, 0.0, -0.5], [0.0, 0.5, 0.0, 0.0]])
    # Without a penalty the truncated row keeps its raw score.
    rewards, _ = compute_token_rewards(lp, ref, t([0.5, 0.5], device=d), mask, 0.1)
    close(rewards[0], [0.0, 0.0, 0.0, 0.5])
    with pytest.raises(ValueError, match="ended"):
        compute_token_rewards(lp, ref, t([0.5, 0.5], device=d), mask, 0.1,
                              missing_eos_penalty=-1.0)


def test_pad_id_equal_to_eos_id_masks_decide():
    eos = pad = 2
    # Generated [7, EOS] then padding with the same id: ids alone cannot tell EOS from pad.
    tokens = torch.tensor([[7, eos, pad, pad], [7, 8, 9, eos]])
    lengths = torch.tensor([2, 4])  # generated lengths, EOS included
    mask = torch.arange(4).unsqueeze(0) < lengths.unsqueeze(1)
    assert (tokens[0, 1:] == eos).all()  # the id is ambiguous on purpose
    lp, ref = _no_kl(2, 4)
    rewards, _ = compute_token_rewards(lp, ref, t([1.0, 2.0]), mask, beta=0.1)
    close(rewards, [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])


def test_left_and_right_padded_batches_agree():
    lp_right = t([[-1.0, -2.0, -0.5, NAN, NAN], [-0.3, -0.7, -1.1, -0.2, -0.9]])
    ref_right = t([[-1.5, -1.0, -0.5, NAN, 0.0], [-0.3, -0.9, -1.0, -0.4, -0.4]])
    mask_right = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    scores = t([1.0, -1.0])
    r_right, kl_right = compute_token_rewards(lp_right, ref_right, scores, mask_right, beta=0.2)
    # Row 0: kl = [0.5, -1.0, 0.0]; r = -0.2*kl + score at t=2.
    close(r_right[0], [-0.1, 0.2, 1.0, 0.0, 0.0])
    close(kl_right[0], [0.5, -1.0, 0.0, 0.0, 0.0])
    # Same rows, left-padded.
    lp_left = torch.cat([torch.full((1, 2), NAN), lp_right[:1, :3]], dim=1)
    ref_left = torch.cat([torch.full((1, 2), 3.0), ref_right[:1, :3]], dim=1)
    lp_left = torch.cat([lp_left, lp_right[1:]])
    ref_left = torch.cat([ref_left, ref_right[1:]])
    mask_left = t([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    r_left, kl_left = compute_token_rewards(lp_left, ref_left, scores, mask_left, beta=0.2)
    close(r_left[0], [0.0, 0.0, -0.1, 0.2, 1.0])
    close(r_left[1], r_right[1])
    close(kl_left[0, 2:], kl_right[0, :3])
    assert torch.isfinite(r_left).all() and torch.isfinite(kl_left).all()


def test_length_one_response():
    rewards, kl = compute_token_rewards(
        t([[-1.2, NAN, NAN]]), t([[-1.6, 0.0, 0.0]]), t([2.0]), t([[1, 0, 0]]), beta=0.05
    )
    close(rewards, [[2.0 - 0.02, 0.0, 0.0]])
    close(kl, [[0.4, 0.0, 0.0]])


def test_zero_length_row_raises_naming_rows_and_drop_helper():
    mask = t([[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]])
    lp, ref = _no_kl(4, 3)
    with pytest.raises(ValueError, match=r"rows \[1, 3\]"):
        compute_token_rewards(lp, ref, t([1.0, 2.0, 3.0, 4.0]), mask, beta=0.1)
    keep = drop_empty_responses(mask)
    assert keep.tolist() == [True, False, True, False]
    scores = t([1.0, 2.0, 3.0, 4.0])
    rewards, _ = compute_token_rewards(lp[keep], ref[keep], scores[keep], mask[keep], beta=0.1)
    close(rewards, [[0.0, 1.0, 0.0], [3.0, 0.0, 0.0]])


def test_rewards_nan_in_masked_slots_does_not_leak_for_every_estimator():
    mask = t([[1, 1, 0, 0]])
    clean_lp, clean_ref = t([[-1.0, -2.0, 0.0, 0.0]]), t([[-1.3, -1.8, 0.0, 0.0]])
    dirty_lp, dirty_ref = t([[-1.0, -2.0, NAN, -math.inf]]), t([[-1.3, -1.8, math.inf, NAN]])
    for est in ("k1", "k2", "k3"):
        r_clean, kl_clean = compute_token_rewards(clean_lp, clean_ref, t([1.0]), mask, 0.1, est)
        r_dirty, kl_dirty = compute_token_rewards(dirty_lp, dirty_ref, t([1.0]), mask, 0.1, est)
        assert torch.isfinite(r_dirty).all() and torch.isfinite(kl_dirty).all()
        torch.testing.assert_close(r_dirty, r_clean)
        torch.testing.assert_close(kl_dirty, kl_clean)
        # Gradients too: where() after exp(inf) would still back-propagate 0 * inf = NaN.
        leaf = dirty_lp.clone().requires_grad_()
        rewards, _ = compute_token_rewards(leaf, dirty_ref, t([1.0]), mask, 0.1, est)
        rewards.sum().backward()
        assert torch.isfinite(leaf.grad).all() and (leaf.grad[0, 2:] == 0).all()


def test_rewards_kl_clamp_and_input_errors():
    _, kl = compute_token_rewards(t([[0.0, -5.0]]), t([[-5.0, 0.0]]), t([0.0]), t([[1, 1]]), 0.1,
                                  kl_clamp=1.0)
    close(kl, [[1.0, -1.0]])
    with pytest.raises(ValueError, match="beta"):
        compute_token_rewards(t([[0.0]]), t([[0.0]]), t([0.0]), t([[1]]), beta=-0.1)
    with pytest.raises(ValueError, match="scores"):
        compute_token_rewards(t([[0.0]]), t([[0.0]]), t([[0.0]]), t([[1]]), beta=0.1)
    with pytest.raises(ValueError, match="shape"):
        compute_token_rewards(t([[0.0, 1.0]]), t([[0.0]]), t([0.0]), t([[1]]), beta=0.1)


def test_last_valid_index_left_right_holes_and_empty():
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 0, 0], [0, 1, 0, 0, 0]]
    )
    assert last_valid_index(mask).tolist() == [2, 4, -1, 2, 1]
    assert last_valid_index(mask.bool()).dtype == torch.long
    assert last_valid_index(torch.zeros(3, 0, dtype=torch.bool)).tolist() == [-1, -1, -1]


# --------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------


@pytest.mark.device
def test_masked_mean_var_whiten_worked(test_device):
    x = t([[2.0, 4.0, NAN], [6.0, math.inf, 100.0]], device=test_device)
    mask = t([[1, 1, 0], [1, 0, 0]], device=test_device)
    on(test_device, masked_mean(x, mask), masked_var(x, mask), masked_whiten(x, mask))
    close(masked_mean(x, mask), 4.0)
    close(masked_mean(x, mask, dim=1), [3.0, 6.0])
    close(masked_var(x, mask), 4.0)  # ((4 + 0 + 4) / 2)
    close(masked_var(x, mask, unbiased=False), 8.0 / 3.0)
    close(masked_whiten(x, mask), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], atol=1e-5)
    close(masked_whiten(x, mask, shift_mean=False), [[3.0, 4.0, 0.0], [5.0, 0.0, 0.0]], atol=1e-5)
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)


def test_masked_var_and_whiten_reject_too_few_valid_elements():
    x, one = t([[1.0, 2.0]]), t([[1, 0]])
    with pytest.raises(ValueError):
        masked_var(x, torch.zeros_like(one))
    with pytest.raises(ValueError):
        masked_var(x, one)
    close(masked_var(x, one, unbiased=False), 0.0)
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(x, one)


def test_masked_whiten_reduce_fn_all_reduces_across_fake_ranks():
    # Two "ranks" in threads; reduce_fn sums their statistics like all_reduce(SUM).
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=gen) * 3 + 50
    mask = torch.rand(4, 6, generator=gen) > 0.3
    expected = masked_whiten(x, mask)
    shards = [(x[:2], mask[:2]), (x[2:], mask[2:])]
    barrier = threading.Barrier(2)
    slots = [None, None]
    results = [None, None]

    def make_reduce(rank):
        def reduce_fn(s, s2, n):
            slots[rank] = (s, s2, n)
            barrier.wait()
            total = tuple(a + b for a, b in zip(*slots))
            barrier.wait()
            return total
        return reduce_fn

    def run(rank):
        results[rank] = masked_whiten(*shards[rank], reduce_fn=make_reduce(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=10)
    torch.testing.assert_close(torch.cat(results), expected, atol=1e-5, rtol=1e-5)
    # Without the reduce each shard normalises with its own statistics: different result.
    assert not torch.allclose(torch.cat([masked_whiten(*s) for s in shards]), expected, atol=1e-3)


# --------------------------------------------------------------------------------------
# Micro-batch invariance and NaN safety of the losses
# --------------------------------------------------------------------------------------


def _random_batch(batch=8, length=6, seed=0, device=None):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    out = {
        "logprobs": -torch.rand(batch, length, generator=gen) * 3,
        "old_logprobs": -torch.rand(batch, length, generator=gen) * 3,
        "advantages": torch.randn(batch, length, generator=gen),
        "values": torch.randn(batch, length, generator=gen),
        "old_values": torch.randn(batch, length, generator=gen),
        "returns": torch.randn(batch, length, generator=gen),
        "entropy": torch.rand(batch, length, generator=gen) * 2,
        "mask": mask,
    }
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


def _total_loss(d, rows, lp, values, entropy, global_tokens):
    sl = slice(*rows)
    pl, p_stats = policy_loss(lp[sl], d["old_logprobs"][sl], d["advantages"][sl], d["mask"][sl],
                              global_tokens, clip_eps=0.2, dual_clip=3.0)
    vl, v_stats = value_loss(values[sl], d["old_values"][sl], d["returns"][sl], d["mask"][sl],
                             global_tokens, clip_range=0.2)
    ent = entropy_bonus(entropy[sl], d["mask"][sl], global_tokens)
    return pl + 0.5 * vl - 0.01 * ent, p_stats, v_stats


def _leaves(d):
    return [d[k].clone().requires_grad_() for k in ("logprobs", "values", "entropy")]


@pytest.mark.device
@pytest.mark.parametrize("splits", [[(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 3), (3, 8)]])
def test_microbatch_split_gives_same_loss_grads_and_stats(splits, test_device):
    d = _random_batch(device=test_device)
    global_tokens = int(d["mask"].sum())
    lp, values, entropy = _leaves(d)
    full, p_full, v_full = _total_loss(d, (0, 8), lp, values, entropy, global_tokens)
    full.backward()
    on(test_device, full, lp.grad, values.grad, entropy.grad)

    lp2, values2, entropy2 = _leaves(d)
    total = torch.zeros((), device=test_device)
    p_parts, v_parts = [], []
    for rows in splits:
        loss, p_stats, v_stats = _total_loss(d, rows, lp2, values2, entropy2, global_tokens)
        loss.backward()  # gradient accumulation, as in the trainer
        total = total + loss.detach()
        p_parts.append(p_stats)
        v_parts.append(v_stats)

    torch.testing.assert_close(total, full.detach(), atol=1e-6, rtol=1e-6)
    for a, b in ((lp, lp2), (values, values2), (entropy, entropy2)):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-7, rtol=1e-6)
    assert lp.grad.abs().sum() > 0
    for full_stats, parts in ((p_full, p_parts), (v_full, v_parts)):
        merged = finalize_token_stats(merge_token_stats(parts))
        expected = finalize_token_stats(full_stats)
        assert merged.keys() == expected.keys()
        for key in expected:
            assert merged[key] == pytest.approx(expected[key], abs=1e-6), key
    assert finalize_token_stats(p_full)["valid_tokens"] == global_tokens


@pytest.mark.parametrize("field", ["logprobs", "old_logprobs", "advantages", "values",
                                   "old_values", "returns", "entropy"])
@pytest.mark.parametrize("bad", [NAN, math.inf, -math.inf])
def test_nan_in_padded_slot_gives_finite_loss_equal_to_zero_slot(field, bad):
    d = _random_batch(seed=1)
    pad = (~d["mask"]).nonzero()[0].tolist()
    global_tokens = int(d["mask"].sum())

    def run(value):
        dd = {k: v.clone() for k, v in d.items()}
        dd[field][pad[0], pad[1]] = value
        lp, values, entropy = _leaves(dd)
        loss, _, _ = _total_loss(dd, (0, 8), lp, values, entropy, global_tokens)
        loss.backward()
        return loss.detach(), [x.grad for x in (lp, values, entropy)]

    loss_bad, grads_bad = run(bad)
    loss_zero, grads_zero = run(0.0)
    assert torch.isfinite(loss_bad)
    torch.testing.assert_close(loss_bad, loss_zero)
    for g_bad, g_zero in zip(grads_bad, grads_zero):
        assert torch.isfinite(g_bad).all()
        torch.testing.assert_close(g_bad, g_zero)
        assert g_bad[pad[0], pad[1]] == 0


def test_policy_stats_extremes_and_merge_of_empty_microbatch():
    mask = t([[1, 1, 0]])
    _, stats = policy_loss(t([[math.log(0.2), math.log(0.05), NAN]]), t([[math.log(0.1)] * 3]),
                           t([[1.0, 1.0, 1.0]]), mask, 2)
    out = finalize_token_stats(stats)
    assert out["ratio_max"] == pytest.approx(2.0, abs=1e-5)
    assert out["ratio_min"] == pytest.approx(0.5, abs=1e-5)
    assert out["ratio_mean"] == pytest.approx(1.25, abs=1e-5)
    assert out["clip_fraction"] == pytest.approx(0.5)  # ratio 2 clipped; ratio 0.5 with A>0 not
    _, empty = policy_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[0]]), 2)
    assert float(empty["ratio_max"]) == -math.inf
    merged = finalize_token_stats(merge_token_stats([stats, empty]))
    assert merged == pytest.approx(out)
    assert math.isnan(finalize_token_stats(empty)["ratio_mean"])


def test_policy_loss_argument_errors():
    args = (t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1]]), 1)
    with pytest.raises(ValueError, match="clip_eps_low"):
        policy_loss(*args, clip_eps=1.0)
    with pytest.raises(ValueError, match="clip_eps_high"):
        policy_loss(*args, clip_eps_high=-0.1)
    with pytest.raises(ValueError, match="shape"):
        policy_loss(t([[0.0, 0.0]]), *args[1:])


# masked_spread: max - min over the valid elements, exact, over DP through a MAX reducer.
def test_masked_spread_is_max_minus_min_of_the_valid_elements():
    x = torch.tensor([1.0, 4.0, 2.0, 9.0])
    assert float(masked_spread(x, torch.tensor([1, 1, 1, 0]))) == 3.0  # 9 is masked
    assert float(masked_spread(x, torch.tensor([True, True, True, True]))) == 8.0
    assert float(masked_spread(torch.full((4,), 0.7), torch.ones(4, dtype=torch.bool))) == 0.0  # exact
    assert float(masked_spread(x, torch.tensor([0, 0, 1, 0]))) == 0.0  # one valid element
    assert float(masked_spread(x, torch.zeros(4, dtype=torch.bool))) == 0.0  # none valid
    # another rank holds max 5 and min -1: [max, -min] reduced by MAX is [5, 1], spread 6
    seen = []

    def other_rank(t):
        seen.append(t.clone())
        return torch.maximum(t, torch.tensor([5.0, 1.0]))

    assert float(masked_spread(x, torch.tensor([1, 1, 1, 0]), reduce_max_fn=other_rank)) == 6.0
    torch.testing.assert_close(seen[0], torch.tensor([4.0, -1.0]))  # this rank's max and -min
    # a rank with no valid element sends [-inf, -inf] and leaves the other rank's spread as it is
    assert float(masked_spread(x, torch.zeros(4, dtype=torch.bool), reduce_max_fn=other_rank)) == 6.0
    assert seen[1].tolist() == [float("-inf"), float("-inf")]
    with pytest.raises(ValueError):
        masked_spread(x, torch.ones(3, dtype=torch.bool))
