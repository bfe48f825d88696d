"""KL estimators, the KL penalty and the KL-coefficient controllers."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rlhf.algorithms.ppo import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    kl_penalty,
)


def test_kl_estimators_worked_values():
    lp, ref = torch.tensor([[-1.2, -2.0]]), torch.tensor([[-1.6, -1.0]])
    # k1 = lp - ref
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([[0.4, -1.0]]))
    # k2 = 0.5 * (lp - ref)^2
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([[0.08, 0.5]]))
    # k3 = exp(ref - lp) - (ref - lp) - 1
    expected = [math.exp(-0.4) + 0.4 - 1, math.exp(1.0) - 1.0 - 1]
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([expected]))
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}


def test_kl_default_estimator_is_k1_and_clamp_is_symmetric():
    lp, ref = torch.tensor([[0.0, -3.0, 0.5]]), torch.tensor([[-3.0, 0.0, 0.0]])
    torch.testing.assert_close(kl_penalty(lp, ref), torch.tensor([[3.0, -3.0, 0.5]]))
    torch.testing.assert_close(kl_penalty(lp, ref, clamp=1.0), torch.tensor([[1.0, -1.0, 0.5]]))
    with pytest.raises(ValueError, match="clamp"):
        kl_penalty(lp, ref, clamp=0.0)


def test_unknown_kl_estimator_lists_valid_names():
    with pytest.raises(ValueError) as err:
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    for name in ("k1", "k2", "k3"):
        assert name in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_kl_penalty_computes_in_fp32(dtype):
    lp = torch.tensor([[-1.2]], dtype=dtype)
    ref = torch.tensor([[-1.6]], dtype=dtype)
    for name in KL_ESTIMATORS:
        assert kl_penalty(lp, ref, name).dtype == torch.float32


def test_k2_k3_never_negative_k1_can_be():
    gen = torch.Generator().manual_seed(0)
    lp, ref = torch.randn(64, 8, generator=gen), torch.randn(64, 8, generator=gen)
    assert (kl_penalty(lp, ref, "k2") >= 0).all()
    assert (kl_penalty(lp, ref, "k3") >= 0).all()
    assert (kl_penalty(lp, ref, "k1") < 0).any()


# --------------------------------------------------------------------------------------
# Controllers (Ziegler et al. 2019)
# --------------------------------------------------------------------------------------


def test_adaptive_controller_raises_beta_when_kl_above_target():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=6.6, n_steps=100)  # e = 0.1 -> mult 1 + 0.1 * 100 / 10000
    assert ctl.value == pytest.approx(0.1 * 1.001, rel=1e-12)


def test_adaptive_controller_lowers_beta_when_kl_below_target():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=5.4, n_steps=100)  # e = -0.1
    assert ctl.value == pytest.approx(0.1 * 0.999, rel=1e-12)


@pytest.mark.parametrize("kl,mult", [(60.0, 1.002), (12.0, 1.002), (0.0, 0.998), (1.0, 0.998)])
def test_adaptive_controller_error_is_clipped_to_plus_minus_02(kl, mult):
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=kl, n_steps=100)
    assert ctl.value == pytest.approx(0.1 * mult, rel=1e-12)


def test_adaptive_controller_at_target_and_zero_steps_is_unchanged():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=6.0, n_steps=100)
    ctl.update(current_kl=100.0, n_steps=0)
    assert ctl.value == 0.1


def test_adaptive_controller_beta_never_negative():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10)
    ctl.update(current_kl=0.0, n_steps=1000)  # mult = 1 - 0.2 * 100 < 0 -> floored
    assert ctl.value == 0.0


def test_adaptive_controller_state_dict_round_trip_is_exact():
    ctl = AdaptiveKLController(0.123456789, target=6.0, horizon=10000)
    for kl in (7.0, 3.1, 9.9, 6.2, 0.4):
        ctl.update(current_kl=kl, n_steps=64)
    state = ctl.state_dict()
    restored = AdaptiveKLController(0.5, target=6.0, horizon=10000)
    restored.load_state_dict(state)
    assert restored.value == ctl.value  # exact float, not approx
    assert restored.value != 0.123456789
    ctl.update(5.0, 64)
    restored.update(5.0, 64)
    assert restored.value == ctl.value


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"init_kl_coef": -0.1, "target": 6.0, "horizon": 10.0}, "init_kl_coef"),
        ({"init_kl_coef": 0.1, "target": 0.0, "horizon": 10.0}, "target"),
        ({"init_kl_coef": 0.1, "target": -1.0, "horizon": 10.0}, "target"),
        ({"init_kl_coef": 0.1, "target": 6.0, "horizon": 0.0}, "horizon"),
        ({"init_kl_coef": math.nan, "target": 6.0, "horizon": 10.0}, "init_kl_coef"),
    ],
)
def test_adaptive_controller_validates_arguments_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AdaptiveKLController(**kwargs)


def test_adaptive_controller_rejects_non_finite_kl():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10)
    with pytest.raises(ValueError, match="current_kl"):
        ctl.update(math.nan, 1)
    assert ctl.value == 0.1


def test_fixed_controller_stays_fixed():
    ctl = FixedKLController(0.05)
    for kl in (0.0, 100.0, 3.0):
        ctl.update(current_kl=kl, n_steps=1000)
    assert ctl.value == 0.05
    other = FixedKLController(0.9)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05
    with pytest.raises(ValueError, match="init_kl_coef"):
        FixedKLController(-1.0)


def test_build_kl_controller_registry():
    assert isinstance(build_kl_controller("fixed", 0.1, target=6.0, horizon=10), FixedKLController)
    ctl = build_kl_controller("adaptive", 0.1, target=6.0, horizon=10)
    assert isinstance(ctl, AdaptiveKLController) and ctl.target == 6.0 and ctl.horizon == 10.0
    with pytest.raises(ValueError) as err:
        build_kl_controller("pid", 0.1)
    assert "adaptive" in str(err.value) and "fixed" in str(err.value)
    with pytest.raises(ValueError, match="horizon"):
        build_kl_controller("adaptive", 0.1, target=6.0)


def test_k3_log_ratio_is_clipped_so_the_estimate_stays_finite():
    from nemo_rlhf.algorithms.ppo.kl import K3_LOG_RATIO_CLAMP

    lp = torch.tensor([-200.0, 0.0, -1.0]).requires_grad_()
    ref = torch.tensor([0.0, -200.0, -1.0])
    kl = kl_penalty(lp, ref, "k3")
    assert torch.isfinite(kl).all()
    expected = [math.exp(K3_LOG_RATIO_CLAMP) - K3_LOG_RATIO_CLAMP - 1,
                math.exp(-K3_LOG_RATIO_CLAMP) + K3_LOG_RATIO_CLAMP - 1, 0.0]
    torch.testing.assert_close(kl, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    kl.sum().backward()
    assert torch.isfinite(lp.grad).all()
