"""Advantage estimators (GAE, GRPO / Dr. GRPO, RLOO, REINFORCE++) and group bookkeeping:
worked examples, plain-loop references, edge cases."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rlhf.algorithms.ppo.advantages_reference import ADVANTAGE_ESTIMATOR_REFERENCES
from nemo_rlhf.algorithms.ppo import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    check_groups_divisible,
    check_slice_keeps_groups,
    compute_advantages,
    compute_gae,
    discounted_returns,
    get_advantage_estimator,
    group_ids_from_samples,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)

NAN = float("nan")
EPS = 1e-6


def t(rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype)


def ids(values):
    return torch.tensor(values, dtype=torch.long)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.as_tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=0,
    )


#: The keyword parameters of each estimator, for direct calls.
PARAMS = {
    "gae": {"gamma": 0.9, "lam": 0.95},
    "grpo": {"norm_by_std": True, "eps": EPS},
    "rloo": {},
    "reinforce_plus_plus": {"gamma": 0.9, "eps": EPS},
}


# --------------------------------------------------------------------------------------
# A worked batch: three prompts, groups of 3, 1 and 2 samples
# --------------------------------------------------------------------------------------

# Token rewards as compute_token_rewards builds them (-beta * KL per token, score last).
#   row 0 (prompt 5): -0.1 + 1.1       -> outcome 1.0
#   row 1 (prompt 5):  0.0 + 0.0 + 0.0 -> outcome 0.0
#   row 2 (prompt 5):  0.2 + 0.3       -> outcome 0.5
#   row 3 (prompt 2):  2.0             -> outcome 2.0 (group of one)
#   row 4 (prompt 8):  0.1 + 0.2       -> outcome 0.3
#   row 5 (prompt 8):  0.3             -> outcome 0.3 (all equal in the group)
REWARDS = t([[-0.1, 1.1, NAN], [0.0, 0.0, 0.0], [0.2, 0.3, 7.0],
             [2.0, NAN, NAN], [0.1, 0.2, NAN], [NAN, NAN, 0.3]])
MASK = t([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0], [0, 0, 1]]).bool()
GROUPS = ids([5, 5, 5, 2, 8, 8])


def test_grpo_worked_example():
    # Prompt 5: outcomes [1, 0, 0.5], mean 0.5, unbiased std sqrt((.25+.25+0)/2) = 0.5
    #   -> A = [0.5, -0.5, 0] / (0.5 + eps) ~ [1, -1, 0] on every valid token.
    # Prompt 2: one sample -> 0.  Prompt 8: equal outcomes -> 0.
    adv, ret = grpo_advantages(REWARDS, None, MASK, GROUPS, norm_by_std=True, eps=EPS)
    a = 0.5 / (0.5 + EPS)
    close(adv, [[a, a, 0], [-a, -a, -a], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    # Returns: undiscounted return-to-go of the token rewards.
    close(ret, [[1.0, 1.1, 0], [0, 0, 0], [0.5, 0.3, 0], [2.0, 0, 0], [0.3, 0.2, 0], [0, 0, 0.3]])


def test_dr_grpo_worked_example_drops_the_std_division():
    adv, _ = grpo_advantages(REWARDS, None, MASK, GROUPS, norm_by_std=False, eps=EPS)
    close(adv, [[0.5, 0.5, 0], [-0.5, -0.5, -0.5], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])


def test_rloo_worked_example():
    # Prompt 5: 1 - (0 + 0.5)/2 = 0.75; 0 - (1 + 0.5)/2 = -0.75; 0.5 - (1 + 0)/2 = 0.
    adv, ret = rloo_advantages(REWARDS, None, MASK, GROUPS)
    close(adv, [[0.75, 0.75, 0], [-0.75, -0.75, -0.75], [0, 0, 0], [0, 0, 0], [0, 0, 0],
                [0, 0, 0]])
    grpo_ret = grpo_advantages(REWARDS, None, MASK, GROUPS, norm_by_std=True, eps=EPS)[1]
    torch.testing.assert_close(ret, grpo_ret)


def test_reinforce_plus_plus_worked_example():
    # gamma 0.5. Row 0: G1 = 1.0, G0 = 0.0 + 0.5 * 1.0 = 0.5. Row 1: G0 = -0.5.
    # Valid returns [0.5, 1.0, -0.5]: mean 1/3, centred [1/6, 2/3, -5/6],
    # unbiased var (1/36 + 16/36 + 25/36) / 2 = 7/12.
    rewards, mask = t([[0.0, 1.0], [-0.5, NAN]]), t([[1, 1], [1, 0]])
    adv, ret = reinforce_plus_plus_advantages(rewards, None, mask, None, gamma=0.5, eps=EPS)
    close(ret, [[0.5, 1.0], [-0.5, 0.0]])
    s = math.sqrt(7 / 12 + EPS)
    close(adv, [[(1 / 6) / s, (2 / 3) / s], [(-5 / 6) / s, 0.0]])


def test_discounted_returns_worked_and_skips_holes():
    # gamma 0.5 over the valid tokens [1, 2, 4] of a row with a hole: G = [3, 4, 4] ...
    # G(4) = 4; G(2) = 2 + 0.5 * 4 = 4; G(1) = 1 + 0.5 * 4 = 3; the hole stays 0.
    out = discounted_returns(t([[1.0, NAN, 2.0, 4.0]]), t([[1, 0, 1, 1]]), 0.5)
    close(out, [[3.0, 0.0, 4.0, 4.0]])


def test_gae_through_the_registry_is_compute_gae():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    mask = torch.rand(3, 5, generator=gen) > 0.3
    expected = compute_gae(rewards, values, mask, 0.9, 0.95)
    got = compute_advantages(AdvantageConfig(gamma=0.9, lam=0.95), rewards, values, mask)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages(AdvantageConfig(), rewards, None, mask)


# --------------------------------------------------------------------------------------
# Vectorised estimators against the plain-loop references
# --------------------------------------------------------------------------------------


@st.composite
def grouped_batches(draw):
    """(generator, mask [B, T] bool with >= 1 valid token per row, group_ids [B])."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    batch = sum(sizes)
    length = draw(st.integers(1, 7))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    layout = draw(st.sampled_from(["right", "left", "random"]))
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    pos = torch.arange(length).unsqueeze(0)
    if layout == "right":
        mask = pos < lengths.unsqueeze(1)
    elif layout == "left":
        mask = pos >= (length - lengths).unsqueeze(1)
    else:
        mask = torch.rand(batch, length, generator=gen) < 0.6
        mask[torch.arange(batch), torch.randint(0, length, (batch,), generator=gen)] = True
    groups = torch.repeat_interleave(torch.arange(len(sizes)) * 3 + 1, torch.tensor(sizes))
    if draw(st.booleans()):  # groups need not be contiguous
        groups = groups[torch.randperm(batch, generator=gen)]
    return gen, mask, groups


def poison(x, mask, gen):
    junk = torch.where(torch.rand(x.shape, generator=gen) < 0.5, NAN, math.inf)
    return torch.where(mask, x, junk)


@settings(max_examples=40, deadline=None)
@given(grouped_batches(), st.sampled_from(sorted(ADVANTAGE_ESTIMATORS)), st.booleans(),
       st.floats(0.0, 1.0))
def test_vectorised_estimators_match_reference_loops(b, name, norm_by_std, gamma):
    gen, mask, groups = b
    assert set(ADVANTAGE_ESTIMATOR_REFERENCES) == set(ADVANTAGE_ESTIMATORS)
    rewards = poison(torch.randn(mask.shape, generator=gen), mask, gen)
    values = poison(torch.randn(mask.shape, generator=gen), mask, gen)
    params = dict(PARAMS[name])
    if "gamma" in params:
        params["gamma"] = gamma
    if "norm_by_std" in params:
        params["norm_by_std"] = norm_by_std
    if name == "reinforce_plus_plus" and int(mask.sum()) < 2:
        return
    adv, ret = ADVANTAGE_ESTIMATORS[name](rewards, values, mask, groups, **params)
    adv_ref, ret_ref = ADVANTAGE_ESTIMATOR_REFERENCES[name](rewards, values, mask, groups,
                                                            **params)
    torch.testing.assert_close(adv, adv_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ret, ret_ref, atol=1e-5, rtol=1e-5)
    assert adv.dtype == ret.dtype == torch.float32
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    if name in ("grpo", "rloo"):
        # One value per row, and the outcome advantages of each group sum to 0.
        first = adv[torch.arange(mask.shape[0]), mask.int().argmax(1)]
        torch.testing.assert_close(adv, torch.where(mask, first.unsqueeze(1), 0.0))
        for g in groups.unique():
            assert abs(float(first[groups == g].sum())) < 1e-4


# --------------------------------------------------------------------------------------
# Edge cases
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_of_one_and_all_equal_outcomes_give_zero(name):
    params = PARAMS[name]
    mask = t([[1, 1], [1, 0], [1, 1], [0, 1]]).bool()
    rewards = t([[3.0, 4.0], [7.0, NAN], [0.5, 0.5], [NAN, 1.0]])
    adv, _ = ADVANTAGE_ESTIMATORS[name](rewards, None, mask, ids([0, 1, 2, 2]), **params)
    assert (adv == 0).all()
    # A whole batch of singletons: nothing to compare against, all zero.
    adv, _ = ADVANTAGE_ESTIMATORS[name](rewards, None, mask, ids([0, 1, 2, 3]), **params)
    assert (adv == 0).all()


def test_grpo_std_normalisation_is_scale_free_dr_grpo_is_not():
    mask = torch.ones(4, 1, dtype=torch.bool)
    rewards, groups = t([[1.0], [0.0], [0.0], [0.0]]), ids([0, 0, 0, 0])
    base = grpo_advantages(rewards, None, mask, groups, norm_by_std=True, eps=EPS)[0]
    scaled = grpo_advantages(10 * rewards, None, mask, groups, norm_by_std=True, eps=EPS)[0]
    torch.testing.assert_close(base, scaled, atol=1e-5, rtol=1e-5)
    dr = grpo_advantages(rewards, None, mask, groups, norm_by_std=False, eps=EPS)[0]
    dr_scaled = grpo_advantages(10 * rewards, None, mask, groups, norm_by_std=False, eps=EPS)[0]
    torch.testing.assert_close(dr_scaled, 10 * dr)
    close(dr, [[0.75], [-0.25], [-0.25], [-0.25]])


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_precision_inputs_give_fp32_outputs(name, dtype):
    adv, ret = ADVANTAGE_ESTIMATORS[name](
        torch.where(MASK, REWARDS, 0.0).to(dtype), torch.ones(MASK.shape, dtype=dtype), MASK,
        GROUPS.int(), **PARAMS[name])
    assert adv.dtype == ret.dtype == torch.float32
    assert not adv.requires_grad and not ret.requires_grad
    assert (adv[~MASK] == 0).all()


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_estimators_input_errors(name):
    params = PARAMS[name]
    fn = ADVANTAGE_ESTIMATORS[name]
    with pytest.raises(ValueError, match="needs group_ids"):
        fn(REWARDS, None, MASK, None, **params)
    with pytest.raises(ValueError, match="shape"):
        fn(REWARDS, None, MASK, GROUPS[:3], **params)
    with pytest.raises(TypeError, match="integer"):
        fn(REWARDS, None, MASK, GROUPS.float(), **params)
    empty = MASK.clone()
    empty[3] = False
    with pytest.raises(ValueError, match=r"rows \[3\]"):
        fn(REWARDS, None, empty, GROUPS, **params)


def test_registry_lookup_and_config_errors_list_valid_names():
    with pytest.raises(ValueError) as err:
        get_advantage_estimator("ppo2")
    for name in ("gae", "grpo", "rloo", "reinforce_plus_plus"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match=r"advantage.estimator='reinforce'.*reinforce_plus_plus"):
        AdvantageConfig(estimator="reinforce")
    with pytest.raises(ValueError, match="advantage.gamma"):
        AdvantageConfig(gamma=1.5)
    with pytest.raises(ValueError, match="advantage.eps"):
        AdvantageConfig(eps=0.0)
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(REWARDS, None, MASK, GROUPS, norm_by_std=True, eps=-1.0)
    with pytest.raises(ValueError, match="at least 2"):
        reinforce_plus_plus_advantages(t([[1.0, 2.0]]), None, t([[1, 0]]), None, gamma=1.0,
                                       eps=EPS)
    cfg = AdvantageConfig()
    assert cfg.estimator == "gae" and cfg.needs_values and not cfg.needs_groups
    assert AdvantageConfig("rloo").needs_groups and not AdvantageConfig("rloo").needs_values


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_compute_advantages_passes_exactly_the_fields_each_estimator_reads(name):
    cfg = AdvantageConfig(estimator=name, gamma=0.7, lam=0.8, norm_by_std=False, eps=1e-3)
    values = torch.where(MASK, 0.5 * REWARDS + 0.1, NAN)
    got = compute_advantages(cfg, REWARDS, values, MASK, GROUPS, reduce_fn=None)
    all_fields = {"gamma": 0.7, "lam": 0.8, "norm_by_std": False, "eps": 1e-3}
    params = {k: all_fields[k] for k in PARAMS[name]}
    expected = ADVANTAGE_ESTIMATORS[name](REWARDS, values, MASK, GROUPS, **params)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_reinforce_plus_plus_reduce_fn_shares_statistics_across_fake_ranks():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.3
    cfg = AdvantageConfig(estimator="reinforce_plus_plus", gamma=0.9)
    expected, expected_ret = compute_advantages(cfg, rewards, None, mask)
    shards = [(rewards[:2], mask[:2]), (rewards[2:], mask[2:])]
    barrier, slots, results = threading.Barrier(2), [None, None], [None, None]

    def make_reduce(rank):
        def reduce_fn(s, s2, n):
            slots[rank] = (s, s2, n)
            barrier.wait()
            total = tuple(a + b for a, b in zip(*slots))
            barrier.wait()
            return total
        return reduce_fn

    def run(rank):
        r, m = shards[rank]
        results[rank] = compute_advantages(cfg, r, None, m, reduce_fn=make_reduce(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=10)
    torch.testing.assert_close(torch.cat([r[0] for r in results]), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), expected_ret)


# --------------------------------------------------------------------------------------
# Group bookkeeping
# --------------------------------------------------------------------------------------


def test_group_ids_from_samples_contiguous_layout():
    assert group_ids_from_samples(6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    assert group_ids_from_samples(4, 1).tolist() == [0, 1, 2, 3]
    assert group_ids_from_samples(0, 2).tolist() == []
    assert group_ids_from_samples(6, 2).dtype == torch.long
    with pytest.raises(ValueError, match="batch_size=7.*n_samples_per_prompt=2"):
        group_ids_from_samples(7, 2)
    with pytest.raises(ValueError, match="n_samples_per_prompt must be >= 1"):
        group_ids_from_samples(4, 0)


def test_check_groups_divisible_names_sizes_and_nearest_valid_ones():
    check_groups_divisible(8, 4, "ppo.num_rollout_samples / dp")
    with pytest.raises(ValueError) as err:
        check_groups_divisible(6, 4, "ppo.num_rollout_samples / dp")
    msg = str(err.value)
    assert "ppo.num_rollout_samples / dp=6" in msg and "n_samples_per_prompt=4" in msg
    assert "nearest: 4, 8" in msg
    with pytest.raises(ValueError, match=r"ppo.global_batch_size / dp=3 .*\(nearest: 4\)"):
        check_groups_divisible(3, 4, "ppo.global_batch_size / dp")


def test_check_slice_keeps_groups():
    groups = group_ids_from_samples(8, 4)
    check_slice_keeps_groups(groups, slice(0, 4))
    check_slice_keeps_groups(groups, slice(4, 8))
    check_slice_keeps_groups(groups, slice(0, 0))
    with pytest.raises(ValueError, match=r"rows \[0:6\) split group 1: it has 4 samples, "
                                         r"the slice holds 2"):
        check_slice_keeps_groups(groups, slice(0, 6))
    # Uneven sizes after dropping empty responses, and any order.
    dropped = ids([0, 0, 0, 1, 2, 2, 2, 2])
    check_slice_keeps_groups(dropped, slice(0, 4))
    with pytest.raises(ValueError, match="split group 2: it has 4 samples, the slice holds 3"):
        check_slice_keeps_groups(dropped, slice(0, 7))
    check_slice_keeps_groups(ids([3, 1, 3, 1]), slice(0, 4))
