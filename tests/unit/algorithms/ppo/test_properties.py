"""Hypothesis property tests for the PPO math on random shapes, masks and dtypes."""

from __future__ import annotations

import math

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nemo_rlhf.algorithms.ppo import (
    compute_gae,
    compute_gae_reference,
    compute_token_rewards,
    entropy_bonus,
    kl_penalty,
    masked_whiten,
    policy_loss,
    value_loss,
)

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def batches(draw, min_len=0, layouts=("right", "left", "random")):
    """(generator, mask [B, T] bool, layout) with right/left padding or arbitrary holes."""
    batch = draw(st.integers(1, 5))
    length = draw(st.integers(1, 12))
    layout = draw(st.sampled_from(layouts))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if layout == "random":
        mask = torch.rand(batch, length, generator=gen) < 0.6
    else:
        lengths = torch.tensor(draw(st.lists(st.integers(min_len, length), min_size=batch,
                                             max_size=batch)))
        pos = torch.arange(length).unsqueeze(0)
        if layout == "right":
            mask = pos < lengths.unsqueeze(1)
        else:
            mask = pos >= (length - lengths).unsqueeze(1)
    return gen, mask, layout


def poison(x, mask, gen):
    """Put NaN/Inf into masked slots."""
    junk = torch.where(torch.rand(x.shape, generator=gen) < 0.5, math.nan, math.inf)
    return torch.where(mask, x, junk.to(x.dtype))


@SETTINGS
@given(batches(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_vectorised_gae_matches_reference_loop(b, gamma, lam):
    gen, mask, _ = b
    rewards = poison(torch.randn(mask.shape, generator=gen), mask, gen)
    values = poison(torch.randn(mask.shape, generator=gen), mask, gen)
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    adv_ref, ret_ref = compute_gae_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, adv_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, ret_ref, atol=1e-5, rtol=1e-5)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    torch.testing.assert_close(ret[mask], (adv + values)[mask], atol=1e-6, rtol=1e-6)


@SETTINGS
@given(batches(layouts=("right",)), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_left_padding_equals_right_padding_shifted(b, gamma, lam):
    gen, mask_r, _ = b
    rewards = torch.randn(mask_r.shape, generator=gen)
    values = torch.randn(mask_r.shape, generator=gen)
    lengths = mask_r.sum(1)
    length = mask_r.shape[1]
    # Roll every row right by its padding so the valid span ends at the last column.
    index = (torch.arange(length).unsqueeze(0) - (length - lengths).unsqueeze(1)) % length
    to_left = lambda x: torch.gather(x, 1, index)  # noqa: E731
    mask_l = to_left(mask_r)
    assert (mask_l == (torch.arange(length) >= (length - lengths).unsqueeze(1))).all()
    adv_r, ret_r = compute_gae(rewards, values, mask_r, gamma, lam)
    adv_l, ret_l = compute_gae(to_left(rewards), to_left(values), mask_l, gamma, lam)
    torch.testing.assert_close(adv_l, to_left(adv_r))
    torch.testing.assert_close(ret_l, to_left(ret_r))


@SETTINGS
@given(batches(), st.floats(1e-2, 1e2), st.floats(-10, 10), st.booleans())
def test_whitened_valid_tokens_have_zero_mean_unit_variance(b, scale, offset, shift_mean):
    gen, mask, _ = b
    x = poison(torch.randn(mask.shape, generator=gen) * scale + offset, mask, gen)
    assume(int(mask.sum()) >= 2)
    # eps = 1e-8 is added to the variance: only data with a spread well above it whitens
    # to unit variance within the tolerance below.
    assume(float(x[mask].double().var()) > 1e-4)
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    assert out.dtype == torch.float32
    assert (out[~mask] == 0).all()
    valid = out[mask].double()
    mean_x = x[mask].double().mean()
    if not shift_mean:
        valid = valid - mean_x
    assert abs(float(valid.mean())) < 1e-4 * max(1.0, abs(float(mean_x)))
    assert abs(float(valid.var(unbiased=True)) - 1.0) < 1e-3


@SETTINGS
@given(batches(min_len=1, layouts=("right", "left")),
       st.sampled_from([torch.float16, torch.bfloat16, torch.float64]),
       st.sampled_from(["k1", "k2", "k3"]))
def test_low_and_high_precision_inputs_give_fp32_outputs(b, dtype, estimator):
    gen, mask, _ = b
    shape = mask.shape

    def rnd(scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(dtype)

    lp, ref = -rnd().abs(), -rnd().abs()
    assert kl_penalty(lp, ref, estimator).dtype == torch.float32
    rewards, kl = compute_token_rewards(lp, ref, torch.randn(shape[0]).to(dtype), mask, 0.1,
                                        estimator)
    assert rewards.dtype == kl.dtype == torch.float32
    adv, ret = compute_gae(rewards.to(dtype), rnd(), mask, 1.0, 0.95)
    assert adv.dtype == ret.dtype == torch.float32
    if int(mask.sum()) >= 2:
        assert masked_whiten(adv.to(dtype), mask).dtype == torch.float32
    n = int(mask.sum())
    pl, p_stats = policy_loss(lp, ref, adv.to(dtype), mask, n)
    vl, v_stats = value_loss(rnd(), rnd(), ret.to(dtype), mask, n)
    ent = entropy_bonus(rnd().abs(), mask, n)
    for x in (pl, vl, ent, *p_stats.values(), *v_stats.values()):
        assert x.dtype == torch.float32
    # The fp32 computation on upcast inputs is what we get (no low-precision arithmetic).
    upcast = policy_loss(lp.float(), ref.float(), adv.to(dtype).float(), mask, n)[0]
    torch.testing.assert_close(pl, upcast)


@SETTINGS
@given(batches(min_len=1, layouts=("right", "left")))
def test_rewards_place_score_at_last_valid_token(b):
    gen, mask, layout = b
    shape = mask.shape
    lp = poison(-torch.rand(shape, generator=gen), mask, gen)
    ref = poison(-torch.rand(shape, generator=gen), mask, gen)
    scores = torch.randn(shape[0], generator=gen)
    rewards, kl = compute_token_rewards(lp, ref, scores, mask, beta=0.1)
    rewards0, _ = compute_token_rewards(lp, ref, torch.zeros_like(scores), mask, beta=0.1)
    diff = rewards - rewards0
    assert torch.isfinite(rewards).all()
    assert (rewards[~mask] == 0).all() and (kl[~mask] == 0).all()
    last = mask.shape[1] - 1 - mask.flip(1).int().argmax(1)
    expected = torch.zeros(shape)
    expected[torch.arange(shape[0]), last] = scores
    torch.testing.assert_close(diff, expected, atol=1e-6, rtol=0)
    if layout == "left":
        assert (last == shape[1] - 1).all()


@SETTINGS
@given(batches(layouts=("right", "left", "random")), st.data())
def test_losses_ignore_masked_slots_and_are_split_invariant(b, data):
    gen, mask, _ = b
    n = max(int(mask.sum()), 1)
    shape = mask.shape
    names = ("logprobs", "old_logprobs", "advantages", "values", "old_values", "returns")
    clean = {k: torch.randn(shape, generator=gen) for k in names}
    dirty = {k: poison(v, mask, gen) for k, v in clean.items()}
    zeroed = {k: torch.where(mask, v, 0.0) for k, v in clean.items()}

    def total(d, rows=slice(None)):
        lp = d["logprobs"][rows].clone().requires_grad_()
        pl, _ = policy_loss(lp, d["old_logprobs"][rows], d["advantages"][rows], mask[rows], n,
                            dual_clip=3.0)
        vl, _ = value_loss(d["values"][rows], d["old_values"][rows], d["returns"][rows],
                           mask[rows], n)
        loss = pl + 0.5 * vl
        loss.backward()
        return loss.detach(), lp.grad

    loss_dirty, grad_dirty = total(dirty)
    loss_zero, grad_zero = total(zeroed)
    assert torch.isfinite(loss_dirty) and torch.isfinite(grad_dirty).all()
    torch.testing.assert_close(loss_dirty, loss_zero)
    torch.testing.assert_close(grad_dirty, grad_zero)

    cut = data.draw(st.integers(0, shape[0]))
    parts = [total(dirty, slice(0, cut)), total(dirty, slice(cut, None))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], loss_dirty, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), grad_dirty)
