"""The RM data's held-out sizing loop (launchers/recipe.py ``_enough_heldout_pairs``, issue
53): the held-out RM prompts are sampled again while their natural pairs are fewer than
``--rm-min-heldout-pairs``, stopping when there are enough or at ``--rm-heldout-sample-rounds``
(the cap). Stages faked (tests/unit/project/test_demo_recipe.py's FakeStages)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import launchers.demo as demo
import launchers.stages as stages
from tests.unit.project.test_demo_recipe import FakeStages, _custom


@pytest.fixture(autouse=True)
def _forget_the_task_module():
    yield
    sys.modules.pop("pkg_upper_task", None)


def _val_sample_seeds(fake) -> list[int]:
    return [int(next(c for c in cmd if c.startswith("seed=")).split("=")[1]) for cmd in fake.cmds
            if any(c.endswith("rm_val_prompts.jsonl") for c in cmd)]


def _argv(tmp_path, monkeypatch, *extra):
    argv = _custom(tmp_path, monkeypatch)
    i = argv.index("--rm-heldout-sample-rounds")
    return [*argv[:i], *argv[i + 2:], *extra]  # the rounds as each test says (default 3)


def test_the_heldout_sampling_stops_at_its_cap(tmp_path, monkeypatch, capsys):
    """FakeStages answers every round alike: 3 natural held-out pairs (3 prompts) however
    often it samples, so the loop runs its 2 rounds and stops."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "--rm-min-heldout-pairs", "20",
                           "--rm-heldout-sample-rounds", "2")) == 0
    assert _val_sample_seeds(fake) == [2, 1001, 1002]
    out = capsys.readouterr().out
    assert "round 2 of at most --rm-heldout-sample-rounds 2" in out and "round 3" not in out
    assert "after 2 more rounds: 3 natural held-out RM pairs (the cap" in out
    rows = (tmp_path / "out" / "rm_data" / "samples_val_all.jsonl").read_text().splitlines()
    assert len(rows) == 3 * 12  # three draws of 3 prompts x 4 samples
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["rm_pairs"]["val"] == 3 and s["rm_gate"]["natural_heldout_pairs"] == 3


def test_the_heldout_sampling_stops_when_the_pairs_are_enough(tmp_path, monkeypatch, capsys):
    """Each extra round brings one new wrong answer per prompt (one more natural pair a
    prompt): 3 -> 6 -> 9 pairs; at least 7 wanted: two rounds, not the cap of 5."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    run = fake.run

    def varied(cmd, log):
        run(cmd, log)
        args = dict(c.split("=", 1) for c in cmd if "=" in c and not c.startswith(("-", "+")))
        if "samples_out" in args and int(args["seed"]) >= 1000:
            path = Path(args["samples_out"])
            rows = [json.loads(x) for x in path.read_text().splitlines()]
            for r in rows:
                if not r["correct"]:
                    r["response"] += args["seed"]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    monkeypatch.setattr(stages, "run_stage", varied)
    assert demo.main(_argv(tmp_path, monkeypatch, "--rm-min-heldout-pairs", "7",
                           "--rm-heldout-sample-rounds", "5")) == 0
    assert _val_sample_seeds(fake) == [2, 1001, 1002]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["rm_pairs"]["val"] == 9


def test_enough_pairs_in_the_first_draw_sample_nothing_more(tmp_path, monkeypatch):
    """The default demo's path (its first draw: 28-35 natural held-out pairs, docs/demo.md):
    no extra round, the held-out pairs built from samples_val.jsonl as before."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "--rm-min-heldout-pairs", "3")) == 0
    assert _val_sample_seeds(fake) == [2]
    assert not (tmp_path / "out" / "rm_data" / "samples_val_all.jsonl").exists()
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(["--out", str(tmp_path / "d"), "--data", str(tmp_path / "dd"), "--precision", "32"]) == 0
    assert _val_sample_seeds(fake) == [2]
