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


# --------------------------------------------------------------------------------------
# The pi controller: log-space proportional-integral rule, one update per PPO step
# --------------------------------------------------------------------------------------


def test_pi_rule_worked_example_from_its_docstring():
    from nemo_rlhf.algorithms.ppo import pi_kl_coef

    # e = log(9/6) = 0.405465; de = log(9/7.5) = log 1.2 = 0.182322
    # step = 1 * 0.182322 + 0.3 * 0.405465 = 0.303961; beta = 0.02 * exp(0.303961) = 0.02 * 1.355216
    beta, e = pi_kl_coef(0.02, 9.0, math.log(7.5 / 6.0), target=6.0, kp=1.0, ki=0.3, error_clip=2.0,
                         max_factor=2.0, min_coef=0.0)
    assert e == pytest.approx(0.405465108, abs=1e-9)
    assert beta == pytest.approx(0.0271043265, rel=1e-8)
    # from KL 4.5: step = log 2 + 0.121640 = 0.814787 > log 2: bounded, beta doubles
    beta, _ = pi_kl_coef(0.02, 9.0, math.log(4.5 / 6.0), target=6.0, kp=1.0, ki=0.3, error_clip=2.0,
                         max_factor=2.0, min_coef=0.0)
    assert beta == pytest.approx(0.04, rel=1e-12)


@pytest.mark.parametrize("kl, prev, want_beta, want_e", [
    # first update: no proportional kick, integral only: 0.1 * 2^0.5
    (12.0, None, 0.1 * 2 ** 0.5, math.log(2.0)),
    # at the target with the previous error 0: unchanged
    (6.0, 0.0, 0.1, 0.0),
    # KL 100x the target: the error is clipped at 2; de = 2 - 0.5 -> exp(1.5 + 1.0) = 12.18 > 10: x10
    (600.0, 0.5, 0.1 * 10.0, 2.0),
    # KL 0 (and k1's negative means) count as -clip: de = -2 - 0 -> exp(-2 - 1) = 0.0498, floored
    (0.0, 0.0, 0.01, -2.0),
    (-0.3, 0.0, 0.01, -2.0),
    # KL falling from 2x to 1.5x the target: the P term lowers beta while the I term raises it
    (9.0, math.log(2.0), 0.1 * math.exp(math.log(0.75) + 0.5 * math.log(1.5)), math.log(1.5)),
    # a fall from 1x to 0.5x the target: step -log 2 - 0.5 log 2 = x 0.354; unbounded at 10
    (3.0, 0.0, 0.1 * 2 ** -1.5, -math.log(2.0)),
])
def test_pi_rule_hand_computed_values(kl, prev, want_beta, want_e):
    from nemo_rlhf.algorithms.ppo import pi_kl_coef

    beta, e = pi_kl_coef(0.1, kl, prev, target=6.0, kp=1.0, ki=0.5, error_clip=2.0, max_factor=10.0,
                         min_coef=0.01)
    assert e == pytest.approx(want_e, abs=1e-12)
    assert beta == pytest.approx(want_beta, rel=1e-12)


def test_pi_controller_keeps_its_previous_error_and_resumes_exactly():
    from nemo_rlhf.algorithms.ppo import PIKLController

    settings = {"kp": 2.0, "ki": 0.5, "error_clip": 1.0, "max_factor": 100.0, "min_coef": 0.05}
    ctl = build_kl_controller("pi", 0.05, target=4.0, pi=settings)
    assert isinstance(ctl, PIKLController) and ctl.min_coef == 0.05  # a floor at init: one-sided
    ctl.update(2.0, n_steps=32)  # e = log 0.5, first: integral only -> 0.05 * 0.5^0.5, floored at 0.05
    assert ctl.value == 0.05 and ctl.prev_error == pytest.approx(math.log(0.5))
    ctl.update(8.0, n_steps=32)  # e = log 2, de = log 4: 0.05 * exp(2 log 4 + 0.5 log 2) = x 22.6
    assert ctl.value == pytest.approx(0.05 * 16 * 2 ** 0.5, rel=1e-12)
    restored = build_kl_controller("pi", 0.05, target=4.0, pi=settings)
    restored.load_state_dict(ctl.state_dict())
    for c in (ctl, restored):
        c.update(5.0, n_steps=32)
    assert restored.value == ctl.value and restored.prev_error == ctl.prev_error
    # a checkpoint of the adaptive controller (no prev_error): the next update has no P kick
    restored.load_state_dict(AdaptiveKLController(0.2, 6.0, 100).state_dict())
    restored.update(8.0, n_steps=32)
    assert restored.value == pytest.approx(0.2 * 2 ** 0.5, rel=1e-12)


def test_pi_beta_falls_below_its_start_down_to_the_default_floor():
    """The default floor is PI_DEFAULTS' absolute 1e-3, not init_kl_coef (#50): with KL at 0
    (the error clipped at -2) and the default gains, each step multiplies beta by
    exp(0.3 * -2) = 0.548812 (no proportional kick: the error does not change), from 0.05:
    0.027441, 0.015060, 0.008265, 0.004536, 0.002489, 0.001366, then 0.000750 < 1e-3: the
    floor. Then KL at 4x the target: e = log 4 = 1.386, step = 1.5 * (1.386 + 2) + 0.3 * 1.386
    = 5.50, bounded at log 4: x4."""
    from nemo_rlhf.algorithms.ppo import PIKLController
    from nemo_rlhf.algorithms.ppo.kl import PI_DEFAULTS

    assert PI_DEFAULTS["min_coef"] == 1e-3
    for ctl in (build_kl_controller("pi", 0.05, target=6.0),
                PIKLController(0.05, 6.0, kp=1.5, ki=0.3, error_clip=2.0, max_factor=4.0)):
        assert ctl.min_coef == 1e-3
        betas = []
        for _ in range(8):
            ctl.update(0.0, n_steps=32)
            betas.append(ctl.value)
        want = [0.05 * math.exp(-0.6 * k) for k in range(1, 7)] + [1e-3, 1e-3]
        assert betas == pytest.approx(want, rel=1e-12)
        assert betas[:6] == pytest.approx([0.0274405818, 0.0150597106, 0.0082649444, 0.0045358977,
                                           0.0024893534, 0.0013661861], rel=1e-7)
        ctl.update(24.0, n_steps=32)
        assert ctl.value == pytest.approx(4e-3, rel=1e-12)
    # the one-sided rule of old is still there for the asking: a floor at init_kl_coef
    held = build_kl_controller("pi", 0.05, target=6.0, pi={"min_coef": 0.05})
    held.update(0.0, n_steps=32)
    assert held.value == 0.05


def test_pi_beta_stops_at_its_ceiling_and_comes_back_down_in_a_few_steps():
    """The default ceiling is PI_DEFAULTS' 10 (#53: at lr 1e-3 on the precedence task KL stayed
    above its target whatever beta did, and beta grew x4 a step to 3.9e16). KL 7.4x the
    target or more (the error clipped at 2), no proportional kick after the first step: each
    step is 0.3 * 2 = 0.6 -> x1.8221 (below log 4). From 0.05: 0.091106, 0.166006, ...;
    the 9th step would reach 0.05 * exp(5.4) = 11.07: held at 10. Then KL at 0 (error -2):
    the first step is 1.5 * (-2 - 2) + 0.3 * -2 = -6.6, bounded at -log 4: 2.5; then x0.5488
    a step: 1.372, 0.7530, ... Without the ceiling beta would have kept growing x1.82 a step
    and needed log(beta / 0.05) / log 4 steps to come down."""
    from nemo_rlhf.algorithms.ppo import pi_kl_coef
    from nemo_rlhf.algorithms.ppo.kl import PI_DEFAULTS

    assert PI_DEFAULTS["max_coef"] == 10.0
    ctl = build_kl_controller("pi", 0.05, target=6.0)
    assert ctl.max_coef == 10.0
    up = []
    for _ in range(12):
        ctl.update(600.0, n_steps=32)
        up.append(ctl.value)
    assert up[:8] == pytest.approx([0.05 * math.exp(0.6 * k) for k in range(1, 9)], rel=1e-12)
    assert up[8:] == [10.0] * 4
    ctl.update(0.0, n_steps=32)
    assert ctl.value == pytest.approx(2.5, rel=1e-12)
    ctl.update(0.0, n_steps=32)
    assert ctl.value == pytest.approx(2.5 * math.exp(-0.6), rel=1e-12)
    # the same KL with no ceiling: the 40 steps multiply beta by exp(24)
    free = build_kl_controller("pi", 0.05, target=6.0, pi={"max_coef": math.inf})
    for _ in range(40):
        free.update(600.0, n_steps=32)
    assert free.value == pytest.approx(0.05 * math.exp(0.6 * 40), rel=1e-9)
    # the bare rule: the ceiling clips the step's result, as the floor does
    beta, e = pi_kl_coef(8.0, 600.0, 2.0, target=6.0, kp=1.5, ki=0.3, error_clip=2.0, max_factor=4.0,
                         min_coef=1e-3, max_coef=10.0)
    assert (beta, e) == (10.0, 2.0)


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_coef": 0.0}, "max_coef=0.0: must be > 0"),
    ({"max_coef": float("nan")}, "max_coef=nan: must be finite"),
    ({"max_coef": 0.01}, "init_kl_coef=0.1: must be <= max_coef=0.01"),
    ({"max_coef": 0.5, "min_coef": 0.6, "init_kl_coef": 0.55}, "min_coef=0.6: must be <= max_coef=0.5"),
])
def test_pi_ceiling_is_checked_against_the_floor_and_the_start(kwargs, needle):
    from nemo_rlhf.algorithms.ppo import PIKLController

    args = {"init_kl_coef": 0.1, "target": 6.0, "kp": 1.0, "ki": 0.3, "error_clip": 2.0, "max_factor": 2.0,
            **kwargs}
    with pytest.raises(ValueError) as err:
        PIKLController(**args)
    assert needle in str(err.value)
    assert PIKLController(0.1, 6.0, 1.0, 0.3, 2.0, 2.0, max_coef=math.inf).max_coef == math.inf


@pytest.mark.parametrize("kwargs, name", [
    ({"init_kl_coef": 0.0}, "init_kl_coef"), ({"target": 0.0}, "target"), ({"kp": -1.0}, "kp"),
    ({"ki": float("nan")}, "ki"), ({"error_clip": 0.0}, "error_clip"), ({"max_factor": 1.0}, "max_factor"),
    ({"min_coef": -0.1}, "min_coef"),
])
def test_pi_controller_validates_arguments_by_name(kwargs, name):
    from nemo_rlhf.algorithms.ppo import PIKLController

    args = {"init_kl_coef": 0.1, "target": 6.0, "kp": 1.0, "ki": 0.3, "error_clip": 2.0, "max_factor": 2.0,
            **kwargs}
    with pytest.raises(ValueError, match=name):
        PIKLController(**args)
    with pytest.raises(ValueError, match="current_kl"):
        PIKLController(0.1, 6.0, 1.0, 0.3, 2.0, 2.0).update(float("inf"), 1)
    with pytest.raises(ValueError, match="target"):
        build_kl_controller("pi", 0.1)
    with pytest.raises(ValueError, match=r"unknown pi controller settings \['kd'\]"):
        build_kl_controller("pi", 0.1, target=6.0, pi={"kd": 1.0})


def _toy_run(ctl, steps: int, v0: float = 0.33, c: float = 1.2) -> list[float]:
    """kl_mean of each step of a toy PPO run: the policy's distance from the reference
    ``d`` grows by ``v0`` a step and the KL penalty pulls it back by ``c * beta * d``
    (``d <- max(0, d + v0 - c * beta * d)``, ``KL = d^2``). With ``beta = 0.02`` the KL
    rises 0 -> 7 nats in 10 steps, as the SmolLM2 demo's did (docs/demo.md: 0 -> 6.3 and,
    on seed 3, 0 -> 9.23). The controller sees each step's KL after the step, as the
    trainer's does."""
    d, kls = 0.0, []
    for _ in range(steps):
        kls.append(d * d)
        ctl.update(d * d, n_steps=32)
        d = max(0.0, d + v0 - c * ctl.value * d)
    return kls


def test_on_a_toy_run_the_pi_controller_holds_the_band_where_ziegler_cannot():
    """Target 6, beta 0.02, 32 samples a step and the floor at beta's start
    (conf/ppo_smollm2.yaml's): Ziegler's rule with the demo's horizon of 1000 barely moves
    beta, and the KL runs on past the target (and past ``guards.kl_over_target``'s 1.25x);
    the pi rule with its default gains settles at it."""
    held = {"min_coef": 0.02}  # the demo's pinned floor (= its init_kl_coef)
    zieg = _toy_run(AdaptiveKLController(0.02, target=6.0, horizon=1000), 20)
    assert zieg[9] > 7.0 and zieg[-1] > 20.0
    pi = _toy_run(build_kl_controller("pi", 0.02, target=6.0, pi=held), 20)
    assert max(pi) < 1.25 * 6.0 and max(pi) == pytest.approx(6.08, abs=0.01)
    assert abs(pi[-1] - 6.0) < 0.3
    for faster in (0.5, 0.7):  # a policy that moves faster: the band still holds
        assert max(_toy_run(build_kl_controller("pi", 0.02, target=6.0, pi=held), 20, v0=faster)) < 1.05 * 6.0
    # with beta at most doubling a step, the fastest reaches the band's edge
    doubling = build_kl_controller("pi", 0.02, target=6.0, pi={**held, "max_factor": 2.0})
    assert 1.2 * 6.0 < max(_toy_run(doubling, 20, v0=0.7)) < 1.26 * 6.0
    # with the library's default floor (1e-3, far below 0.02) or none, beta falls while KL
    # is still small (8x, to 0.0025), and KL overshoots: the price of a two-sided rule
    for floor in ({}, {"min_coef": 0.0}):
        kls = _toy_run(build_kl_controller("pi", 0.02, target=6.0, pi=floor), 20)
        assert max(kls) == pytest.approx(11.19, abs=0.01)


def test_on_a_toy_run_with_too_high_a_start_only_the_default_floor_lets_kl_reach_its_target():
    """The other side (#50): beta started above what holds KL at the target (the toy's
    KL at the target needs beta ~0.11: 4.5x less). With the floor at the start, beta can never come
    down and KL stays at a twentieth of its target (0.30); with the default floor it does
    (5.96 at step 30)."""
    held = _toy_run(build_kl_controller("pi", 0.5, target=6.0, pi={"min_coef": 0.5}), 30)
    assert max(held) < 0.4
    free = _toy_run(build_kl_controller("pi", 0.5, target=6.0), 30)
    assert abs(free[-1] - 6.0) < 0.5
