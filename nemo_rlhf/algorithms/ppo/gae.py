"""Generalized Advantage Estimation over masked, batch-first response tokens.

Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation", eq. 11-16: ``delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)``,
``A_t = sum_l (gamma * lam)^l delta_{t+l}``, computed backwards as
``A_t = delta_t + gamma * lam * A_{t+1}``; returns (value targets) ``R_t = A_t + V(s_t)``
(the TD(lambda) return, as in TRL/verl).

Masking: masked positions are skipped, i.e. the recursion runs over the valid tokens of
each row in order, as if the padding were not there. The value after the last valid token
is 0 (a finished or truncated response is treated as terminal: no bootstrap from padding
or from a value the critic never saw). Rewards/values at masked positions are never read,
so left padding, right padding, and NaN/Inf in padding do not change the result.

Holes (multi-turn trajectories, #51): the mask may be 0 in the middle of a row, on the
tokens an environment appended between two policy segments (a tool's output, a user turn).
Those tokens are transparent to the recursion: for a policy token ``t`` the "next" value
and advantage are those of the next policy token ``t' > t`` of the row (``V(s_{t'})``,
``A_{t'}``), so the critic's bootstrap passes over the environment tokens, and their own
rewards and values are never read. Discounting is per policy token: ``gamma`` (and
``gamma * lam``) applies once per step from one policy token to the next, however many
environment tokens lie between them (the environment's tokens are not actions, so they
are not time steps of the token MDP). This is verl's multi-turn GAE
(``verl/trainer/ppo/core_algos.py``, ``compute_gae_advantage_return``: "skip values and
TD-error on observation tokens", which carries ``nextvalues``/``lastgaelam`` unchanged
through tokens whose ``response_mask`` is 0), except that here the outputs on environment
tokens are exactly 0 where verl leaves the carried values there. A reward placed on an
environment token is ignored: a per-turn reward belongs on its turn's last policy token.

Decoupled lambda (VC-PPO, Yuan et al. 2025, "What's Behind PPO's Collapse in Long-CoT?
Value Optimization Holds the Secret", arXiv:2503.01491): the critic's value
targets and the policy's advantages come from two GAE passes with their own lambda,
``compute_decoupled_gae``: returns ``R_t = A_t(lam_critic) + V(s_t)`` (VC-PPO: ``lam_critic
= 1``, the Monte-Carlo return, so the reward at the end of a long response reaches the
first tokens' targets undecayed), advantages ``A_t(lam_policy)`` (VC-PPO: 0.95). Both passes
skip environment tokens as above.

Length-adaptive lambda (VAPO, Yue et al. 2025, "VAPO: Efficient and Reliable Reinforcement
Learning for Advanced Reasoning Tasks", arXiv:2504.05118, length-adaptive GAE):
``lam_policy = 1 - 1 / (alpha * l)`` per sequence, ``l`` its number of policy tokens
(``length_adaptive_lam``; VAPO: ``alpha = 0.05``), so that the sum of the GAE weights,
``1 / (1 - lam)``, grows with the length as ``alpha * l``. The formula is negative for
``l < 1 / alpha``; here it is clamped to ``[0, 1]`` (0: the one-step TD advantage). GAE
takes such a lambda as a ``[batch]`` tensor, one value per row.

Simplified / left out: no bootstrap for truncated responses (the usual RLHF choice: the
score is given at the last token), no ``dones`` inside a row (one episode per row).
Outputs are detached: advantages and returns are targets, not differentiated through.
"""

from __future__ import annotations

import math
from typing import List, Tuple, Union

import torch

from nemo_rlhf.algorithms.ppo.core import _bool_mask, _check_2d, _check_same_shape, _fp32, _select

__all__ = ["compute_decoupled_gae", "compute_gae", "compute_gae_reference", "length_adaptive_lam"]

#: A GAE lambda: one float for the batch, or a ``[batch]`` tensor, one value per row.
Lam = Union[float, torch.Tensor]


def _check_gae_coefs(gamma: float, lam: Lam, batch: int) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if isinstance(lam, torch.Tensor):
        if lam.shape != (batch,):
            raise ValueError(f"a per-row lam must have shape [batch]=({batch},), got {tuple(lam.shape)}")
        if not lam.is_floating_point():
            raise TypeError(f"a per-row lam must be a float tensor, got dtype {lam.dtype}")
        bad = ~((lam >= 0) & (lam <= 1))  # NaN too
        if bool(bad.any()):
            rows = torch.nonzero(bad).flatten().tolist()
            raise ValueError(f"lam must be in [0, 1]; rows {rows} have {lam[bad].tolist()}")
    elif not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")


def length_adaptive_lam(response_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive policy lambda (arXiv:2504.05118), one per row.

    ``lam = 1 - 1 / (alpha * l)`` with ``l`` the row's number of policy tokens (the 1s of
    ``response_mask``: environment tokens of a holed row do not count), clamped to
    ``[0, 1]`` (negative for ``l < 1 / alpha``; a row with no policy token gets 0, it has
    nothing to weight).

    Args:
        response_mask: ``[batch, response_len]`` bool or 0/1.
        alpha: > 0 (VAPO: 0.05).

    Returns:
        ``[batch]`` float32 on the mask's device.

    Raises:
        ValueError: ``alpha`` not a finite number > 0, or a mask that is not 2-D.
    """
    _check_2d(response_mask)
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha}")
    length = _bool_mask(response_mask).sum(dim=1).to(torch.float32)
    lam = 1.0 - 1.0 / (alpha * length.clamp_min(1.0))
    return torch.where(length > 0, lam, 0.0).clamp(0.0, 1.0)


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: Lam,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns, vectorised over the batch (loop over time).

    Formula: Schulman et al. 2016, eq. 11-16 (see module docstring); masked positions
    are skipped and ``V`` after the last valid token is 0.

    Args:
        rewards: ``[batch, response_len]`` per-token rewards, any float dtype.
        values: ``[batch, response_len]`` critic values ``V(s_t)``, any float dtype.
        response_mask: ``[batch, response_len]`` bool or 0/1.
        gamma: discount, in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]``: a float, or a ``[batch]`` float tensor (one lambda
            per row, e.g. :func:`length_adaptive_lam`; its range check reads one bool on
            the host).

    Returns:
        ``(advantages, returns)``, both ``[batch, response_len]`` fp32, detached, exactly 0
        on masked positions; ``returns = advantages + values`` on valid positions.

    Raises:
        ValueError: shape mismatches, or ``gamma``/``lam`` outside ``[0, 1]``.
        TypeError: a per-row ``lam`` that is not a float tensor.
    """
    _check_2d(response_mask)
    _check_gae_coefs(gamma, lam, response_mask.shape[0])
    r = _fp32(rewards, "rewards").detach()
    v = _fp32(values, "values").detach()
    _check_same_shape(response_mask, "response_mask", rewards=r, values=v)
    mask = _bool_mask(response_mask)
    r = _select(mask, r)
    v = _select(mask, v)

    batch, length = mask.shape
    if isinstance(lam, torch.Tensor):
        lam = lam.detach().to(device=r.device, dtype=torch.float32)
    advantages = torch.zeros_like(r)
    next_value = torch.zeros(batch, dtype=torch.float32, device=r.device)
    next_adv = torch.zeros_like(next_value)
    for t in range(length - 1, -1, -1):
        valid = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv = delta + gamma * lam * next_adv
        # Masked step: output 0 and carry (next_value, next_adv) through unchanged.
        advantages[:, t] = torch.where(valid, adv, torch.zeros_like(adv))
        next_value = torch.where(valid, v[:, t], next_value)
        next_adv = torch.where(valid, adv, next_adv)
    returns = _select(mask, advantages + v)
    return advantages, returns


def compute_gae_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: Lam,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain Python loop over every ``(b, t)``: the readable definition ``compute_gae``
    is tested against. Same arguments, returns and errors as ``compute_gae``; slow.

    For each row it lists the valid positions, then runs the textbook backward
    recursion (Schulman et al. 2016, eq. 11-16) over them with ``V`` = 0 after the last.
    """
    _check_2d(response_mask)
    _check_gae_coefs(gamma, lam, response_mask.shape[0])
    _check_same_shape(response_mask, "response_mask", rewards=rewards, values=values)
    lams = (lam.detach().float().cpu().tolist() if isinstance(lam, torch.Tensor)
            else [lam] * response_mask.shape[0])
    r = _fp32(rewards, "rewards").detach().cpu().tolist()
    v = _fp32(values, "values").detach().cpu().tolist()
    mask = _bool_mask(response_mask).cpu().tolist()
    batch = len(mask)
    length = len(mask[0]) if batch else 0

    adv_out: List[List[float]] = [[0.0] * length for _ in range(batch)]
    ret_out: List[List[float]] = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        positions = [t for t in range(length) if mask[b][t]]
        next_value = 0.0
        next_adv = 0.0
        for t in reversed(positions):
            delta = r[b][t] + gamma * next_value - v[b][t]
            adv = delta + gamma * lams[b] * next_adv
            adv_out[b][t] = adv
            ret_out[b][t] = adv + v[b][t]
            next_value = v[b][t]
            next_adv = adv
    device = rewards.device
    shape = tuple(response_mask.shape)
    advantages = torch.tensor(adv_out, dtype=torch.float32, device=device).reshape(shape)
    returns = torch.tensor(ret_out, dtype=torch.float32, device=device).reshape(shape)
    return advantages, returns


def compute_decoupled_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam_policy: Lam,
    lam_critic: Lam,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """VC-PPO's decoupled GAE (arXiv:2503.01491): advantages with ``lam_policy``, the
    critic's targets with ``lam_critic`` (see module docstring).

    One :func:`compute_gae` pass when both lambdas are the same float (then exactly
    ``compute_gae(..., lam_policy)``), two otherwise.

    Args:
        rewards, values, response_mask, gamma: as :func:`compute_gae`.
        lam_policy: lambda of the advantages (float or ``[batch]`` tensor), in ``[0, 1]``.
        lam_critic: lambda of the returns (float or ``[batch]`` tensor), in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``: ``[batch, response_len]`` fp32, detached, 0 on masked
        positions; ``advantages`` of ``compute_gae(..., lam_policy)``, ``returns`` of
        ``compute_gae(..., lam_critic)``.

    Raises:
        ValueError / TypeError: as :func:`compute_gae`.
    """
    advantages, returns = compute_gae(rewards, values, response_mask, gamma, lam_policy)
    same = (not isinstance(lam_policy, torch.Tensor) and not isinstance(lam_critic, torch.Tensor)
            and lam_policy == lam_critic)
    if not same:
        _, returns = compute_gae(rewards, values, response_mask, gamma, lam_critic)
    return advantages, returns
