"""Plain-loop versions of the advantage estimators of :mod:`.advantages`: the readable
definitions, row by row in Python floats, that the tests check the vectorised estimators
against (``tests/unit/algorithms/ppo/test_advantages.py``; slow, one process, no
``reduce_fn``). An estimator registered with
:func:`~.advantages.register_advantage_estimator` adds its own here
(:data:`ADVANTAGE_ESTIMATOR_REFERENCES`; docs/extending.md).
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch

from nemo_rlhf.algorithms.ppo.advantages import (
    AdvantageEstimator,
    _check_eps,
    _check_gamma,
    _check_group_ids,
    _check_no_empty_rows,
)
from nemo_rlhf.algorithms.ppo.core import _bool_mask, _check_2d, _check_same_shape, _fp32
from nemo_rlhf.algorithms.ppo.gae import compute_gae_reference

__all__ = ["ADVANTAGE_ESTIMATOR_REFERENCES"]


def _rows(token_rewards, response_mask):
    _check_2d(response_mask)
    _check_same_shape(response_mask, "response_mask", token_rewards=token_rewards)
    r = _fp32(token_rewards, "token_rewards").detach().cpu().tolist()
    mask = _bool_mask(response_mask).cpu().tolist()
    return r, mask


def _to_tensor(rows: List[List[float]], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32, device=like.device).reshape(like.shape)


def _returns_loop(r, mask, gamma) -> List[List[float]]:
    out = [[0.0] * len(row) for row in mask]
    for b, row in enumerate(mask):
        g = 0.0
        for t in reversed([t for t, valid in enumerate(row) if valid]):
            g = r[b][t] + gamma * g
            out[b][t] = g
    return out


def _outcome_reference(token_rewards, response_mask, group_ids, name, leave_one_out,
                       norm_by_std, eps):
    _check_group_ids(group_ids, len(response_mask), name)
    r, mask = _rows(token_rewards, response_mask)
    if not all(any(row) for row in mask):
        _check_no_empty_rows(_bool_mask(response_mask), name)
    outcome = [sum(r[b][t] for t, valid in enumerate(row) if valid) for b, row in enumerate(mask)]
    gids = group_ids.tolist()
    adv_rows = []
    for b, row in enumerate(mask):
        group = [outcome[j] for j in range(len(gids)) if gids[j] == gids[b]]
        k = len(group)
        if k == 1:
            a = 0.0
        elif leave_one_out:
            others = [outcome[j] for j in range(len(gids)) if gids[j] == gids[b] and j != b]
            a = outcome[b] - sum(others) / len(others)
        else:
            mean = sum(group) / k
            a = outcome[b] - mean
            if norm_by_std:
                std = math.sqrt(sum((o - mean) ** 2 for o in group) / (k - 1))
                a = a / (std + eps)
        adv_rows.append([a if valid else 0.0 for valid in row])
    returns = _returns_loop(r, mask, 1.0)
    return _to_tensor(adv_rows, response_mask), _to_tensor(returns, response_mask)


def _gae_reference(token_rewards, values, response_mask, group_ids, *, gamma, lam,
                   lam_critic=None, lam_policy=None, lam_policy_alpha=None):
    if values is None:
        raise ValueError("the 'gae' advantage estimator needs critic values, got None")
    if lam_policy_alpha is not None:  # VAPO: 1 - 1 / (alpha * policy tokens), clamped to [0, 1]
        if lam_policy is not None:
            raise ValueError("set one of lam_policy and lam_policy_alpha")
        lengths = [sum(1 for v in row if v) for row in _bool_mask(response_mask).tolist()]
        lam_policy = torch.tensor([min(1.0, max(0.0, 1.0 - 1.0 / (lam_policy_alpha * n))) if n else 0.0
                                   for n in lengths], dtype=torch.float32)
    adv, _ = compute_gae_reference(token_rewards, values, response_mask, gamma,
                                   lam if lam_policy is None else lam_policy)
    _, ret = compute_gae_reference(token_rewards, values, response_mask, gamma,
                                   lam if lam_critic is None else lam_critic)
    return adv, ret


def _grpo_reference(token_rewards, values, response_mask, group_ids, *, norm_by_std, eps):
    _check_eps(eps)
    return _outcome_reference(token_rewards, response_mask, group_ids, "grpo", False,
                              norm_by_std, eps)


def _rloo_reference(token_rewards, values, response_mask, group_ids):
    return _outcome_reference(token_rewards, response_mask, group_ids, "rloo", True, False, 0.0)


def _reinforce_plus_plus_reference(token_rewards, values, response_mask, group_ids, *, gamma,
                                   eps, reduce_fn=None):
    if reduce_fn is not None:
        raise ValueError("the reference version runs on one process: reduce_fn must be None")
    _check_gamma(gamma)
    _check_eps(eps)
    r, mask = _rows(token_rewards, response_mask)
    g = _returns_loop(r, mask, gamma)
    valid = [g[b][t] for b, row in enumerate(mask) for t, v in enumerate(row) if v]
    if len(valid) < 2:
        raise ValueError(f"reinforce_plus_plus needs at least 2 valid tokens, got {len(valid)}")
    mean = sum(valid) / len(valid)
    var = sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)
    adv = [[(g[b][t] - mean) / math.sqrt(var + eps) if v else 0.0 for t, v in enumerate(row)]
           for b, row in enumerate(mask)]
    return _to_tensor(adv, response_mask), _to_tensor(g, response_mask)


#: name -> plain-loop version with the same signature (tests check each estimator against it).
ADVANTAGE_ESTIMATOR_REFERENCES: Dict[str, AdvantageEstimator] = {
    "gae": _gae_reference,
    "grpo": _grpo_reference,
    "rloo": _rloo_reference,
    "reinforce_plus_plus": _reinforce_plus_plus_reference,
}
