"""The task interface (nemo_rlhf/tasks/task.py): addition and reversal as tasks of it, the
recipe's data steps written against it (prompt files, natural and counterfactual pairs,
demonstrations), one sample-row schema for both sample files, and the refusals that name
the field."""

from __future__ import annotations

import json
import random

import pytest

from nemo_rlhf.data.sample_rows import SAMPLE_ROW_KEYS, row_extras, sample_row
from nemo_rlhf.tasks.task import (PROMPT_FILES, Task, build_preference_pairs, count_right,
                                  demonstration_rows, edit_pairs, load_task, write_prompt_files)


def _upper(**kw) -> Task:
    """A small task: upper-case a word; the edit rule changes the last letter."""
    words = ["cat", "dog", "sun", "hat", "pen", "cup", "box", "map"]
    fields = dict(
        name="upper", train=[{"word": w, "answer": w.upper()} for w in words[2:]],
        heldout=[{"word": w, "answer": w.upper()} for w in words[:2]], prompt_template="Upper: {word} ->",
        check=lambda p, r, ex: r.strip() == ex["answer"],
        edit_answer=lambda p, r, ex, right, rng: (r[:-1] + ("Z" if r[-1] != "Z" else "Y")) if right
        else ex["answer"],
        demonstrate=lambda p, ex: ex["answer"])
    return Task(**{**fields, **kw})


def test_addition_prompt_files_are_the_old_generators_byte_for_byte(tmp_path):
    """The demo's default data is unchanged by the interface: the same four files, the
    same bytes, for the default sizes and for others."""
    from nemo_rlhf.tasks.addition import TASK, AdditionTaskConfig, make_addition_dataset

    for n_rm, n_rm_val, n_ppo in ((256, 64, 4096), (40, 10, 100)):
        old = make_addition_dataset(tmp_path / f"old{n_rm}", AdditionTaskConfig(n_rm=n_rm, n_rm_val=n_rm_val,
                                                                                 n_ppo=n_ppo))
        new = write_prompt_files(TASK, tmp_path / f"new{n_rm}", n_rm=n_rm, n_rm_val=n_rm_val, n_ppo=n_ppo)
        assert new["files"] == old["files"]
        for name in PROMPT_FILES:
            assert (tmp_path / f"new{n_rm}" / name).read_bytes() == (tmp_path / f"old{n_rm}" / name).read_bytes()


def test_reversal_heldout_is_the_tiny_demos_eval_set():
    from nemo_rlhf.tasks.reversal import TASK, ReversalTaskConfig, build_reversal_files

    files = build_reversal_files(ReversalTaskConfig())
    rows = [json.loads(line) for line in files["eval.jsonl"].splitlines()]
    assert [TASK.prompt_row(p)["prompt"] for p in TASK.heldout] == [r["prompt"] for r in rows]
    assert not {p["number"] for p in TASK.heldout} & {p["number"] for p in TASK.train}
    row = TASK.prompt_row(TASK.train[0])
    extras = {k: v for k, v in row.items() if k != "prompt"}
    assert TASK.right(row["prompt"], extras["answer"], extras)
    wrong = TASK.edit_answer(row["prompt"], extras["answer"], extras, True, random.Random(0))
    assert wrong != extras["answer"] and not TASK.right(row["prompt"], wrong, extras)
    assert TASK.edit_answer(row["prompt"], "99", extras, False, random.Random(0)) == extras["answer"]
    assert TASK.edit_answer(row["prompt"], "no number", extras, False, random.Random(0)) is None


def test_prompt_files_split_train_in_order_and_refuse_too_few_problems_naming_the_flags(tmp_path):
    task = _upper()
    m = write_prompt_files(task, tmp_path, n_rm=2, n_rm_val=1, n_ppo=10)
    rows = {n: [json.loads(x) for x in (tmp_path / n).read_text().splitlines()] for n in PROMPT_FILES}
    assert [r["word"] for r in rows["eval.jsonl"]] == ["cat", "dog"]
    assert [r["word"] for r in rows["rm_val_prompts.jsonl"]] == ["sun"]
    assert [r["word"] for r in rows["rm_prompts.jsonl"]] == ["hat", "pen"]
    assert [r["word"] for r in rows["ppo_prompts.jsonl"]] == ["cup", "box", "map"]
    assert rows["eval.jsonl"][0] == {"prompt": "Upper: cat ->", "word": "cat", "answer": "CAT"}
    assert m["settings"]["task"] == "upper"
    with pytest.raises(ValueError, match=r"6 train problems for --rm-val-prompts 1 \+ --rm-prompts 5"):
        write_prompt_files(task, tmp_path / "b", n_rm=5, n_rm_val=1, n_ppo=10)


@pytest.mark.parametrize("kw, needle", [
    ({"prompt_template": "Upper: {wrd}"}, "names 'wrd' but Task.train[0] has only ['answer', 'word']"),
    ({"train": []}, "Task.train is empty"),
    ({"heldout": [{"prompt": "x", "word": "a", "answer": "A"}]}, "Task.heldout[0] has a 'prompt' field"),
    ({"heldout": ["cat"]}, "Task.heldout[0] is a str, not a dict"),
    ({"check": "exact"}, "Task.check must be callable"),
    ({"demonstrate": 3}, "Task.demonstrate must be callable or None"),
    ({"generate": "words"}, "Task.generate must be callable or None"),
    ({"name": ""}, "Task.name=''"),
])
def test_a_bad_task_is_refused_naming_the_field(kw, needle):
    with pytest.raises((ValueError, TypeError)) as err:
        _upper(**kw)
    assert needle in str(err.value)


def test_score_is_the_reward_function_form_and_refuses_a_bad_check():
    task = _upper()
    assert task.score(["p", "p"], ["CAT", "cat"], [{"answer": "CAT"}] * 2) == [1.0, 0.0]
    with pytest.raises(ValueError, match="same length"):
        task.score(["p"], ["CAT", "x"], [{"answer": "CAT"}])
    bad = _upper(check=lambda p, r, ex: "yes")
    with pytest.raises(ValueError, match="Task.check returned 'yes'; it must return a bool or a number"):
        bad.score(["p"], ["r"], [{}])


def test_natural_and_edit_pairs_read_both_sample_schemas_alike():
    """Rows of nemo_rlhf.evaluate before the schema (the prompt row's fields at the top
    level) and after (``extras``) give the same pairs."""
    from nemo_rlhf.tasks.addition import TASK, answer_edit_pairs

    old = [{"prompt": "What is 26+28?", "response": r, "correct": c, "response_length": 3, "answer": "54",
            "a": 26, "b": 28} for r, c in (("54", 1.0), ("The answer is 55.", 0.0), ("26 + 28 = 54", 1.0))]
    new = [sample_row(r["prompt"], r["response"], r["correct"], 3, {"answer": "54", "a": 26, "b": 28})
           for r in old]
    assert list(new[0])[:5] == list(SAMPLE_ROW_KEYS) and row_extras(new[0])["answer"] == "54"
    assert build_preference_pairs(old) == build_preference_pairs(new) != []
    assert build_preference_pairs(new)[0]["answer"] == "54"
    assert answer_edit_pairs(old, per_prompt=3) == answer_edit_pairs(new, per_prompt=3) != []
    assert edit_pairs(TASK, new, per_prompt=3) == answer_edit_pairs(new, per_prompt=3)


def test_edit_pairs_keep_only_edits_the_checker_flips():
    task = _upper()
    rows = [sample_row("Upper: cat ->", r, c, 3, {"word": "cat", "answer": "CAT"})
            for r, c in (("CAT", 1.0), ("CAX", 0.0), ("cat", 0.0))]
    pairs = edit_pairs(task, rows, per_prompt=5, seed=0)
    got = {(p["chosen"], p["rejected"], p["edit"]) for p in pairs}
    assert got == {("CAT", "CAZ", "wrong_answer"), ("CAT", "CAX", "right_answer"),
                   ("CAT", "cat", "right_answer")}
    never_flips = _upper(edit_answer=lambda p, r, ex, right, rng: r + " ")  # still right / still wrong
    assert edit_pairs(never_flips, rows, per_prompt=5) == []
    with pytest.raises(ValueError, match="has no Task.edit_answer"):
        edit_pairs(_upper(edit_answer=None), rows)
    assert count_right(rows) == 1


def _episode_row(prompt: str, calls: str, tool: str, final: str, correct: float) -> dict:
    """A sample row of a two-turn episode, as nemo_rlhf.evaluate writes it with env.name."""
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": calls},
                {"role": "tool", "content": tool}, {"role": "assistant", "content": final}]
    return sample_row(prompt, final, correct, 3, {"answer": "CAT"}, messages=messages, turns=2)


def test_episode_rows_give_pairs_of_whole_conversations_that_the_rm_loader_reads(tmp_path):
    """Rows with ``messages`` (#51): natural pairs compare the two conversations (a right
    final answer read off the tool against a wrong one; identical conversations merged, the
    verdict the row's ``correct``), edit pairs differ only in the final answer; neither has
    ``prompt`` (the row format of docs/data-formats.md, "Whole conversations"), and the
    preference loader reads them as conversation pairs whose shared prefix is the first
    turn and the tool's output."""
    from nemo_rlhf.data.jsonl import CONVERSATION_FIELDS, read_jsonl

    task = _upper()
    rows = [_episode_row("Upper: cat ->", "call(upper, cat)", "CAT", "CAT", 1.0),
            _episode_row("Upper: cat ->", "call(upper, cat)", "CAT", "CAT", 1.0),  # the same episode again
            _episode_row("Upper: cat ->", "call(upper, cat)", "CAT", "CAX", 0.0),
            _episode_row("Upper: cat ->", "cat", "cat", "cat", 0.0)]
    natural = build_preference_pairs(rows, max_pairs_per_prompt=4)
    assert len(natural) == 2 and all(set(p) == {"chosen", "rejected", "answer"} for p in natural)
    assert all(p["chosen"] == rows[0]["messages"] and p["answer"] == "CAT" for p in natural)
    assert sorted(p["rejected"][-1]["content"] for p in natural) == ["CAX", "cat"]
    edits = edit_pairs(task, rows, per_prompt=5, seed=0)
    got = {(p["chosen"][-1]["content"], p["rejected"][-1]["content"], p["edit"]) for p in edits}
    assert got == {("CAT", "CAZ", "wrong_answer"), ("CAT", "CAX", "right_answer"), ("CAT", "cat", "right_answer")}
    for p in edits:
        assert "prompt" not in p and p["chosen"][:-1] == p["rejected"][:-1]  # only the final answer differs
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in natural + edits))
    loaded, _, report = read_jsonl(path, "preference")
    assert len(loaded) == 5 and report.invalid == 0 and all(r[CONVERSATION_FIELDS[0]][2]["role"] == "tool" for r in loaded)
    bad = [dict(rows[2], messages=rows[2]["messages"][:-1] + [{"role": "assistant", "content": "other"}])]
    with pytest.raises(ValueError, match="whose messages do not end with its response"):
        edit_pairs(task, bad)


def test_demonstrations_are_checked_and_a_task_without_them_is_named():
    rows = [{"prompt": "Upper: cat ->", "word": "cat", "answer": "CAT"}]
    assert demonstration_rows(_upper(), rows) == [{"prompt": "Upper: cat ->", "response": "CAT"}]
    with pytest.raises(ValueError, match="Task.demonstrate gave 'cat' for 'Upper: cat ->', which Task.check "
                                         "marks wrong"):
        demonstration_rows(_upper(demonstrate=lambda p, ex: "cat"), rows)
    with pytest.raises(ValueError, match="has no Task.demonstrate"):
        demonstration_rows(_upper(demonstrate=None), rows)


def test_segmented_demonstrations_are_checked_on_their_last_policy_segment():
    rows = [{"prompt": "Upper: cat ->", "word": "cat", "answer": "CAT"}]

    def segs(final, last="policy"):
        return lambda p, ex: [{"kind": "policy", "text": "lookup(cat)"}, {"kind": "env", "text": "CAT"},
                              {"kind": last, "text": final}]

    assert demonstration_rows(_upper(demonstrate=segs("CAT")), rows) == [
        {"prompt": "Upper: cat ->", "segments": segs("CAT")("", {})}]
    with pytest.raises(ValueError, match="which Task.check marks wrong"):  # the env's text is not the answer
        demonstration_rows(_upper(demonstrate=segs("cat")), rows)
    with pytest.raises(ValueError, match="ending with a policy segment"):
        demonstration_rows(_upper(demonstrate=segs("CAT", last="env")), rows)
    with pytest.raises(ValueError, match="segments must be"):
        demonstration_rows(_upper(demonstrate=lambda p, ex: [{"kind": "tool", "text": "CAT"}]), rows)


def test_load_task_names_the_checker_the_stages_use(tmp_path, monkeypatch):
    (tmp_path / "my_upper_task.py").write_text(
        "from nemo_rlhf.tasks.task import Task\n"
        "TASK = Task(name='u', train=[{'w': 'a'}, {'w': 'b'}], heldout=[{'w': 'c'}], prompt_template='{w}',\n"
        "            check=lambda p, r, ex: r == ex['w'].upper())\n"
        "NOT_A_TASK = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task, checker = load_task("my_upper_task:TASK")
    assert task.name == "u" and checker == "my_upper_task:TASK.score"
    from nemo_rlhf.reward.functions import get_reward_function

    assert get_reward_function(checker)(["c"], ["C"], [{"w": "c"}]) == [1.0]  # what the stages call
    from nemo_rlhf.tasks.addition import TASK as ADDITION

    assert load_task("nemo_rlhf.tasks.addition:TASK") == (ADDITION, "two_digit_addition")
    with pytest.raises(ValueError, match="is a int, not a nemo_rlhf.tasks.task.Task"):
        load_task("my_upper_task:NOT_A_TASK")
    with pytest.raises(ValueError, match="give 'package.module:ATTRIBUTE'"):
        load_task("my_upper_task")
    with pytest.raises(AttributeError, match="has no attribute 'TASKS'"):
        load_task("my_upper_task:TASKS")
    with pytest.raises(ImportError, match="cannot import 'no_such_task_module'"):
        load_task("no_such_task_module:TASK")


def test_the_example_task_of_docs_tasks_md_builds_and_its_rules_hold(tmp_path, monkeypatch):
    """docs/tasks.md's whole example, as written there: a valid Task whose edits flip the
    checker and whose demonstrations are right."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "tasks.md").read_text()
    (code,) = re.findall(r"```python\n(# my_tasks/sorting.py.*?)```", text, flags=re.S)
    (tmp_path / "my_tasks").mkdir()
    (tmp_path / "my_tasks" / "sorting.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    task, checker = load_task("my_tasks.sorting:TASK")
    assert checker == "my_tasks.sorting:TASK.score" and len(task.heldout) == 200 and len(task.train) > 2000
    rows = [task.prompt_row(p) for p in task.train[:50]]
    demos = demonstration_rows(task, rows)
    samples = [sample_row(d["prompt"], d["response"], 1.0, 5, {k: v for k, v in r.items() if k != "prompt"})
               for d, r in zip(demos, rows)]
    samples += [sample_row(s["prompt"], s["response"][::-1], 0.0, 5, s["extras"]) for s in samples]
    pairs = edit_pairs(task, samples, per_prompt=2)
    assert len(pairs) > 60 and {p["edit"] for p in pairs} == {"wrong_answer", "right_answer"}
    assert all(task.right(p["prompt"], p["chosen"], {"answer": p["answer"]})
               and not task.right(p["prompt"], p["rejected"], {"answer": p["answer"]}) for p in pairs)
    import random  # its generator (more held-out RM prompts, launchers/rm_heldout.py): new problems, right answers
    rng = random.Random(0)
    made = [task.prompt_row(task.generate(rng)) for _ in range(100)]
    assert len({r["prompt"] for r in made}) > 95
    assert all(task.right(r["prompt"], r["answer"], r) and not task.right(r["prompt"], r["word"], r)
               for r in made if r["word"] != r["answer"])
