"""The real-model task: two-digit addition asked in natural language through a chat template.

    "What is 26+28? Answer with just the number."  ->  "54"

Every ordered pair ``(a, b)`` with ``10 <= a, b <= 99`` is one problem (8,100 in all). They
are shuffled once by the seed and split, disjointly, into

* ``eval.jsonl`` (``n_eval``, default 200): the fixed held-out set, ``{"prompt", "answer"}``;
* ``rm_val_prompts.jsonl`` (``n_rm_val``): prompts whose sampled answers become the RM's
  held-out preference pairs;
* ``rm_prompts.jsonl`` (``n_rm``): prompts whose sampled answers become RM training pairs;
* ``ppo_prompts.jsonl`` (``n_ppo``): PPO prompts (InstructGPT also keeps the RM and PPO
  prompt sets apart).

and ``manifest.json`` holds the settings and each file's SHA-256. The checker is
:func:`two_digit_addition` (a built-in short name of the reward functions: the answer is
the first integer once restatements of ``a+b`` are removed); ``just_the_number`` measures the format.

:data:`TASK` is this task in the recipe's interface (:class:`~nemo_rlhf.tasks.task.Task`:
``python -m launchers.demo --task nemo_rlhf.tasks.addition:TASK``; ``--task smollm2``, the
default, is the same task on SmolLM2).

Preference pairs come from the model's own samples (the InstructGPT recipe, with the
checker as the labeller): :func:`build_preference_pairs` turns scored samples into
``{"prompt", "chosen", "rejected"}`` rows, a correct answer against an incorrect one of the
same prompt. Such pairs mostly teach an RM the *form* of a right answer (the model's right
answers are mostly ``a + b = c`` lines, its wrong ones prose), which PPO then exploits
(measured: docs/demo.md). :func:`answer_edit_pairs` adds minimal pairs that
differ only in the stated number -- a right sample against the same text with a near-miss
number, a wrong sample against the same text with the right sum -- so that the form alone
cannot separate chosen from rejected (counterfactual augmentation of the model's own
samples; every edit is re-checked by the checker).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from nemo_rlhf.data.answers import check_lengths, first_integer, integer_answers
from nemo_rlhf.tasks.task import Task, build_preference_pairs, edit_pairs  # noqa: F401 (build_preference_pairs: re-exported, the module docstring names it)

PROMPT = "What is {a}+{b}? Answer with just the number."
SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
"""The system message SmolLM2's chat template inserts when a conversation has none."""


@dataclass
class AdditionTaskConfig:
    """Split sizes of :func:`make_addition_dataset` (counts of prompts)."""

    seed: int = 0
    n_eval: int = 200
    n_rm: int = 512
    n_rm_val: int = 64
    n_ppo: int = 4096
    low: int = 10
    high: int = 99

    def __post_init__(self) -> None:
        total = (self.high - self.low + 1) ** 2
        need = self.n_eval + self.n_rm + self.n_rm_val + self.n_ppo
        if self.low > self.high:
            raise ValueError(f"low={self.low} > high={self.high}")
        if need > total:
            raise ValueError(f"n_eval + n_rm + n_rm_val + n_ppo = {need} prompts, but only {total} "
                             f"problems have operands in [{self.low}, {self.high}]")


def _row(a: int, b: int) -> dict:
    return {"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b), "a": a, "b": b}


def _write_jsonl(path: Path, rows: Iterable[Mapping]) -> str:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()


def make_addition_dataset(out: str | Path, cfg: AdditionTaskConfig = AdditionTaskConfig()) -> dict:
    """Write the prompt files and ``manifest.json`` under ``out``; return the manifest.

    Idempotent: when ``manifest.json`` exists with the same settings, nothing is rewritten.
    Deterministic in ``cfg.seed``; the splits are disjoint (tested).
    """
    out = Path(out)
    manifest_path = out / "manifest.json"
    settings = {"task": "two_digit_addition", **asdict(cfg)}
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("settings") == settings and all((out / f).is_file() for f in manifest["files"]):
            return manifest
    problems = [(a, b) for a in range(cfg.low, cfg.high + 1) for b in range(cfg.low, cfg.high + 1)]
    random.Random(cfg.seed).shuffle(problems)
    splits, i = {}, 0
    for name, n in (("eval.jsonl", cfg.n_eval), ("rm_val_prompts.jsonl", cfg.n_rm_val),
                    ("rm_prompts.jsonl", cfg.n_rm), ("ppo_prompts.jsonl", cfg.n_ppo)):
        splits[name] = problems[i:i + n]
        i += n
    out.mkdir(parents=True, exist_ok=True)
    files = {name: _write_jsonl(out / name, (_row(a, b) for a, b in rows)) for name, rows in splits.items()}
    manifest = {"settings": settings, "files": files}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


NEAR_MISS_OFFSETS = (-11, -10, -9, -2, -1, 1, 2, 9, 10, 11)
"""Wrong answers :func:`answer_edit_pairs` writes: the sum plus one of these (a carry or a
units-digit slip, the model's own typical errors)."""

_NUMBER_SPAN = re.compile(r"-?\d+(?:\.\d+)?")


def _answer_span(response: str, answer: int | None) -> tuple[int, int] | None:
    """Character span of the number the checker reads as the answer, or None.

    Found by editing: the first integer whose replacement changes what
    :func:`addition_answer` reads to the replacement (numbers
    inside a restated ``a + b`` are skipped by the checker, so they fail this test).
    """
    probe = -123457 if answer is None else answer + 777
    for m in _NUMBER_SPAN.finditer(response):
        edited = response[:m.start()] + str(probe) + response[m.end():]
        if addition_answer(edited) == probe:
            return m.start(), m.end()
    return None


def edit_addition_answer(prompt: str, response: str, extras: Mapping[str, Any], right: bool,
                         rng: random.Random) -> str | None:
    """The addition task's counterfactual rule (:attr:`Task.edit_answer`): the stated number
    of ``response`` (the one :func:`addition_answer` reads) replaced, in place, by a near
    miss (the sum plus one of :data:`NEAR_MISS_OFFSETS`, drawn from ``rng``) when the
    response is ``right``, else by the right sum. None when it states no number.

    Raises:
        KeyError: ``extras`` without ``answer``.
    """
    answer = int(extras["answer"])
    span = _answer_span(response, answer)
    if span is None:
        return None
    number = answer + rng.choice(NEAR_MISS_OFFSETS) if right else answer
    return response[:span[0]] + str(number) + response[span[1]:]


def answer_edit_pairs(samples: Sequence[Mapping], per_prompt: int = 1, seed: int = 0) -> list[dict]:
    """Minimal chosen/rejected pairs: a sample of the model and the same text with only
    the stated number changed (:func:`nemo_rlhf.tasks.task.edit_pairs` with
    :func:`edit_addition_answer`).

    A right sample (checker score 1) is chosen against itself with a near-miss number
    (the sum plus one of :data:`NEAR_MISS_OFFSETS`); a wrong sample that states a number is
    rejected against itself with the right sum. Samples that state no number (as the
    checker reads them) give nothing. Every edited text is re-scored by the checker
    (``two_digit_addition``) and kept only if its score flipped.

    Args:
        samples: sample rows ``{"prompt", "response", "correct", "extras": {"answer"}}``
            (:mod:`nemo_rlhf.data.sample_rows`; ``answer`` at the top level also works).
        per_prompt: pairs per prompt at most (distinct samples, shuffled by ``seed``).
        seed: seed of the sample shuffle and of the near-miss choice.

    Returns:
        ``[{"prompt", "chosen", "rejected", "answer", "edit": "wrong_sum"|"right_sum"}]``.

    Raises:
        KeyError: a row without ``answer``.
    """
    return edit_pairs(TASK, samples, per_prompt=per_prompt, seed=seed)


# --------------------------------------------------------------------------- checkers
_ADDITION = re.compile(r"(-?\d+)\s*\+\s*(-?\d+)")
_JUST_A_NUMBER = re.compile(r"-?\d+\.?")


def _expected_sums(prompts: Sequence[str], extras: Sequence[Mapping[str, Any]], fn_name: str) -> list[int]:
    out = []
    for i, (prompt, ex) in enumerate(zip(prompts, extras)):
        if "answer" in ex:
            out.append(integer_answers([ex], fn_name)[0])
            continue
        match = _ADDITION.search(prompt)
        if match is None:
            raise ValueError(f"{fn_name}: extras[{i}] has no 'answer' and prompts[{i}] has no 'a+b': {prompt[:80]!r}")
        out.append(int(match.group(1)) + int(match.group(2)))
    return out


def addition_answer(response: str) -> int | None:
    """The integer a chat answer to ``"What is a+b?"`` gives, or None.

    Restatements of a sum (``a+b``, ``a + b``) are removed first, then the first integer
    left is the answer: ``"54"``, ``"The answer is 54."`` and ``"26 + 28 = 54"`` give 54;
    ``"26+28 is 26+28, which is"`` gives None; ``"54 or 55"`` gives 54 (first answer wins,
    so hedging does not pay).
    """
    return first_integer(_ADDITION.sub(" ", response))


def two_digit_addition(prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
    """1.0 when a chat answer states the sum asked for (:func:`addition_answer`), else 0.0.

    For prompts like ``"What is 26+28? Answer with just the number."``: the expected value
    is ``extras[i]["answer"]`` when present, else the ``a+b`` found in the prompt.
    ``"54"``, ``"The answer is 54."`` and ``"26+28=54"`` score 1.0; ``"55"``, ``"26+28"``
    and ``""`` score 0.0. Raises ``ValueError`` naming the index when neither source gives
    an answer.
    """
    check_lengths(prompts, responses, extras, "two_digit_addition")
    expected = _expected_sums(prompts, extras, "two_digit_addition")
    return [1.0 if addition_answer(r) == e else 0.0 for r, e in zip(responses, expected)]


def just_the_number(prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
    """Format compliance: 1.0 when the whole response is one integer (``"54"``, ``" 54.\n"``),
    right or wrong; 0.0 otherwise (``"The answer is 54."``, ``"26+28=54"``, ``""``)."""
    check_lengths(prompts, responses, extras, "just_the_number")
    return [1.0 if _JUST_A_NUMBER.fullmatch(r.strip()) else 0.0 for r in responses]


def addition_problems(cfg: AdditionTaskConfig = AdditionTaskConfig()) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)`` problems ``{"answer", "a", "b"}``: every ``(a, b)`` shuffled by
    ``cfg.seed``; the first ``cfg.n_eval`` are held out. Split by
    :func:`~nemo_rlhf.tasks.task.write_prompt_files` (RM held-out, RM, PPO from ``train``),
    the prompt files equal :func:`make_addition_dataset`'s of the same sizes byte for byte
    (tested)."""
    problems = [(a, b) for a in range(cfg.low, cfg.high + 1) for b in range(cfg.low, cfg.high + 1)]
    random.Random(cfg.seed).shuffle(problems)
    rows = [{"answer": str(a + b), "a": a, "b": b} for a, b in problems]
    return rows[cfg.n_eval:], rows[:cfg.n_eval]


def _check(prompt: str, response: str, extras: Mapping[str, Any]) -> float:
    return two_digit_addition([prompt], [response], [extras])[0]


def _demonstrate(prompt: str, extras: Mapping[str, Any]) -> str:
    return str(extras["answer"])


_TRAIN, _HELDOUT = addition_problems()
TASK = Task(name="two_digit_addition", train=_TRAIN, heldout=_HELDOUT, prompt_template=PROMPT, check=_check,
            edit_answer=edit_addition_answer, demonstrate=_demonstrate, checker_name="two_digit_addition",
            extra_checkers=("just_the_number",), edit_labels=("wrong_sum", "right_sum"))
"""Two-digit addition in the recipe's interface: the SmolLM2 demo's task."""
