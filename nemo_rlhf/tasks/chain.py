"""A long-response task for the tiny model: a running sum written out, one step a line (#52).

The prompt is ``aa+d=`` (``aa`` a two-digit start 00-99, ``d`` a step 1-9); the response
adds ``d`` to the running value, modulo 100, ``steps`` times, one numbered line a step,
every number at a fixed width::

    07+3=  ->  01:07+3=10
               02:10+3=13
               ...
               47:45+3=48

so the correct response of :data:`TASK` (47 steps, lines of 11 characters) is 517 tokens
on the tiny model's character vocabulary, EOS included, and :data:`TASK_2K`'s (170 steps,
3-digit line numbers, 12 characters a line) 2040. Each line is local work (the line number
plus one, the last line's result copied, ``d`` added with its carry) at a fixed distance
back in the text, chosen so that a 2-layer model could learn it by SFT (not shown: after
400 SFT steps the tiny model writes the lines' format but not their numbers,
docs/algorithms.md "The critic at length, measured"); the final answer, ``(aa + steps *
d) mod 100``, is right only if every one of the ``steps`` lines is. That is the shape the
critic at length needs (issue #52, docs/algorithms.md "The critic at length"): one reward at
the end of a response hundreds of tokens long, decided by mistakes anywhere in it.

The checker (:func:`chain_answer_right`) reads the final answer as the number after the
last ``=`` and compares it with the problem's ``answer``; it does not check the lines
(a chain that skips or garbles a line almost always ends on a wrong number; no partial
credit). :attr:`Task.demonstrate` writes the whole chain (SFT). :func:`prefix_score`, the
share of lines right before the first slip, is a partial-credit reward function kept apart
from the checker (``benchmarks/critic_at_length.py --reward prefix``), as is
:func:`char_score`, the share of the chain's characters written right at their position
(``--reward chars``).

The tiny model reads 64 tokens by default (``conf/model/tiny.yaml``: 128 positions; the
recipe's profile ``data.max_seq_length`` 64): :func:`chain_overrides` gives the model and
data lengths a chain task needs (``model.max_position_embeddings``,
``data.max_seq_length``, ``rollout.max_new_tokens``), which
``benchmarks/critic_at_length.py`` passes to its SFT and PPO jobs. The recipe
(``launchers.demo --task``) has no per-task model length yet and refuses these tasks at
its length check (docs/tasks.md, "A long task").

Problems: every ``(aa, d)``, 900, shuffled by a seed; 100 held out. Simplified: one
operation (addition modulo 100), no partial credit in the checker, no edit rule
(``Task.edit_answer``).
"""

from __future__ import annotations

import random
import re
from typing import Any, Mapping, Optional

from nemo_rlhf.data.answers import check_lengths
from nemo_rlhf.tasks.task import Task

__all__ = ["TASK", "TASK_2K", "chain_answer", "chain_answer_right", "chain_char_match", "chain_overrides",
           "chain_prefix_right", "char_score",
           "chain_problems", "chain_response", "chain_task", "line_width", "prefix_score", "response_tokens"]

PROMPT = "{start}+{step}="
_ANSWER = re.compile(r"\d+")


def chain_problems(steps: int, seed: int = 0, n_heldout: int = 100) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)``: every ``{"start": "07", "step": 3, "steps", "answer": "48"}``
    with start 00-99 and step 1-9 (900 problems), ``answer = (start + steps * step) mod 100``
    at two digits, shuffled by ``seed``; the first ``n_heldout`` held out.

    Raises:
        ValueError: ``steps < 1`` or ``n_heldout`` not in ``[1, 899]``.
    """
    if steps < 1:
        raise ValueError(f"chain_problems: steps={steps}: must be >= 1")
    if not 1 <= n_heldout < 900:
        raise ValueError(f"chain_problems: n_heldout={n_heldout}: must be in [1, 899]")
    problems = [{"start": f"{a:02d}", "step": d, "steps": steps, "answer": f"{(a + steps * d) % 100:02d}"}
                for a in range(100) for d in range(1, 10)]
    random.Random(seed).shuffle(problems)
    return problems[n_heldout:], problems[:n_heldout]


def line_width(steps: int) -> int:
    """Characters of one line, its newline included: ``len(str(steps))`` for the line number,
    then ``:aa+d=bb`` (8) and ``\\n``."""
    return len(str(steps)) + 9


def response_tokens(steps: int) -> int:
    """Tokens of the correct response on a character tokenizer, EOS included:
    ``steps * line_width(steps)`` (the last line has no newline; the EOS takes its place)."""
    return steps * line_width(steps)


def chain_response(start: str, step: int, steps: int) -> str:
    """The whole correct chain: ``steps`` lines ``<i>:<x>+<d>=<y>`` joined by newlines, ``i``
    from 1 at ``len(str(steps))`` digits, ``x`` the running value (first: ``start``), ``y =
    (x + d) mod 100``, both at two digits. ``chain_response("07", 3, 2) == "1:07+3=10\\n2:10+3=13"``."""
    width, x, lines = len(str(steps)), int(start), []
    for i in range(1, steps + 1):
        y = (x + step) % 100
        lines.append(f"{i:0{width}d}:{x:02d}+{step}={y:02d}")
        x = y
    return "\n".join(lines)


def chain_answer(response: str) -> Optional[str]:
    """The final answer of a chain response: the text after its last ``=``, stripped, when
    it is digits only; else None. ``"...\\n47:45+3=48"`` gives ``"48"``; ``"47:45+3="`` and
    ``""`` give None."""
    if "=" not in response:
        return None
    tail = response.rsplit("=", 1)[-1].strip()
    return tail if _ANSWER.fullmatch(tail) else None


def chain_answer_right(prompt: str, response: str, extras: Mapping[str, Any]) -> bool:
    """The chain checker (:attr:`Task.check`): :func:`chain_answer` equals ``extras["answer"]``
    (two digits, ``"08"``; an answer written ``"8"`` is wrong: the chain's numbers are
    two-digit).

    Raises:
        KeyError: ``extras`` without ``answer``.
    """
    return chain_answer(response) == str(extras["answer"]).strip()


def chain_prefix_right(prompt: str, response: str, extras: Mapping[str, Any]) -> float:
    """Partial credit, not the task's checker: the share of the ``steps`` lines that are right
    before the first wrong one (lines compared as text with :func:`chain_response`'s; a
    missing line is wrong). 1.0 exactly when the whole chain is right, whatever follows it.

    Raises:
        KeyError: ``extras`` without ``start``, ``step`` or ``steps``.
    """
    steps = int(extras["steps"])
    right = chain_response(str(extras["start"]), int(extras["step"]), steps).split("\n")
    got = response.split("\n")
    n = 0
    while n < steps and n < len(got) and got[n].strip() == right[n]:
        n += 1
    return n / steps


def prefix_score(prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
    """The batch form of :func:`chain_prefix_right` (a reward function,
    ``nemo_rlhf.tasks.chain:prefix_score``: ``benchmarks/critic_at_length.py --reward prefix``)."""
    check_lengths(prompts, responses, extras, "chain prefix_score")
    return [chain_prefix_right(p, r, e) for p, r, e in zip(prompts, responses, extras)]


def chain_char_match(prompt: str, response: str, extras: Mapping[str, Any]) -> float:
    """Partial credit, not the task's checker: the share of the correct chain's characters
    (:func:`chain_response`) that ``response`` has at the same position (a missing one is
    wrong; characters past the chain's end are not read). The lines' fixed width keeps the
    positions aligned while the format holds, so a chain with every number wrong still earns
    its line numbers and ``:+=`` (about half).

    Raises:
        KeyError: ``extras`` without ``start``, ``step`` or ``steps``.
    """
    right = chain_response(str(extras["start"]), int(extras["step"]), int(extras["steps"]))
    return sum(a == b for a, b in zip(response, right)) / len(right)


def char_score(prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
    """The batch form of :func:`chain_char_match` (``nemo_rlhf.tasks.chain:char_score``:
    ``benchmarks/critic_at_length.py --reward chars``)."""
    check_lengths(prompts, responses, extras, "chain char_score")
    return [chain_char_match(p, r, e) for p, r, e in zip(prompts, responses, extras)]


def _demonstrate(prompt: str, extras: Mapping[str, Any]) -> str:
    return chain_response(str(extras["start"]), int(extras["step"]), int(extras["steps"]))


def chain_task(steps: int, name: Optional[str] = None, seed: int = 0) -> Task:
    """The chain task of ``steps`` lines: :func:`chain_problems`, the checker, whole-chain
    demonstrations, ``max_new_tokens`` one line more than the correct response (a chain that
    runs one line long ends by itself; longer ones are cut)."""
    train, heldout = chain_problems(steps, seed)
    return Task(name=name or f"chain{steps}", train=train, heldout=heldout, prompt_template=PROMPT,
                check=chain_answer_right, demonstrate=_demonstrate,
                max_new_tokens=response_tokens(steps) + line_width(steps))


def chain_overrides(task: Task, prompt_tokens: int = 8) -> list[str]:
    """Hydra overrides of the SFT / PPO jobs that fit ``task``'s responses on the tiny model:
    ``model.max_position_embeddings`` and ``data.max_seq_length`` = ``prompt_tokens`` (the
    prompt ``aa+d=`` is 5 characters, BOS 1) + ``task.max_new_tokens``, rounded up to a
    multiple of 64; ``rollout.max_new_tokens`` = ``task.max_new_tokens``."""
    length = -(-(prompt_tokens + task.max_new_tokens) // 64) * 64
    return [f"model.max_position_embeddings={length}", f"data.max_seq_length={length}",
            f"rollout.max_new_tokens={task.max_new_tokens}"]


TASK = chain_task(47, "chain47")
"""47 steps: the correct response is 517 tokens (11 a line), ``max_new_tokens`` 528."""
TASK_2K = chain_task(170, "chain170")
"""170 steps: the correct response is 2040 tokens (12 a line), ``max_new_tokens`` 2052."""
