"""Advantage estimators behind one registry: GAE, GRPO / Dr. GRPO, RLOO, REINFORCE++.

Every estimator has the same leading arguments and returns the same thing::

    fn(token_rewards, values, response_mask, group_ids, *, <its own parameters>)
        -> (advantages, returns)

* ``token_rewards``: ``[batch, response_len]`` per-token rewards as built by
  ``compute_token_rewards``: ``-beta * KL_t`` on every valid token plus the sequence score
  on the last valid one (with ``beta = 0`` when the KL is a loss term instead, see
  ``losses.kl_loss``, the row holds only the score).
* ``values``: ``[batch, response_len]`` critic values, or None (only ``gae`` reads them).
* ``response_mask``: ``[batch, response_len]`` bool or 0/1.
* ``group_ids``: ``[batch]`` integer id of the prompt each sample answers, or None (only
  ``grpo`` and ``rloo`` read them). Samples with equal ids form a group; any order works,
  ``group_ids_from_samples`` builds the ids of the contiguous layout.
* ``advantages``, ``returns``: ``[batch, response_len]`` fp32, detached, exactly 0 on masked
  positions.

What each estimator reads:

=======================  =================  ======  =========  ==========================
name                     token_rewards      values  group_ids  parameters
=======================  =================  ======  =========  ==========================
``gae``                  per token          yes     no         ``gamma``, ``lam``,
                                                               ``lam_critic``,
                                                               ``lam_policy``,
                                                               ``lam_policy_alpha``
``grpo``                 row sum (outcome)  no      yes        ``norm_by_std``, ``eps``
``rloo``                 row sum (outcome)  no      yes        (none)
``reinforce_plus_plus``  per token          no      no         ``gamma``, ``eps``,
                                                               ``reduce_fn``
=======================  =================  ======  =========  ==========================

Definitions:

* ``gae``: ``compute_gae`` (Schulman et al. 2016); returns are the TD(lambda) targets.
  ``lam_critic`` / ``lam_policy`` split the one ``lam`` into the returns' and the
  advantages' (VC-PPO's decoupled GAE, arXiv:2503.01491); ``lam_policy_alpha`` makes the
  advantages' lambda per row, ``1 - 1 / (alpha * length)`` (VAPO, arXiv:2504.05118); see
  :mod:`.gae`.
* Outcome reward of a sample (``grpo``, ``rloo``): ``o_i = sum_t token_rewards[i, t]`` over
  valid tokens, i.e. the score, plus the summed ``-beta * KL_t`` when the KL is in the
  reward (as verl's ``token_level_rewards.sum(-1)``). With the KL as a loss term
  (``beta = 0``) the outcome is the score alone, as in the GRPO paper.
* ``grpo``: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), section 4.1.2, outcome
  supervision: ``A_i = (o_i - mean_g(o)) / (std_g(o) + eps)`` over the samples of the
  same prompt, the same value on every valid token. ``std`` is the unbiased (Bessel)
  sample std, as ``torch.std``. ``norm_by_std=False`` gives Dr. GRPO's ``A_i = o_i -
  mean_g(o)`` (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
  Perspective", arXiv:2503.20783, section 3.1: the std division up-weights prompts whose
  samples all score alike, e.g. too easy or too hard).
* ``rloo``: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization
  for Learning from Human Feedback in LLMs" (arXiv:2402.14740), after Kool et al. 2019,
  "Buy 4 REINFORCE Samples, Get a Baseline for Free!":
  ``A_i = o_i - mean_{j != i, j in g} o_j = k / (k - 1) * (o_i - mean_g(o))`` for a group
  of ``k`` samples, on every valid token.
* ``reinforce_plus_plus``: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for
  Aligning Large Language Models" (arXiv:2501.03262): the discounted return-to-go of the
  token rewards ``G_t = sum_{s >= t} gamma^(s - t) r_s`` (over valid tokens), whitened over
  all valid tokens of the global batch (``masked_whiten``; mean and variance all-reduced
  over data-parallel ranks through ``reduce_fn``). Returns are ``G``.
* Groups of one sample (``grpo``, ``rloo``) have no baseline: their advantage is 0 (verl's
  GRPO instead gives such a sample its raw score). A group whose outcomes are all equal
  also gets 0.
* Returns of the critic-free estimators (``grpo``, ``rloo``) are the undiscounted
  return-to-go of the token rewards (what a critic would be fit to); no loss reads them
  unless a critic is trained, they keep the trainer's ``returns`` metrics meaningful.

Holed masks (multi-turn, #51): a 0 inside a row (an environment's tokens between two
policy segments) is skipped like padding: the outcome of ``grpo``/``rloo`` sums the policy
tokens only (the episode's final score sits on the last policy token), their advantage is
broadcast to the policy tokens only, and ``reinforce_plus_plus`` discounts once per policy
token (``gamma^(number of policy tokens between t and s)``, see ``gae``) and whitens over
policy tokens only.

Simplified / left out: no REINFORCE++-baseline (group mean subtracted, then whitened)
variant, no process (per-step) rewards for GRPO, no groups spread over data-parallel ranks
(a group must sit on one rank: ``check_slice_keeps_groups``; the group statistics are not
all-reduced). ``grpo``/``rloo`` read two numbers on the host per call (the empty-row check
and the number of groups).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from nemo_rlhf.algorithms.ppo.core import (
    ReduceFn,
    _bool_mask,
    _check_2d,
    _check_same_shape,
    _fp32,
    _select,
    masked_whiten,
)
from nemo_rlhf.algorithms.ppo.gae import compute_decoupled_gae, compute_gae, length_adaptive_lam
from nemo_rlhf.config import check_choice

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ESTIMATOR_TRAITS",
    "AdvantageConfig",
    "EstimatorTraits",
    "estimator_parameters",
    "estimator_traits",
    "register_advantage_estimator",
    "check_groups_divisible",
    "check_slice_keeps_groups",
    "compute_advantages",
    "discounted_returns",
    "gae_advantages",
    "get_advantage_estimator",
    "group_ids_from_samples",
    "policy_lambda",
    "grpo_advantages",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
]

Pair = Tuple[torch.Tensor, torch.Tensor]
AdvantageEstimator = Callable[..., Pair]


# --------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------


def _prepare_rewards(token_rewards: torch.Tensor, response_mask: torch.Tensor):
    _check_2d(response_mask)
    r = _fp32(token_rewards, "token_rewards").detach()
    _check_same_shape(response_mask, "response_mask", token_rewards=r)
    mask = _bool_mask(response_mask)
    return _select(mask, r), mask


def _check_group_ids(group_ids: Optional[torch.Tensor], batch: int, name: str) -> torch.Tensor:
    if group_ids is None:
        raise ValueError(
            f"the {name!r} advantage estimator needs group_ids ([batch] int64, one id per "
            f"prompt; see group_ids_from_samples)"
        )
    if not isinstance(group_ids, torch.Tensor):
        raise TypeError(f"group_ids must be a torch.Tensor, got {type(group_ids).__name__}")
    if group_ids.shape != (batch,):
        raise ValueError(
            f"group_ids must have shape [batch]=({batch},), got {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    return group_ids


def _check_no_empty_rows(mask: torch.Tensor, name: str) -> None:
    keep = mask.any(dim=1)
    if not bool(keep.all()):
        empty = torch.nonzero(~keep).flatten().tolist()
        raise ValueError(
            f"rows {empty} have zero valid response tokens: their outcome would count as 0 "
            f"in their group's {name!r} statistics; drop them (drop_empty_responses) with "
            f"their group_ids first"
        )


def _check_gamma(gamma: float) -> None:
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")


def _check_eps(eps: float) -> None:
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0, got {eps}")


def _broadcast(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` -> ``[batch, response_len]``, the row value on valid tokens, 0 elsewhere."""
    return _select(mask, per_row.unsqueeze(1).expand(mask.shape))


# --------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------


def discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Discounted return-to-go ``G_t = sum_{s >= t} gamma^(s - t) r_s`` over valid tokens.

    This is GAE with ``V = 0`` and ``lam = 1`` (``delta_t = r_t``, ``A_t = r_t + gamma *
    A_{t+1}``), so it reuses ``compute_gae``: masked positions are skipped and the return
    after the last valid token is 0.

    Args:
        token_rewards: ``[batch, response_len]``, any float dtype.
        response_mask: ``[batch, response_len]`` bool or 0/1.
        gamma: discount, in ``[0, 1]``.

    Returns:
        ``[batch, response_len]`` fp32, detached, exactly 0 on masked positions.

    Raises:
        ValueError: shape mismatch or ``gamma`` outside ``[0, 1]``.
    """
    r, mask = _prepare_rewards(token_rewards, response_mask)
    returns, _ = compute_gae(r, torch.zeros_like(r), mask, gamma, 1.0)
    return returns


def _group_centred(outcome: torch.Tensor, group_ids: torch.Tensor):
    """Per row: ``outcome - group mean``, the group size, the group's unbiased std."""
    _, inverse = torch.unique(group_ids.to(outcome.device), return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(n_groups, dtype=torch.float32, device=outcome.device)
    size = zeros.index_add(0, inverse, torch.ones_like(outcome))
    mean = zeros.index_add(0, inverse, outcome) / size.clamp_min(1)
    centred = outcome - mean[inverse]
    sq = zeros.index_add(0, inverse, centred * centred)
    std = torch.sqrt(sq / (size - 1).clamp_min(1))
    return centred, size[inverse], std[inverse]


# --------------------------------------------------------------------------------------
# The estimators
# --------------------------------------------------------------------------------------


def gae_advantages(
    token_rewards: torch.Tensor,
    values: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    group_ids: Optional[torch.Tensor],
    *,
    gamma: float,
    lam: float,
    lam_critic: Optional[float] = None,
    lam_policy: Optional[float] = None,
    lam_policy_alpha: Optional[float] = None,
) -> Pair:
    """GAE (Schulman et al. 2016): ``compute_gae`` behind the common estimator signature,
    with VC-PPO's decoupled lambdas and VAPO's length-adaptive policy lambda
    (:func:`~nemo_rlhf.algorithms.ppo.gae.compute_decoupled_gae`,
    :func:`~nemo_rlhf.algorithms.ppo.gae.length_adaptive_lam`).

    The returns (the critic's targets) use ``lam_critic``, the advantages ``lam_policy``,
    or with ``lam_policy_alpha`` each row's ``1 - 1 / (alpha * l)`` (``l``: its policy
    tokens); a lambda left None is ``lam``. All None: exactly ``compute_gae(..., lam)``.

    Args:
        token_rewards: ``[batch, response_len]``, any float dtype.
        values: ``[batch, response_len]`` critic values (required).
        response_mask: ``[batch, response_len]`` bool or 0/1.
        group_ids: not read.
        gamma: discount, in ``[0, 1]``.
        lam: GAE lambda, in ``[0, 1]``: the default of the two below.
        lam_critic: lambda of the returns, in ``[0, 1]`` (None: ``lam``; VC-PPO: 1.0).
        lam_policy: lambda of the advantages, in ``[0, 1]`` (None: ``lam``).
        lam_policy_alpha: VAPO's ``alpha`` > 0 (None: off); excludes ``lam_policy``.

    Returns:
        ``(advantages, returns)`` as ``compute_gae``.

    Raises:
        ValueError: ``values`` is None, shape mismatches, coefficients outside ``[0, 1]``,
            ``lam_policy_alpha <= 0``, or both ``lam_policy`` and ``lam_policy_alpha``.
    """
    if values is None:
        raise ValueError("the 'gae' advantage estimator needs critic values, got None")
    policy_lam = policy_lambda(response_mask, lam, lam_policy, lam_policy_alpha)
    critic_lam = lam if lam_critic is None else lam_critic
    return compute_decoupled_gae(token_rewards, values, response_mask, gamma, policy_lam, critic_lam)


def policy_lambda(response_mask: torch.Tensor, lam: float, lam_policy: Optional[float],
                  lam_policy_alpha: Optional[float]):
    """The advantages' GAE lambda: VAPO's per-row ``length_adaptive_lam(response_mask,
    lam_policy_alpha)`` (``[batch]`` float32) when ``lam_policy_alpha`` is set, else
    ``lam_policy``, else ``lam`` (floats).

    Raises:
        ValueError: both ``lam_policy`` and ``lam_policy_alpha`` set, or a bad ``alpha``.
    """
    if lam_policy_alpha is None:
        return lam if lam_policy is None else lam_policy
    if lam_policy is not None:
        raise ValueError(f"lam_policy={lam_policy} and lam_policy_alpha={lam_policy_alpha}: the "
                         f"length-adaptive lambda replaces lam_policy; set one of them")
    return length_adaptive_lam(response_mask, lam_policy_alpha)


def grpo_advantages(
    token_rewards: torch.Tensor,
    values: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    group_ids: Optional[torch.Tensor],
    *,
    norm_by_std: bool,
    eps: float,
) -> Pair:
    """GRPO outcome advantage (Shao et al. 2024), or Dr. GRPO's (Liu et al. 2025).

    ``o_i = sum_t token_rewards[i, t]``; ``A_i = (o_i - mean_g) / (std_g + eps)`` with
    ``norm_by_std``, else ``A_i = o_i - mean_g``; ``A_i`` on every valid token of row ``i``.
    Groups of one sample get 0. See the module docstring.

    Args:
        token_rewards: ``[batch, response_len]``, any float dtype.
        values: not read (may be None).
        response_mask: ``[batch, response_len]`` bool or 0/1; every row needs a valid token.
        group_ids: ``[batch]`` integer prompt ids (required).
        norm_by_std: divide by the group's unbiased std (GRPO) or not (Dr. GRPO).
        eps: added to the std, > 0.

    Returns:
        ``(advantages, returns)`` ``[batch, response_len]`` fp32; ``returns`` is the
        undiscounted return-to-go of ``token_rewards``.

    Raises:
        ValueError: missing/misshaped ``group_ids``, shape mismatches, ``eps <= 0``, rows
            with no valid token (named).
        TypeError: non-integer ``group_ids``.
    """
    _check_eps(eps)
    r, mask = _prepare_rewards(token_rewards, response_mask)
    gids = _check_group_ids(group_ids, mask.shape[0], "grpo")
    _check_no_empty_rows(mask, "grpo")
    centred, _, std = _group_centred(r.sum(dim=1), gids)
    adv = centred / (std + eps) if norm_by_std else centred
    return _broadcast(adv, mask), discounted_returns(r, mask, 1.0)


def rloo_advantages(
    token_rewards: torch.Tensor,
    values: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    group_ids: Optional[torch.Tensor],
) -> Pair:
    """RLOO advantage (Ahmadian et al. 2024): outcome minus the mean of the other samples.

    ``A_i = o_i - mean_{j != i} o_j = k / (k - 1) * (o_i - mean_g)`` for a group of ``k``;
    0 for ``k = 1``; ``A_i`` on every valid token of row ``i``.

    Args:
        token_rewards: ``[batch, response_len]``, any float dtype.
        values: not read (may be None).
        response_mask: ``[batch, response_len]`` bool or 0/1; every row needs a valid token.
        group_ids: ``[batch]`` integer prompt ids (required).

    Returns:
        ``(advantages, returns)`` as ``grpo_advantages``.

    Raises:
        ValueError / TypeError: as ``grpo_advantages``.
    """
    r, mask = _prepare_rewards(token_rewards, response_mask)
    gids = _check_group_ids(group_ids, mask.shape[0], "rloo")
    _check_no_empty_rows(mask, "rloo")
    centred, size, _ = _group_centred(r.sum(dim=1), gids)
    adv = centred * size / (size - 1).clamp_min(1)  # size 1: centred is exactly 0
    return _broadcast(adv, mask), discounted_returns(r, mask, 1.0)


def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor,
    values: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    group_ids: Optional[torch.Tensor],
    *,
    gamma: float,
    eps: float,
    reduce_fn: Optional[ReduceFn] = None,
) -> Pair:
    """REINFORCE++ (Hu 2025): discounted token return, whitened over the global batch.

    ``G = discounted_returns(token_rewards, mask, gamma)``; ``A = (G - mean) / sqrt(var +
    eps)`` over all valid tokens (``masked_whiten``, unbiased variance; ``reduce_fn``
    all-reduces the statistics over data-parallel ranks, every rank must call).

    Args:
        token_rewards: ``[batch, response_len]``, any float dtype.
        values, group_ids: not read (may be None).
        response_mask: ``[batch, response_len]`` bool or 0/1.
        gamma: discount, in ``[0, 1]``.
        eps: added to the variance, > 0.
        reduce_fn: optional SUM all-reduce of ``(sum, sum_sq, count)`` (see ``ReduceFn``).

    Returns:
        ``(advantages, returns)``, ``returns = G``; fp32, 0 on masked positions.

    Raises:
        ValueError: shape mismatches, ``gamma`` outside ``[0, 1]``, ``eps <= 0``, fewer
            than 2 valid tokens in the (global) batch.
    """
    _check_gamma(gamma)
    _check_eps(eps)
    r, mask = _prepare_rewards(token_rewards, response_mask)
    returns = discounted_returns(r, mask, gamma)
    return masked_whiten(returns, mask, reduce_fn=reduce_fn, eps=eps), returns


#: name -> estimator; each takes ``(token_rewards, values, response_mask, group_ids,
#: *, <keyword parameters>)`` and returns ``(advantages, returns)`` (see module docstring).
ADVANTAGE_ESTIMATORS: Dict[str, AdvantageEstimator] = {
    "gae": gae_advantages,
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
}


@dataclass(frozen=True)
class EstimatorTraits:
    """What an advantage estimator reads and how a trainer treats its output: every check
    of a trainer and its config reads these, never an estimator's name."""

    needs_values: bool = False
    """Reads the critic's values: the trainer computes them and trains the value head (a
    critic-free estimator refuses ``critic.mode=separate`` and a critic warm-up)."""
    needs_groups: bool = False
    """Compares the samples of one prompt (``group_ids``): needs
    ``rollout.n_samples_per_prompt >= 2`` (with one sample every advantage would be 0)."""
    outcome_only: bool = False
    """Reads each row's token rewards only through their sum (its outcome, ``grpo``,
    ``rloo``): where in the row a reward sits changes nothing, so a trainer refuses per-turn
    reward placement (``env.turn_rewards=per_turn``) with it."""
    batch_whitening: bool = False
    """``ppo.normalize_advantages`` whitens its advantages over the batch (``gae``; ``grpo``
    and ``reinforce_plus_plus`` normalise by their own rule, ``rloo`` keeps its baseline's
    scale)."""


#: name -> :class:`EstimatorTraits`, the same names as :data:`ADVANTAGE_ESTIMATORS`.
ESTIMATOR_TRAITS: Dict[str, EstimatorTraits] = {
    "gae": EstimatorTraits(needs_values=True, batch_whitening=True),
    "grpo": EstimatorTraits(needs_groups=True, outcome_only=True),
    "rloo": EstimatorTraits(needs_groups=True, outcome_only=True),
    "reinforce_plus_plus": EstimatorTraits(),
}


def register_advantage_estimator(name: str, fn: AdvantageEstimator, traits: EstimatorTraits,
                                 replace: bool = False) -> None:
    """Add an estimator under ``name`` (then ``ppo.advantage_estimator=<name>`` accepts it:
    register before the config is built, e.g. in the module that defines it).

    Args:
        name: the config value.
        fn: ``(token_rewards, values, response_mask, group_ids, *, <keyword parameters>) ->
            (advantages, returns)``; its keyword-only parameters are filled from the
            :class:`AdvantageConfig` fields of the same names (and ``reduce_fn``).
        traits: what it reads (:class:`EstimatorTraits`).
        replace: allow replacing an estimator of that name.

    Raises:
        ValueError: the name is taken (and not ``replace``), or ``fn`` has a keyword-only
            parameter that no :class:`AdvantageConfig` field fills.
    """
    if name in ADVANTAGE_ESTIMATORS and not replace:
        raise ValueError(f"advantage estimator {name!r} is already registered (pass replace=True)")
    fields = {f.name for f in dataclasses.fields(AdvantageConfig)} | {"reduce_fn"}
    unknown = [k for k in _keyword_params(fn) if k not in fields]
    if unknown:
        raise ValueError(f"advantage estimator {name!r}: keyword parameters {unknown} are not "
                         f"AdvantageConfig fields ({sorted(fields - {'estimator'})})")
    ADVANTAGE_ESTIMATORS[name] = fn
    ESTIMATOR_TRAITS[name] = traits


def estimator_traits(name: str) -> EstimatorTraits:
    """The :class:`EstimatorTraits` of the estimator registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the valid names).
    """
    get_advantage_estimator(name)
    return ESTIMATOR_TRAITS.get(name, EstimatorTraits())


def estimator_parameters(name: str) -> List[str]:
    """The keyword parameters the estimator registered as ``name`` reads (the
    :class:`AdvantageConfig` fields ``compute_advantages`` passes it, and ``reduce_fn``).

    Raises:
        ValueError: unknown name (the message lists the valid names).
    """
    return _keyword_params(get_advantage_estimator(name))


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the valid names).
    """
    fn = ADVANTAGE_ESTIMATORS.get(name)
    if fn is None:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid names: {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    return fn


def _keyword_params(fn: Callable) -> List[str]:
    return [
        p.name for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]


def check_gae_settings(prefix: str, *, gamma: float, lam: float, lam_critic: Optional[float],
                       lam_policy: Optional[float], lam_policy_alpha: Optional[float]) -> None:
    """The GAE knobs' ranges, checked once for ``ppo.*`` and ``advantage.*`` (``prefix``):
    ``gamma``, ``lam`` and the decoupled lambdas in ``[0, 1]`` (None: ``lam``), VAPO's
    ``lam_policy_alpha`` finite and > 0 (None: off) and not set with ``lam_policy``.

    Raises:
        ValueError: naming ``<prefix>.<key>`` and its value.
    """
    for key, value in (("gamma", gamma), ("lam", lam), ("lam_critic", lam_critic), ("lam_policy", lam_policy)):
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"{prefix}.{key}={value}: must be in [0, 1]"
                             + (f" (null: {prefix}.lam={lam})" if key.startswith("lam_") else ""))
    alpha = lam_policy_alpha
    if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"{prefix}.lam_policy_alpha={alpha}: must be a finite number > 0 "
                         f"(VAPO: 0.05; null: off)")
    if alpha is not None and lam_policy is not None:
        raise ValueError(f"{prefix}.lam_policy={lam_policy} and {prefix}.lam_policy_alpha={alpha}: the "
                         f"length-adaptive lambda replaces {prefix}.lam_policy; set one of them to null")


@dataclass
class AdvantageConfig:
    """Which advantage estimator runs and its parameters: the one place their defaults live
    (the PPO trainer's ``ppo.advantage_estimator``, ``ppo.gamma``,
    ``ppo.lam`` and ``ppo.norm_by_std`` take theirs from here and build it);
    ``compute_advantages`` passes each estimator exactly the fields it reads.
    """

    estimator: str = "gae"
    """A key of ``ADVANTAGE_ESTIMATORS``: ``gae``, ``grpo``, ``rloo``, ``reinforce_plus_plus``."""
    gamma: float = 1.0
    """Discount in ``[0, 1]`` (``gae``, ``reinforce_plus_plus``)."""
    lam: float = 0.95
    """GAE lambda in ``[0, 1]`` (``gae``): of the advantages and the returns unless the
    two below split them."""
    lam_critic: Optional[float] = None
    """``gae``: lambda of the returns (the critic's value targets) in ``[0, 1]``; None:
    ``lam``. VC-PPO (arXiv:2503.01491) uses 1.0 (Monte-Carlo targets)."""
    lam_policy: Optional[float] = None
    """``gae``: lambda of the policy's advantages in ``[0, 1]``; None: ``lam``."""
    lam_policy_alpha: Optional[float] = None
    """``gae``: VAPO's length-adaptive policy lambda (arXiv:2504.05118): each row's
    ``1 - 1 / (alpha * l)``, ``l`` its policy-token count, clamped to ``[0, 1]``; > 0
    (VAPO: 0.05); None: off. Excludes ``lam_policy``."""
    norm_by_std: bool = True
    """``grpo``: divide by the group std (GRPO); False is Dr. GRPO."""
    eps: float = 1e-6
    """> 0; ``grpo``: added to the group std; ``reinforce_plus_plus``: to the batch variance."""

    def __post_init__(self) -> None:
        check_choice("advantage.estimator", self.estimator, sorted(ADVANTAGE_ESTIMATORS))
        check_gae_settings("advantage", gamma=self.gamma, lam=self.lam, lam_critic=self.lam_critic,
                           lam_policy=self.lam_policy, lam_policy_alpha=self.lam_policy_alpha)
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"advantage.eps={self.eps}: must be a finite number > 0")

    @property
    def traits(self) -> EstimatorTraits:
        """The estimator's :class:`EstimatorTraits` (from the registry)."""
        return estimator_traits(self.estimator)

    @property
    def needs_values(self) -> bool:
        """Whether the estimator reads critic values (:attr:`EstimatorTraits.needs_values`)."""
        return self.traits.needs_values

    @property
    def needs_groups(self) -> bool:
        """Whether the estimator reads ``group_ids`` (:attr:`EstimatorTraits.needs_groups`)."""
        return self.traits.needs_groups


def compute_advantages(
    config: AdvantageConfig,
    token_rewards: torch.Tensor,
    values: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    group_ids: Optional[torch.Tensor] = None,
    reduce_fn: Optional[ReduceFn] = None,
) -> Pair:
    """Run ``config.estimator`` with the parameters it reads from ``config``.

    ``reduce_fn`` (the DP all-reduce of whitening statistics) goes to the estimators that
    take it (``reinforce_plus_plus``) and is ignored by the others, so a trainer can always
    pass its hook. Arguments and returns: see the module docstring and each estimator.
    """
    fn = get_advantage_estimator(config.estimator)
    kwargs = {}
    for name in _keyword_params(fn):
        kwargs[name] = reduce_fn if name == "reduce_fn" else getattr(config, name)
    return fn(token_rewards, values, response_mask, group_ids, **kwargs)


# --------------------------------------------------------------------------------------
# Group bookkeeping (for the sampler and the data-parallel split)
# --------------------------------------------------------------------------------------


def group_ids_from_samples(batch_size: int, n_samples_per_prompt: int,
                           device: torch.device | str = "cpu") -> torch.Tensor:
    """Group ids of a batch whose ``n_samples_per_prompt`` samples per prompt are contiguous.

    ``[p0, p0, p1, p1, ...]`` -> ``[0, 0, 1, 1, ...]`` (``row // n_samples_per_prompt``).

    Returns:
        ``[batch_size]`` int64 on ``device`` (the trainer passes ``dims.device``).

    Raises:
        ValueError: ``n_samples_per_prompt < 1`` or a batch size it does not divide.
    """
    check_groups_divisible(batch_size, n_samples_per_prompt, "batch_size")
    return torch.arange(batch_size, dtype=torch.long, device=device) // n_samples_per_prompt


def check_groups_divisible(size: int, n_samples_per_prompt: int, name: str) -> None:
    """Check that slices of ``size`` contiguous rows hold whole groups.

    With contiguous groups of ``n_samples_per_prompt`` rows, cutting a batch every
    ``size`` rows keeps every group whole iff ``size`` is a multiple of it. For config
    validation (e.g. ``name="ppo.num_rollout_samples / dp"``).

    Raises:
        ValueError: naming ``name``, both sizes and the nearest valid sizes.
    """
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
    if size < 0 or size % n_samples_per_prompt:
        lower = max(size, 0) // n_samples_per_prompt * n_samples_per_prompt
        nearest = [n for n in (lower, lower + n_samples_per_prompt) if n > 0]
        raise ValueError(
            f"{name}={size} rows would split a group of n_samples_per_prompt="
            f"{n_samples_per_prompt} samples of one prompt; use a multiple of "
            f"{n_samples_per_prompt} (nearest: {', '.join(map(str, nearest))})"
        )


def check_slice_keeps_groups(group_ids: torch.Tensor, rows: slice) -> None:
    """Check that ``group_ids[rows]`` holds every sample of each group it touches.

    Works for any group sizes (e.g. after empty responses were dropped) and any order.

    Args:
        group_ids: ``[batch]`` integer ids of the whole batch.
        rows: the slice about to be cut out (e.g. one DP rank's share).

    Raises:
        ValueError: naming the first split group, its size and how many of its rows the
            slice holds.
    """
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D [batch], got shape {tuple(group_ids.shape)}")
    inside, in_count = torch.unique(group_ids[rows], return_counts=True)
    whole, whole_count = torch.unique(group_ids, return_counts=True)
    total = whole_count[torch.searchsorted(whole, inside)]
    split = torch.nonzero(in_count != total).flatten()
    if split.numel():
        i = int(split[0])
        start, stop, _ = rows.indices(group_ids.shape[0])
        raise ValueError(
            f"rows [{start}:{stop}) split group {int(inside[i])}: it has {int(total[i])} "
            f"samples, the slice holds {int(in_count[i])} ({split.numel()} group(s) split); "
            f"cut at group boundaries"
        )
