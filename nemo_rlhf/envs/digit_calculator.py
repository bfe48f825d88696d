"""A calculator the tiny demo model can call in its own vocabulary (#51):
``env.name=digit_calculator``.

The tiny model's character tokenizer holds only digits, ``+ - * =`` and ``<pad> <bos>
<eos>`` (:func:`nemo_rlhf.tasks.precedence.build_char_tokenizer_json`), so it cannot write a
Hermes ``<tool_call>{json}</tool_call>`` (:class:`~nemo_rlhf.envs.ToolEnvironment`). This
environment reads each policy turn (EOS dropped, surrounding whitespace ignored) as:

* a **call**: an expression of integers and ``+ - *`` ending in ``=``, e.g. ``37*12=``. The
  observation is the value's digits followed by ``=`` (``444=``): the ``=`` marks where
  the tool's output ends, so the policy's next turn starts after it. The episode goes on.
  (``444=`` is a trivial call: its observation is ``444=``.)
* a **final answer**: an integer alone (``444``). The episode ends; its reward is 1.0 when
  the integer equals the problem's ``answer`` (as text), 0.0 when not, None when the
  problem has no ``answer``.
* anything else (``37*=``, ``37*12=444``, the empty turn, a call whose value exceeds the
  calculator's bounds) is **malformed**: the episode ends (no error text can be written in
  this vocabulary), ``malformed_calls`` 1, reward 0.0 (None without an ``answer``).

A well-formed episode of the ``calc`` task (:mod:`nemo_rlhf.tasks.calc`), as tokens::

    <bos>37*12=   37*12=<eos>   444=   444<eos>
    prompt        policy turn   env    policy turn (the final answer)

``info``: ``tool_calls`` (evaluated calls so far), ``malformed_calls`` (0 or 1),
``truncated`` and, when the episode ends without an answer, ``reason``
(``malformed`` or a limit). A call on the episode's last turn (``max_turns``) or at
``max_total_tokens`` ends the episode truncated: no turn is left to read the result.
Expressions are evaluated by :func:`~nemo_rlhf.envs.tools.evaluate_arithmetic` (``*``
before ``+ -``, its size bounds).
"""

from __future__ import annotations

import re
import time
from typing import Any, Optional

from nemo_rlhf.envs.base import EnvLimits, Environment, StepResult
from nemo_rlhf.envs.tools import evaluate_arithmetic

__all__ = ["DigitCalculatorEnv", "digit_calculator_env", "parse_digit_turn"]

_CALL = re.compile(r"(-?\d+(?:[+\-*]-?\d+)*)=")
_ANSWER = re.compile(r"-?\d+")


def parse_digit_turn(text: str) -> tuple[str, Optional[str]]:
    """Classify one policy turn of the digit-vocabulary calculator.

    Returns:
        ``("call", expression)`` (``"37*12="`` -> ``("call", "37*12")``), ``("answer",
        integer text)`` (``" 444"`` -> ``("answer", "444")``) or ``("malformed", None)``.
    """
    text = text.strip()
    m = _CALL.fullmatch(text)
    if m:
        return "call", m.group(1)
    if _ANSWER.fullmatch(text):
        return "answer", text
    return "malformed", None


class DigitCalculatorEnv(Environment):
    """The digit-vocabulary calculator (module docstring).

    Args:
        limits: the per-episode :class:`EnvLimits` (``max_turns``, ``max_total_tokens``).
    """

    observation_role = "tool"

    def __init__(self, limits: EnvLimits) -> None:
        self.limits = limits
        self.problem: Any = None
        self.tool_calls = 0

    def reset(self, problem: Any) -> str:
        """Start an episode: ``problem["prompt"]`` (a dict) or ``str(problem)``."""
        self.problem = problem
        self.tool_calls = 0
        return problem["prompt"] if isinstance(problem, dict) else str(problem)

    def _reward(self, answer: Optional[str]) -> Optional[float]:
        if not isinstance(self.problem, dict) or "answer" not in self.problem:
            return None
        return float(answer is not None and answer == str(self.problem["answer"]).strip())

    def _info(self, malformed: int = 0, **extra) -> dict:
        return {"tool_calls": self.tool_calls, "malformed_calls": malformed, **extra}

    def step(self, trajectory_so_far: Any, last_action_text: str) -> StepResult:
        """Answer one policy turn. ``trajectory_so_far`` needs ``turns`` (policy turns so
        far, this one included) and ``len()`` (its tokens)."""
        kind, value = parse_digit_turn(last_action_text)
        if kind == "answer":
            return StepResult(None, True, self._reward(value), self._info(truncated=False))
        if kind == "call":
            for limit, used in (("max_turns", trajectory_so_far.turns),
                                ("max_total_tokens", len(trajectory_so_far))):
                if used >= getattr(self.limits, limit):  # no turn left to read the result
                    return StepResult(None, True, self._reward(None),
                                      self._info(truncated=True, reason=limit))
            t0 = time.perf_counter()
            try:
                result = evaluate_arithmetic(value)
            except ValueError:  # a bound exceeded: no digits to answer with
                kind = "malformed"
            else:
                self.tool_calls += 1
                return StepResult(f"{result}=", False, None,
                                  self._info(truncated=False, tool_time_s=time.perf_counter() - t0))
        return StepResult(None, True, self._reward(None),
                          self._info(malformed=1, truncated=False, reason="malformed"))


def digit_calculator_env(env_cfg) -> DigitCalculatorEnv:
    """``env.name=digit_calculator``: a :class:`DigitCalculatorEnv` with ``env_cfg``'s
    limits (``env.tool_call_format`` does not apply: its calls are ``<expression>=``)."""
    return DigitCalculatorEnv(env_cfg.limits())
