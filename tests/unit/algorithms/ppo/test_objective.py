"""The assembled PPO objective (algorithms/ppo/objective.py): a worked example by hand, the
terms each mode includes, and the errors for missing inputs."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rlhf.algorithms.ppo import (
    PPOObjective,
    critic_loss,
    entropy_bonus,
    kl_loss,
    policy_loss,
    ppo_loss,
    value_loss,
)

MASK = torch.tensor([[True, True, False], [True, False, False]])
T, S = 3, 2  # global valid tokens and sequences (one micro-batch here)
# the ratio is 1 everywhere (lp == old) and no clip binds: the policy term is -mean(adv)
LP = torch.log(torch.tensor([[0.5, 0.25, 1.0], [0.5, 1.0, 1.0]]))
ENT = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
ADV = torch.tensor([[1.0, -2.0, 7.0], [4.0, 7.0, 7.0]])
VALUES = torch.tensor([[0.5, 0.0, 0.0], [1.0, 0.0, 0.0]])
RETURNS = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
REF = LP - 0.1  # the reference 0.1 nats below on every token


def _objective(**kw):
    return PPOObjective(value_clip=None, **kw)


def test_hand_computed_total_with_every_term():
    o = _objective(value_loss_coef=0.5, entropy_coef=0.1, kl_loss_coef=0.2, kl_estimator="k1")
    loss, stats = ppo_loss(o, LP, ENT, MASK, T, S, old_logprobs=LP, advantages=ADV,
                           values=VALUES, old_values=VALUES, returns=RETURNS,
                           kl_logprobs=LP, ref_logprobs=REF)
    policy = -(1 - 2 + 4) / 3                                    # -mean(adv), ratio 1
    value = 0.5 * ((0.5 - 1) ** 2 + (0 - 1) ** 2 + (1 - 0) ** 2) / 3  # 0.5 (v - R)^2
    entropy = (1 + 2 + 3) / 3
    kl = 0.1                                                     # k1 = lp - ref
    assert float(loss) == pytest.approx(0.5 * value + policy - 0.1 * entropy + 0.2 * kl, abs=1e-6)
    assert float(stats["policy_loss_sum"]) == pytest.approx(policy * T, abs=1e-6)
    assert float(stats["value_loss_sum"]) == pytest.approx(value * T, abs=1e-6)
    assert float(stats["entropy_sum"]) == pytest.approx(entropy * T, abs=1e-6)
    assert float(stats["kl_loss_sum"]) == pytest.approx(kl * T, abs=1e-6)


def test_total_equals_the_sum_of_the_tested_terms_in_every_mode():
    torch.manual_seed(0)
    lp, old = torch.randn(2, 3) - 1, torch.randn(2, 3) - 1
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                 "seq-mean-token-sum-norm"):
        o = PPOObjective(value_loss_coef=0.3, entropy_coef=0.01, kl_loss_coef=0.05,
                         loss_agg_mode=mode, norm_length=4)
        agg = dict(loss_agg_mode=mode, global_sequences=S, norm_length=4)
        loss, _ = ppo_loss(o, lp, ENT, MASK, T, S, old_logprobs=old, advantages=ADV,
                           values=VALUES, old_values=VALUES + 0.3, returns=RETURNS,
                           kl_logprobs=lp, ref_logprobs=old)
        pl, _ = policy_loss(lp, old, ADV, MASK, T, **agg)
        vl, _ = value_loss(VALUES, VALUES + 0.3, RETURNS, MASK, T, **agg)
        eb = entropy_bonus(ENT, MASK, T, **agg)
        kll, _ = kl_loss(lp, old, MASK, T, estimator="k3", **agg)
        assert float(loss) == pytest.approx(float(0.3 * vl + pl - 0.01 * eb + 0.05 * kll),
                                            abs=1e-6), mode


def test_warmup_keeps_only_the_value_term_and_still_reports_the_policy():
    o = _objective(value_loss_coef=0.5, entropy_coef=0.1, kl_loss_coef=0.2)
    loss, stats = ppo_loss(o, LP, ENT, MASK, T, S, old_logprobs=LP, advantages=ADV,
                           values=VALUES, old_values=VALUES, returns=RETURNS, policy=False)
    assert float(loss) == pytest.approx(0.5 * float(stats["value_loss_sum"]) / T, abs=1e-7)
    assert "kl_loss_sum" not in stats and "policy_loss_sum" in stats


def test_critic_free_has_no_value_term_and_no_kl_when_its_coef_is_zero():
    loss, stats = ppo_loss(_objective(), LP, ENT, MASK, T, S, old_logprobs=LP, advantages=ADV)
    assert float(loss) == pytest.approx(-(1 - 2 + 4) / 3, abs=1e-6)
    assert "value_loss_sum" not in stats and "kl_loss_sum" not in stats


def test_the_gradient_flows_to_the_log_probs_and_values():
    lp, v = LP.clone().requires_grad_(), VALUES.clone().requires_grad_()
    loss, _ = ppo_loss(_objective(value_loss_coef=0.5), lp, ENT, MASK, T, S, old_logprobs=LP,
                       advantages=ADV, values=v, old_values=VALUES, returns=RETURNS)
    loss.backward()
    assert torch.count_nonzero(lp.grad[MASK]) == 3 and torch.all(lp.grad[~MASK] == 0)
    assert torch.count_nonzero(v.grad[MASK]) == 3


def test_missing_inputs_are_named():
    with pytest.raises(ValueError, match="kl_loss_coef > 0 needs kl_logprobs and ref_logprobs"):
        ppo_loss(_objective(kl_loss_coef=0.1), LP, ENT, MASK, T, S, old_logprobs=LP, advantages=ADV)
    with pytest.raises(ValueError, match="value term needs old_values and returns"):
        ppo_loss(_objective(), LP, ENT, MASK, T, S, old_logprobs=LP, advantages=ADV, values=VALUES)


def test_critic_loss_is_the_value_loss_alone_without_vf_coef():
    o = _objective(value_loss_coef=0.5)
    loss, stats = critic_loss(o, VALUES, VALUES, RETURNS, MASK, T, S)
    expected = 0.5 * ((0.5 - 1) ** 2 + 1 + 1) / 3
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert float(stats["value_loss_sum"]) == pytest.approx(expected * T, abs=1e-6)
    assert float(stats["valid_tokens"]) == 3 and not math.isnan(float(loss))


def test_logged_entropy_and_kl_loss_are_nats_per_token_in_every_agg_mode():
    # Every valid token has entropy 1 nat and k1 KL 0.5 nats: the logged entropy and kl_loss
    # are 1.0 and 0.5 whatever loss_agg_mode aggregates the loss terms with (they were the
    # aggregated terms: 1.0 / 4.5 / 1.0 / 0.14 for the four modes at these lengths).
    from nemo_rlhf.algorithms.ppo import finalize_token_stats

    mask = torch.tensor([[True] * 8, [True] + [False] * 7])
    lp = torch.full((2, 8), -1.0)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                 "seq-mean-token-sum-norm"):
        o = PPOObjective(kl_loss_coef=0.1, kl_estimator="k1", loss_agg_mode=mode, norm_length=64)
        _, stats = ppo_loss(o, lp, torch.ones(2, 8), mask, 9, 2, old_logprobs=lp,
                            advantages=torch.zeros(2, 8), kl_logprobs=lp, ref_logprobs=lp - 0.5)
        out = finalize_token_stats(stats)
        assert out["entropy"] == pytest.approx(1.0, abs=1e-6), mode
        assert out["kl_loss"] == pytest.approx(0.5, abs=1e-6), mode


def test_kl_term_far_from_the_reference_is_finite_and_clamped():
    # logp - ref_logp = -100 on one token: k3's exp(100) overflowed fp32 to inf (an infinite
    # loss and a NaN gradient: the step was skipped). The log-ratio is clipped before the exp
    # and the estimate clamped to DEFAULT_KL_LOSS_CLAMP (10 nats): finite, no gradient there.
    from nemo_rlhf.algorithms.ppo import DEFAULT_KL_LOSS_CLAMP, finalize_token_stats

    lp = torch.tensor([[-101.0, -1.0]]).requires_grad_()
    ref = torch.tensor([[-1.0, -1.5]])
    mask = torch.tensor([[True, True]])
    o = _objective(kl_loss_coef=1.0, kl_estimator="k3")
    loss, stats = ppo_loss(o, lp, torch.zeros(1, 2), mask, 2, 1, old_logprobs=lp.detach(),
                           advantages=torch.zeros(1, 2), kl_logprobs=lp, ref_logprobs=ref)
    loss.backward()
    k3_second = math.exp(-0.5) + 0.5 - 1  # log r = ref - logp = -0.5
    assert DEFAULT_KL_LOSS_CLAMP == 10.0
    assert float(loss) == pytest.approx((10.0 + k3_second) / 2, abs=1e-5)
    assert finalize_token_stats(stats)["kl_loss"] == pytest.approx((10.0 + k3_second) / 2, abs=1e-5)
    assert torch.isfinite(lp.grad).all()
    assert float(lp.grad[0, 0]) == 0.0  # clamped: no gradient from the far token
    assert float(lp.grad[0, 1]) == pytest.approx((1 - math.exp(-0.5)) / 2, abs=1e-6)
    # off (kl_clamp=None): still finite, k3's log-ratio bound (20) keeps exp finite
    lp.grad = None
    loss, _ = ppo_loss(_objective(kl_loss_coef=1.0, kl_estimator="k3", kl_clamp=None), lp,
                       torch.zeros(1, 2), mask, 2, 1, old_logprobs=lp.detach(),
                       advantages=torch.zeros(1, 2), kl_logprobs=lp, ref_logprobs=ref)
    loss.backward()
    assert float(loss) == pytest.approx((math.exp(20.0) - 21.0 + k3_second) / 2, rel=1e-5)
    assert torch.isfinite(lp.grad).all()
