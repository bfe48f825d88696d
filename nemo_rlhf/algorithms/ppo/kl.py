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

Controllers follow Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences", section 2.2 (as in TRL/OpenAI lm-human-preferences ``AdaptiveKLController``).

Simplified / left out: no per-sequence KL (sum over tokens) variants and no
"full" KL over the vocabulary: only the sampled-token estimators that need log-probs.
``kl_penalty`` does not mask; callers (``compute_token_rewards``) select valid tokens.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Type, Union

import torch

from nemo_rlhf.algorithms.ppo.core import _check_same_shape, _fp32

__all__ = [
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "K3_LOG_RATIO_CLAMP",
    "build_kl_controller",
    "kl_penalty",
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


KLController = Union[FixedKLController, AdaptiveKLController]

#: kind -> controller class.
KL_CONTROLLERS: Dict[str, Type] = {
    "fixed": FixedKLController,
    "adaptive": AdaptiveKLController,
}


def build_kl_controller(
    kind: str,
    init_kl_coef: float,
    target: Optional[float] = None,
    horizon: Optional[float] = None,
) -> KLController:
    """Build a KL controller by name.

    Args:
        kind: ``"fixed"`` or ``"adaptive"``.
        init_kl_coef: initial ``beta`` (>= 0).
        target, horizon: required for ``"adaptive"``; ignored for ``"fixed"`` (so a
            config that always carries them can be passed through unchanged).

    Raises:
        ValueError: unknown ``kind`` (the message lists the valid kinds), or
            ``"adaptive"`` without ``target``/``horizon``, or invalid values.
    """
    if kind not in KL_CONTROLLERS:
        raise ValueError(f"unknown KL controller {kind!r}; valid kinds: {sorted(KL_CONTROLLERS)}")
    if kind == "fixed":
        return FixedKLController(init_kl_coef)
    missing = [n for n, v in (("target", target), ("horizon", horizon)) if v is None]
    if missing:
        raise ValueError(f"the adaptive KL controller needs {', '.join(missing)}")
    return AdaptiveKLController(init_kl_coef, target, horizon)
