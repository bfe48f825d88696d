"""Per-token KL estimators and the KL-coefficient controllers.

Estimators follow J. Schulman, "Approximating KL Divergence" (blog post, 2020), with
samples drawn from the actor (``logprobs``) and the reference (``ref_logprobs``) as the
second distribution; ``log r = ref_logprobs - logprobs``:

* ``k1 = logp - ref_logp = -log r``: unbiased, high variance, can be negative per token.
* ``k2 = 0.5 * (logp - ref_logp)^2``: biased, low variance, never negative.
* ``k3 = exp(log r) - log r - 1``: unbiased, low variance, never negative (verl's
  ``low_var_kl``). ``log r`` is clipped to ``[-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP]``
  (20, as verl's ``low_var_kl``) before the ``exp``: a token with ``logp - ref_logp <
  -88.7`` would otherwise give ``inf`` in fp32, and an infinite loss and gradient.

Controllers: ``fixed`` (InstructGPT's constant beta); ``adaptive``, Ziegler et al. 2019,
"Fine-Tuning Language Models from Human Preferences", section 2.2 (as in TRL/OpenAI
lm-human-preferences ``AdaptiveKLController``); ``pi``, a proportional-integral rule on
``log(KL / target)`` that moves beta by a factor per PPO step (:func:`pi_kl_coef`), for
runs too short for Ziegler's horizon (its ``n_steps / horizon`` with 32 samples a step and
a horizon of 1000 moves beta by at most 0.64% a step: 6.6% in a 10-step run).

Simplified / left out: no per-sequence KL (sum over tokens) variants and no
"full" KL over the vocabulary: only the sampled-token estimators that need log-probs.
``kl_penalty`` does not mask; callers (``compute_token_rewards``) select valid tokens.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple, Type, Union

import torch

from nemo_rlhf.algorithms.ppo.core import _check_same_shape, _fp32

__all__ = [
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "K3_LOG_RATIO_CLAMP",
    "PI_DEFAULTS",
    "PI_RANGES",
    "PIKLController",
    "build_kl_controller",
    "check_pi_settings",
    "kl_penalty",
    "pi_kl_coef",
]

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs - ref_logprobs


def _kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    diff = logprobs - ref_logprobs
    return 0.5 * diff * diff


K3_LOG_RATIO_CLAMP = 20.0
"""``|log r|`` bound of the k3 estimate (``exp(20) - 21 = 4.9e8`` nats at most: finite in
fp32, and its gradient too)."""


def _kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    log_r = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return torch.exp(log_r) - log_r - 1.0


#: name -> ``fn(logprobs, ref_logprobs) -> per-token estimate`` (fp32 in, fp32 out).
KL_ESTIMATORS: Dict[str, KLEstimator] = {"k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3}


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    clamp: Optional[float] = None,
) -> torch.Tensor:
    """Per-token KL estimate between the actor and the reference policy.

    Formulas: see ``KL_ESTIMATORS`` and the module docstring (Schulman 2020 blog).

    Args:
        logprobs: ``[batch, response_len]`` actor log-probs of the sampled tokens, any
            float dtype.
        ref_logprobs: ``[batch, response_len]`` reference log-probs, any float dtype.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        clamp: if given, the estimate is clipped to ``[-clamp, clamp]`` (must be > 0).

    Returns:
        ``[batch, response_len]`` fp32. No masking is applied.

    Raises:
        ValueError: unknown ``estimator`` (the message lists the valid names),
            ``clamp <= 0``, or shapes that differ.
    """
    fn = KL_ESTIMATORS.get(estimator)
    if fn is None:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; valid names: {sorted(KL_ESTIMATORS)}"
        )
    if clamp is not None and not clamp > 0:
        raise ValueError(f"kl clamp must be > 0 or None, got {clamp}")
    lp = _fp32(logprobs, "logprobs")
    ref = _fp32(ref_logprobs, "ref_logprobs")
    _check_same_shape(lp, "logprobs", ref_logprobs=ref)
    kl = fn(lp, ref)
    if clamp is not None:
        kl = kl.clamp(min=-clamp, max=clamp)
    return kl


# --------------------------------------------------------------------------------------
# KL coefficient controllers
# --------------------------------------------------------------------------------------


def _check_kl_coef(value: float, name: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value


class FixedKLController:
    """Constant KL coefficient ``beta`` (InstructGPT, Ouyang et al. 2022, eq. 2).

    Args:
        init_kl_coef: ``beta``, finite and >= 0.

    Raises:
        ValueError: if ``init_kl_coef`` is negative or not finite.
    """

    def __init__(self, init_kl_coef: float) -> None:
        self.value = _check_kl_coef(init_kl_coef, "init_kl_coef")

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed); arguments are accepted for a common API."""

    def state_dict(self) -> Dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.value = _check_kl_coef(state["value"], "state['value']")

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value!r})"


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019, section 2.2.

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``.
    KL above target raises ``beta``, below target lowers it. ``beta`` never goes
    negative: if ``n_steps > 5 * horizon`` the multiplier could (``1 - 0.2 * n/h < 0``),
    so it is floored at 0 (the paper's ``n_steps / horizon`` is tiny, e.g. 64 / 10000).

    Args:
        init_kl_coef: initial ``beta``, finite and >= 0.
        target: target KL (nats per sequence/token, as the caller measures it), > 0.
        horizon: number of samples over which ``beta`` adapts, > 0.

    Raises:
        ValueError: naming the argument, for ``init_kl_coef < 0``, ``target <= 0`` or
            ``horizon <= 0`` (or any non-finite value).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        self.value = _check_kl_coef(init_kl_coef, "init_kl_coef")
        self.target = float(target)
        if not math.isfinite(self.target) or self.target <= 0:
            raise ValueError(f"target must be a finite number > 0, got {target}")
        self.horizon = float(horizon)
        if not math.isfinite(self.horizon) or self.horizon <= 0:
            raise ValueError(f"horizon must be a finite number > 0, got {horizon}")

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt ``beta`` from the KL measured over the last ``n_steps`` samples.

        Raises:
            ValueError: if ``current_kl`` is not finite or ``n_steps < 0``.
        """
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        mult = 1.0 + proportional_error * n_steps / self.horizon
        self.value = max(self.value * mult, 0.0)

    def state_dict(self) -> Dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        """Restore ``value`` exactly (target/horizon come from the config, not the state).

        Raises:
            ValueError: if the stored value is negative or not finite.
        """
        self.value = _check_kl_coef(state["value"], "state['value']")

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self.value!r}, target={self.target!r}, "
            f"horizon={self.horizon!r})"
        )


def pi_kl_coef(
    beta: float,
    current_kl: float,
    prev_error: Optional[float],
    target: float,
    kp: float,
    ki: float,
    error_clip: float,
    max_factor: float,
    min_coef: float,
    max_coef: float = math.inf,
) -> Tuple[float, float]:
    """One step of the proportional-integral KL-coefficient rule, in log space.

    A PI controller in velocity form (Astrom & Murray, "Feedback Systems", 2nd ed., sec.
    11.3: the increment form of the discrete PI law, with a rate limit on the actuator) on
    the log error, applied to ``log beta``::

        e_t       = clip(log(max(KL_t, tiny) / target), -error_clip, error_clip)
        step_t    = clip(kp * (e_t - e_t-1) + ki * e_t, -log(max_factor), log(max_factor))
        beta_t+1  = min(max_coef, max(min_coef, beta_t * exp(step_t)))

    ``ki * e_t`` is the integral action (beta is the running product: KL 1.5x the target
    for three steps at ``ki = 0.3`` multiplies beta by ``1.5^0.9``); ``kp * (e_t - e_t-1)``
    the proportional one, which reacts to KL *rising* before it passes the target. The log
    error treats "twice the target" and "half the target" alike and makes the rule
    multiplicative (beta stays > 0). ``max_factor`` bounds the change of one step (4: beta
    at most quadruples or quarters): a step's ``kl_mean`` is noisy, and at small KL its
    log error is noisier still (on the tiny demo's PPO at ``kl.target=0.3`` without the
    bound, KL 0.03 -> 0.21 between two steps multiplied beta by 11, and beta swung between
    0.05 and 3.9 over the run; docs/algorithms.md has the runs with 2 and 4). ``min_coef`` is a lower bound on beta (a clamp on the controller's state, ``log beta``; not an
    anti-windup scheme: the integral action is not stopped, beta is only clipped). It keeps
    beta > 0 -- the rule is multiplicative, so a beta of 0 could never rise again -- and bounds
    how far beta falls while KL sits below its target, and so how many steps it needs to climb
    back: at most ``ceil(log(beta_needed / min_coef) / log(max_factor))``. A floor at the
    initial beta makes the rule one-sided (beta can only rise from its start, and a too-large
    ``init_kl_coef`` is never corrected), so the default is the small absolute
    ``PI_DEFAULTS["min_coef"]``. The price: in a run whose KL starts at 0 (the first steps,
    where the policy has not moved) the integral action lowers beta, which then has to climb
    back when KL arrives. On a toy plant of the SmolLM2 demo's KL rise (0 to 7 nats in 10
    steps at beta 0.02; ``test_kl.py``'s ``_toy_run``) with ``kp=1.5, ki=0.3, error_clip=2,
    max_factor=4``: with the floor at the initial 0.02 (the demo recipe's,
    ``conf/ppo_smollm2.yaml``) KL peaked at 6.1 against a target of 6; with the default floor
    beta first fell 8x and KL peaked at 11.2.

    Args:
        beta: the current coefficient, finite and > 0.
        current_kl: the KL measured at this step (nats per sequence, as ``target``); a
            value <= 0 (``k1`` can give one) counts as the lowest error, ``-error_clip``.
        prev_error: the previous step's ``e`` (the second return value), or None at the
            first update (no proportional kick: ``e_t-1 = e_t``).
        target: the target KL, > 0.
        kp: proportional gain, >= 0.
        ki: integral gain, >= 0.
        error_clip: bound of ``|e|``, > 0 (2.0: KL from 0.14x to 7.4x the target is seen).
        max_factor: the most beta changes in one step, as a factor, > 1.
        min_coef: the floor of beta, >= 0 (0: none, though a beta that reaches 0 stays there).
        max_coef: the ceiling of beta, >= ``min_coef`` (default: none). A clamp on the state
            like the floor: while KL stays above its target whatever beta does (a policy
            that diverges for reasons the penalty cannot hold, e.g. too large a learning
            rate), the integral action multiplies beta by up to ``max_factor`` every step
            without end (``kl_coef`` 3.9e16 was seen on the precedence task at lr 1e-3, #53),
            and once KL is back under its target beta needs ``log(beta / beta_needed) /
            log(max_factor)`` steps to come down (28 from 3.9e16 to 0.05 at a factor of 4).
            The ceiling bounds that climb down.

    Returns:
        ``(new_beta, e_t)``.

    Raises:
        ValueError: naming the argument, for a non-finite ``current_kl`` or a bad setting.

    Worked example (tests/unit/algorithms/ppo/test_kl.py): ``beta=0.02, KL=9, target=6,
    prev_error=log(7.5/6), kp=1, ki=0.3, clip=2, max_factor=2``: ``e = log 1.5 = 0.4055``,
    ``de = log 1.2 = 0.1823``, ``beta = 0.02 * exp(0.1823 + 0.1216) = 0.02 * 1.3552 =
    0.027104``; from ``prev_error=log(4.5/6)`` the step ``log 2 + 0.1216 = 0.8148`` is
    bounded to ``log 2``: ``beta = 0.04``.
    """
    current_kl = float(current_kl)
    if not math.isfinite(current_kl):
        raise ValueError(f"current_kl must be finite, got {current_kl}")
    check_pi_settings({"target": target, "kp": kp, "ki": ki, "error_clip": error_clip,
                       "max_factor": max_factor, "min_coef": min_coef, "max_coef": max_coef})
    ratio = current_kl / target
    error = math.log(ratio) if ratio > math.exp(-error_clip) else -error_clip
    error = min(max(error, -error_clip), error_clip)
    delta = 0.0 if prev_error is None else error - float(prev_error)
    bound = math.log(max_factor)
    step = min(max(kp * delta + ki * error, -bound), bound)
    return min(float(max_coef), max(float(min_coef), float(beta) * math.exp(step))), error


#: the pi controller's ranges, ``name -> (test, rule)``: the only place they are written
#: (:class:`PIKLController`, :func:`pi_kl_coef` and the config schema's ``KLConfig`` check
#: through :func:`check_pi_settings`). ``init_kl_coef`` > 0: the rule is multiplicative.
PI_RANGES: Dict[str, Tuple[Callable[[float], bool], str]] = {
    "init_kl_coef": (lambda v: v > 0, "> 0"),
    "target": (lambda v: v > 0, "> 0"),
    "kp": (lambda v: v >= 0, ">= 0"),
    "ki": (lambda v: v >= 0, ">= 0"),
    "error_clip": (lambda v: v > 0, "> 0"),
    "max_factor": (lambda v: v > 1, "> 1"),
    "min_coef": (lambda v: v >= 0, ">= 0"),
    "max_coef": (lambda v: v > 0, "> 0"),
}


def check_pi_settings(settings: Dict[str, float], keys: Optional[Dict[str, str]] = None,
                      where: str = "") -> None:
    """Refuse pi controller settings outside :data:`PI_RANGES`, in the table's order.

    Args:
        settings: ``{name: value}`` for names of :data:`PI_RANGES` (any subset).
        keys: the name to give each setting in the message (e.g. ``{"kp": "kl.pi_kp"}``;
            default: the setting's own name).
        where: appended to the message (e.g. ``" with kl.type=pi"``).

    Raises:
        ValueError: ``"<key>=<value>: must be finite<where>"`` or ``"<key>=<value>: must be
            <rule><where>"`` for the first bad setting; a ``min_coef`` or ``init_kl_coef``
            above ``max_coef`` (``math.inf`` is allowed there: no ceiling); a name outside
            :data:`PI_RANGES`.
    """
    unknown = sorted(set(settings) - set(PI_RANGES))
    if unknown:
        raise ValueError(f"unknown pi controller settings {unknown}; valid: {sorted(PI_RANGES)}")
    keys = keys or {}
    for name, (ok, rule) in PI_RANGES.items():
        if name not in settings:
            continue
        value = float(settings[name])
        key = keys.get(name, name)
        if not math.isfinite(value) and not (name == "max_coef" and value == math.inf):
            raise ValueError(f"{key}={value}: must be finite{where}")
        if not ok(value):
            raise ValueError(f"{key}={value}: must be {rule}{where}")
    ceiling = settings.get("max_coef")
    if ceiling is not None:  # the ceiling is above the floor and the start
        for name in ("min_coef", "init_kl_coef"):
            if name in settings and float(settings[name]) > float(ceiling):
                raise ValueError(f"{keys.get(name, name)}={float(settings[name])}: must be <= "
                                 f"{keys.get('max_coef', 'max_coef')}={float(ceiling)}{where}")


class PIKLController:
    """Proportional-integral KL coefficient (:func:`pi_kl_coef`), one update per PPO step.

    Args:
        init_kl_coef: initial ``beta``, finite and > 0 (the rule is multiplicative).
        target: target KL (nats per sequence, as the trainer's ``kl_mean``), > 0.
        kp, ki: proportional and integral gains, >= 0.
        error_clip: bound of the log error, > 0.
        max_factor: the most ``beta`` changes in one step, as a factor, > 1.
        min_coef: floor of ``beta``, >= 0 (default ``PI_DEFAULTS["min_coef"]``: see
            :func:`pi_kl_coef`; give ``init_kl_coef`` for the one-sided rule of old).
        max_coef: ceiling of ``beta``, >= ``min_coef`` and ``init_kl_coef`` (default
            ``PI_DEFAULTS["max_coef"]``; ``math.inf``: none).

    Raises:
        ValueError: naming the argument, for any value outside its range
            (:func:`check_pi_settings`).
    """

    def __init__(self, init_kl_coef: float, target: float, kp: float, ki: float, error_clip: float,
                 max_factor: float, min_coef: Optional[float] = None,
                 max_coef: Optional[float] = None) -> None:
        min_coef = PI_DEFAULTS["min_coef"] if min_coef is None else min_coef
        max_coef = PI_DEFAULTS["max_coef"] if max_coef is None else max_coef
        check_pi_settings({"init_kl_coef": init_kl_coef, "target": target, "kp": kp, "ki": ki,
                           "error_clip": error_clip, "max_factor": max_factor, "min_coef": min_coef,
                           "max_coef": max_coef})
        self.value, self.min_coef, self.max_coef = float(init_kl_coef), float(min_coef), float(max_coef)
        self.target, self.kp, self.ki = float(target), float(kp), float(ki)
        self.error_clip, self.max_factor = float(error_clip), float(max_factor)
        self.prev_error: Optional[float] = None

    def update(self, current_kl: float, n_steps: int) -> None:
        """One PI step from this PPO step's ``current_kl``; ``n_steps`` (samples) is not used:
        the rule's unit is the PPO step.

        Raises:
            ValueError: if ``current_kl`` is not finite or ``n_steps < 0``.
        """
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        self.value, self.prev_error = pi_kl_coef(self.value, current_kl, self.prev_error, self.target,
                                                 self.kp, self.ki, self.error_clip, self.max_factor,
                                                 self.min_coef, self.max_coef)

    def state_dict(self) -> Dict[str, Optional[float]]:
        return {"value": self.value, "prev_error": self.prev_error, "target": self.target}

    def load_state_dict(self, state: Dict[str, Optional[float]]) -> None:
        """Restore ``value`` and the previous error exactly (a checkpoint of another
        controller has no ``prev_error``: the next update has no proportional kick).

        Raises:
            ValueError: if the stored value is negative or not finite.
        """
        self.value = _check_kl_coef(state["value"], "state['value']")
        prev = state.get("prev_error")
        self.prev_error = None if prev is None else float(prev)

    def __repr__(self) -> str:
        return (f"PIKLController(value={self.value!r}, target={self.target!r}, kp={self.kp!r}, "
                f"ki={self.ki!r}, error_clip={self.error_clip!r}, max_factor={self.max_factor!r}, "
                f"min_coef={self.min_coef!r}, max_coef={self.max_coef!r})")


KLController = Union[FixedKLController, AdaptiveKLController, PIKLController]

#: kind -> controller class.
KL_CONTROLLERS: Dict[str, Type] = {
    "fixed": FixedKLController,
    "adaptive": AdaptiveKLController,
    "pi": PIKLController,
}

#: the one default of each pi controller setting: :func:`build_kl_controller` fills those it
#: is not given from here, and the config schema's ``KLConfig.pi_*`` fields take theirs from
#: here (ranges: :data:`PI_RANGES`). ``min_coef`` 1e-3: beta stays > 0 (the
#: rule is multiplicative), and at ``max_factor`` 4 it climbs back from the floor to 0.05 in 3
#: steps and to 1.0 in 5; at the default target of 6 nats the floor's penalty, 0.006 a
#: sequence, is small against a reward of scale 1, so the floor itself holds no KL.
#: ``max_coef`` 10: at 10 one nat of KL costs ten times a reward of scale 1, so the penalty
#: already outweighs any reward; above it beta holds KL no better, and from 10 it comes back
#: down to 0.05 in 4 steps at ``max_factor`` 4.
PI_DEFAULTS = {"kp": 1.5, "ki": 0.3, "error_clip": 2.0, "max_factor": 4.0, "min_coef": 1e-3,
               "max_coef": 10.0}


def build_kl_controller(
    kind: str,
    init_kl_coef: float,
    target: Optional[float] = None,
    horizon: Optional[float] = None,
    pi: Optional[Dict[str, Optional[float]]] = None,
) -> KLController:
    """Build a KL controller by name.

    Args:
        kind: ``"fixed"``, ``"adaptive"`` or ``"pi"``.
        init_kl_coef: initial ``beta`` (>= 0; > 0 for ``"pi"``).
        target: required for ``"adaptive"`` and ``"pi"``; ignored for ``"fixed"``.
        horizon: required for ``"adaptive"``; ignored otherwise (so a config that always
            carries them can be passed through unchanged).
        pi: ``"pi"``'s ``kp``, ``ki``, ``error_clip``, ``max_factor``, ``min_coef``, ``max_coef`` (any left out
            or None: :data:`PI_DEFAULTS`).

    Raises:
        ValueError: unknown ``kind`` (the message lists the valid kinds), a missing
            ``target``/``horizon``, or invalid values.
    """
    if kind not in KL_CONTROLLERS:
        raise ValueError(f"unknown KL controller {kind!r}; valid kinds: {sorted(KL_CONTROLLERS)}")
    if kind == "fixed":
        return FixedKLController(init_kl_coef)
    needed = (("target", target), ("horizon", horizon)) if kind == "adaptive" else (("target", target),)
    missing = [n for n, v in needed if v is None]
    if missing:
        raise ValueError(f"the {kind} KL controller needs {', '.join(missing)}")
    if kind == "adaptive":
        return AdaptiveKLController(init_kl_coef, target, horizon)
    given = {k: v for k, v in (pi or {}).items() if v is not None}
    unknown = sorted(set(given) - set(PI_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown pi controller settings {unknown}; valid: {sorted(PI_DEFAULTS)}")
    settings = {**PI_DEFAULTS, **given}
    return PIKLController(init_kl_coef, target, **settings)
