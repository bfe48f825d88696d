"""A task written from docs/tasks.md alone (issue 53's third untuned task): the sum of the
digits of a four-digit number (``"Digit sum of 4821?"`` -> ``"15"``).

Problems: every number 1000-9999 once (9,000), shuffled with seed 0; the first 200 are
held out. The checker compares the stripped response with the sum (a decimal string, 1-36).
The edit rule: a right answer becomes the sum plus or minus one (within 1-36), a wrong one
the right sum. Demonstrations: the sum alone. The prompt is short enough for
``--model tiny`` (at most 64 characters of prompt and answer).
"""

from __future__ import annotations

import random

from nemo_rlhf.tasks.task import Task


def digit_sum_problems() -> list[dict]:
    """``[{"number": "4821", "answer": "15"}, ...]``: 1000-9999 shuffled with seed 0."""
    numbers = list(range(1000, 10000))
    random.Random(0).shuffle(numbers)
    return [{"number": str(n), "answer": str(sum(int(d) for d in str(n)))} for n in numbers]


def check_digit_sum(prompt: str, response: str, extras: dict) -> bool:
    """True when the response, stripped, is the digit sum ``extras["answer"]``."""
    return response.strip() == extras["answer"]


def edit_digit_sum(prompt: str, response: str, extras: dict, right: bool, rng: random.Random):
    """:attr:`Task.edit_answer`: a right response's sum replaced by the sum +-1 (1-36), a
    wrong one's stripped text by the right sum; None for an empty response."""
    text, answer = response.strip(), extras["answer"]
    if not text:
        return None
    if not right:
        return response.replace(text, answer)
    n = int(answer)
    wrong = n + rng.choice([d for d in (-1, 1) if 1 <= n + d <= 36])
    return response.replace(answer, str(wrong), 1)


_PROBLEMS = digit_sum_problems()
TASK = Task(name="digit_sum", train=_PROBLEMS[200:], heldout=_PROBLEMS[:200],
            prompt_template="Digit sum of {number}?", check=check_digit_sum,
            edit_answer=edit_digit_sum, demonstrate=lambda prompt, extras: extras["answer"])
"""The digit sum in the recipe's interface (``python -m launchers.demo --task
nemo_rlhf.tasks.digit_sum:TASK --model tiny``)."""
