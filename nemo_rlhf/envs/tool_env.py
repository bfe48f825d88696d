"""An environment that answers a policy's tool calls with the tools' outputs (#51).

Each policy turn is parsed in the model's tool-call format
(:func:`~nemo_rlhf.envs.parsing.parse_tool_calls`). A turn with calls gets, as its
observation, every call's result in order (well-formed calls run through the
:class:`~nemo_rlhf.envs.tools.ToolRegistry`; malformed ones are answered with their parse
error); the episode goes on. A turn without a call is the final answer: the episode ends
and, when a ``reward_fn`` is given, it scores the answer. The limits of
:class:`~nemo_rlhf.envs.base.EnvLimits` end the episode truncated: after ``max_turns``
policy turns, at ``max_total_tokens`` tokens, and a call is refused once the episode's
``max_tool_time_s`` is spent.

The observation is the tool message's content, text only; wrapping it in the chat
template's tool-role tokens is the rollout engine's job, and the result must be appended
to the trajectory as ids (:mod:`nemo_rlhf.rollout.trajectory`). Each result is written as
``<tool_response>...</tool_response>`` (Hermes/Qwen's tool-output wrapper; Llama 3.1 puts
the output in an ``ipython`` message, ``observation_format="plain"`` writes the bare texts).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from nemo_rlhf.config import check_choice
from nemo_rlhf.envs.base import EnvLimits, Environment, StepResult
from nemo_rlhf.envs.parsing import parse_tool_calls
from nemo_rlhf.envs.tools import ToolRegistry

__all__ = ["OBSERVATION_FORMATS", "ToolEnvironment"]

OBSERVATION_FORMATS = ("tool_response", "plain")
"""How tool results are written in the observation: ``<tool_response>`` blocks or bare."""


class ToolEnvironment(Environment):
    """Tool calls in, tool outputs out (see the module docstring).

    Args:
        registry: the tools the policy may call.
        tool_call_format: how calls are written (``hermes`` or ``llama3``).
        limits: the per-episode :class:`EnvLimits`.
        prompt_fn: ``problem -> first observation`` (default: ``problem["prompt"]`` for a
            dict, else ``str(problem)``).
        reward_fn: ``(problem, final answer text) -> float``, or None (no reward from the
            environment: the RM or a checker scores the episode).
        observation_format: one of :data:`OBSERVATION_FORMATS`.

    Raises:
        ValueError: an unknown format (naming its key and the choices).
    """

    observation_role = "tool"

    def __init__(self, registry: ToolRegistry, tool_call_format: str, limits: EnvLimits,
                 prompt_fn: Optional[Callable[[Any], str]] = None,
                 reward_fn: Optional[Callable[[Any, str], float]] = None,
                 observation_format: str = "tool_response") -> None:
        parse_tool_calls("", tool_call_format)  # validates the format
        check_choice("env.observation_format", observation_format, OBSERVATION_FORMATS)
        self.registry = registry
        self.tool_call_format = tool_call_format
        self.limits = limits
        self.prompt_fn = prompt_fn
        self.reward_fn = reward_fn
        self.observation_format = observation_format
        self.problem: Any = None
        self.tool_time_s = 0.0
        self.tool_calls = 0
        self.malformed_calls = 0

    def reset(self, problem: Any) -> str:
        """Start an episode: the tool time and call counts go back to 0."""
        self.problem = problem
        self.tool_time_s = 0.0
        self.tool_calls = 0
        self.malformed_calls = 0
        if self.prompt_fn is not None:
            return self.prompt_fn(problem)
        return problem["prompt"] if isinstance(problem, dict) else str(problem)

    def _info(self, **extra) -> dict:
        return {"tool_calls": self.tool_calls, "malformed_calls": self.malformed_calls,
                "tool_time_s": self.tool_time_s, **extra}

    def _wrap(self, texts: List[str]) -> str:
        if self.observation_format == "plain":
            return "\n".join(texts)
        return "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in texts)

    def step(self, trajectory_so_far: Any, last_action_text: str) -> StepResult:
        """Answer the policy's turn: run its calls, or end the episode on a plain answer or
        at a limit. ``trajectory_so_far`` needs ``turns`` (policy turns so far, this one
        included) and ``len()`` (its tokens). ``info``: ``tool_calls`` and
        ``malformed_calls`` (episode totals), ``tool_time_s``, ``truncated``, and
        ``reason`` when truncated (``max_turns``, ``max_total_tokens``)."""
        parsed = parse_tool_calls(last_action_text, self.tool_call_format)
        if not parsed.has_calls:
            reward = None if self.reward_fn is None else float(self.reward_fn(self.problem, last_action_text))
            return StepResult(None, True, reward, self._info(truncated=False))
        for limit, value in (("max_turns", trajectory_so_far.turns),
                             ("max_total_tokens", len(trajectory_so_far))):
            if value >= getattr(self.limits, limit):  # no turn left to read the tool's output
                return StepResult(None, True, None, self._info(truncated=True, reason=limit))
        texts = [f"Error: {e}" for e in parsed.errors]
        self.malformed_calls += len(parsed.errors)
        for call in parsed.calls:
            budget = self.limits.max_tool_time_s - self.tool_time_s
            result = self.registry.call(call.name, call.arguments, budget_s=budget)
            self.tool_time_s += result.seconds
            self.tool_calls += 1
            if result.error in ("unknown_tool", "bad_arguments"):
                self.malformed_calls += 1
            texts.append(result.text)
        return StepResult(self._wrap(texts), False, None, self._info(truncated=False))
