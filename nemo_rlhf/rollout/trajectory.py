"""A multi-turn episode as one token sequence: the prompt, then segments that alternate
between what the policy generated (trainable) and what the environment appended (a tool's
output, a user turn: not trainable) (#51).

Token-in/token-out: a :class:`Trajectory` is only ever extended by appending token ids
(:meth:`Trajectory.append_policy`, :meth:`Trajectory.append_env`). The policy's tokens are
the ids the engine sampled, kept as they are (never decoded and re-encoded: BPE does not
compose across a seam, so ``encode(decode(ids))`` may differ from ``ids``); the
environment's text is tokenised alone and its ids appended. Nothing is re-tokenised, so a
turn costs the tokens it adds, not the whole conversation again (TRL #6250's O(T^2)).

When a caller does build a turn's input some other way (e.g. by rendering the whole
conversation through the model's chat template each turn, as a serving API does),
:func:`check_prefix_extension` asserts that the new input extends the previous one and
names the turn and the first differing position when it does not: chat templates that
strip ``<think>...</think>`` from earlier assistant turns (NeMo-RL #2821/#2856) or that
change the whitespace at a turn boundary (verl #6501) rewrite the past, and a trajectory
trained on such inputs scores tokens the policy never saw.

The loss mask is 1 on policy tokens and 0 on the prompt and environment tokens;
:func:`to_padded_batch` lays a list of trajectories out as the trainer's single-turn batch
does (prompt left-padded to ``P``, the rest from column ``P``, right-padded), with the
loss mask (holes where the environment spoke) as ``response_mask``. The PPO reducers read
such a mask correctly (``nemo_rlhf/algorithms/ppo/core.py``); the megatron engine's
:func:`~nemo_rlhf.rollout.episodes.run_episodes` produces trajectories, and the PPO
trainer trains on them with ``env.name`` set
(:class:`~nemo_rlhf.trainers.ppo.episode_source.EpisodeRolloutSource`; docs/multi-turn.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

__all__ = ["POLICY", "ENV", "Segment", "Trajectory", "PrefixMismatch", "check_prefix_extension",
           "PaddedTrajectories", "to_padded_batch"]

POLICY = "policy"
"""Segment kind: tokens the policy sampled (loss mask 1)."""
ENV = "env"
"""Segment kind: tokens the environment appended (loss mask 0)."""


@dataclass(frozen=True)
class Segment:
    """One run of tokens of one kind: ``ids[start:end]`` of the trajectory (after the
    prompt: ``start >= prompt_length``)."""

    kind: str
    """:data:`POLICY` or :data:`ENV`."""
    start: int
    end: int


class PrefixMismatch(ValueError):
    """A turn's input is not a prefix-extension of the previous turn's input."""

    def __init__(self, turn: int, position: int, message: str):
        super().__init__(message)
        self.turn = turn
        self.position = position


def _check_ids(ids: Sequence[int], name: str) -> List[int]:
    out = [int(i) for i in ids]
    if any(i < 0 for i in out):
        raise ValueError(f"{name}: token ids must be >= 0, got {out[:8]}")
    return out


@dataclass
class Trajectory:
    """One episode: ``prompt`` then alternating policy / environment segments.

    Attributes are appended to, never rewritten. ``token_ids`` is the whole sequence
    (prompt included), ``loss_mask`` is 1 on policy tokens and 0 elsewhere (same length),
    ``logprobs`` holds the behaviour (sampling) log-prob of each policy token and 0 on the
    others (same length), ``segments`` the runs after the prompt, ``turns`` the number of
    policy segments, ``truncated`` whether the episode was cut at a limit (max turns, max
    tokens) rather than ended by the policy or the environment.

    Args:
        prompt_ids: the first observation's token ids (the rendered prompt), non-empty.

    Raises:
        ValueError: an empty prompt or a negative id.
    """

    prompt_ids: List[int]
    token_ids: List[int] = field(init=False)
    loss_mask: List[int] = field(init=False)
    logprobs: List[float] = field(init=False)
    segments: List[Segment] = field(init=False)
    truncated: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.prompt_ids = _check_ids(self.prompt_ids, "prompt_ids")
        if not self.prompt_ids:
            raise ValueError("Trajectory: prompt_ids is empty")
        self.token_ids = list(self.prompt_ids)
        self.loss_mask = [0] * len(self.prompt_ids)
        self.logprobs = [0.0] * len(self.prompt_ids)
        self.segments = []

    @property
    def prompt_length(self) -> int:
        """Tokens of the prompt."""
        return len(self.prompt_ids)

    @property
    def turns(self) -> int:
        """Policy segments so far (one per assistant turn)."""
        return sum(1 for s in self.segments if s.kind == POLICY)

    @property
    def policy_tokens(self) -> int:
        """Tokens with loss mask 1."""
        return sum(self.loss_mask)

    def __len__(self) -> int:
        return len(self.token_ids)

    def _append(self, kind: str, ids: List[int], logprobs: List[float]) -> None:
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if kind == POLICY else 0] * len(ids))
        self.logprobs.extend(logprobs)
        self.segments.append(Segment(kind, start, start + len(ids)))

    def append_policy(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Append the ids the policy sampled in one turn and their behaviour log-probs.

        Args:
            token_ids: the sampled ids, as the engine returned them (non-empty).
            logprobs: one sampling log-prob per id (finite, <= 0 up to rounding).

        Raises:
            ValueError: empty ``token_ids``, a length mismatch, a negative id, a non-finite
                log-prob, or two policy segments in a row (an environment turn must lie
                between them; append to the turn instead of starting a new one).
        """
        ids = _check_ids(token_ids, "append_policy")
        lps = [float(x) for x in logprobs]
        if not ids:
            raise ValueError("append_policy: a turn needs at least one token")
        if len(lps) != len(ids):
            raise ValueError(f"append_policy: {len(ids)} token ids but {len(lps)} logprobs")
        if not all(torch.isfinite(torch.tensor(lps)).tolist()):
            raise ValueError(f"append_policy: non-finite logprobs {lps[:8]}")
        if self.segments and self.segments[-1].kind == POLICY:
            raise ValueError(f"append_policy: turn {self.turns} is already a policy segment; "
                             f"an environment segment must come between two policy turns")
        self._append(POLICY, ids, lps)

    def append_env(self, token_ids: Sequence[int]) -> None:
        """Append the environment's tokens (a tool's output, a user turn, the template's
        role header of the next assistant turn), tokenised alone by the caller.

        Raises:
            ValueError: a negative id, or an environment segment before the first policy
                turn (the prompt is the first observation).
        """
        ids = _check_ids(token_ids, "append_env")
        if not self.segments:
            raise ValueError("append_env: the first observation is the prompt; the policy "
                             "speaks first")
        if not ids:
            return
        if self.segments[-1].kind == ENV:  # several environment pieces form one segment
            last = self.segments.pop()
            self.token_ids.extend(ids)
            self.loss_mask.extend([0] * len(ids))
            self.logprobs.extend([0.0] * len(ids))
            self.segments.append(Segment(ENV, last.start, len(self.token_ids)))
            return
        self._append(ENV, ids, [0.0] * len(ids))

    def mark_truncated(self) -> None:
        """The episode was cut at a limit (max turns / max total tokens)."""
        self.truncated = True


def check_prefix_extension(prev_ids: Sequence[int], new_ids: Sequence[int], turn: int) -> None:
    """Assert that turn ``turn``'s input ``new_ids`` starts with ``prev_ids`` (the previous
    turn's input plus what was generated and appended since).

    Args:
        prev_ids: the token ids the conversation held before this turn.
        new_ids: this turn's input ids, however they were built.
        turn: the turn number, for the message.

    Raises:
        PrefixMismatch (a ``ValueError``): naming the turn, the first position where the two
            differ (or where ``new_ids`` ends), the ids around it on both sides.
    """
    prev, new = list(prev_ids), list(new_ids)
    n = min(len(prev), len(new))
    pos = next((i for i in range(n) if prev[i] != new[i]), n)
    if pos == len(prev):
        return
    lo = max(0, pos - 3)
    if pos >= len(new):
        msg = (f"turn {turn}: the input is not a prefix-extension of the previous turn: it has "
               f"{len(new)} tokens, fewer than the previous {len(prev)} (ends at position {pos}; "
               f"previous ids {prev[lo:pos + 4]} from position {lo})")
    else:
        msg = (f"turn {turn}: the input is not a prefix-extension of the previous turn: first "
               f"difference at position {pos} (previous ids {prev[lo:pos + 4]}, new ids "
               f"{new[lo:pos + 4]}, from position {lo}); the chat template rewrote earlier "
               f"turns (e.g. stripped <think> or changed a turn boundary's whitespace): append "
               f"token ids instead of re-rendering the conversation")
    raise PrefixMismatch(turn, pos, msg)


@dataclass
class PaddedTrajectories:
    """Trajectories in the trainer's batch layout (``RolloutBatch``'s): the prompt
    left-padded to ``P`` columns, everything after it (policy and environment tokens) from
    column ``P``, right-padded to ``R`` columns. All tensors on the ``device`` given."""

    input_ids: torch.Tensor
    """``[B, P+R]`` int64, padding = ``pad_id``."""
    attention_mask: torch.Tensor
    """``[B, P+R]`` int64: 1 on prompt, policy and environment tokens, 0 on padding."""
    prompt_length: int
    """``P``."""
    response_mask: torch.Tensor
    """``[B, R]`` bool: the loss mask after the prompt, True on policy tokens only (holes on
    environment tokens)."""
    logprobs: torch.Tensor
    """``[B, R]`` float32: behaviour log-probs of the policy tokens, 0 elsewhere."""
    response_lengths: torch.Tensor
    """``[B]`` int64: tokens after the prompt (policy + environment), the row's extent."""
    turns: torch.Tensor
    """``[B]`` int64: policy segments per episode."""
    truncated: torch.Tensor
    """``[B]`` bool: the episode was cut at a limit."""


def to_padded_batch(trajectories: Sequence[Trajectory], pad_id: int,
                    device: Optional[torch.device | str] = None) -> PaddedTrajectories:
    """Lay ``trajectories`` out as a padded batch with the loss mask (see
    :class:`PaddedTrajectories`). For one-turn trajectories (one policy segment, no
    environment segment) it is today's single-turn layout.

    Args:
        trajectories: non-empty, each with at least one policy turn.
        pad_id: id of the padding.
        device: where the tensors go (the trainer passes ``dims.device``); default CPU.

    Raises:
        ValueError: no trajectory, or one without a policy turn (named by index).
    """
    if not trajectories:
        raise ValueError("to_padded_batch: no trajectories")
    for i, tr in enumerate(trajectories):
        if tr.turns == 0:
            raise ValueError(f"to_padded_batch: trajectory {i} has no policy turn")
    device = torch.device("cpu") if device is None else torch.device(device)
    B = len(trajectories)
    P = max(tr.prompt_length for tr in trajectories)
    R = max(len(tr) - tr.prompt_length for tr in trajectories)
    ids = torch.full((B, P + R), int(pad_id), dtype=torch.long)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    mask = torch.zeros(B, R, dtype=torch.bool)
    lps = torch.zeros(B, R, dtype=torch.float32)
    for b, tr in enumerate(trajectories):
        p, r = tr.prompt_length, len(tr) - tr.prompt_length
        ids[b, P - p:P] = torch.tensor(tr.prompt_ids, dtype=torch.long)
        ids[b, P:P + r] = torch.tensor(tr.token_ids[p:], dtype=torch.long)
        attn[b, P - p:P + r] = 1
        mask[b, :r] = torch.tensor(tr.loss_mask[p:], dtype=torch.bool)
        lps[b, :r] = torch.tensor(tr.logprobs[p:], dtype=torch.float32)
    lengths = torch.tensor([len(tr) - tr.prompt_length for tr in trajectories], dtype=torch.long)
    turns = torch.tensor([tr.turns for tr in trajectories], dtype=torch.long)
    truncated = torch.tensor([tr.truncated for tr in trajectories], dtype=torch.bool)
    return PaddedTrajectories(ids.to(device), attn.to(device), P, mask.to(device), lps.to(device),
                              lengths.to(device), turns.to(device), truncated.to(device))
