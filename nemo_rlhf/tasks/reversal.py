"""The tiny demo's task: reverse a number, taught by a sloppy demonstrator (``4821=`` -> ``1284``).

Why this task: it is the InstructGPT premise in miniature. The *demonstrations* come from a
labeller who, on ``sft_copy_rate`` of the prompts, copies the number instead of reversing
it, so supervised fine-tuning imitates the majority and the SFT policy's greedy answer is
mostly the copy. The *comparisons* are labelled correctly (judging two answers is easier
than writing one): the RM learns to prefer the reversal, and PPO against the served RM moves
the policy's mode from the copy to the reversal, which SFT on the same labeller cannot do.
A model of the tiny shape (``conf/model/tiny.yaml``) learns both the copy and the reversal
from a few thousand rows, so what PPO changes is the choice between them, not the model's
capacity. (The precedence arithmetic of :mod:`nemo_rlhf.tasks.precedence`, the tests' fixture
task, is capacity-bound at that size: its SFT model computes about half the sums right at
all, and PPO could not move it; docs/demo.md, "The task the tiny demo replaced".)

Prompts are ``d1 d2 ... dn =`` with ``n`` in ``[min_digits, max_digits]`` and digits 1-9
(no zero, so every answer is an integer without a leading zero and the integer checker
:func:`nemo_rlhf.tasks.precedence.arithmetic_exact_match` scores it). The files have the same
names and fields as :mod:`nemo_rlhf.tasks.precedence`'s:

* ``sft.jsonl``: ``{"prompt", "response", "label_noise"}``, the response copied (noise)
  at ``sft_copy_rate``, else reversed;
* ``sft_val.jsonl``: clean SFT rows on validation prompts;
* ``preference.jsonl`` / ``preference_val.jsonl``: ``{"prompt", "chosen", "rejected",
  "rejected_kind"}``: chosen is the reversal; rejected is the copy (half the pairs, the
  labeller's mistake), one digit of the reversal changed, or two adjacent digits of it
  swapped;
* ``ppo_prompts.jsonl`` / ``eval.jsonl``: ``{"prompt", "answer"}``; the held-out prompts
  are disjoint from every other file's;
* ``tokenizer/``: the demo's character-level tokenizer; ``manifest.json``.

Palindromes (copy == reversal) are left out of every file: they cannot tell the two apart.
Deterministic in the seed.

:data:`TASK` is the same task in the recipe's interface (:class:`~nemo_rlhf.tasks.task.Task`),
with clean demonstrations and the recipe's own preference pairs from the model's samples.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from nemo_rlhf.tasks.precedence import (SPECIAL_TOKENS, TaskSizes, _jsonl, arithmetic_exact_match,
                                        build_char_tokenizer_json, with_manifest, write_dataset_files)
from nemo_rlhf.tasks.task import Task

REJECTED_KINDS = ("copy", "digit_change", "adjacent_swap")


@dataclass
class ReversalTaskConfig(TaskSizes):
    """Sizes and the demonstrator's noise of the reversal task."""

    min_digits: int = 3
    """Shortest number."""
    max_digits: int = 5
    """Longest number (5: answer + EOS fit ``rollout.max_new_tokens=6`` of ``conf/ppo_tiny.yaml``)."""
    sft_copy_rate: float = 0.6
    """Probability that the demonstrator copies the number instead of reversing it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 2 <= self.min_digits <= self.max_digits:
            raise ValueError(f"min_digits={self.min_digits}, max_digits={self.max_digits}: "
                             f"need 2 <= min_digits <= max_digits")
        if not 0.0 <= self.sft_copy_rate <= 1.0:
            raise ValueError(f"sft_copy_rate={self.sft_copy_rate}: must be in [0, 1]")
        held_out = self.n_eval + self.n_val
        if held_out >= _count(self.min_digits, self.max_digits):
            raise ValueError(f"n_eval + n_val = {held_out} leaves no training prompt with "
                             f"{self.min_digits}-{self.max_digits} digits")


def _count(lo: int, hi: int) -> int:
    """Non-palindromic numbers of ``lo``..``hi`` digits 1-9."""
    return sum(9 ** n - 9 ** ((n + 1) // 2) for n in range(lo, hi + 1))


def _numbers(lo: int, hi: int, rng: random.Random, cap: int) -> list[str]:
    """Up to ``cap`` distinct non-palindromic numbers of ``lo``..``hi`` digits 1-9, drawn
    with a uniform length (then uniform digits)."""
    total = _count(lo, hi)
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < min(cap, total):
        s = "".join(rng.choice("123456789") for _ in range(rng.randint(lo, hi)))
        if s != s[::-1] and s not in seen:
            seen.add(s)
            out.append(s)
    return out


def reverse(number: str) -> str:
    """``"4821"`` -> ``"1284"``."""
    return number[::-1]


def wrong_answer(number: str, rng: random.Random) -> tuple[str, str]:
    """A wrong answer to ``number`` and its kind (one of :data:`REJECTED_KINDS`): the copy
    (half the time), one digit of the reversal changed, or two adjacent differing digits of
    the reversal swapped (else a digit changed)."""
    right = reverse(number)
    kind = "copy" if rng.random() < 0.5 else rng.choice(REJECTED_KINDS[1:])
    if kind == "adjacent_swap":
        spots = [i for i in range(len(right) - 1) if right[i] != right[i + 1]]
        if spots:
            i = rng.choice(spots)
            return right[:i] + right[i + 1] + right[i] + right[i + 2:], kind
        kind = "digit_change"
    if kind == "digit_change":
        i = rng.randrange(len(right))
        d = rng.choice([c for c in "123456789" if c != right[i]])
        return right[:i] + d + right[i + 1:], kind
    return number, kind


def build_reversal_files(cfg: ReversalTaskConfig) -> dict[str, str]:
    """File name -> content of the whole reversal dataset (nothing written)."""
    rng = random.Random(cfg.seed)
    n_train = max(cfg.n_sft, cfg.n_pref, cfg.n_ppo)
    pool = _numbers(cfg.min_digits, cfg.max_digits, rng, cap=cfg.n_eval + cfg.n_val + n_train)
    eval_nums, val_nums = pool[:cfg.n_eval], pool[cfg.n_eval:cfg.n_eval + cfg.n_val]
    train = pool[cfg.n_eval + cfg.n_val:]

    def draw(n: int) -> list[str]:  # without replacement while the pool lasts
        out = []
        while len(out) < n:
            out += rng.sample(train, min(len(train), n - len(out)))
        return out

    def sft_rows(nums, copy_rate):
        rows = []
        for s in nums:
            noisy = rng.random() < copy_rate
            rows.append({"prompt": f"{s}=", "response": s if noisy else reverse(s), "label_noise": noisy})
        return rows

    def pref_rows(nums):
        rows = []
        for s in nums:
            wrong, kind = wrong_answer(s, rng)
            rows.append({"prompt": f"{s}=", "chosen": reverse(s), "rejected": wrong, "rejected_kind": kind})
        return rows

    def answer_rows(nums):
        return [{"prompt": f"{s}=", "answer": reverse(s)} for s in nums]

    files = {
        "sft.jsonl": _jsonl(sft_rows(draw(cfg.n_sft), cfg.sft_copy_rate)),
        "sft_val.jsonl": _jsonl(sft_rows(val_nums, 0.0)),
        "preference.jsonl": _jsonl(pref_rows(draw(cfg.n_pref))),
        "preference_val.jsonl": _jsonl(pref_rows(val_nums)),
        "ppo_prompts.jsonl": _jsonl(answer_rows(draw(cfg.n_ppo))),
        "eval.jsonl": _jsonl(answer_rows(eval_nums)),
        "tokenizer/tokenizer.json": build_char_tokenizer_json(),
        "tokenizer/special_tokens.json": json.dumps(SPECIAL_TOKENS, indent=2) + "\n",
    }
    return with_manifest(files, "nemo_rlhf.tasks.reversal", cfg)


def make_reversal_dataset(out: str | Path, cfg: ReversalTaskConfig, force: bool = False) -> dict[str, str]:
    """Write the reversal dataset into ``out``; idempotent, refuses to overwrite a different
    one unless ``force`` (:func:`nemo_rlhf.tasks.precedence.write_dataset_files`).

    Returns:
        File name -> ``"written"``, ``"unchanged"`` or ``"overwritten"``.

    Raises:
        FileExistsError: existing files differ and ``force`` is False (names them).
    """
    return write_dataset_files(out, build_reversal_files(cfg), force=force)


# --------------------------------------------------------------------------- the recipe's interface
_LEADING_NUMBER = re.compile(r"\s*(\d+)")


def reversal_problems(cfg: ReversalTaskConfig = ReversalTaskConfig()) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)`` problems ``{"number", "answer"}`` of :data:`TASK`: the numbers of
    :func:`build_reversal_files`' pool with the same settings (held-out: its ``eval.jsonl``
    numbers; train: the validation and training numbers)."""
    pool = _numbers(cfg.min_digits, cfg.max_digits, random.Random(cfg.seed),
                    cap=cfg.n_eval + cfg.n_val + max(cfg.n_sft, cfg.n_pref, cfg.n_ppo))
    rows = [{"number": s, "answer": reverse(s)} for s in pool]
    return rows[cfg.n_eval:], rows[:cfg.n_eval]


def _check(prompt: str, response: str, extras) -> float:
    return arithmetic_exact_match([prompt], [response], [extras])[0]


def edit_reversal_answer(prompt: str, response: str, extras, right: bool, rng: random.Random):
    """:attr:`Task.edit_answer` of the reversal task: the leading number of ``response``
    replaced, in place, by a wrong answer of :func:`wrong_answer` (the copy, a changed
    digit, two adjacent digits swapped) when it is ``right``, else by the reversal. None
    when the response does not start with a number."""
    m = _LEADING_NUMBER.match(response)
    if m is None:
        return None
    new = wrong_answer(extras["number"], rng)[0] if right else str(extras["answer"])
    return response[:m.start(1)] + new + response[m.end(1):]


_TRAIN, _HELDOUT = reversal_problems()
TASK = Task(name="number_reversal", train=_TRAIN, heldout=_HELDOUT, prompt_template="{number}=",
            check=_check, edit_answer=edit_reversal_answer,
            demonstrate=lambda prompt, extras: str(extras["answer"]),
            checker_name="arithmetic_exact_match", max_new_tokens=6)
"""Number reversal in the recipe's interface (``python -m launchers.demo --task
nemo_rlhf.tasks.reversal:TASK --model tiny``): clean demonstrations, unlike ``--task tiny``'s
sloppy demonstrator."""
