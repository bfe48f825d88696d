"""Loss aggregation modes (token-mean, seq-mean-token-sum, seq-mean-token-mean,
seq-mean-token-sum-norm) and the KL loss: hand values, split invariance, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rlhf.algorithms.ppo import (
    DEFAULT_LOSS_AGG_MODE,
    LOSS_AGG_MODES,
    aggregate_loss,
    entropy_bonus,
    finalize_token_stats,
    kl_loss,
    merge_token_stats,
    policy_loss,
    value_loss,
)

NAN = float("nan")


def t(rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=0,
    )


# --------------------------------------------------------------------------------------
# Loss aggregation modes
# --------------------------------------------------------------------------------------

# Two rows of a mini-batch whose other micro-batches hold more: global T = 6 valid tokens,
# S = 4 sequences, L = 5.
LOSS = t([[1.0, 2.0, NAN], [3.0, math.inf, -math.inf]])
LOSS_MASK = t([[1, 1, 0], [1, 0, 0]])
COUNTS = {"global_valid_tokens": 6, "global_sequences": 4, "norm_length": 5}
HAND = {
    "token-mean": (1 + 2 + 3) / 6,
    "seq-mean-token-sum": ((1 + 2) + 3) / 4,
    "seq-mean-token-mean": ((1 + 2) / 2 + 3 / 1) / 4,
    "seq-mean-token-sum-norm": (1 + 2 + 3) / (4 * 5),
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_loss_hand_values(mode):
    assert set(HAND) == set(LOSS_AGG_MODES)
    close(aggregate_loss(LOSS, LOSS_MASK, mode, **COUNTS), HAND[mode])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_loss_aggregates_through_the_same_mode(mode):
    # ratio 1 and A = -l: policy token loss l. Value, no clip: 0.5 * (V - R)^2 = 0.5 * l^2
    # with V - R = sqrt(l). Entropy: l. KL k1: logp - ref = l.
    l = torch.where(LOSS_MASK.bool(), LOSS, 0.0)
    zeros = torch.zeros_like(l)
    kw = dict(loss_agg_mode=mode, global_sequences=4, norm_length=5)
    expected = HAND[mode]
    close(policy_loss(zeros, zeros, -l, LOSS_MASK, 6, **kw)[0], expected)
    close(value_loss(l.sqrt(), zeros, zeros, LOSS_MASK, 6, clip_range=None, **kw)[0],
          0.5 * expected)
    close(entropy_bonus(l, LOSS_MASK, 6, **kw), expected)
    close(kl_loss(l, zeros, LOSS_MASK, 6, estimator="k1", **kw)[0], expected)


def test_default_mode_is_token_mean_and_unused_counts_may_be_none():
    assert DEFAULT_LOSS_AGG_MODE == "token-mean"
    close(entropy_bonus(LOSS, LOSS_MASK, 6), HAND["token-mean"])
    close(entropy_bonus(LOSS, LOSS_MASK, None, loss_agg_mode="seq-mean-token-sum",
                        global_sequences=torch.tensor(4.0)), HAND["seq-mean-token-sum"])


def test_aggregation_errors_name_the_mode_and_the_missing_count():
    with pytest.raises(ValueError) as err:
        aggregate_loss(LOSS, LOSS_MASK, "sequence-mean", **COUNTS)
    for mode in LOSS_AGG_MODES:
        assert mode in str(err.value)
    with pytest.raises(ValueError, match="'seq-mean-token-mean' needs global_sequences"):
        entropy_bonus(LOSS, LOSS_MASK, 6, loss_agg_mode="seq-mean-token-mean")
    with pytest.raises(ValueError, match="needs norm_length"):
        policy_loss(LOSS, LOSS, LOSS, LOSS_MASK, 6, loss_agg_mode="seq-mean-token-sum-norm",
                    global_sequences=4)
    with pytest.raises(ValueError, match="global_sequences must be > 0"):
        aggregate_loss(LOSS, LOSS_MASK, "seq-mean-token-sum", global_sequences=0)
    with pytest.raises(ValueError, match="needs global_valid_tokens"):
        aggregate_loss(LOSS, LOSS_MASK)


def test_seq_mean_token_mean_of_sequence_shards_with_their_whole_counts():
    """Context parallelism: each row's tokens are split over shards (columns {0, 2} and
    {1}); with ``sequence_tokens`` (each token's whole row count ``n_b``) the shards'
    losses add up to the whole rows' hand value ``((1 + 2) / 2 + 3 / 1) / 4``; with the
    shard's own count (None) they do not."""
    shards = [torch.tensor([0, 2]), torch.tensor([1])]
    whole = LOSS_MASK.sum(1, keepdim=True).expand_as(LOSS_MASK)  # n_b per token: 2, 1
    kw = dict(global_sequences=4)
    total = sum(aggregate_loss(LOSS[:, c], LOSS_MASK[:, c], "seq-mean-token-mean",
                               sequence_tokens=whole[:, c], **kw) for c in shards)
    close(total, HAND["seq-mean-token-mean"])
    close(aggregate_loss(LOSS[:, shards[1]], LOSS_MASK[:, shards[1]], "seq-mean-token-mean",
                         sequence_tokens=whole[:, shards[1]], **kw), (2 / 2) / 4)
    wrong = sum(aggregate_loss(LOSS[:, c], LOSS_MASK[:, c], "seq-mean-token-mean", **kw) for c in shards)
    close(wrong, (1 / 1 + 2 / 1 + 3 / 1) / 4)  # the shard's own count: row 0 counted twice
    # the other modes ignore it; a wrong shape is refused
    close(aggregate_loss(LOSS, LOSS_MASK, "seq-mean-token-sum", sequence_tokens=whole, **kw),
          HAND["seq-mean-token-sum"])
    with pytest.raises(ValueError, match="sequence_tokens has shape"):
        aggregate_loss(LOSS, LOSS_MASK, "seq-mean-token-mean", sequence_tokens=whole[:, :2], **kw)


def test_every_loss_passes_sequence_tokens_through():
    l = torch.where(LOSS_MASK.bool(), LOSS, 0.0)
    zeros = torch.zeros_like(l)
    n = torch.full_like(l, 4.0)  # as if every row had 4 tokens in all
    kw = dict(loss_agg_mode="seq-mean-token-mean", global_sequences=4, sequence_tokens=n)
    want = (1 + 2 + 3) / 4 / 4
    close(policy_loss(zeros, zeros, -l, LOSS_MASK, 6, **kw)[0], want)
    close(value_loss(l.sqrt(), zeros, zeros, LOSS_MASK, 6, clip_range=None, **kw)[0], 0.5 * want)
    close(entropy_bonus(l, LOSS_MASK, 6, **kw), want)
    close(kl_loss(l, zeros, LOSS_MASK, 6, estimator="k1", **kw)[0], want)


def _uneven_batch(seed=0, batch=8, length=7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 7, 3, 5, 2, 7, 4, 6])[:batch]  # uneven on purpose
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    d = {k: torch.randn(batch, length, generator=gen) for k in
         ("logprobs", "old_logprobs", "ref_logprobs", "advantages", "values", "old_values",
          "returns")}
    d["entropy"] = torch.rand(batch, length, generator=gen)
    return {k: torch.where(mask, v, NAN) for k, v in d.items()}, mask


def _mode_loss(d, mask, rows, leaves, mode, counts):
    lp, values, entropy = leaves
    kw = dict(loss_agg_mode=mode, global_sequences=counts["S"], norm_length=counts["L"])
    T, m = counts["T"], mask[rows]
    pl, p_stats = policy_loss(lp[rows], d["old_logprobs"][rows], d["advantages"][rows], m, T,
                              dual_clip=3.0, **kw)
    vl, _ = value_loss(values[rows], d["old_values"][rows], d["returns"][rows], m, T, **kw)
    ent = entropy_bonus(entropy[rows], m, T, **kw)
    kl, k_stats = kl_loss(lp[rows], d["ref_logprobs"][rows], m, T, estimator="k3", **kw)
    return pl + 0.5 * vl - 0.01 * ent + 0.1 * kl, p_stats, k_stats


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("splits", [[8], [1, 7], [3, 2, 3], [2, 2, 2, 2], [1] * 8, [5, 3]])
def test_loss_modes_are_split_invariant_with_global_denominators(mode, splits):
    d, mask = _uneven_batch()
    counts = {"T": int(mask.sum()), "S": mask.shape[0], "L": mask.shape[1]}

    def leaves():
        return [d[k].clone().requires_grad_() for k in ("logprobs", "values", "entropy")]

    full_leaves = leaves()
    full, p_full, k_full = _mode_loss(d, mask, slice(0, 8), full_leaves, mode, counts)
    full.backward()

    part_leaves = leaves()
    total, p_parts, k_parts, start = torch.zeros(()), [], [], 0
    for size in splits:
        loss, p_stats, k_stats = _mode_loss(d, mask, slice(start, start + size), part_leaves,
                                            mode, counts)
        loss.backward()  # gradient accumulation over micro-batches
        total, start = total + loss.detach(), start + size
        p_parts.append(p_stats)
        k_parts.append(k_stats)

    assert torch.isfinite(full)
    torch.testing.assert_close(total, full.detach(), atol=1e-6, rtol=1e-6)
    for a, b in zip(full_leaves, part_leaves):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(b.grad, a.grad, atol=1e-7, rtol=1e-6)
    for whole, parts in ((p_full, p_parts), (k_full, k_parts)):
        merged = finalize_token_stats(merge_token_stats(parts))
        assert merged == pytest.approx(finalize_token_stats(whole), abs=1e-6)


def test_seq_mean_token_mean_needs_the_global_sequence_count():
    # With each micro-batch's own sequence count (a local mean) the sum is not the loss.
    d, mask = _uneven_batch()
    mode = "seq-mean-token-mean"
    full = aggregate_loss(d["entropy"], mask, mode, global_sequences=8)
    local = sum(aggregate_loss(d["entropy"][s], mask[s], mode, global_sequences=n)
                for s, n in ((slice(0, 3), 3), (slice(3, 8), 5)))
    assert not torch.allclose(local, full)
    weighted = (3 * aggregate_loss(d["entropy"][:3], mask[:3], mode, global_sequences=3)
                + 5 * aggregate_loss(d["entropy"][3:], mask[3:], mode, global_sequences=5)) / 8
    torch.testing.assert_close(weighted, full)


# --------------------------------------------------------------------------------------
# KL in the loss
# --------------------------------------------------------------------------------------


def test_kl_loss_worked_values_per_estimator():
    # Two valid tokens: logp - ref = 0.4 and -1.0; token-mean over T = 2.
    lp, ref, mask = t([[-1.2, -2.0, NAN]]), t([[-1.6, -1.0, math.inf]]), t([[1, 1, 0]])
    k1 = (0.4 - 1.0) / 2
    k2 = (0.5 * 0.16 + 0.5 * 1.0) / 2
    k3 = ((math.exp(-0.4) + 0.4 - 1) + (math.exp(1.0) - 1.0 - 1)) / 2
    for est, expected in (("k1", k1), ("k2", k2), ("k3", k3)):
        loss, stats = kl_loss(lp, ref, mask, 2, estimator=est)
        close(loss, expected)
        assert finalize_token_stats(stats)["ref_kl"] == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="k1"):
        kl_loss(lp, ref, mask, 2, estimator="low_var_kl")
    close(kl_loss(t([[0.0, -5.0]]), t([[-5.0, 0.0]]), t([[1, 1]]), 2, estimator="k1",
                  clamp=1.0)[0], 0.0)


def test_kl_loss_k3_never_negative_and_zero_at_equal_policies():
    gen = torch.Generator().manual_seed(0)
    lp, ref = torch.randn(32, 8, generator=gen) * 2, torch.randn(32, 8, generator=gen) * 2
    mask = torch.rand(32, 8, generator=gen) > 0.2
    for row in range(32):
        loss, _ = kl_loss(lp[row:row + 1], ref[row:row + 1], mask[row:row + 1], 8,
                          estimator="k3")
        assert loss >= 0
    close(kl_loss(lp, lp.clone(), mask, 8, estimator="k3")[0], 0.0)
    # k1 of a single token can be negative (an unbiased estimate, not a divergence).
    assert kl_loss(t([[-2.0]]), t([[-1.0]]), t([[1]]), 1, estimator="k1")[0] < 0


def test_kl_loss_gradient_signs():
    # logp above ref on token 0, below on token 1; token 2 masked (NaN there).
    lp = t([[-1.0, -3.0, NAN]]).requires_grad_()
    ref = t([[-2.0, -2.0, 0.0]]).requires_grad_()
    mask = t([[1, 1, 0]])
    kl_loss(lp, ref, mask, 2, estimator="k1")[0].backward()
    # k1 = logp - ref: gradient +1/T on every valid token, whatever the sign of logp - ref.
    close(lp.grad, [[0.5, 0.5, 0.0]])
    assert ref.grad is None or (ref.grad == 0).all()  # the reference is not trained
    lp.grad = None
    kl_loss(lp, ref, mask, 2, estimator="k3")[0].backward()
    # k3 gradient (1 - exp(ref - logp)) / T: > 0 where logp > ref (pushes it down), < 0 where
    # logp < ref (pushes it up), 0 on the masked slot.
    close(lp.grad, [[(1 - math.exp(-1.0)) / 2, (1 - math.exp(1.0)) / 2, 0.0]])
    assert lp.grad[0, 0] > 0 > lp.grad[0, 1]
    lp.grad = None
    kl_loss(lp, ref, mask, 2, estimator="k2")[0].backward()
    close(lp.grad, [[1.0 / 2, -1.0 / 2, 0.0]])  # (logp - ref) / T
