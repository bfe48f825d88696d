"""The tool task on SmolLM2: three-digit by two-digit multiplication in the model's ChatML
chat format, with the calculator tool called in the Hermes ``<tool_call>`` JSON form (#51).

The user message asks for the product and offers the tool the way Hermes / Qwen tool use
writes it (a ``<tools>`` block with the tool's JSON definition,
:meth:`~nemo_rlhf.envs.tools.Tool.spec`, and the call's form); it goes in the user turn,
not the system message, because the recipe's SmolLM2 profile keeps its own system prompt
(:data:`~nemo_rlhf.tasks.addition.SMOLLM2_SYSTEM_PROMPT`) for every job. An episode
(``env.name=calculator``, :func:`~nemo_rlhf.envs.builtin.calculator_env`) is then, after the
chat-templated prompt (``...<|im_start|>assistant\\n``)::

    policy  <tool_call>
            {"name": "calculator", "arguments": {"expression": "347*28"}}
            </tool_call><|im_end|>
    env     \\n<|im_start|>tool\\n<tool_response>\\n9716\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
    policy  9716<|im_end|>

``<|im_end|>`` is SmolLM2's EOS, so a policy turn's EOS closes its assistant message and
the observation (:data:`OBSERVATION_TEMPLATE`, ``env.observation_template``) holds the rest
of the ChatML between the turns: the newline, the tool message and the next assistant
header. It is tokenised alone and its ids appended (token-in/token-out); the rendered text
of the whole episode is exactly ChatML with a ``tool`` message (the role of
:attr:`ToolEnvironment.observation_role <nemo_rlhf.envs.tool_env.ToolEnvironment>`).

* :data:`TASK` (``--task nemo_rlhf.tasks.calc_chat:TASK --model smollm2 --reward checker``):
  with the tool. Its demonstrations are the episode after the prompt as segments
  (policy call / env observation / policy answer): the SFT row holds the episode's ids
  exactly (:func:`nemo_rlhf.data.datasets.encode_segments`) and SFT trains only the two
  policy turns.
* :data:`NO_TOOL`: the same problems asked without the tool (the same question, no
  ``<tools>`` block), single-turn, the demonstration the bare product: the "without the
  tool" comparison.

The checker :func:`calc_chat_right` reads the final answer (:func:`calc_chat_answer`): the
last integer of the episode's last policy turn (digit-grouping commas removed), none when
that turn is itself a tool call (an episode cut at ``env.max_turns`` while still calling).
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Mapping, Optional

from nemo_rlhf.envs.tools import calculator_tool
from nemo_rlhf.tasks.task import Task

__all__ = ["NO_TOOL", "OBSERVATION_TEMPLATE", "TASK", "calc_chat_answer", "calc_chat_problems",
           "calc_chat_right", "tool_call_text"]

QUESTION = "What is {a}*{b}? Answer with just the number."
"""The question, with and without the tool."""

_TOOL = calculator_tool()
_TOOL_SPEC = json.dumps({"name": _TOOL.name, "description": "Evaluate an arithmetic expression.",
                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                        "required": ["expression"]}})
TOOL_PROMPT = (QUESTION + "\nYou may call this tool:\n<tools>\n" + _TOOL_SPEC.replace("{", "{{").replace("}", "}}")
               + "\n</tools>\nTo call it, write <tool_call>\n{{\"name\": \"calculator\", \"arguments\": "
                 "{{\"expression\": ...}}}}\n</tool_call>")
"""The user message with the tool offered: Hermes' ``<tools>`` block (the calculator's
JSON-schema definition, :func:`~nemo_rlhf.envs.tools.calculator_tool`'s name and argument,
its description shortened: the prompt is 141 tokens with the system message) and the call's form; a
``str.format`` template over ``a`` and ``b``."""

OBSERVATION_TEMPLATE = "\n<|im_start|>tool\n{observation}<|im_end|>\n<|im_start|>assistant\n"
"""``env.observation_template`` for ChatML whose EOS is ``<|im_end|>`` (SmolLM2): the policy
turn's EOS already closed the assistant message (module docstring)."""

_INTEGER = re.compile(r"-?\d+")
_GROUPED = re.compile(r"(?<=\d),(?=\d{3}\b)")


def calc_chat_problems(seed: int = 0, n_heldout: int = 200) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)``: every ``{"a", "b", "answer"}`` with ``100 <= a <= 999`` and
    ``11 <= b <= 99`` (80,100 problems), shuffled by ``seed``; the first ``n_heldout`` held
    out. ``answer`` is ``str(a * b)``."""
    problems = [{"a": a, "b": b, "answer": str(a * b)} for a in range(100, 1000) for b in range(11, 100)]
    random.Random(seed).shuffle(problems)
    return problems[n_heldout:], problems[:n_heldout]


def calc_chat_answer(response: str) -> Optional[str]:
    """The final answer of a response (an episode's last policy turn, or a tool-free answer):
    its last integer with digit-grouping commas removed, as text; None when it has no
    integer or contains ``<tool_call>`` (a call is not an answer). ``"9716"``, ``"347 * 28 =
    9,716."`` give ``"9716"``; ``"<tool_call>..."`` and ``"I don't know"`` give None."""
    if "<tool_call>" in response:
        return None
    numbers = _INTEGER.findall(_GROUPED.sub("", response))
    return numbers[-1] if numbers else None


def calc_chat_right(prompt: str, response: str, extras: Mapping[str, Any]) -> bool:
    """The checker (:attr:`Task.check`): :func:`calc_chat_answer` equals ``extras["answer"]``.

    Raises:
        KeyError: ``extras`` without ``answer``.
    """
    return calc_chat_answer(response) == str(extras["answer"]).strip()


def tool_call_text(expression: str) -> str:
    """The policy's call turn in the Hermes form (the text before its EOS): ``<tool_call>``,
    the JSON ``{"name": "calculator", "arguments": {"expression": ...}}``, ``</tool_call>``,
    one per line (as Hermes / Qwen2.5's chat templates write an assistant's call)."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n</tool_call>"


def _demonstrate_with_tool(prompt: str, extras: Mapping[str, Any]) -> list[dict]:
    answer = str(extras["answer"])
    observation = OBSERVATION_TEMPLATE.format(observation=f"<tool_response>\n{answer}\n</tool_response>")
    return [{"kind": "policy", "text": tool_call_text(f"{extras['a']}*{extras['b']}")},
            {"kind": "env", "text": observation}, {"kind": "policy", "text": answer}]


def _demonstrate_alone(prompt: str, extras: Mapping[str, Any]) -> str:
    return str(extras["answer"])


_TRAIN, _HELDOUT = calc_chat_problems()
TASK = Task(name="calc_chat", train=_TRAIN, heldout=_HELDOUT, prompt_template=TOOL_PROMPT, check=calc_chat_right,
            demonstrate=_demonstrate_with_tool, max_new_tokens=48, max_seq_length=256, env="calculator",
            env_overrides=("env.max_turns=2", "env.max_total_tokens=256",
                           f"env.observation_template='{OBSERVATION_TEMPLATE}'"))
"""Three-digit by two-digit multiplication on SmolLM2 with the calculator tool (a Hermes call
turn, the tool's output, the answer)."""
NO_TOOL = Task(name="calc_chat_no_tool", train=_TRAIN, heldout=_HELDOUT, prompt_template=QUESTION,
               check=calc_chat_right, demonstrate=_demonstrate_alone, max_new_tokens=48)
"""The same problems without the tool: single-turn, the question alone."""
