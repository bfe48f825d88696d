"""The task interface: what the demo recipe (``python -m launchers.demo --task module:TASK``)
needs to know about a verifiable task, and the recipe's data steps written against it.

A :class:`Task` is data plus a few functions (every field typed below; docs/tasks.md shows a
whole one):

* ``train`` / ``heldout``: *problems*, each a JSON-able dict of fields (``{"a": 26, "b": 28,
  "answer": "54"}``). The prompt row of a problem is ``{"prompt": prompt_template.format(
  **problem), **problem}``; every field but ``prompt`` reaches the checker as ``extras``
  (as the PPO trainer and ``nemo_rlhf.evaluate`` pass a dataset row's other fields).
  ``heldout`` is the evaluation set; the recipe splits ``train`` into the RM's held-out
  prompts, the RM's prompts and the PPO prompts, in that order (:func:`write_prompt_files`).
* ``check(prompt, response, extras) -> bool | float``: the verifier; 1 (True) is right.
  It labels the model's samples into preference pairs and scores the held-out set; it never
  enters the PPO reward unless ``--reward checker|both``.
* ``edit_answer(prompt, response, extras, right, rng) -> str | None`` (optional): the
  counterfactual rule. Given a sample the checker marked ``right``, the same text with only
  its answer changed to a wrong one; given a wrong one, the same text with the right answer
  (or None: only right -> wrong is required). None when the response states no answer.
  The recipe re-checks every edit and keeps it only if the checker's verdict flipped
  (:func:`edit_pairs`): pairs in the same wording, which make an RM score the answer, not
  the form (docs/demo.md).
* ``demonstrate(prompt, extras) -> str | list[dict]`` (optional): a right response, written
  for SFT; for a task with an environment, the episode after the prompt as segments
  ``[{"kind": "policy" | "env", "text": str}, ...]`` (the SFT row's ``segments``: the loss
  trains on the policy's turns only, never on the tool's output;
  :mod:`nemo_rlhf.data.datasets`). The recipe uses it only when the model cannot do the
  task (no right answer among its samples, so no natural pair): SFT on demonstrations
  first, then RM and PPO, InstructGPT's order (Ouyang et al. 2022, sec. 3.5). Without it,
  such a task is refused, naming this field.

The subprocess stages (``nemo_rlhf.evaluate``, the PPO trainer) name the checker by a
string: ``checker_name`` (``package.module:function`` or a built-in short name, of the
``fn(prompts, responses, extras) -> list[float]`` form) when the task gives one, else
the task's own batch method ``<module>:<attribute>.score`` (:meth:`Task.score`), found from
the ``--task`` path. The task's module must therefore be importable by those processes:
from the working directory or ``PYTHONPATH`` (the recipe passes its own ``sys.path`` on).

* ``generate(rng) -> problem`` (optional): one new problem of the task's kind, drawn with
  ``rng`` (a ``random.Random``). The recipe's held-out RM sizing loop
  (``launchers/rm_heldout.py``) takes new held-out RM prompts from the ``train`` problems no
  prompt file uses, then from this; problems whose prompt any prompt file already holds are
  skipped, so a generator may repeat itself. Without it a task with a fixed dataset stops
  growing its held-out RM prompts when ``train`` is used up (the recipe says so).
* ``env`` (optional): an environment (an ``env.name``) PPO's rollouts run, e.g. a tool the
  policy calls (``digit_calculator``, :mod:`nemo_rlhf.tasks.calc`); the recipe passes it
  and ``env_overrides`` to the PPO stage and to every ``nemo_rlhf.evaluate`` of the
  recipe (its samples, SFT gate and held-out evaluations then run episodes and score the
  final answer; docs/tasks.md, "A tool task").

Simplified: one checker per task (plus ``extra_checkers`` that are only reported), scores
thresholded at 0.5 into right / wrong for the pairs, and the prompt is one ``str.format``
template (no few-shot examples).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from nemo_rlhf.data.answers import check_lengths
from nemo_rlhf.data.sample_rows import row_extras

__all__ = ["Task", "PROMPT_FILES", "build_preference_pairs", "count_right", "demonstration_rows",
           "edit_pairs", "env_overrides", "load_task", "write_prompt_files"]

Problem = Mapping[str, Any]
"""One problem: a JSON-able dict of fields (no ``prompt`` key: the template makes it)."""
Checker = Callable[[str, str, Mapping[str, Any]], Union[bool, float]]
AnswerEdit = Callable[[str, str, Mapping[str, Any], bool, random.Random], Optional[str]]
Demonstrator = Callable[[str, Mapping[str, Any]], Union[str, list]]
Generator = Callable[[random.Random], Problem]

PROMPT_FILES = ("eval.jsonl", "rm_val_prompts.jsonl", "rm_prompts.jsonl", "ppo_prompts.jsonl")
"""The prompt files :func:`write_prompt_files` writes, in the order the problems fill them."""


@dataclass(frozen=True)
class Task:
    """A verifiable task for the demo recipe (module docstring: what each field is for)."""

    name: str
    """Short name (reports, the manifest)."""
    train: Sequence[Problem]
    """Problems for the RM's held-out prompts, the RM's prompts and PPO, split in that order."""
    heldout: Sequence[Problem]
    """Problems of the held-out evaluation (the before/after table, the gold guard)."""
    prompt_template: str
    """``str.format`` template over a problem's fields: the prompt text."""
    check: Checker
    """``(prompt, response, extras) -> bool | float``: 1.0 / True is right."""
    edit_answer: Optional[AnswerEdit] = None
    """``(prompt, response, extras, right, rng) -> str | None``: the counterfactual edit."""
    demonstrate: Optional[Demonstrator] = None
    """``(prompt, extras) -> str | [{"kind", "text"}]``: a right response (or, with an
    environment, the episode's segments), for SFT when the model cannot do the task."""
    generate: Optional[Generator] = None
    """``(rng: random.Random) -> problem``: one new problem (a dict of the template's fields),
    for more held-out RM prompts than ``train`` has left (module docstring)."""
    checker_name: Optional[str] = None
    """``module:function`` or a built-in short name the stages name (None: ``<task>.score``)."""
    extra_checkers: tuple = ()
    """Reward functions (as ``checker_name``) reported beside the checker (e.g. ``just_the_number``)."""
    max_new_tokens: Optional[int] = None
    """Response budget in tokens (None: the model profile's, ``launchers/recipe.py``)."""
    max_seq_length: Optional[int] = None
    """``data.max_seq_length`` (tokens, prompt and response or whole episode) of the recipe's
    SFT, RM and PPO jobs (None: the model profile's, ``launchers/recipe.py``): a tool task's
    episode (prompt with the tool's definition, call, tool output, answer) can be longer than
    the profile's single-turn length."""
    edit_labels: tuple = ("wrong_answer", "right_answer")
    """The ``edit`` field of an edit pair: right made wrong, wrong made right."""
    env: Optional[str] = None
    """The environment PPO's rollouts run (an ``env.name``: a built-in short name or a
    ``package.module:function`` factory, :mod:`nemo_rlhf.envs.config`); None: single-turn
    rollouts. The recipe passes ``env.name=<env>`` and :attr:`env_overrides` to PPO; the
    checker then scores an episode's final answer (its last policy turn)."""
    env_overrides: tuple = ()
    """More ``env.*`` overrides of the PPO stage when :attr:`env` is set (e.g.
    ``("env.max_turns=2",)``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Task.name={self.name!r}: must be a non-empty string")
        for key in ("check",):
            if not callable(getattr(self, key)):
                raise TypeError(f"Task {self.name!r}: Task.{key} must be callable, got "
                                f"{type(getattr(self, key)).__name__}")
        for key in ("edit_answer", "demonstrate", "generate"):
            value = getattr(self, key)
            if value is not None and not callable(value):
                raise TypeError(f"Task {self.name!r}: Task.{key} must be callable or None, got "
                                f"{type(value).__name__}")
        if self.env is not None and (not isinstance(self.env, str) or not self.env):
            raise ValueError(f"Task {self.name!r}: Task.env={self.env!r}: must be None or an env.name "
                             f"(a built-in short name or a 'package.module:function' factory)")
        for i, o in enumerate(self.env_overrides):
            if not isinstance(o, str) or not o.startswith("env.") or "=" not in o or o.startswith("env.name="):
                raise ValueError(f"Task {self.name!r}: Task.env_overrides[{i}]={o!r}: must be an "
                                 f"'env.<key>=<value>' override other than env.name (Task.env sets it)")
        if self.env_overrides and self.env is None:
            raise ValueError(f"Task {self.name!r}: Task.env_overrides={self.env_overrides!r} without "
                             f"Task.env: set Task.env (the environment they configure)")
        for key in ("train", "heldout"):
            problems = getattr(self, key)
            if len(problems) == 0:
                raise ValueError(f"Task {self.name!r}: Task.{key} is empty; it needs problems "
                                 f"(dicts of the template's fields)")
            for i, p in enumerate(problems[:1]):  # the first of each: the rest are alike
                self.prompt_row(p, f"Task.{key}[{i}]")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"Task {self.name!r}: Task.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.max_seq_length is not None and self.max_seq_length < 2:
            raise ValueError(f"Task {self.name!r}: Task.max_seq_length={self.max_seq_length}: must be >= 2 "
                             f"(or None: the model profile's)")
        if len(self.edit_labels) != 2:
            raise ValueError(f"Task {self.name!r}: Task.edit_labels={self.edit_labels!r}: two names")

    def prompt_row(self, problem: Problem, where: str = "problem") -> dict:
        """``{"prompt": template.format(**problem), **problem}``.

        Raises:
            ValueError: ``problem`` is not a dict, has a ``prompt`` field, or lacks a field
                the template names (naming ``where`` and the fields it has).
        """
        if not isinstance(problem, Mapping):
            raise ValueError(f"Task {self.name!r}: {where} is a {type(problem).__name__}, not a dict "
                             f"of fields")
        if "prompt" in problem:
            raise ValueError(f"Task {self.name!r}: {where} has a 'prompt' field; the prompt is "
                             f"Task.prompt_template filled with the problem's fields")
        try:
            prompt = self.prompt_template.format(**problem)
        except (KeyError, IndexError) as exc:
            raise ValueError(f"Task {self.name!r}: Task.prompt_template={self.prompt_template!r} names "
                             f"{exc} but {where} has only {sorted(problem)}") from None
        return {"prompt": prompt, **problem}

    def right(self, prompt: str, response: str, extras: Mapping[str, Any]) -> bool:
        """The checker's verdict as a bool (a score > 0.5 is right)."""
        return _score(self.check(prompt, response, extras), self.name) > 0.5

    def score(self, prompts: list[str], responses: list[str], extras: list[dict]) -> list[float]:
        """The checker in the reward-function form the stages call:
        ``fn(prompts, responses, extras) -> list[float]`` (``[batch]``; True -> 1.0).

        Raises:
            ValueError: lists of different lengths, or a score that is not a finite number.
        """
        check_lengths(prompts, responses, extras, f"task {self.name!r}")
        return [_score(self.check(p, r, e), self.name) for p, r, e in zip(prompts, responses, extras)]


def env_overrides(task: Task) -> list[str]:
    """The PPO stage's ``env`` overrides of ``task``: ``["env.name='<env>'", *env_overrides]``
    when :attr:`Task.env` is set, else ``[]`` (single-turn PPO)."""
    if task.env is None:
        return []
    return [f"env.name='{task.env}'", *task.env_overrides]


def _score(value: Any, name: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"task {name!r}: Task.check returned {value!r}; it must return a bool or a "
                         f"number") from None
    if not math.isfinite(out):
        raise ValueError(f"task {name!r}: Task.check returned {out}; it must be finite")
    return out


def load_task(spec: str) -> tuple[Task, str]:
    """The :class:`Task` at ``"package.module:ATTRIBUTE"`` and the ``checker`` string the
    stages name it by (``checker_name``, else ``"package.module:ATTRIBUTE.score"``).

    Raises:
        ValueError: ``spec`` without ``:``, or an attribute that is not a :class:`Task`
            (naming it); ``ImportError`` / ``AttributeError`` naming the module/attribute.
    """
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--task {spec!r}: give 'package.module:ATTRIBUTE' (a nemo_rlhf.tasks.task.Task), "
                         f"or one of the built-in demos 'smollm2' and 'tiny'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"--task {spec!r}: cannot import {module_name!r} (is it on PYTHONPATH or in the "
                          f"working directory?): {exc}") from exc
    task: Any = module
    for part in attr.split("."):
        if not hasattr(task, part):
            raise AttributeError(f"--task {spec!r}: module {module_name!r} has no attribute {attr!r}")
        task = getattr(task, part)
    if not isinstance(task, Task):
        raise ValueError(f"--task {spec!r} is a {type(task).__name__}, not a nemo_rlhf.tasks.task.Task")
    return task, task.checker_name or f"{module_name}:{attr}.score"


def _jsonl(rows: Sequence[Mapping]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def write_prompt_files(task: Task, out: str | Path, n_rm: int, n_rm_val: int, n_ppo: int) -> dict:
    """Write :data:`PROMPT_FILES` and ``manifest.json`` under ``out``; return the manifest.

    ``eval.jsonl`` holds every ``heldout`` problem; ``train`` fills ``rm_val_prompts.jsonl``
    (the first ``n_rm_val``), ``rm_prompts.jsonl`` (the next ``n_rm``) and
    ``ppo_prompts.jsonl`` (the next ``n_ppo`` at most, at least one). Rows are
    :meth:`Task.prompt_row`. Idempotent: a manifest with the same settings and files is kept.

    Raises:
        ValueError: ``train`` too small for ``n_rm_val + n_rm`` and one PPO prompt (naming
            the counts and the launcher's flags), or a bad problem.
    """
    out = Path(out)
    need = n_rm_val + n_rm + 1
    if min(n_rm, n_rm_val, n_ppo) < 1 or len(task.train) < need:
        raise ValueError(f"task {task.name!r}: {len(task.train)} train problems for --rm-val-prompts "
                         f"{n_rm_val} + --rm-prompts {n_rm} + at least 1 PPO prompt (--ppo-prompts "
                         f"{n_ppo}); each must be >= 1: lower the flags or give the task more problems")
    splits = {"eval.jsonl": list(task.heldout), "rm_val_prompts.jsonl": task.train[:n_rm_val],
              "rm_prompts.jsonl": task.train[n_rm_val:n_rm_val + n_rm],
              "ppo_prompts.jsonl": task.train[n_rm_val + n_rm:n_rm_val + n_rm + n_ppo]}
    texts = {name: _jsonl([task.prompt_row(p, f"Task.{'heldout' if name == 'eval.jsonl' else 'train'}"
                                              f" problem") for p in rows])
             for name, rows in splits.items()}
    files = {name: hashlib.sha256(t.encode()).hexdigest() for name, t in texts.items()}
    manifest = {"settings": {"task": task.name, "n_rm": n_rm, "n_rm_val": n_rm_val, "n_ppo": n_ppo},
                "files": files}
    path = out / "manifest.json"
    if path.is_file() and json.loads(path.read_text()) == manifest and all(
            (out / f).is_file() for f in files):
        return manifest
    out.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (out / name).write_text(text, encoding="utf-8")
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def count_right(samples: Sequence[Mapping]) -> int:
    """Samples the checker marked right (``correct > 0.5``)."""
    return sum(float(r["correct"]) > 0.5 for r in samples)


def build_preference_pairs(samples: Sequence[Mapping], max_pairs_per_prompt: int = 4,
                           seed: int = 0) -> list[dict]:
    """Natural chosen/rejected pairs from scored samples of the model itself.

    Args:
        samples: sample rows (:mod:`nemo_rlhf.data.sample_rows`: ``prompt``, ``response``,
            ``correct``, ``extras``; several per prompt), as ``nemo_rlhf.evaluate`` writes
            them with ``samples_out``; ``correct`` is the checker's 1.0 or 0.0.
        max_pairs_per_prompt: cap on pairs per prompt, so that easy prompts with many
            distinct answers do not dominate.
        seed: seed of the pairing shuffle.

    Returns:
        ``[{"prompt", "chosen", "rejected", "answer"}]``: each a distinct correct response
        against a distinct incorrect one of the same prompt (identical texts are merged
        first; ``answer``: the row's, None without one). Prompts whose samples are all
        correct or all wrong give no pair. Rows of multi-turn episodes (a ``messages``
        list, as ``nemo_rlhf.evaluate`` writes with ``env.name``) give pairs of whole
        conversations, ``{"chosen": [messages], "rejected": [messages], "answer"}`` (no
        ``prompt``: the messages hold it; docs/data-formats.md, "Whole conversations"),
        identical conversations merged; the right/wrong verdict is still the row's
        ``correct`` (the checker on the final answer).
    """
    by_prompt: dict[str, dict] = {}
    for row in samples:
        entry = by_prompt.setdefault(row["prompt"], {"good": [], "bad": [],
                                                     "answer": row_extras(row).get("answer")})
        bucket = entry["good"] if float(row["correct"]) > 0.5 else entry["bad"]
        item = _pair_side(row)
        if item not in bucket:
            bucket.append(item)
    rng = random.Random(seed)
    pairs = []
    for prompt, entry in by_prompt.items():
        good, bad = entry["good"][:], entry["bad"][:]
        rng.shuffle(good)
        rng.shuffle(bad)
        n = min(max_pairs_per_prompt, len(good) * len(bad))
        combos = [(g, b) for b in bad for g in good][:n] if good and bad else []
        for g, b in combos:
            pairs.append({**({} if isinstance(g, list) else {"prompt": prompt}), "chosen": g, "rejected": b,
                          "answer": entry["answer"]})
    return pairs


def _pair_side(row: Mapping):
    """What a sample row puts on one side of a pair: its ``messages`` (a copy) when it is a
    multi-turn episode's, else its ``response`` text."""
    messages = row.get("messages")
    return [dict(m) for m in messages] if isinstance(messages, list) else row["response"]


def edit_pairs(task: Task, samples: Sequence[Mapping], per_prompt: int = 1, seed: int = 0) -> list[dict]:
    """Counterfactual pairs: a sample of the model against itself with only its answer
    changed by ``task.edit_answer`` (a right sample is chosen over its wrong edit; a wrong
    one is rejected against its right edit). Every edit is re-checked by ``task.check`` and
    kept only if the verdict flipped.

    Args:
        task: a task with ``edit_answer``.
        samples: sample rows as for :func:`build_preference_pairs`.
        per_prompt: pairs per prompt at most (distinct samples, shuffled by ``seed``).
        seed: seed of the sample shuffle and of the rng handed to ``edit_answer``.

    Returns:
        ``[{"prompt", "chosen", "rejected", ("answer",) "edit"}]``: ``answer`` when the row
        has one (as a string); ``edit`` is ``task.edit_labels[0]`` (right made wrong) or
        ``[1]`` (wrong made right). A multi-turn episode's row (``messages``): the final
        answer is edited (the row's ``response``, the last assistant message) and the pair
        is two whole conversations that differ only there, without ``prompt``
        (:func:`build_preference_pairs`).

    Raises:
        ValueError: a task without ``edit_answer``.
    """
    if task.edit_answer is None:
        raise ValueError(f"task {task.name!r} has no Task.edit_answer: no counterfactual pairs")
    rng = random.Random(seed)
    by_prompt: dict[str, list[Mapping]] = {}
    for row in samples:
        rows = by_prompt.setdefault(row["prompt"], [])
        if all(r["response"] != row["response"] for r in rows):
            rows.append(row)
    pairs = []
    for prompt, rows in by_prompt.items():
        rows = rows[:]
        rng.shuffle(rows)
        made = 0
        for row in rows:
            if made >= per_prompt:
                break
            extras, text = row_extras(row), row["response"]
            right = float(row["correct"]) > 0.5
            edited = task.edit_answer(prompt, text, extras, right, rng)
            if edited is None or edited == text or task.right(prompt, edited, extras) == right:
                continue
            side = _pair_side(row)
            if isinstance(side, list):  # the conversation, its final answer edited
                if side[-1] != {"role": "assistant", "content": text}:
                    raise ValueError(f"edit_pairs: a sample row of {prompt!r} whose messages do not end with "
                                     f"its response as the assistant's message: {side[-1]!r}")
                text, edited = side, side[:-1] + [{"role": "assistant", "content": edited}]
            chosen, rejected = (text, edited) if right else (edited, text)
            pairs.append({**({} if isinstance(side, list) else {"prompt": prompt}),
                          "chosen": chosen, "rejected": rejected,
                          **({"answer": str(extras["answer"])} if "answer" in extras else {}),
                          "edit": task.edit_labels[0] if right else task.edit_labels[1]})
            made += 1
    return pairs


def demonstration_rows(task: Task, rows: Sequence[Mapping]) -> list[dict]:
    """SFT rows of prompt rows (``{"prompt", **fields}``) by ``task.demonstrate``: ``{"prompt",
    "response"}`` for a text, ``{"prompt", "segments"}`` for a list of segments (a
    multi-turn demonstration, the SFT row format of :mod:`nemo_rlhf.data.jsonl`). Each is
    checked: a text by the checker; segments by the checker on the last policy segment's
    text (the final answer, as PPO scores an episode); a wrong one is an error.

    Raises:
        ValueError: the task has no ``demonstrate`` (naming the field), a demonstration that
            is neither a string nor a list of ``{"kind": "policy" | "env", "text": str}``
            ending with a policy segment, or one the checker marks wrong (naming the prompt).
    """
    if task.demonstrate is None:
        raise ValueError(f"task {task.name!r} has no Task.demonstrate: no SFT demonstrations")
    out = []
    for row in rows:
        extras = {k: v for k, v in row.items() if k != "prompt"}
        demo = task.demonstrate(row["prompt"], extras)
        if isinstance(demo, (list, tuple)):
            segments = [dict(s) if isinstance(s, Mapping) else s for s in demo]
            ok = bool(segments) and all(isinstance(s, dict) and set(s) == {"kind", "text"}
                                        and s["kind"] in ("policy", "env") and isinstance(s["text"], str)
                                        for s in segments) and segments[-1]["kind"] == "policy"
            if not ok:
                raise ValueError(f"task {task.name!r}: Task.demonstrate gave {demo!r} for {row['prompt']!r}: "
                                 f"segments must be [{{'kind': 'policy' | 'env', 'text': str}}, ...] ending "
                                 f"with a policy segment")
            final, made = segments[-1]["text"], {"prompt": row["prompt"], "segments": segments}
        else:
            final, made = demo, {"prompt": row["prompt"], "response": demo}
        if not isinstance(final, str) or not task.right(row["prompt"], final, extras):
            raise ValueError(f"task {task.name!r}: Task.demonstrate gave {demo!r} for "
                             f"{row['prompt']!r}, which Task.check marks wrong")
        out.append(made)
    return out
