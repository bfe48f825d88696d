"""Built-in environment factories (``env.name``, :data:`~nemo_rlhf.envs.config.BUILTIN_ENVIRONMENTS`)
and the ``env`` reward function (#51).

* :func:`calculator_env`: ``env.name=calculator``.
* :func:`env_reward`: ``reward.functions=[{name: env}]``, the environment's episode reward
  as a reward source.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from nemo_rlhf.envs.tool_env import ToolEnvironment
from nemo_rlhf.envs.tools import ToolRegistry, calculator_tool

__all__ = ["ENV_REWARD_KEY", "answer_reward", "calculator_env", "env_reward"]

ENV_REWARD_KEY = "env_reward"
"""The key of a multi-turn row's ``extras`` that holds its episode reward (the sum of the
environment's per-turn rewards), which the trainer adds before scoring."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def answer_reward(problem: Any, answer_text: str) -> Optional[float]:
    """1.0 when the last number in ``answer_text`` equals ``problem["answer"]`` (as text),
    else 0.0; None when the problem has no ``answer``."""
    if not isinstance(problem, dict) or "answer" not in problem:
        return None
    numbers = _NUMBER.findall(answer_text)
    return float(bool(numbers) and numbers[-1] == str(problem["answer"]).strip())


def calculator_env(env_cfg) -> ToolEnvironment:
    """``env.name=calculator``: a :class:`ToolEnvironment` with the calculator tool, calls
    in ``env.tool_call_format``, results written as ``<tool_response>`` blocks, the episode
    limits of ``env_cfg``; the final answer scored by :func:`answer_reward` (the row's
    ``answer``; no reward without one)."""
    registry = ToolRegistry()
    registry.register(calculator_tool())
    return ToolEnvironment(registry, env_cfg.tool_call_format, env_cfg.limits(),
                           reward_fn=lambda problem, text: answer_reward(problem, text) or 0.0)


def env_reward(prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
    """The environment's episode reward of each row (``extras[i]["env_reward"]``: the sum
    of its per-turn rewards, 0 when the environment gave none), as a reward function.

    Raises:
        ValueError: a row without it (single-turn rollouts: set ``env.name``).
    """
    out = []
    for i, e in enumerate(extras):
        if ENV_REWARD_KEY not in e:
            raise ValueError(f"reward function 'env': row {i} has no episode reward; it scores "
                             f"multi-turn rollouts only (set env.name)")
        out.append(float(e[ENV_REWARD_KEY]))
    return out
