"""Environments of multi-turn and tool-calling rollouts (#51): the interface
(:mod:`.base`: :class:`Environment`, :class:`StepResult`, the per-episode
:class:`EnvLimits`), tools (:mod:`.tools`: :class:`Tool`, :class:`ToolRegistry`, the
calculator), tool-call parsing in the Hermes/Qwen and Llama 3.1 formats (:mod:`.parsing`)
and :class:`ToolEnvironment`, which wires them (:mod:`.tool_env`);
:class:`DigitCalculatorEnv`, a calculator called as ``37*12=`` in the tiny model's digit
vocabulary (:mod:`.digit_calculator`); the PPO config's ``env``
section and the built-in environments (:mod:`.config`, :mod:`.builtin`). Called by the
megatron engine's :func:`~nemo_rlhf.rollout.episodes.run_episodes`, which the PPO trainer
runs with ``env.name`` set: docs/multi-turn.md says what is wired and what is not.
"""

from nemo_rlhf.envs.base import EnvLimits, Environment, StepResult
from nemo_rlhf.envs.digit_calculator import DigitCalculatorEnv, parse_digit_turn
from nemo_rlhf.envs.parsing import TOOL_CALL_FORMATS, ParsedTurn, ToolCall, parse_tool_calls
from nemo_rlhf.envs.tool_env import OBSERVATION_FORMATS, ToolEnvironment
from nemo_rlhf.envs.tools import Tool, ToolRegistry, ToolResult, calculator, calculator_tool, evaluate_arithmetic

__all__ = [
    "DigitCalculatorEnv", "EnvLimits", "Environment", "OBSERVATION_FORMATS", "ParsedTurn", "StepResult", "TOOL_CALL_FORMATS",
    "Tool", "ToolCall", "ToolEnvironment", "ToolRegistry", "ToolResult", "calculator", "calculator_tool",
    "evaluate_arithmetic", "parse_digit_turn", "parse_tool_calls",
]
