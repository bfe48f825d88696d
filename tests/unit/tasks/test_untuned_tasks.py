"""Issue 53's untuned tasks in the recipe's interface: precedence (``precedence:TASK``) and
the digit sum written from docs/tasks.md alone (``digit_sum:TASK``): their problems, the
checker, the edit rule (every edit flips the checker) and the demonstrations."""

from __future__ import annotations

import random

import pytest

from nemo_rlhf.data.sample_rows import sample_row
from nemo_rlhf.tasks.task import demonstration_rows, edit_pairs, load_task

TASKS = ("nemo_rlhf.tasks.precedence:TASK", "nemo_rlhf.tasks.digit_sum:TASK")


@pytest.mark.parametrize("spec", TASKS)
def test_heldout_is_disjoint_and_demonstrations_are_right(spec):
    task, checker = load_task(spec)
    assert checker == f"{spec}.score" and len(task.heldout) == 200 and len(task.train) == 8800
    key = "expr" if "precedence" in spec else "number"
    assert not {p[key] for p in task.heldout} & {p[key] for p in task.train}
    rows = [task.prompt_row(p) for p in task.heldout]
    assert len(demonstration_rows(task, rows)) == 200  # each checked right
    # the tiny profile reads 64 characters; its response budget is 8
    assert max(len(r["prompt"]) for r in rows) + 8 <= 64


def test_precedence_values_and_edit_rule():
    task, _ = load_task(TASKS[0])
    by_expr = {p["expr"]: p for p in (*task.train, *task.heldout)}
    assert by_expr["3+3*6"] == {"expr": "3+3*6", "answer": "21", "left_to_right": "36"}
    assert task.prompt_row(by_expr["3+3*6"])["prompt"] == "3+3*6="
    assert sum(1 for p in task.heldout if p["expr"][1] in "+-" and p["expr"][3] == "*") == 100  # a±b*c
    assert sum(1 for p in task.heldout if p["answer"] != p["left_to_right"]) == 73  # left to right is wrong
    ex = by_expr["3+3*6"]
    assert task.edit_answer("3+3*6=", "21", ex, True, random.Random(0)) == "36"
    assert task.edit_answer("3+3*6=", " 40", ex, False, random.Random(0)) == " 21"
    assert task.edit_answer("3+3*6=", "  ", ex, False, random.Random(0)) is None
    same = by_expr["2*3+1"]  # left to right is right: off by one
    assert task.edit_answer("2*3+1=", "7", same, True, random.Random(0)) in ("6", "8")


def test_digit_sum_values_checker_and_edit_pairs():
    task, _ = load_task(TASKS[1])
    assert {p["number"]: p["answer"] for p in task.train + list(task.heldout)}["4821"] == "15"
    ex = {"number": "4821", "answer": "15"}
    assert task.check("Digit sum of 4821?", " 15 ", ex) and not task.check("Digit sum of 4821?", "151", ex)
    assert task.edit_answer("", "1", {"number": "1000", "answer": "1"}, True, random.Random(0)) == "2"
    assert task.edit_answer("", "36", {"number": "9999", "answer": "36"}, True, random.Random(0)) == "35"
    rows = [sample_row("Digit sum of 4821?", r, c, 3, ex) for r, c in (("15", 1.0), ("14", 0.0), ("x", 0.0))]
    got = {(p["chosen"], p["rejected"]) for p in edit_pairs(task, rows, per_prompt=5, seed=0)}
    assert got >= {("15", "14"), ("15", "x")} and all(c == "15" for c, _ in got)
