"""The recipe's held-out RM sizing loop (issue 53): new held-out RM prompts until their natural
pairs are enough to measure the RM, or a budget ends.

The RM gate (:func:`launchers.gates.rm_gate`) needs ``--rm-min-heldout-pairs`` natural
held-out pairs (a right and a wrong sampled answer of one held-out RM prompt). On a task the
policy nearly solves, the first draw (``--rm-val-prompts`` prompts x
``--rm-samples-per-prompt`` samples) gives few: sorting after SFT, 97% right, gave 5-6 pairs of
64 prompts, and sampling the same 64 prompts three more times added one (docs/demo.md, "The
recipe on tasks it was not tuned on"): the same prompts give the same few wrong answers. So each
extra round samples **new** held-out prompts (:func:`new_problems`): first the task's ``train``
problems that no prompt file uses (for a fixed dataset: what ``--ppo-prompts`` left), then
``Task.generate``'s; never a prompt of ``eval.jsonl``, ``rm_prompts.jsonl`` (the RM's training
prompts), ``ppo_prompts.jsonl`` (PPO's, and SFT's demonstrations) or an earlier round. A round's
size follows the pair rate measured so far (:func:`round_size`). The loop stops at the minimum,
at ``--rm-heldout-max-prompts`` held-out prompts in all (the budget), after
``--rm-heldout-sample-rounds`` rounds, or when the task has no new problem; it prints and records
(``summary.json``'s ``rm_heldout_sizing``, :func:`size_heldout_prompts`) the prompts and samples
it used and why it stopped.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Callable

from launchers.stages import write_atomic

ROUND_MARGIN = 1.5
"""A round samples this many times the prompts the pair rate so far says the shortfall needs
(the rate is measured on few pairs: 5-6 in issue 53's sorting runs)."""

MAX_PROMPTS_PER_FIRST_DRAW = 8
"""``--rm-heldout-max-prompts`` by default: this many times ``--rm-val-prompts``. Issue 53's
sorting runs had 5-6 pairs per 64 prompts, about 3.5 times too few for 20; 8 leaves room for
a pair rate half as high, at a sampling cost of at most 8 first draws."""

GENERATE_TRIES_PER_PROBLEM = 20
"""Calls of ``Task.generate`` allowed per new problem asked for (its draws may repeat a prompt
already used; a generator that keeps repeating is out of problems)."""


def default_max_prompts(rm_val_prompts: int) -> tuple[int, str]:
    """``(--rm-heldout-max-prompts, why)`` when the flag is not given:
    :data:`MAX_PROMPTS_PER_FIRST_DRAW` times ``rm_val_prompts``."""
    value = MAX_PROMPTS_PER_FIRST_DRAW * rm_val_prompts
    return value, (f"the held-out RM sizing loop's budget: {MAX_PROMPTS_PER_FIRST_DRAW} x --rm-val-prompts "
                   f"{rm_val_prompts} held-out RM prompts in all; issue 53's sorting runs had 5-6 natural pairs a "
                   f"64-prompt draw, so 20 needed about 3.5 draws")


def prompts_of(path: Path) -> list[str]:
    """The ``prompt`` of each row of a JSONL prompt file (none when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def new_problems(task, used: set, n: int, seed: int) -> tuple[list[dict], dict]:
    """Up to ``n`` prompt rows (:meth:`~nemo_rlhf.tasks.task.Task.prompt_row`) of problems whose
    prompt is not in ``used`` and distinct from each other: the ``task.train`` problems in order,
    then ``task.generate(random.Random(seed))`` draws (at most
    :data:`GENERATE_TRIES_PER_PROBLEM` calls per problem still wanted).

    Args:
        task: a :class:`~nemo_rlhf.tasks.task.Task`.
        used: prompts already taken (every prompt file, earlier rounds); not modified.
        n: problems wanted (>= 0).
        seed: seed of the generator's ``random.Random``.

    Returns:
        ``(rows, {"from_train": k, "generated": g, "generator": bool, "generator_tries": t})``.

    Raises:
        ValueError: ``task.generate`` returned something that is not a problem of the template
            (naming ``Task.generate``).
    """
    rows, seen = [], set(used)
    for p in task.train:
        if len(rows) >= n:
            break
        row = task.prompt_row(p, "Task.train problem")
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    from_train, tries = len(rows), 0
    if task.generate is not None and len(rows) < n:
        rng, limit = random.Random(seed), GENERATE_TRIES_PER_PROBLEM * (n - len(rows))
        while len(rows) < n and tries < limit:
            tries += 1
            row = task.prompt_row(task.generate(rng), "a Task.generate problem")
            if row["prompt"] not in seen:
                seen.add(row["prompt"])
                rows.append(row)
    return rows, {"from_train": from_train, "generated": len(rows) - from_train,
                  "generator": task.generate is not None, "generator_tries": tries}


def round_size(pairs: int, wanted: int, prompts: int, floor: int, left: int) -> int:
    """New held-out prompts for the next round: :data:`ROUND_MARGIN` times the prompts the
    shortfall ``wanted - pairs`` needs at the rate ``pairs / prompts`` measured so far (without
    a pair yet: as many as ``prompts``, doubling), at least ``floor`` (a sampling job's start
    costs about what a few dozen prompts do), at most ``left`` (the budget). Returns >= 0."""
    if pairs > 0:
        need = math.ceil(ROUND_MARGIN * (wanted - pairs) * prompts / pairs)
    else:
        need = prompts
    return max(0, min(left, max(floor, need)))


def size_heldout_prompts(a, task, rm_data: Path, data: Path, rows: list[dict],
                         sample: Callable[[Path, Path, int], list[dict]], count_pairs: Callable) -> tuple:
    """The sizing loop (module docstring). ``rows``: the first draw's samples
    (``samples_val.jsonl``); ``sample(prompts_file, out_stem, seed) -> rows`` samples a prompt
    file as the first draw was (``a.rm_samples_per_prompt`` at ``a.rm_temperature``);
    ``count_pairs(rows)``: the natural held-out pairs of samples. Round ``r`` writes
    ``<rm_data>/val_prompts_new<r>.jsonl`` and samples it with seed ``1000 + r`` into
    ``samples_val_new<r>.jsonl``.

    Args:
        a: the recipe's flags: ``rm_min_heldout_pairs`` (the minimum), ``rm_val_prompts``
            (the first draw, also a round's least size), ``rm_heldout_max_prompts`` (the
            budget: held-out prompts in all) and ``rm_heldout_sample_rounds`` (the round cap).

    Returns:
        ``(samples file of the held-out pairs, record)``: ``samples_val.jsonl`` when no round
        ran, else ``samples_val_all.jsonl`` (every draw's rows); the record
        (``summary.json``'s ``rm_heldout_sizing``): ``natural_heldout_pairs``,
        ``min_heldout_pairs``, ``prompts`` (in all), ``first_prompts``, ``new_prompts``,
        ``new_from_train``, ``new_generated``, ``samples``, ``rounds`` (per round: ``round``,
        ``new_prompts``, ``from_train``, ``generated``, ``samples``, ``natural_heldout_pairs``
        after it), ``max_prompts``, ``max_rounds``, ``stopped`` (``enough``, ``max_prompts``,
        ``max_rounds`` or ``no_new_problems``) and ``reason`` (the printed line's words).
    """
    wanted, budget, max_rounds = a.rm_min_heldout_pairs, a.rm_heldout_max_prompts, a.rm_heldout_sample_rounds
    first = prompts_of(data / "rm_val_prompts.jsonl")
    used = set(first)
    for name in ("eval.jsonl", "rm_prompts.jsonl", "ppo_prompts.jsonl"):
        used.update(prompts_of(data / name))
    count, prompts, rounds, stopped, reason = count_pairs(rows), len(first), [], None, ""
    while True:
        if count >= wanted:
            stopped, reason = "enough", f"{count} >= --rm-min-heldout-pairs {wanted}"
        elif len(rounds) >= max_rounds:
            stopped, reason = "max_rounds", f"the round cap, --rm-heldout-sample-rounds {max_rounds}"
        elif prompts >= budget:
            stopped, reason = "max_prompts", (f"the prompt budget: {prompts} held-out RM prompts, "
                                              f"--rm-heldout-max-prompts {budget}")
        if stopped:
            break
        r = len(rounds) + 1
        n = round_size(count, wanted, prompts, a.rm_val_prompts, budget - prompts)
        file = rm_data / f"val_prompts_new{r}.jsonl"
        if file.exists():  # a rerun: the round's prompts as it drew them (its samples are reused too)
            problems = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
            got = _sources(task, problems)
        else:
            problems, got = new_problems(task, used, n, seed=1000 + r)
            if not problems:
                stopped, reason = "no_new_problems", _no_problems(task, got, data)
                break
            _write(file, problems)
        used.update(p["prompt"] for p in problems)
        print(f"{count} natural held-out RM pairs, fewer than --rm-min-heldout-pairs {wanted}: sampling "
              f"{len(problems)} new held-out RM prompts ({got['from_train']} unused Task.train problems, "
              f"{got['generated']} from Task.generate; round {r} of at most --rm-heldout-sample-rounds "
              f"{max_rounds}, {prompts + len(problems)} of at most --rm-heldout-max-prompts {budget} "
              f"held-out prompts)", flush=True)
        new = sample(file, rm_data / f"samples_val_new{r}", 1000 + r)
        rows = rows + new
        count, prompts = count_pairs(rows), prompts + len(problems)
        rounds.append({"round": r, "new_prompts": len(problems), "from_train": got["from_train"],
                       "generated": got["generated"], "samples": len(new), "natural_heldout_pairs": count})
    record = {"natural_heldout_pairs": count, "min_heldout_pairs": wanted, "prompts": prompts,
              "first_prompts": len(first), "new_prompts": prompts - len(first),
              "new_from_train": sum(x["from_train"] for x in rounds),
              "new_generated": sum(x["generated"] for x in rounds), "samples": len(rows), "rounds": rounds,
              "max_prompts": budget, "max_rounds": max_rounds, "stopped": stopped, "reason": reason}
    if rounds or count < wanted:
        print(f"held-out RM sizing: {count} natural held-out pairs from {prompts} prompts ({len(first)} first + "
              f"{record['new_prompts']} new: {record['new_from_train']} unused Task.train problems, "
              f"{record['new_generated']} from Task.generate), {len(rows)} samples; stopped: {reason}", flush=True)
    if not rounds:
        return rm_data / "samples_val.jsonl", record
    combined = rm_data / "samples_val_all.jsonl"
    _write(combined, rows)
    return combined, record


def _sources(task, problems: list[dict]) -> dict:
    """:func:`new_problems`'s counts for prompt rows drawn before (a rerun's round file)."""
    train = {task.prompt_row(p)["prompt"] for p in task.train}
    k = sum(p["prompt"] in train for p in problems)
    return {"from_train": k, "generated": len(problems) - k, "generator": task.generate is not None,
            "generator_tries": 0}


def _no_problems(task, got: dict, data: Path) -> str:
    if got["generator"]:
        return (f"the task has no new problem: every Task.train problem is a prompt already and "
                f"Task.generate gave no unused one in {got['generator_tries']} tries")
    return (f"the task has no new problem: each of its {len(task.train)} Task.train problems is a prompt "
            f"already (held-out RM, RM, PPO prompts in {data}) and it has no Task.generate; give it one, "
            f"or leave problems unused with a lower --ppo-prompts")


def _write(path: Path, rows: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
