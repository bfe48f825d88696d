"""Every PPO reducer with a loss mask that has holes (#51): a multi-turn trajectory's mask
is 1 on policy tokens and 0 on the environment's tokens between them (tool output, a user
turn) as well as on padding. The environment slots below hold large garbage values (or
NaN): a reducer that reads them, in a numerator or a denominator, gives another number.
Every expected value is worked by hand in the comments.

Layout used throughout (P = policy token, E = environment token, . = padding)::

    row 0:  P P E E P .     mask [1, 1, 0, 0, 1, 0]
    row 1:  P E P . . .     mask [1, 0, 1, 0, 0, 0]
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rlhf.algorithms.ppo import (
    aggregate_loss,
    compute_gae,
    compute_gae_reference,
    compute_token_rewards,
    discounted_returns,
    entropy_bonus,
    grpo_advantages,
    kl_loss,
    masked_mean,
    masked_whiten,
    policy_loss,
    reinforce_plus_plus_advantages,
    rloo_advantages,
    rollout_correction_weights,
    value_loss,
)

NAN = float("nan")
MASK = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 0]], dtype=torch.bool)
T_GLOBAL = 5  # policy tokens: 3 + 2
S_GLOBAL = 2


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------
# GAE: the bootstrap passes over environment tokens, one discount per policy token
# --------------------------------------------------------------------------------------


def test_gae_bootstraps_over_environment_tokens():
    # gamma 0.9, lam 0.5 (gamma * lam = 0.45). Row 0, policy tokens at 0, 1, 4:
    #   t=4: delta = 1 + 0.9*0 - 0.2 = 0.8;            A4 = 0.8;                 R4 = 1.0
    #   t=1: next policy token is 4 (V=0.2), not 2:
    #        delta = 0 + 0.9*0.2 - 0.4 = -0.22;         A1 = -0.22 + 0.45*0.8 = 0.14;  R1 = 0.54
    #   t=0: delta = 0 + 0.9*0.4 - 0.5 = -0.14;         A0 = -0.14 + 0.45*0.14 = -0.077; R0 = 0.423
    # Row 1, policy tokens at 0, 2:
    #   t=2: delta = 2 - 1 = 1;                          A2 = 1;     R2 = 2
    #   t=0: delta = 0 + 0.9*1 - 1 = -0.1;               A0 = -0.1 + 0.45*1 = 0.35; R0 = 1.35
    rewards = t([[0, 0, 99, 99, 1, 77], [0, 55, 2, 66, 66, 66]])
    values = t([[0.5, 0.4, NAN, 50, 0.2, NAN], [1, 1e6, 1, NAN, NAN, NAN]])
    adv, ret = compute_gae(rewards, values, MASK, gamma=0.9, lam=0.5)
    close(adv, [[-0.077, 0.14, 0, 0, 0.8, 0], [0.35, 0, 1.0, 0, 0, 0]])
    close(ret, [[0.423, 0.54, 0, 0, 1.0, 0], [1.35, 0, 2.0, 0, 0, 0]])
    ref_adv, ref_ret = compute_gae_reference(rewards, values, MASK, gamma=0.9, lam=0.5)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_with_holes_equals_gae_of_the_policy_tokens_alone():
    # Removing the environment tokens (compacting each row) gives the same advantages on the
    # policy tokens: they are transparent.
    torch.manual_seed(0)
    rewards, values = torch.randn(2, 6), torch.randn(2, 6)
    adv, ret = compute_gae(rewards, values, MASK, gamma=0.95, lam=0.9)
    for b in range(2):
        idx = MASK[b].nonzero().flatten()
        a1, r1 = compute_gae(rewards[b, idx][None], values[b, idx][None],
                             torch.ones(1, len(idx), dtype=torch.bool), gamma=0.95, lam=0.9)
        close(adv[b, idx], a1[0])
        close(ret[b, idx], r1[0])


def test_discounted_returns_discount_once_per_policy_token():
    # gamma 0.5. Row 0: G4 = 4; G1 = 0 + 0.5*G4 = 2 (the two E tokens between 1 and 4 are
    # not steps: per position it would be 0.5^3 * 4 = 0.5); G0 = 0 + 0.5*2 = 1.
    # Row 1: G2 = 2; G0 = 0 + 0.5*2 = 1.
    rewards = t([[0, 0, 100, 100, 4, 100], [0, 100, 2, 100, 100, 100]])
    close(discounted_returns(rewards, MASK, 0.5), [[1, 2, 0, 0, 4, 0], [1, 0, 2, 0, 0, 0]])


# --------------------------------------------------------------------------------------
# Whitening and masked means: only policy tokens in the statistics
# --------------------------------------------------------------------------------------


def test_whitening_uses_policy_tokens_only():
    # policy values 1, 2, 3 | 2, 2: mean = 10/5 = 2; centred -1, 0, 1, 0, 0;
    # unbiased var = 2/4 = 0.5, std = 0.70711; whitened -1.41421, 0, 1.41421, 0, 0.
    x = t([[1, 2, 100, 100, 3, NAN], [2, -100, 2, 9, 9, 9]])
    s = 1 / math.sqrt(0.5)
    close(masked_whiten(x, MASK), [[-s, 0, 0, 0, s, 0], [0, 0, 0, 0, 0, 0]], atol=1e-5)
    # masked_mean: (1 + 2 + 3 + 2 + 2) / 5 = 2; per row 6/3 = 2 and 4/2 = 2.
    close(masked_mean(x, MASK), 2.0)
    close(masked_mean(x, MASK, dim=1), [2.0, 2.0])


# --------------------------------------------------------------------------------------
# Aggregation: numerator AND denominator masked (ROLL #444)
# --------------------------------------------------------------------------------------

LOSS = t([[1, 2, 50, 50, 3, 70], [4, 60, 5, NAN, 80, 90]])
# policy losses: row 0: 1, 2, 3 (sum 6, n 3); row 1: 4, 5 (sum 9, n 2); total 15 over T = 5


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 15 / 5),                       # 3.0 (unmasked numerator: > 300)
    ("seq-mean-token-sum", 15 / 2),               # 7.5
    ("seq-mean-token-mean", (6 / 3 + 9 / 2) / 2),  # (2 + 4.5) / 2 = 3.25 (n_b = policy tokens)
    ("seq-mean-token-sum-norm", 15 / (2 * 4)),    # 1.875 with L = 4
])
def test_aggregation_modes_mask_numerator_and_denominator(mode, expected):
    got = aggregate_loss(LOSS, MASK, mode, global_valid_tokens=T_GLOBAL,
                         global_sequences=S_GLOBAL, norm_length=4)
    close(got, expected)
    close(entropy_bonus(LOSS, MASK, T_GLOBAL, loss_agg_mode=mode, global_sequences=S_GLOBAL,
                        norm_length=4), expected)


def test_policy_loss_and_its_stats_ignore_environment_tokens():
    # old log-probs 0; new 0.1 on row 0's first token, 0 on the other policy tokens and 25
    # on environment/padding slots (their ratio e^25 would dominate every stat).
    # ratio: e^0.1 = 1.105171, then 1, 1 | 1, 1; advantages 1, 2, 3 | 4, 5 (no clipping:
    # 1.105 < 1.2). loss = -(1.105171 + 2 + 3 + 4 + 5) / 5 = -3.0210342.
    lp = t([[0.1, 0, 25, 25, 0, 25], [0, 25, 0, 25, 25, 25]])
    old = torch.zeros(2, 6)
    adv = LOSS  # policy values 1, 2, 3 | 4, 5
    loss, stats = policy_loss(lp, old, adv, MASK, T_GLOBAL)
    close(loss, -(math.exp(0.1) + 14) / 5)
    close(stats["valid_tokens"], 5.0)
    close(stats["ratio_max"], math.exp(0.1))
    close(stats["ratio_min"], 1.0)
    close(stats["ratio_mean_sum"], math.exp(0.1) + 4)
    close(stats["clip_fraction_sum"], 0.0)


def test_value_loss_on_policy_tokens_only():
    # unclipped: (V - R)^2 on policy tokens: row 0: 1, 1, 4; row 1: 0, 4 -> sum 10;
    # loss = 0.5 * 10 / 5 = 1.0
    v = t([[1, 1, 9, 9, 1, 9], [2, 9, 2, 9, 9, 9]])
    r = t([[0, 2, 0, 0, 3, 0], [2, 0, 4, 0, 0, 0]])
    loss, stats = value_loss(v, v, r, MASK, T_GLOBAL, clip_range=None)
    close(loss, 1.0)
    close(stats["value_error_sq_sum"], 10.0)


def test_kl_loss_on_policy_tokens_only():
    # k1 = logp - ref on policy tokens: 0.5, 0.25, 0.25 | 0.5, 0.5 -> sum 2.0; / 5 = 0.4
    lp = t([[0.5, 0.25, 30, 30, 0.25, 30], [0.5, 30, 0.5, 30, 30, 30]])
    loss, stats = kl_loss(lp, torch.zeros(2, 6), MASK, T_GLOBAL, estimator="k1", clamp=None)
    close(loss, 0.4)
    close(stats["ref_kl_sum"], 2.0)


# --------------------------------------------------------------------------------------
# KL in the reward (slime #1370) and the score on the last policy token
# --------------------------------------------------------------------------------------


def test_token_rewards_kl_only_on_policy_tokens_score_on_last_policy_token():
    # beta 0.1, k1, ref 0. Row 0: KL 0.5, 0.25, -, -, 0.25 -> rewards -0.05, -0.025, 0, 0,
    # -0.025 + 2 (score at the last policy token, column 4) = 1.975, 0.
    # Row 1: KL 0.5, -, 0.5 -> -0.05, 0, -0.05 - 1 (score -1 at column 2) = -1.05, 0, 0, 0.
    lp = t([[0.5, 0.25, 7, 7, 0.25, 7], [0.5, 7, 0.5, 7, 7, 7]])
    rewards, kl = compute_token_rewards(lp, torch.zeros(2, 6), t([2.0, -1.0]), MASK, beta=0.1)
    close(kl, [[0.5, 0.25, 0, 0, 0.25, 0], [0.5, 0, 0.5, 0, 0, 0]])
    close(rewards, [[-0.05, -0.025, 0, 0, 1.975, 0], [-0.05, 0, -1.05, 0, 0, 0]])


# --------------------------------------------------------------------------------------
# Estimators on the episode's final score
# --------------------------------------------------------------------------------------

# token rewards with garbage on environment slots; outcomes: row 0: -0.05 - 0.025 + 1.975
# = 1.9, row 1: -0.05 - 1.05 = -1.1 (one group of 2: mean 0.4, centred +-1.5, unbiased
# std sqrt((2.25 + 2.25) / 1) = 2.1213203).
REWARDS = t([[-0.05, -0.025, 100, 100, 1.975, 100], [-0.05, 100, -1.05, 100, 100, 100]])
GROUP = torch.tensor([0, 0])


def _on_policy(a, b):
    return [[a, a, 0, 0, a, 0], [b, 0, b, 0, 0, 0]]


def test_grpo_and_dr_grpo_on_episode_score():
    adv, ret = grpo_advantages(REWARDS, None, MASK, GROUP, norm_by_std=True, eps=1e-6)
    a = 1.5 / (math.sqrt(4.5) + 1e-6)  # 0.7071066
    close(adv, _on_policy(a, -a), atol=1e-5)
    # returns: undiscounted return-to-go over policy tokens: row 0: 1.9, 1.95, 1.975
    close(ret, [[1.9, 1.95, 0, 0, 1.975, 0], [-1.1, 0, -1.05, 0, 0, 0]], atol=1e-5)
    adv, _ = grpo_advantages(REWARDS, None, MASK, GROUP, norm_by_std=False, eps=1e-6)
    close(adv, _on_policy(1.5, -1.5), atol=1e-5)


def test_rloo_on_episode_score():
    # k = 2: A = o_i - o_j: 1.9 - (-1.1) = 3.0 and -3.0
    adv, _ = rloo_advantages(REWARDS, None, MASK, GROUP)
    close(adv, _on_policy(3.0, -3.0), atol=1e-5)


def test_reinforce_plus_plus_discount_and_whitening_on_policy_tokens():
    # gamma 0.5: returns (see test_discounted_returns_...) 1, 2, 4 | 1, 2; mean 2, centred
    # -1, 0, 2, -1, 0; unbiased var 6/4 = 1.5; std 1.2247449.
    rewards = t([[0, 0, 100, 100, 4, 100], [0, 100, 2, 100, 100, 100]])
    adv, ret = reinforce_plus_plus_advantages(rewards, None, MASK, None, gamma=0.5, eps=1e-8)
    s = math.sqrt(1.5)
    close(ret, [[1, 2, 0, 0, 4, 0], [1, 0, 2, 0, 0, 0]])
    close(adv, [[-1 / s, 0, 0, 0, 2 / s, 0], [-1 / s, 0, 0, 0, 0, 0]], atol=1e-5)


# --------------------------------------------------------------------------------------
# Rollout correction: environment tokens have no behaviour log-prob to compare
# --------------------------------------------------------------------------------------


def test_rollout_correction_ignores_environment_tokens():
    # The environment's tokens were not sampled: their "rollout log-prob" is garbage (-50).
    # log ratios on policy tokens: 0.5, 0, 1.0 | 0, 0.2. Cap 2: weights e^0.5 = 1.648721, 1,
    # min(e^1, 2) = 2 | 1, e^0.2 = 1.221403. Threshold 1.5 nats: no row masked (an
    # environment token's 50-nat "mismatch" would mask both rows).
    train = t([[0.5, 0, 0, 0, 1.0, 0], [0, 0, 0.2, 0, 0, 0]])
    rollout = t([[0, 0, -50, -50, 0, -50], [0, -50, 0, -50, -50, -50]])
    w, stats = rollout_correction_weights(train, rollout, MASK, tis_cap=2.0, mask_threshold=1.5)
    close(w, [[math.exp(0.5), 1, 0, 0, 2, 0], [1, 0, math.exp(0.2), 0, 0, 0]])
    close(stats["valid_tokens"], 5.0)
    close(stats["mismatch_max"], 1.0)
    close(stats["mismatch_sum"], 1.7)
    close(stats["masked_fraction_sum"], 0.0)
    close(stats["is_truncated_fraction_sum"], 1.0)


def test_mismatch_k3_and_row_counts_ignore_environment_tokens():
    # the rollout above: policy-token log ratios 0.5, 0, 1.0 | 0, 0.2; the environment's -50s
    # would give k3 = exp(20) - 21 each (the clamp) and mask both rows at 1.5 nats
    from nemo_rlhf.algorithms.ppo.rollout_correction import (
        rollout_correction_row_counts,
        rollout_train_k3,
    )

    train = t([[0.5, 0, 0, 0, 1.0, 0], [0, 0, 0.2, 0, 0, 0]])
    rollout = t([[0, 0, -50, -50, 0, -50], [0, -50, 0, -50, -50, -50]])
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731
    close(rollout_train_k3(train, rollout, MASK),
          [[k3(0.5), 0, 0, 0, k3(1.0), 0], [0, 0, k3(0.2), 0, 0, 0]])
    counts = rollout_correction_row_counts(train, rollout, MASK, tis_cap=2.0, mask_threshold=1.5)
    close(counts["rows"], 2.0)
    close(counts["masked_rows"], 0.0)
    close(counts["capped_rows"], 1.0)  # row 0's e^1 > 2
