"""Per-token PPO-RLHF rewards: KL penalty on every token, score on the last one.

``r_t = -beta * KL_t`` on valid response tokens, plus the reward-model score at the last
valid token: InstructGPT (Ouyang et al. 2022, eq. 2) and Ziegler et al. 2019 (section
2.2), in the per-token form of TRL's and verl's PPO (``compute_rewards`` /
``apply_kl_penalty``).

Conventions (the caller's): the response mask covers the generated tokens INCLUDING the
EOS token when one was generated; masks, not token ids, decide where a response ends, so
a tokenizer whose pad id equals its eos id needs no special care. Left- and right-padded
batches both work (the score goes to the last True of each row).

Multi-turn rows (#51): the mask may be 0 on environment tokens between policy segments;
the KL term is computed and placed on policy tokens only (an environment token carries no
``-beta * KL``: the policy did not choose it; slime #1370 forgot this), and the score goes
on the row's last policy token.

Defined behaviour for a zero-length response (a row with no valid token): it cannot
carry its score (there is no token to put it on), so it is never scored on a masked
slot: ``compute_token_rewards`` raises ``ValueError`` naming the rows. The PPO trainer
never produces such rows: a rollout row always holds its first generated token (an EOS
or stop token drawn first gives the one-token response ``[EOS]``, whose score sits on
that token), and the PPO config requires ``rollout.max_new_tokens >= 1``. Callers with
other data can filter rows with ``drop_empty_responses`` first.

Per-turn rewards (#51, ``env.turn_rewards=per_turn``): ``turn_reward_tensor`` lays out
rewards given at chosen positions (an environment's reward of each turn at the last
policy token of that turn) as a ``[batch, response_len]`` tensor the caller adds to the
token rewards; the sequence score stays on the row's last valid token.

Simplified / left out: no reward clipping/normalisation of the score (done by the
reward module if wanted), no per-sequence KL reward (all KL is per token).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from nemo_rlhf.algorithms.ppo.core import (
    _bool_mask,
    _check_2d,
    _check_same_shape,
    _fp32,
    _select,
    last_valid_index,
)
from nemo_rlhf.algorithms.ppo.kl import kl_penalty

__all__ = ["compute_token_rewards", "drop_empty_responses", "turn_reward_tensor"]


def drop_empty_responses(response_mask: torch.Tensor) -> torch.Tensor:
    """Which rows to keep: those with at least one valid response token.

    A zero-length response can't carry its score, so a caller whose data may hold one
    drops it (and counts it) before rewards are computed; it is never scored on a masked
    slot. The PPO trainer's rollouts never hold one (see the module docstring).

    Args:
        response_mask: ``[batch, response_len]`` bool or 0/1.

    Returns:
        ``keep``: ``[batch]`` bool, False for rows with no valid token.

    Raises:
        ValueError: if ``response_mask`` is not 2-D.
    """
    _check_2d(response_mask)
    return _bool_mask(response_mask).any(dim=1)


def compute_token_rewards(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float,
    kl_estimator: str = "k1",
    kl_clamp: Optional[float] = None,
    ended: Optional[torch.Tensor] = None,
    missing_eos_penalty: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``-beta * KL_t`` plus the sequence score at the last valid token.

    Formula: InstructGPT (Ouyang et al. 2022) eq. 2, ``R = r_theta(x, y) - beta *
    log(pi_RL / pi_SFT)``, spread per token as in Ziegler et al. 2019 (section 2.2) and
    TRL: every valid token gets ``-beta * KL_t``, the last valid token additionally gets
    the score. ``missing_eos_penalty`` is added to the score of rows that did not end
    with EOS (TRL's ``missing_eos_penalty``).

    NaN/Inf in masked positions of ``logprobs``/``ref_logprobs`` never reach the outputs
    (masked slots are replaced by 0 with ``torch.where`` before the estimator runs).

    Args:
        logprobs: ``[batch, response_len]`` actor log-probs, any float dtype.
        ref_logprobs: ``[batch, response_len]`` reference log-probs, any float dtype.
        scores: ``[batch]`` reward-model scores, any float dtype.
        response_mask: ``[batch, response_len]`` bool or 0/1; True = generated token
            (EOS included when generated).
        beta: KL coefficient, >= 0 (float or 0-d tensor).
        kl_estimator: a key of ``KL_ESTIMATORS`` (``"k1"``, ``"k2"``, ``"k3"``).
        kl_clamp: optional clip of the per-token KL to ``[-kl_clamp, kl_clamp]``.
        ended: ``[batch]`` bool, True where the response ended with EOS. Required when
            ``missing_eos_penalty`` is given.
        missing_eos_penalty: added to ``scores[b]`` where ``ended[b]`` is False
            (e.g. ``-1.0``).

    Returns:
        ``(rewards, kl)``, both ``[batch, response_len]`` fp32, exactly 0 on masked
        positions. ``kl`` is the (clamped) per-token estimate, before ``-beta``.

    Raises:
        ValueError: shape mismatches; ``beta < 0``; unknown ``kl_estimator``;
            ``missing_eos_penalty`` without ``ended``; rows with zero valid tokens (the
            message names the row indices; drop them with ``drop_empty_responses``).
            The empty-row check reads a flag on the host (one sync per call).
    """
    _check_2d(response_mask)
    lp = _fp32(logprobs, "logprobs")
    ref = _fp32(ref_logprobs, "ref_logprobs")
    _check_same_shape(response_mask, "response_mask", logprobs=lp, ref_logprobs=ref)
    mask = _bool_mask(response_mask)
    batch = mask.shape[0]

    score = _fp32(scores, "scores")
    if score.shape != (batch,):
        raise ValueError(f"scores must have shape [batch]=({batch},), got {tuple(score.shape)}")
    beta_f = float(beta)
    if not math.isfinite(beta_f) or beta_f < 0:
        raise ValueError(f"beta must be a finite number >= 0, got {beta_f}")

    keep = mask.any(dim=1)
    if not bool(keep.all()):
        empty = torch.nonzero(~keep).flatten().tolist()
        raise ValueError(
            f"rows {empty} have zero valid response tokens and cannot carry a score; "
            f"drop them first with drop_empty_responses(response_mask) and count them"
        )

    if missing_eos_penalty is not None:
        if ended is None:
            raise ValueError("missing_eos_penalty needs `ended` ([batch] bool)")
        if ended.shape != (batch,):
            raise ValueError(f"ended must have shape ({batch},), got {tuple(ended.shape)}")
        penalty = torch.tensor(float(missing_eos_penalty), dtype=torch.float32, device=score.device)
        score = score + torch.where(_bool_mask(ended, "ended"), torch.zeros_like(penalty), penalty)

    kl = kl_penalty(_select(mask, lp), _select(mask, ref), kl_estimator, kl_clamp)
    kl = _select(mask, kl)
    rewards = _select(mask, -beta_f * kl)
    last = last_valid_index(mask)
    rewards = rewards.scatter_add(1, last.unsqueeze(1), score.unsqueeze(1))
    return rewards, kl


def turn_reward_tensor(placements: Sequence[Sequence[Tuple[int, float]]],
                       response_mask: torch.Tensor) -> torch.Tensor:
    """Rewards given at chosen response positions, as a ``[batch, response_len]`` tensor.

    Row ``b`` gets ``reward`` at column ``position`` for each ``(position, reward)`` of
    ``placements[b]`` (rewards at the same position add up); every other slot is 0. The
    multi-turn PPO trainer passes each turn's environment reward at the last policy token
    of that turn (``env.turn_rewards=per_turn``) and adds the result to
    ``compute_token_rewards``' rewards, so ``r_t = -beta * KL_t + [t = end of turn k] *
    reward_k + [t = last valid] * score``.

    Args:
        placements: one list per row of ``(position, reward)``: ``position`` a response
            column (``0 <= position < response_len``) where ``response_mask`` is True,
            ``reward`` a finite float.
        response_mask: ``[batch, response_len]`` bool or 0/1 (holes allowed).

    Returns:
        ``[batch, response_len]`` fp32 on ``response_mask``'s device, 0 off the positions.

    Raises:
        ValueError: ``len(placements) != batch``; a position out of range or on a masked
            slot (naming the row and position); a non-finite reward. The mask check reads
            the mask at the positions on the host (one sync per call).
    """
    _check_2d(response_mask)
    mask = _bool_mask(response_mask)
    batch, length = mask.shape
    if len(placements) != batch:
        raise ValueError(f"placements has {len(placements)} rows, response_mask has {batch}")
    rows, cols, vals = [], [], []
    for b, row in enumerate(placements):
        for position, reward in row:
            position, reward = int(position), float(reward)
            if not 0 <= position < length:
                raise ValueError(f"row {b}: position {position} is outside the response (length {length})")
            if not math.isfinite(reward):
                raise ValueError(f"row {b}: reward {reward} at position {position} is not finite")
            rows.append(b)
            cols.append(position)
            vals.append(reward)
    out = torch.zeros(batch, length, dtype=torch.float32, device=mask.device)
    if not rows:
        return out
    r = torch.tensor(rows, dtype=torch.long, device=mask.device)
    c = torch.tensor(cols, dtype=torch.long, device=mask.device)
    on_mask = mask[r, c]
    if not bool(on_mask.all()):
        bad = [(rows[i], cols[i]) for i in torch.nonzero(~on_mask).flatten().tolist()]
        raise ValueError(f"(row, position) {bad}: a reward must sit on a valid (mask True) token")
    return out.index_put((r, c), torch.tensor(vals, dtype=torch.float32, device=mask.device), accumulate=True)
