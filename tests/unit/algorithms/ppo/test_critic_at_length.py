"""The critic at length (#52): VC-PPO's decoupled GAE lambdas, VAPO's length-adaptive
policy lambda, and the critic's value error by response position, against hand-computed
values."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.algorithms.ppo import (
    AdvantageConfig,
    compute_advantages,
    compute_decoupled_gae,
    compute_gae,
    compute_gae_reference,
    gae_advantages,
    length_adaptive_lam,
    position_bucket_names,
    value_error_by_position_from_sums,
    value_error_by_position_sums,
)
from nemo_rlhf.algorithms.ppo.advantages_reference import ADVANTAGE_ESTIMATOR_REFERENCES

NAN = float("nan")


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# One response of three policy tokens, gamma = 1, the score 1 on the last token:
#   V = [0.5, 0.6, 0.8]; deltas: t2 = 1 - 0.8 = 0.2, t1 = 0.8 - 0.6 = 0.2, t0 = 0.6 - 0.5 = 0.1
#   lam = 0.5: A2 = 0.2, A1 = 0.2 + 0.5 * 0.2 = 0.3, A0 = 0.1 + 0.5 * 0.3 = 0.25
#   lam = 1:   A = [0.5, 0.4, 0.2], R = A + V = [1, 1, 1] (the Monte-Carlo return)
#   lam = 0:   A = deltas = [0.1, 0.2, 0.2]
# Row 0 has an environment token at column 1 (mask 0, junk reward/value): transparent.
REWARDS = t([[0.0, 9.0, 0.0, 1.0], [NAN, 0.0, 0.0, 1.0]])
VALUES = t([[0.5, 99.0, 0.6, 0.8], [NAN, 0.5, 0.6, 0.8]])
MASK = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)


def test_decoupled_gae_advantages_with_lam_policy_returns_with_lam_critic():
    adv, ret = compute_decoupled_gae(REWARDS, VALUES, MASK, 1.0, lam_policy=0.5, lam_critic=1.0)
    close(adv, [[0.25, 0.0, 0.3, 0.2], [0.0, 0.25, 0.3, 0.2]])
    close(ret, [[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    # the other way round: TD(0) targets, Monte-Carlo advantages
    adv, ret = compute_decoupled_gae(REWARDS, VALUES, MASK, 1.0, lam_policy=1.0, lam_critic=0.0)
    close(adv, [[0.5, 0.0, 0.4, 0.2], [0.0, 0.5, 0.4, 0.2]])
    close(ret, [[0.6, 0.0, 0.8, 1.0], [0.0, 0.6, 0.8, 1.0]])


def test_per_row_lambda_tensor_in_gae_and_its_reference():
    lam = torch.tensor([0.5, 0.0])
    for fn in (compute_gae, compute_gae_reference):
        adv, ret = fn(REWARDS, VALUES, MASK, 1.0, lam)
        close(adv, [[0.25, 0.0, 0.3, 0.2], [0.0, 0.1, 0.2, 0.2]])
        close(ret, [[0.75, 0.0, 0.9, 1.0], [0.0, 0.6, 0.8, 1.0]])
    # a per-row lambda equal on every row is the float lambda, exactly
    for a, b in zip(compute_gae(REWARDS, VALUES, MASK, 0.9, torch.tensor([0.7, 0.7])),
                    compute_gae(REWARDS, VALUES, MASK, 0.9, 0.7)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_per_row_lambda_errors():
    with pytest.raises(ValueError, match=r"shape \[batch\]=\(2,\)"):
        compute_gae(REWARDS, VALUES, MASK, 1.0, torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        compute_gae(REWARDS, VALUES, MASK, 1.0, torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        compute_gae_reference(REWARDS, VALUES, MASK, 1.0, torch.tensor([NAN, 0.5]))
    with pytest.raises(TypeError, match="float tensor"):
        compute_gae(REWARDS, VALUES, MASK, 1.0, torch.tensor([0, 1]))


def test_vapo_length_adaptive_lambda_counts_policy_tokens_and_clamps():
    # 1 - 1 / (alpha * l), alpha = 0.05: l = 40 -> 0.5; l = 100 -> 0.8; l = 10 -> -1 -> 0;
    # a row without policy tokens -> 0. Environment tokens (holes) do not count.
    mask = torch.zeros(4, 120, dtype=torch.bool)
    mask[0, :40] = True
    mask[1, :50] = True
    mask[1, 60:110] = True  # 100 policy tokens around a hole of 10 environment tokens
    mask[2, 5:15] = True
    close(length_adaptive_lam(mask, 0.05), [0.5, 0.8, 0.0, 0.0])
    assert length_adaptive_lam(mask, 0.05).dtype == torch.float32
    for alpha in (0.0, -1.0, float("inf"), NAN):
        with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
            length_adaptive_lam(mask, alpha)


def test_gae_estimator_with_vapo_lambda_and_vc_ppo_critic_lambda():
    # alpha = 2/3: row 0 has 3 policy tokens -> lam 1 - 1/2 = 0.5; row 1 has 1 -> clamped 0
    rewards = t([[0.0, 9.0, 0.0, 1.0], [NAN, NAN, NAN, 1.0]])
    values = t([[0.5, 99.0, 0.6, 0.8], [NAN, NAN, NAN, 0.8]])
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)
    kw = dict(gamma=1.0, lam=0.95, lam_critic=1.0, lam_policy_alpha=2.0 / 3.0)
    for fn in (gae_advantages, ADVANTAGE_ESTIMATOR_REFERENCES["gae"]):
        adv, ret = fn(rewards, values, mask, None, **kw)
        close(adv, [[0.25, 0.0, 0.3, 0.2], [0.0, 0.0, 0.0, 0.2]])
        close(ret, [[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    got = compute_advantages(AdvantageConfig(gamma=1.0, lam=0.95, lam_critic=1.0, lam_policy_alpha=2.0 / 3.0),
                             rewards, values, mask)
    close(got[0], [[0.25, 0.0, 0.3, 0.2], [0.0, 0.0, 0.0, 0.2]])
    with pytest.raises(ValueError, match="set one of them"):
        gae_advantages(rewards, values, mask, None, gamma=1.0, lam=0.95, lam_policy=0.5,
                       lam_policy_alpha=0.05)


def test_unset_lambdas_are_todays_single_lambda_gae_exactly():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    expected = compute_gae(rewards, values, mask, 0.9, 0.95)
    for cfg in (AdvantageConfig(gamma=0.9, lam=0.95),
                AdvantageConfig(gamma=0.9, lam=0.95, lam_critic=0.95, lam_policy=0.95)):
        for a, b in zip(compute_advantages(cfg, rewards, values, mask), expected):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    # lam_critic alone changes the returns only, lam_policy alone the advantages only
    adv, ret = compute_advantages(AdvantageConfig(gamma=0.9, lam=0.95, lam_critic=1.0), rewards, values, mask)
    torch.testing.assert_close(adv, expected[0], atol=0, rtol=0)
    torch.testing.assert_close(ret, compute_gae(rewards, values, mask, 0.9, 1.0)[1], atol=0, rtol=0)
    adv, ret = compute_advantages(AdvantageConfig(gamma=0.9, lam=0.95, lam_policy=0.3), rewards, values, mask)
    torch.testing.assert_close(adv, compute_gae(rewards, values, mask, 0.9, 0.3)[0], atol=0, rtol=0)
    torch.testing.assert_close(ret, expected[1], atol=0, rtol=0)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(lam_critic=1.5), r"advantage.lam_critic=1.5: must be in \[0, 1\]"),
    (dict(lam_policy=-0.1), r"advantage.lam_policy=-0.1: must be in \[0, 1\]"),
    (dict(lam_policy_alpha=0.0), r"advantage.lam_policy_alpha=0.0: must be a finite number > 0"),
    (dict(lam_policy=0.9, lam_policy_alpha=0.05), "set one of them"),
])
def test_advantage_config_refuses_bad_lambdas_naming_the_key(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        AdvantageConfig(**kwargs)


# --------------------------------------------------------------------------------------
# Value error by response position
# --------------------------------------------------------------------------------------

def test_position_bucket_names_are_log2_spaced_inclusive():
    assert position_bucket_names(5) == ["0-1", "2-3", "4-7", "8-15", "16-"]


def test_value_error_by_position_hand_values_and_sums_over_fake_ranks():
    # |V - R| on the valid tokens; columns 0-1, 2-3, 4-7 are the buckets reached
    #   row 0: |[0,1,2,3,4] - [1,1,0,3,3]| = [1, 0, 2, _, 1]   (column 3 masked)
    #   row 1: |2 - 0| = 2 at column 0, the rest masked (NaN values there)
    #   0-1: (1 + 0 + 2) / 3 = 1;  2-3: 2 / 1 = 2;  4-7: 1 / 1 = 1
    values = t([[0.0, 1.0, 2.0, NAN, 4.0], [2.0, NAN, NAN, NAN, NAN]])
    returns = t([[1.0, 1.0, 0.0, 3.0, 3.0], [0.0, 7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    sums, counts = value_error_by_position_sums(values, returns, mask, n_buckets=4)
    close(sums, [3.0, 2.0, 1.0, 0.0])
    close(counts, [3.0, 1.0, 1.0, 0.0])
    assert value_error_by_position_from_sums(sums, counts) == pytest.approx(
        {"critic/value_error_pos_0-1": 1.0, "critic/value_error_pos_2-3": 2.0,
         "critic/value_error_pos_4-7": 1.0})
    # two data-parallel ranks holding a row each: the summed sums and counts give the whole
    # batch's means (0-1: 3 / 3 = 1; the mean of the ranks' means would be (0.5 + 2) / 2)
    parts = [value_error_by_position_sums(values[i:i + 1], returns[i:i + 1], mask[i:i + 1], 4) for i in (0, 1)]
    total = value_error_by_position_from_sums(parts[0][0] + parts[1][0], parts[0][1] + parts[1][1])
    assert total == pytest.approx({"critic/value_error_pos_0-1": 1.0, "critic/value_error_pos_2-3": 2.0,
                                   "critic/value_error_pos_4-7": 1.0})


def test_value_error_position_beyond_the_last_edge_goes_to_the_open_bucket():
    values, returns = torch.zeros(1, 6), torch.ones(1, 6)
    sums, counts = value_error_by_position_sums(values, returns, torch.ones(1, 6, dtype=torch.bool), n_buckets=2)
    close(counts, [2.0, 4.0])  # columns 0-1, then 2.. (the last bucket is open-ended)
    assert set(value_error_by_position_from_sums(sums, counts)) == {
        "critic/value_error_pos_0-1", "critic/value_error_pos_2-"}
    with pytest.raises(ValueError, match="n_buckets must be >= 1"):
        value_error_by_position_sums(values, returns, torch.ones(1, 6, dtype=torch.bool), n_buckets=0)
