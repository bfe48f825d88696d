"""Reading answers: the helpers the tasks' checkers share (``nemo_rlhf/data/<task>.py``).

A checker is a reward function ``fn(prompts, responses, extras) -> list[float]``; the
tasks register theirs in :mod:`nemo_rlhf.reward.functions`.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_integer(text: str, anchored: bool = False) -> int | None:
    """The first number in ``text`` if it is an integer, else None.

    A number is ``-?digits`` with an optional ``.digits`` fraction; a number with a
    fraction (``21.5``) is not an integer, so it yields None, but a trailing period
    (``21.``) is punctuation. ``anchored=True``: the number must start ``text`` after
    whitespace is stripped (``" 21\\n"`` -> 21, ``"x 21"`` -> None).
    """
    text = text.strip()
    match = _NUMBER.match(text) if anchored else _NUMBER.search(text)
    if match is None or "." in match.group():
        return None
    return int(match.group())


def integer_answers(extras: Sequence[Mapping[str, Any]], fn_name: str) -> list[int]:
    """``int(extras[i]["answer"])`` for every row.

    Raises:
        KeyError: a row without ``answer`` (naming the index and the keys present).
        ValueError: an ``answer`` that is not an integer (naming the index).
    """
    answers = []
    for i, ex in enumerate(extras):
        if "answer" not in ex:
            raise KeyError(f"{fn_name}: extras[{i}] has no 'answer'; keys present: {sorted(ex)}")
        try:
            answers.append(int(str(ex["answer"]).strip()))
        except ValueError:
            raise ValueError(f"{fn_name}: extras[{i}]['answer']={ex['answer']!r} is not an integer") from None
    return answers


def check_lengths(prompts: Sequence, responses: Sequence, extras: Sequence, fn_name: str) -> None:
    """Raises ``ValueError`` naming ``fn_name`` unless the three lists have one length."""
    if not len(prompts) == len(responses) == len(extras):
        raise ValueError(f"{fn_name}: {len(prompts)} prompts, {len(responses)} responses, {len(extras)} extras; "
                         f"they must have the same length")
