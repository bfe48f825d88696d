"""The held-out RM sizing loop (launchers/rm_heldout.py, issue 53): while the natural held-out
pairs are fewer than ``--rm-min-heldout-pairs``, each round samples NEW held-out RM prompts
(unused ``Task.train`` problems, then ``Task.generate``'s; never a prompt of the RM's, PPO's or
the evaluation's files), stopping at the minimum, at ``--rm-heldout-max-prompts``, at
``--rm-heldout-sample-rounds`` or when the task has no new problem, and says which in its
printed line and ``summary.json``'s ``rm_heldout_sizing``. Stages faked
(tests/unit/project/test_demo_recipe.py's FakeStages: per prompt 4 samples, the first
``right * 4`` right, every right one alike and every wrong one alike, so a prompt with both
gives exactly one natural pair)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import launchers.demo as demo
import launchers.stages as stages
from tests.unit.project.test_demo_recipe import FakeStages

TASK_MODULE = '''
import random
from nemo_rlhf.tasks.task import Task

WORDS = ["w%03d" % i for i in range(30)]
PROBLEMS = [{"word": w, "answer": w.upper()} for w in WORDS]
# train: 26 problems; 3 held-out RM prompts + 6 RM prompts + --ppo-prompts 10 leave 7 unused


def generate(rng):
    # half its draws repeat a problem the prompt files or train already hold: they must be skipped
    w = rng.choice(WORDS) if rng.random() < 0.5 else "g%04d" % rng.randrange(10000)
    return {"word": w, "answer": w.upper()}


TASK = Task(name="gen", train=PROBLEMS[4:], heldout=PROBLEMS[:4], prompt_template="Upper: {word} ->",
            check=lambda p, r, ex: r == ex["answer"],
            edit_answer=lambda p, r, ex, right, rng: r.lower() if right else ex["answer"],
            demonstrate=lambda p, ex: ex["answer"], generate=generate)
FIXED = Task(name="fixed", train=PROBLEMS[4:], heldout=PROBLEMS[:4], prompt_template="Upper: {word} ->",
             check=lambda p, r, ex: r == ex["answer"], demonstrate=lambda p, ex: ex["answer"])
'''


@pytest.fixture(autouse=True)
def _forget_the_task_module():
    yield
    sys.modules.pop("pkg_gen_task", None)


def _argv(tmp_path, monkeypatch, *extra, task="TASK"):
    (tmp_path / "pkg_gen_task.py").write_text(TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    return ["--task", f"pkg_gen_task:{task}", "--model", "tiny", "--out", str(tmp_path / "out"),
            "--rm-prompts", "6", "--rm-val-prompts", "3", "--ppo-prompts", "10", "--sft-steps", "7",
            "--force", "--sft-more-rounds", "0", *extra]


def _prompts(path: Path) -> list[str]:
    return [json.loads(x)["prompt"] for x in path.read_text().splitlines() if x.strip()]


def _heldout_sample_seeds(fake) -> list[int]:
    """Seeds of the held-out RM samples: the first draw (rm_val_prompts.jsonl) and each round's."""
    return [int(next(c for c in cmd if c.startswith("seed=")).split("=")[1]) for cmd in fake.cmds
            if any(c.startswith("samples_out=") and "samples_val" in c for c in cmd)]


def _summary(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "summary.json").read_text())


def test_new_heldout_prompts_are_distinct_unused_and_never_training_prompts(tmp_path, monkeypatch, capsys):
    """3 pairs of the first 3 prompts (one a prompt), 20 wanted: round 1 asks for 1.5 x 17 / (3 / 3)
    = 26 new prompts: the 7 unused train problems in order, then 19 generated, none of them a
    prompt of any file (the generator repeats train problems half the time) nor of each other."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "--rm-heldout-max-prompts", "100")) == 0
    data, rm_data = tmp_path / "out" / "data", tmp_path / "out" / "rm_data"
    new = _prompts(rm_data / "val_prompts_new1.jsonl")
    assert len(new) == 26 == len(set(new))
    taken = set()
    for name in ("eval.jsonl", "rm_prompts.jsonl", "ppo_prompts.jsonl", "rm_val_prompts.jsonl"):
        taken |= set(_prompts(data / name))
    assert len(taken) == 4 + 6 + 10 + 3 and not taken & set(new)
    assert new[:7] == [f"Upper: w{i:03d} ->" for i in range(23, 30)]  # the unused train problems, in order
    assert all(p.startswith("Upper: g") for p in new[7:])  # then Task.generate's
    assert _heldout_sample_seeds(fake) == [2, 1001]
    assert f"data={rm_data}/val_prompts_new1.jsonl" in next(c for c in fake.cmds if "seed=1001" in c)
    assert len((rm_data / "samples_val_all.jsonl").read_text().splitlines()) == (3 + 26) * 4
    s = _summary(tmp_path)
    assert s["rm_pairs"]["val"] == 29 and s["rm_gate"]["natural_heldout_pairs"] == 29
    z = s["rm_heldout_sizing"]
    assert (z["prompts"], z["first_prompts"], z["new_prompts"], z["new_from_train"], z["new_generated"]) == \
        (29, 3, 26, 7, 19)
    assert z["rounds"] == [{"round": 1, "new_prompts": 26, "from_train": 7, "generated": 19, "samples": 104,
                            "natural_heldout_pairs": 29}]
    assert (z["samples"], z["stopped"], z["max_prompts"], z["max_rounds"]) == (116, "enough", 100, 3)
    text = capsys.readouterr().out
    assert "sampling 26 new held-out RM prompts (7 unused Task.train problems, 19 from Task.generate; round 1" \
        in text
    assert "held-out RM sizing: 29 natural held-out pairs from 29 prompts (3 first + 26 new: 7 unused " \
           "Task.train problems, 19 from Task.generate), 116 samples; stopped: 29 >= --rm-min-heldout-pairs 20" \
        in text


def test_a_rerun_reuses_the_rounds_prompts_and_samples(tmp_path, monkeypatch):
    """A rerun in the same --out (every stage skipped when its output exists) samples nothing
    again and records the round's prompts as drawn, even where it would now draw another count
    (25 wanted: 1.5 x 22 = 33 prompts, but the file holds round 1's 26)."""
    FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    argv = _argv(tmp_path, monkeypatch, "--rm-heldout-max-prompts", "100")
    assert demo.main(argv) == 0
    first = _summary(tmp_path)["rm_heldout_sizing"]
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main([*argv, "--rm-min-heldout-pairs", "25"]) == 0
    assert _heldout_sample_seeds(fake) == []
    again = _summary(tmp_path)["rm_heldout_sizing"]
    assert again["rounds"] == first["rounds"] and (again["new_prompts"], again["new_from_train"]) == (26, 7)
    assert (again["natural_heldout_pairs"], again["stopped"]) == (29, "enough")


def test_the_loop_stops_at_the_minimum(tmp_path, monkeypatch):
    """7 wanted, 3 of 3 prompts: round 1 asks for max(3, 1.5 x 4 x 3 / 3) = 6 prompts, 9 pairs:
    no round 2 (the cap is 5, the budget 100)."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "--rm-min-heldout-pairs", "7", "--rm-heldout-sample-rounds",
                           "5", "--rm-heldout-max-prompts", "100")) == 0
    assert _heldout_sample_seeds(fake) == [2, 1001]
    z = _summary(tmp_path)["rm_heldout_sizing"]
    assert (z["natural_heldout_pairs"], z["prompts"], z["stopped"], len(z["rounds"])) == (9, 9, "enough", 1)


def test_the_loop_stops_at_the_prompt_budget(tmp_path, monkeypatch, capsys):
    """A budget of 10 held-out prompts: round 1 gets 7 (26 wanted), then no more; the RM gate's
    refusal (10 pairs < 20; --force goes on) names the budget first."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "--rm-heldout-max-prompts", "10")) == 0
    assert _heldout_sample_seeds(fake) == [2, 1001]
    z = _summary(tmp_path)["rm_heldout_sizing"]
    assert (z["prompts"], z["natural_heldout_pairs"], z["stopped"], z["max_prompts"]) == (10, 10, "max_prompts", 10)
    assert "stopped: the prompt budget: 10 held-out RM prompts, --rm-heldout-max-prompts 10" \
        in capsys.readouterr().out
    settings = json.loads((tmp_path / "out" / "rm_data" / "settings.json").read_text())
    assert settings["rm_heldout_max_prompts"] == 10  # a rerun with another budget is refused
    remedies = _summary(tmp_path)["rm_gate"]["remedies"]  # 10 pairs < 20: the gate names the budget
    assert "more new held-out RM prompts: --rm-heldout-max-prompts (now 10), --rm-heldout-sample-rounds (now 3)" \
        in remedies[0]


def test_the_loop_stops_at_its_round_cap(tmp_path, monkeypatch, capsys):
    """New prompts whose samples are all right add no pair: 3 pairs after each round (round 2:
    1.5 x 17 x 29 / 3 = 246.5 -> 247 prompts); the cap of 2 rounds stops it with the budget
    (1000) not spent."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    run = fake.run

    def all_right_on_new_prompts(cmd, log):
        run(cmd, log)
        args = dict(c.split("=", 1) for c in cmd if "=" in c and not c.startswith(("-", "+")))
        if "val_prompts_new" in args.get("data", ""):
            path = Path(args["samples_out"])
            rows = [json.loads(x) for x in path.read_text().splitlines()]
            for r in rows:
                r["response"], r["correct"] = r["extras"]["answer"], 1.0
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    monkeypatch.setattr(stages, "run_stage", all_right_on_new_prompts)
    assert demo.main(_argv(tmp_path, monkeypatch, "--rm-heldout-sample-rounds", "2",
                           "--rm-heldout-max-prompts", "1000")) == 0
    assert _heldout_sample_seeds(fake) == [2, 1001, 1002]
    z = _summary(tmp_path)["rm_heldout_sizing"]
    assert [r["new_prompts"] for r in z["rounds"]] == [26, 247]  # the pair rate falls: the next round grows
    assert (z["natural_heldout_pairs"], z["prompts"], z["stopped"]) == (3, 276, "max_rounds")
    r1, r2 = (set(_prompts(tmp_path / "out" / "rm_data" / f"val_prompts_new{r}.jsonl")) for r in (1, 2))
    assert not r1 & r2
    assert "stopped: the round cap, --rm-heldout-sample-rounds 2" in capsys.readouterr().out


def test_a_fixed_dataset_draws_what_is_left_and_says_when_it_runs_out(tmp_path, monkeypatch, capsys):
    """No Task.generate: round 1 takes the 7 unused train problems (26 wanted), round 2 finds none."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, task="FIXED")) == 0
    assert _heldout_sample_seeds(fake) == [2, 1001]
    z = _summary(tmp_path)["rm_heldout_sizing"]
    assert (z["prompts"], z["new_from_train"], z["new_generated"], z["stopped"]) == (10, 7, 0, "no_new_problems")
    text = capsys.readouterr().out
    assert ("stopped: the task has no new problem: each of its 26 Task.train problems is a prompt already "
            "(held-out RM, RM, PPO prompts in") in text
    assert "it has no Task.generate; give it one, or leave problems unused with a lower --ppo-prompts" in text
    assert z["reason"] in text


def test_enough_pairs_in_the_first_draw_add_no_prompt(tmp_path, monkeypatch, capsys):
    """The default demo's path (28-35 natural held-out pairs in its first draw): no round. The
    budget not given: 8 x --rm-val-prompts, printed with its reason."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "--rm-min-heldout-pairs", "3")) == 0
    assert _heldout_sample_seeds(fake) == [2]
    assert not list((tmp_path / "out" / "rm_data").glob("val_prompts_new*"))
    z = _summary(tmp_path)["rm_heldout_sizing"]
    assert (z["prompts"], z["rounds"], z["stopped"], z["reason"]) == (3, [], "enough", "3 >= --rm-min-heldout-pairs 3")
    text = capsys.readouterr().out
    assert "held-out RM sizing:" not in text and z["max_prompts"] == 24
    assert "default: rm_heldout_max_prompts = 24 (the held-out RM sizing loop's budget: 8 x --rm-val-prompts 3" \
        in text


def test_a_round_is_sized_by_the_pair_rate_within_its_floor_and_the_budget():
    """Hand-computed: issue 53's sorting draw, 5 pairs of 64 prompts, 20 wanted: 1.5 x 15 x 64 / 5
    = 288 new prompts; no pair yet: as many again as so far; the floor and what is left bound it."""
    from launchers.rm_heldout import round_size

    assert round_size(5, 20, 64, 64, 448) == 288
    assert round_size(6, 20, 64, 64, 448) == 224  # 1.5 x 14 x 64 / 6 = 224.0
    assert round_size(7, 20, 64, 64, 448) == 179  # 178.29 -> 179
    assert round_size(0, 20, 64, 64, 448) == 64
    assert round_size(19, 20, 64, 64, 448) == 64  # 1.5 x 1 x 64 / 19 = 5.05: the floor
    assert round_size(5, 20, 64, 64, 100) == 100  # the budget's rest
    assert round_size(5, 20, 64, 64, 0) == 0


def test_new_problems_skip_used_and_repeated_prompts_and_name_their_source():
    from launchers.rm_heldout import GENERATE_TRIES_PER_PROBLEM, new_problems
    from nemo_rlhf.tasks.task import Task

    calls = []

    def generate(rng):
        calls.append(1)
        return {"word": rng.choice(["a", "b", "c", "d"])}

    task = Task(name="t", train=[{"word": w} for w in "abc"], heldout=[{"word": "z"}], prompt_template="{word}?",
                check=lambda p, r, ex: True, generate=generate)
    rows, got = new_problems(task, {"a?"}, 2, seed=0)
    assert [r["prompt"] for r in rows] == ["b?", "c?"] and got["from_train"] == 2 and not calls
    rows, got = new_problems(task, {"a?"}, 5, seed=0)
    assert [r["prompt"] for r in rows] == ["b?", "c?", "d?"]  # the generator's only new word: 'd'
    assert (got["from_train"], got["generated"], got["generator_tries"]) == (2, 1, 3 * GENERATE_TRIES_PER_PROBLEM)
