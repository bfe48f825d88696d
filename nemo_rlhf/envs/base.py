"""The environment interface of multi-turn rollouts (#51) and its per-episode limits.

An :class:`Environment` is one episode's other party: ``reset(problem)`` starts the episode
and returns the first observation (the prompt text), and after each policy turn
``step(trajectory_so_far, last_action_text)`` answers with a :class:`StepResult`: the
observation to append (a tool's output, a user turn) or None, whether the episode is done,
a reward (per turn or at the end) or None, and an info dict for logging. ``astep`` is the
``async`` form (by default ``step`` run in a worker thread, so an async rollout loop can
run many episodes' environments at once); an environment whose work is naturally async
(an HTTP call) overrides ``astep`` and may implement ``step`` through it.

One instance serves one episode at a time (``reset`` starts it, the instance may keep the
episode's state, e.g. the tool time used); concurrent episodes use one instance each.

The shape follows NeMo-RL's ``EnvironmentInterface.step`` (observations, metadata, done,
rewards per step) and verl's agent loop (``AgentLoopBase``: generate, call tools, append);
here it is per episode and text-in/text-out: the rollout engine tokenises the observation
alone and appends its ids (:mod:`nemo_rlhf.rollout.trajectory`). The megatron engine's
:func:`~nemo_rlhf.rollout.episodes.run_episodes` calls environments, and the PPO trainer
runs it with ``env.name`` set (:mod:`nemo_rlhf.envs.config`); the vLLM engine and the async
workers do not yet (docs/multi-turn.md).
"""

from __future__ import annotations

import asyncio
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

__all__ = ["EnvLimits", "Environment", "StepResult"]


@dataclass
class StepResult:
    """An environment's answer to one policy turn."""

    observation: Optional[str]
    """Text to append before the policy's next turn (tokenised alone by the caller), or
    None when there is nothing to append (the episode is done)."""
    done: bool
    """The episode ends here (answered, or cut at a limit: ``info["truncated"]``)."""
    reward: Optional[float] = None
    """This turn's reward, or None (no reward for this turn)."""
    info: Dict[str, Any] = field(default_factory=dict)
    """Logging and bookkeeping (e.g. ``tool_calls``, ``malformed_calls``, ``truncated``)."""

    def __post_init__(self) -> None:
        if self.observation is not None and not isinstance(self.observation, str):
            raise TypeError(f"StepResult.observation must be a str or None, got "
                            f"{type(self.observation).__name__}")
        if self.reward is not None and not math.isfinite(float(self.reward)):
            raise ValueError(f"StepResult.reward must be finite or None, got {self.reward}")
        if not self.done and self.observation is None:
            raise ValueError("StepResult: an episode that is not done needs an observation "
                             "for the policy's next turn")


@dataclass
class EnvLimits:
    """Per-episode limits of a multi-turn rollout (config section ``env``); an episode cut at
    one ends with ``done=True`` and ``info["truncated"] = True`` (the trajectory's
    ``truncated`` flag, logged)."""

    max_turns: int = 4
    """Policy turns per episode (>= 1); after the last one the episode ends."""
    max_total_tokens: int = 2048
    """Tokens per episode, prompt, policy and environment tokens together (>= 1)."""
    max_tool_time_s: float = 10.0
    """Seconds of tool execution per episode (> 0), all calls together; each call gets at
    most its own tool's limit and what is left of this."""

    def __post_init__(self) -> None:
        for key in ("max_turns", "max_total_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"env.{key}={value!r}: must be an integer >= 1")
        t = self.max_tool_time_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise ValueError(f"env.max_tool_time_s={t!r}: must be a finite number of seconds > 0")


class Environment(ABC):
    """One episode's environment (see the module docstring)."""

    observation_role: str = "user"
    """The role of this environment's observations in the episode's conversation
    (``Episode.messages``, what a served reward model reads): ``user`` (a user's turn, the
    default) or ``tool`` (a tool's output, :class:`~nemo_rlhf.envs.ToolEnvironment`)."""

    @abstractmethod
    def reset(self, problem: Any) -> str:
        """Start an episode on ``problem`` (a dataset row) and return the first observation
        (the prompt's text, before the chat template)."""

    @abstractmethod
    def step(self, trajectory_so_far: Any, last_action_text: str) -> StepResult:
        """Answer the policy's turn ``last_action_text`` (its decoded text).

        Args:
            trajectory_so_far: the episode so far
                (:class:`~nemo_rlhf.rollout.trajectory.Trajectory`, the last turn included):
                its ``turns`` and length are what the limits read.
            last_action_text: the policy's last turn, decoded.
        """

    async def astep(self, trajectory_so_far: Any, last_action_text: str) -> StepResult:
        """``step`` for an async rollout loop; by default ``step`` in a worker thread."""
        return await asyncio.to_thread(self.step, trajectory_so_far, last_action_text)
