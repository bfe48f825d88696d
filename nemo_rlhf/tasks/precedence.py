"""Demo task: one-digit arithmetic with operator precedence (``3+3*6=`` -> ``21``).

Prompts are ``a o1 b o2 c =`` with one-digit operands and ``o1, o2`` in ``+ - *``; the
answer applies ``*`` first. The classic mistake evaluates left to right (``36``). A
``precedence_fraction`` of the prompts has the form ``a±b*c``, where the mistake changes
the answer, so the task is mostly about precedence.

Files written by :func:`make_demo_dataset` (``launchers/make_demo_data.py``):

* ``sft.jsonl``: ``{"prompt", "response", "label_noise"}``; a *noisy labeller* answers
  precedence-sensitive prompts left to right at ``sft_noise_rate``, so the SFT model is
  decent but imperfect and PPO has room to improve;
* ``sft_val.jsonl``: clean SFT rows on validation prompts (validation loss, samples);
* ``preference.jsonl`` / ``preference_val.jsonl``: ``{"prompt", "chosen", "rejected",
  "rejected_kind"}``: chosen is correct, rejected is a typical mistake (left to right,
  off by one, or two digits swapped);
* ``ppo_prompts.jsonl``: ``{"prompt", "answer"}``;
* ``eval.jsonl``: ``{"prompt", "answer"}``: fixed held-out prompts, disjoint from every
  training and validation prompt;
* ``tokenizer/tokenizer.json`` + ``tokenizer/special_tokens.json``: a character-level
  tokenizer (digits, ``+ - * =``, ``<pad> <bos> <eos>``);
* ``manifest.json``: the generator settings and each file's SHA-256.

Everything is deterministic in the seed. Simplified: two operators, one-digit operands,
no parentheses, no division.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from nemo_rlhf.data.answers import check_lengths, first_integer, integer_answers
from nemo_rlhf.tasks.task import Task

OPS = ("+", "-", "*")
DIGITS = tuple(range(10))
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}
MISTAKES = ("left_to_right", "off_by_one", "digit_swap")


@dataclass
class TaskSizes:
    """The seed and the file sizes every generated demo dataset has."""

    seed: int = 0
    """Seed of every random choice."""
    n_sft: int = 4000
    """SFT training rows."""
    n_pref: int = 4000
    """Preference training pairs."""
    n_ppo: int = 2000
    """PPO prompts."""
    n_eval: int = 200
    """Held-out evaluation prompts (disjoint from all others)."""
    n_val: int = 200
    """Validation prompts (SFT and RM validation; disjoint from training and eval)."""

    def __post_init__(self) -> None:
        for key in ("n_sft", "n_pref", "n_ppo", "n_eval", "n_val"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 1")


@dataclass
class DemoTaskConfig(TaskSizes):
    """Sizes and noise of the generated demo datasets."""

    sft_noise_rate: float = 0.35
    """Probability that the SFT labeller answers a precedence-sensitive prompt left to right."""
    precedence_fraction: float = 0.5
    """Fraction of prompts of the form ``a+b*c`` / ``a-b*c``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("sft_noise_rate", "precedence_fraction"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"{key}={getattr(self, key)}: must be in [0, 1]")


# --------------------------------------------------------------------------- the task
def _apply(x: int, op: str, y: int) -> int:
    return x + y if op == "+" else x - y if op == "-" else x * y


def solve(a: int, o1: str, b: int, o2: str, c: int) -> int:
    """``a o1 b o2 c`` with ``*`` before ``+``/``-`` (left to right within a level)."""
    if o2 == "*" and o1 != "*":
        return _apply(a, o1, b * c)
    return _apply(_apply(a, o1, b), o2, c)


def left_to_right(a: int, o1: str, b: int, o2: str, c: int) -> int:
    """The classic mistake: ``(a o1 b) o2 c``."""
    return _apply(_apply(a, o1, b), o2, c)


def prompt_text(a: int, o1: str, b: int, o2: str, c: int) -> str:
    """``"3+3*6="``."""
    return f"{a}{o1}{b}{o2}{c}="


def parse_prompt(prompt: str) -> tuple[int, str, int, str, int]:
    """Inverse of :func:`prompt_text`; raises ``ValueError`` on another shape."""
    if len(prompt) != 6 or prompt[-1] != "=" or prompt[1] not in OPS or prompt[3] not in OPS \
            or not all(prompt[i].isdigit() for i in (0, 2, 4)):
        raise ValueError(f"not a demo prompt: {prompt!r}")
    return int(prompt[0]), prompt[1], int(prompt[2]), prompt[3], int(prompt[4])


def precedence_sensitive(e: tuple) -> bool:
    """Whether left-to-right evaluation gives a different answer."""
    return solve(*e) != left_to_right(*e)


def _off_by_one(n: int, rng: random.Random) -> int:
    return n + rng.choice((-1, 1))


def _digit_swap(n: int) -> int | None:
    s = str(abs(n))
    if len(s) < 2:
        return None
    swapped = int(s[:-2] + s[-1] + s[-2]) * (-1 if n < 0 else 1)
    return swapped if swapped != n else None


def mistake(e: tuple, rng: random.Random) -> tuple[int, str]:
    """A typical wrong answer and its kind: left to right (when it differs), off by one,
    or the last two digits swapped (when that changes the number)."""
    answer = solve(*e)
    kinds = ["off_by_one"]
    if _digit_swap(answer) is not None:
        kinds.append("digit_swap")
    if precedence_sensitive(e):
        kinds += ["left_to_right"] * len(kinds)  # half the mistakes on these prompts
    kind = rng.choice(kinds)
    if kind == "left_to_right":
        return left_to_right(*e), kind
    if kind == "digit_swap":
        return _digit_swap(answer), kind
    return _off_by_one(answer, rng), kind


# --------------------------------------------------------------------------- datasets
def all_expressions() -> tuple[list[tuple], list[tuple]]:
    """Every expression, split into ``(a±b*c form, other)`` in a fixed order."""
    sensitive_form, other = [], []
    for a, o1, b, o2, c in itertools.product(DIGITS, OPS, DIGITS, OPS, DIGITS):
        (sensitive_form if (o1 in "+-" and o2 == "*") else other).append((a, o1, b, o2, c))
    return sensitive_form, other


def _sample(pool: list, n: int, rng: random.Random) -> list:
    """``n`` items without replacement while the pool lasts, then again (reshuffled)."""
    out = []
    while len(out) < n:
        out += rng.sample(pool, min(len(pool), n - len(out)))
    return out


def _draw(pools: tuple[list, list], n: int, frac: float, rng: random.Random) -> list[tuple]:
    k = round(n * frac)
    items = _sample(pools[0], k, rng) + _sample(pools[1], n - k, rng)
    rng.shuffle(items)
    return items


def build_char_tokenizer_json() -> str:
    """The character-level demo tokenizer as ``tokenizer.json`` text.

    Vocabulary: ``<pad>=0 <bos>=1 <eos>=2``, digits, ``+ - * =``; one token per character;
    a character outside it fails to encode (no unknown token).
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    for ch in "0123456789+-*=":
        vocab[ch] = len(vocab)
    tok = HFTokenizer(models.WordLevel(vocab))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS.values()))
    return tok.to_str(pretty=True)


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)


def build_demo_files(cfg: DemoTaskConfig) -> dict[str, str]:
    """File name -> content of the whole demo dataset (nothing written)."""
    rng = random.Random(cfg.seed)
    sensitive_form, other = all_expressions()
    rng.shuffle(sensitive_form)
    rng.shuffle(other)
    frac = cfg.precedence_fraction

    def held_out(n):  # taken from the front of both pools, removed from training
        k = round(n * frac)
        items = sensitive_form[:k] + other[:n - k]
        del sensitive_form[:k], other[:n - k]
        rng.shuffle(items)
        return items

    eval_exprs, val_exprs = held_out(cfg.n_eval), held_out(cfg.n_val)
    pools = (sensitive_form, other)

    def sft_rows(exprs, noise):
        rows = []
        for e in exprs:
            noisy = precedence_sensitive(e) and rng.random() < noise
            answer = left_to_right(*e) if noisy else solve(*e)
            rows.append({"prompt": prompt_text(*e), "response": str(answer), "label_noise": noisy})
        return rows

    def pref_rows(exprs):
        rows = []
        for e in exprs:
            wrong, kind = mistake(e, rng)
            rows.append({"prompt": prompt_text(*e), "chosen": str(solve(*e)),
                         "rejected": str(wrong), "rejected_kind": kind})
        return rows

    def answer_rows(exprs):
        return [{"prompt": prompt_text(*e), "answer": str(solve(*e))} for e in exprs]

    files = {
        "sft.jsonl": _jsonl(sft_rows(_draw(pools, cfg.n_sft, frac, rng), cfg.sft_noise_rate)),
        "sft_val.jsonl": _jsonl(sft_rows(val_exprs, 0.0)),
        "preference.jsonl": _jsonl(pref_rows(_draw(pools, cfg.n_pref, frac, rng))),
        "preference_val.jsonl": _jsonl(pref_rows(val_exprs)),
        "ppo_prompts.jsonl": _jsonl(answer_rows(_draw(pools, cfg.n_ppo, frac, rng))),
        "eval.jsonl": _jsonl(answer_rows(eval_exprs)),
        "tokenizer/tokenizer.json": build_char_tokenizer_json(),
        "tokenizer/special_tokens.json": json.dumps(SPECIAL_TOKENS, indent=2) + "\n",
    }
    return with_manifest(files, "nemo_rlhf.tasks.precedence", cfg)


def make_demo_dataset(out: str | Path, cfg: DemoTaskConfig, force: bool = False) -> dict[str, str]:
    """Write the demo dataset into ``out``; idempotent (see :func:`write_dataset_files`).

    Returns:
        File name -> ``"written"``, ``"unchanged"`` or ``"overwritten"``.

    Raises:
        FileExistsError: existing files differ and ``force`` is False (names them).
    """
    return write_dataset_files(out, build_demo_files(cfg), force=force)


def with_manifest(files: dict[str, str], generator: str, cfg) -> dict[str, str]:
    """``files`` plus ``manifest.json``: the generator, its config and each file's SHA-256."""
    manifest = {
        "generator": generator,
        "config": asdict(cfg),
        "sha256": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(files.items())},
    }
    return {**files, "manifest.json": json.dumps(manifest, indent=2) + "\n"}


def write_dataset_files(out: str | Path, files: dict[str, str], force: bool = False) -> dict[str, str]:
    """Write ``files`` (name -> text) into ``out``, each by an atomic rename.

    Identical existing files are left untouched; if any existing file differs, nothing is
    written unless ``force``.

    Returns:
        File name -> ``"written"``, ``"unchanged"`` or ``"overwritten"``.

    Raises:
        FileExistsError: existing files differ and ``force`` is False (names them).
    """
    out = Path(out)
    status = {}
    for name, text in files.items():
        p = out / name
        if not p.exists():
            status[name] = "written"
        elif p.read_bytes() == text.encode():
            status[name] = "unchanged"
        else:
            status[name] = "overwritten"
    changed = sorted(n for n, s in status.items() if s == "overwritten")
    if changed and not force:
        raise FileExistsError(
            f"{out} holds a different dataset (differing files: {', '.join(changed)}); "
            f"pass --force to overwrite it or choose another --out"
        )
    for name, text in files.items():
        if status[name] != "unchanged":
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            # a name of this process's own: two processes writing the same folder (the ranks
            # of a job) each publish a whole file by the rename, never a half-written one
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            tmp.write_bytes(text.encode())
            tmp.replace(target)
    return status


# --------------------------------------------------------------------------- checker
def arithmetic_exact_match(prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
    """1.0 when the response *starts* (after whitespace) with the integer ``extras[i]["answer"]``.

    For completion prompts like ``"3+3*6="`` with ``{"answer": "21"}``: ``"21"``, ``" 21\\n"``
    and ``"21."`` score 1.0; ``"36"``, ``""``, ``"21.5"`` and ``"is 21"`` score 0.0;
    ``"-3"`` scores 1.0 for answer ``"-3"``. Raises ``KeyError`` / ``ValueError`` naming
    the index when an answer is missing or not an integer.
    """
    check_lengths(prompts, responses, extras, "arithmetic_exact_match")
    answers = integer_answers(extras, "arithmetic_exact_match")
    return [1.0 if first_integer(r, anchored=True) == a else 0.0 for r, a in zip(responses, answers)]


# --------------------------------------------------------------------------- the recipe's interface
def precedence_problems() -> list[dict]:
    """Every expression as a problem ``{"expr", "answer", "left_to_right"}`` (``"3+3*6"``,
    ``"21"``, ``"36"``; answers are decimal strings), alternating the ``a±b*c`` form and
    the others (so half the first 2 x 1000 are precedence-sensitive in form), each list
    shuffled with seed 0. :data:`TASK` holds out the first 200."""
    sensitive, other = all_expressions()
    rng = random.Random(0)
    rng.shuffle(sensitive)
    rng.shuffle(other)
    rest = other[len(sensitive):]
    exprs = [e for pair in zip(sensitive, other) for e in pair] + rest
    return [{"expr": f"{a}{o1}{b}{o2}{c}", "answer": str(solve(a, o1, b, o2, c)),
             "left_to_right": str(left_to_right(a, o1, b, o2, c))} for a, o1, b, o2, c in exprs]


def _check_precedence(prompt: str, response: str, extras) -> bool:
    return response.strip() == extras["answer"]


def edit_precedence_answer(prompt: str, response: str, extras, right: bool, rng: random.Random):
    """:attr:`Task.edit_answer` of :data:`TASK`: a right response's answer replaced by the
    left-to-right one (off by one where that is the same); a wrong one's stripped text by
    the right answer; None for an empty response."""
    text, answer = response.strip(), extras["answer"]
    if not text:
        return None
    if not right:
        return response.replace(text, answer)
    wrong = extras["left_to_right"] if extras["left_to_right"] != answer else str(int(answer) + rng.choice((-1, 1)))
    return response.replace(answer, wrong, 1)


_PROBLEMS = precedence_problems()
TASK = Task(name="precedence", train=_PROBLEMS[200:], heldout=_PROBLEMS[:200], prompt_template="{expr}=",
            check=_check_precedence, edit_answer=edit_precedence_answer,
            demonstrate=lambda prompt, extras: extras["answer"])
"""Operator precedence in the recipe's interface (``python -m launchers.demo --task
nemo_rlhf.tasks.precedence:TASK --model tiny``): prompt ``{expr}=``, the exact answer
checked, clean demonstrations, the edit rule's wrong answer the left-to-right one. Not
tuned on (issue 53's check, docs/tasks.md)."""
