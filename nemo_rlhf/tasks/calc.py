"""A tool task for the tiny model: multiplication with a calculator (``37*12=`` -> ``444``).

The prompt is ``a*b=`` with ``a`` two-digit and ``b`` one- or two-digit (``10 <= a <= 99``,
``2 <= b <= 99``); the answer is the product. A model of the tiny shape cannot multiply
two-digit numbers from a few thousand demonstrations (the precedence task's one-digit
sums are already capacity-bound at that size, :mod:`nemo_rlhf.tasks.reversal`), but it
can copy: with the digit-vocabulary calculator (``env.name=digit_calculator``,
:mod:`nemo_rlhf.envs.digit_calculator`) an episode is

    prompt ``37*12=`` | policy ``37*12=`` EOS (the call) | env ``444=`` | policy ``444`` EOS

so the policy has to learn to call (repeat the expression) and to copy the result.

* :data:`TASK` (``--task nemo_rlhf.tasks.calc:TASK``): with the tool. Its demonstrations
  (:attr:`Task.demonstrate`, for SFT) are the episode after the prompt as segments: policy
  ``37*12=``, env ``444=``, policy ``444``; the SFT row holds the episode's tokens exactly
  (each policy segment ends with EOS, as a turn does) and its loss trains on the two policy
  turns only, not on the observation ``444=`` (as PPO masks it).
* :data:`NO_TOOL`: the same problems, checker and budget, single-turn (``Task.env``
  None), demonstrations the bare product: the comparison.

The checker :func:`calc_answer_right` reads the final answer as the text after the last
``=`` (an integer alone): an episode's last policy turn (``444``), a demonstration, a
tool-free answer (``444``); a single-turn decode of a tool-calling model (``37*12=``, it
stops at the call's EOS) states none and is wrong.
"""

from __future__ import annotations

import random
import re
from typing import Any, Mapping, Optional

from nemo_rlhf.tasks.task import Task

__all__ = ["NO_TOOL", "TASK", "calc_answer", "calc_answer_right", "calc_problems"]

PROMPT = "{a}*{b}="
_INTEGER = re.compile(r"-?\d+")


def calc_problems(seed: int = 0, n_heldout: int = 200) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)``: every ``{"a", "b", "answer"}`` with ``10 <= a <= 99`` and
    ``2 <= b <= 99`` (8,820 problems), shuffled by ``seed``; the first ``n_heldout`` held out."""
    problems = [{"a": a, "b": b, "answer": str(a * b)} for a in range(10, 100) for b in range(2, 100)]
    random.Random(seed).shuffle(problems)
    return problems[n_heldout:], problems[:n_heldout]


def calc_answer(response: str) -> Optional[str]:
    """The final answer of a calc response: the text after its last ``=``, stripped, when it
    is an integer; else None. ``"444"`` and ``"37*12=<eos>444=444"`` give ``"444"``;
    ``"37*12="`` and ``"44 4"`` give None."""
    tail = response.rsplit("=", 1)[-1].strip()
    return tail if _INTEGER.fullmatch(tail) else None


def calc_answer_right(prompt: str, response: str, extras: Mapping[str, Any]) -> bool:
    """The calc checker (:attr:`Task.check`): :func:`calc_answer` equals ``extras["answer"]``.

    Raises:
        KeyError: ``extras`` without ``answer``.
    """
    return calc_answer(response) == str(extras["answer"]).strip()


def _demonstrate_with_tool(prompt: str, extras: Mapping[str, Any]) -> list[dict]:
    answer = extras["answer"]
    return [{"kind": "policy", "text": prompt}, {"kind": "env", "text": f"{answer}="},
            {"kind": "policy", "text": str(answer)}]


def _demonstrate_alone(prompt: str, extras: Mapping[str, Any]) -> str:
    return str(extras["answer"])


_TRAIN, _HELDOUT = calc_problems()
TASK = Task(name="calc", train=_TRAIN, heldout=_HELDOUT, prompt_template=PROMPT, check=calc_answer_right,
            demonstrate=_demonstrate_with_tool, max_new_tokens=8, env="digit_calculator",
            env_overrides=("env.max_turns=2", "env.max_total_tokens=64"))
"""Two-digit multiplication with the digit-vocabulary calculator (a call turn, then the answer)."""
NO_TOOL = Task(name="calc_no_tool", train=_TRAIN, heldout=_HELDOUT, prompt_template=PROMPT,
               check=calc_answer_right, demonstrate=_demonstrate_alone, max_new_tokens=8)
"""The same problems without the tool: single-turn, the demonstrations the bare product."""
