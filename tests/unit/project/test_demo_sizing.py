"""The recipe's sizing loops (issue 53): the default demo's first draw of held-out RM samples
is enough (the loop that adds new held-out RM prompts: test_demo_heldout_prompts.py), the RM
continues while it improves (``--rm-more-rounds``), SFT while its exact match rises
(``--sft-more-rounds``), and their caps in ``rm_data/settings.json``. Stages faked
(tests/unit/project/test_demo_recipe.py's FakeStages)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import launchers.demo as demo
import launchers.gates as gates
import launchers.stages as stages
from tests.unit.project.test_demo_recipe import FakeStages, _custom


@pytest.fixture(autouse=True)
def _forget_the_task_module():
    yield
    sys.modules.pop("pkg_upper_task", None)


def _val_sample_seeds(fake) -> list[int]:
    return [int(next(c for c in cmd if c.startswith("seed=")).split("=")[1]) for cmd in fake.cmds
            if any(c.endswith("rm_val_prompts.jsonl") for c in cmd)
            and not any(c.startswith("rm_checkpoint=") for c in cmd)]  # not the RM gate's AUC draw


def _argv(tmp_path, monkeypatch, *extra):
    argv = _custom(tmp_path, monkeypatch)
    i = argv.index("--rm-heldout-sample-rounds")
    return [*argv[:i], *argv[i + 2:], *extra]  # the rounds as each test says (default 3)


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


def _rm_accuracy_by_round(fake, monkeypatch, by_exp: dict):
    """The fake RM job logs ``by_exp[<exp_dir name>]`` as its held-out pair accuracy."""
    run = fake.run

    def run_with(cmd, log):
        run(cmd, log)
        exp = next((c.split("=", 1)[1] for c in cmd if str(c).startswith("exp_manager.exp_dir=")), None)
        if "nemo_rlhf.train_rm" in cmd and exp is not None:
            (Path(exp) / "metrics.jsonl").write_text(
                json.dumps({"step": 1, "val/accuracy": by_exp[Path(exp).name]}) + "\n")

    monkeypatch.setattr(stages, "run_stage", run_with)


def _rm_runs(fake) -> list[str]:
    return [Path(next(c for c in cmd if c.startswith("exp_manager.exp_dir=")).split("=", 1)[1]).name
            for cmd in fake.cmds if "nemo_rlhf.train_rm" in cmd]


def _default(tmp_path, *extra):
    return ["--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--precision", "32", *extra]


def test_the_rm_continues_while_it_improves_and_stops_at_its_cap(tmp_path, monkeypatch, capsys):
    """The default task's fake: 64 natural held-out pairs; 50% -> 52% -> 55% -> 58% would
    go on improving, still inside chance's interval: the cap (2) stops it, the gate refuses
    the best RM (round 2's), each round continued from the one before."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    _rm_accuracy_by_round(fake, monkeypatch, {"rm": 32 / 64, "rm_more1": 33 / 64, "rm_more2": 35 / 64,
                                              "rm_more3": 37 / 64})
    assert demo.main(_default(tmp_path, "--rm-more-rounds", "2")) == 3
    assert _rm_runs(fake) == ["rm", "rm_more1", "rm_more2"] and fake.ppo == []
    rm_cmds = [c for c in fake.cmds if "nemo_rlhf.train_rm" in c]
    assert f"rm.init_from={tmp_path}/out/rm/checkpoints/step_1" in rm_cmds[1]
    assert f"rm.init_from={tmp_path}/out/rm_more1/checkpoints/step_1" in rm_cmds[2]
    assert "round 2 of at most --rm-more-rounds 2" in capsys.readouterr().out
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["rm_gate"]["heldout_pair_accuracy"] == 35 / 64
    assert [r["round"] for r in s["rm_gate"]["more_rm_rounds"]] == [1, 2]


def test_the_rm_stops_when_a_round_does_not_improve_and_keeps_the_best(tmp_path, monkeypatch, capsys):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    _rm_accuracy_by_round(fake, monkeypatch, {"rm": 33 / 64, "rm_more1": 32 / 64, "rm_more2": 1.0})
    assert demo.main(_default(tmp_path, "--force")) == 0  # default cap 2: one round, no better
    assert _rm_runs(fake) == ["rm", "rm_more1"]
    assert "no better: the RM stops here (the best: 51.6%)" in capsys.readouterr().out
    assert fake.ppo[0]["rm"] == f"{tmp_path}/out/rm/checkpoints/step_1"  # the best, the first


def test_an_rm_that_passes_the_gate_trains_its_steps_once(tmp_path, monkeypatch):
    """The default demo's RM (27/28 held-out in docs/demo.md) is not continued: its stage
    sizes stay those of the five-seed table."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_default(tmp_path)) == 0
    assert _rm_runs(fake) == ["rm"]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["rm_gate"]["passed"] is True and s["rm_gate"]["more_rm_rounds"] == []


def _sft_argv(tmp_path, monkeypatch, rounds):
    argv = _custom(tmp_path, monkeypatch)
    i = argv.index("--sft-more-rounds")
    return [*argv[:i], *argv[i + 2:], "--sft-more-rounds", str(rounds)]


def _right_by_stage(exact: dict):
    """The fake's share of right answers by the checkpoint's stage folder: the original
    model none (so SFT comes first), each SFT round ``exact[<folder>]``."""
    def right(ckpt):
        stage = Path(ckpt).parents[1].name
        return 0.0 if stage == "model" else exact[stage]
    return right


def _sft_runs(fake) -> list[str]:
    return [Path(next(c for c in cmd if c.startswith("exp_manager.exp_dir=")).split("=", 1)[1]).name
            for cmd in fake.cmds if "nemo_rlhf.train_sft" in cmd]


def test_sft_continues_while_its_exact_match_improves_and_stops_at_its_cap(tmp_path, monkeypatch, capsys):
    fake = FakeStages(monkeypatch, right=_right_by_stage({"sft": 0.25, "sft_more1": 0.5, "sft_more2": 0.75,
                                                          "sft_more3": 1.0}))
    assert demo.main(_sft_argv(tmp_path, monkeypatch, 2)) == 0
    assert _sft_runs(fake) == ["sft", "sft_more1", "sft_more2"]
    sft_cmds = [c for c in fake.cmds if "nemo_rlhf.train_sft" in c]
    assert f"sft.init_from={tmp_path}/out/sft_more1/checkpoints/step_1" in sft_cmds[2]  # each from the last
    assert all("trainer.max_steps=7" in c for c in sft_cmds)
    best = f"{tmp_path}/out/sft_more2/checkpoints/step_1"
    assert f"exp_manager.init_from={best}" in fake.ppo[0]["args"]  # PPO (and the RM) start from the best
    assert any(f"rm.init_from={best}" in c for c in fake.cmds if "nemo_rlhf.train_rm" in c)
    evals = [c for c in fake.cmds if "nemo_rlhf.evaluate" in c and any("rm_val_prompts" in x for x in c)
             and not any(x.startswith("samples_out=") for x in c)]
    assert len(evals) == 3  # each SFT model's greedy exact match on the held-out RM prompts
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(r["round"], r["exact_match"]) for r in s["sft_rounds"]] == [(0, 0.25), (1, 0.5), (2, 0.75)]
    assert "SFT round 2 of at most --sft-more-rounds 2" in capsys.readouterr().out


def test_a_run_the_rm_gate_refuses_keeps_the_sft_rounds_in_summary_json(tmp_path, monkeypatch):
    """Issue 53's precedence run (seed 1): SFT rose 21.9 -> 32.8 -> 46.9% to its cap and the
    RM gate refused; the refused run's summary.json says so (more SFT is its first remedy)."""
    FakeStages(monkeypatch, right=_right_by_stage({"sft": 0.25, "sft_more1": 0.5, "sft_more2": 0.75}),
               rm_accuracy=0.5)
    argv = [x for x in _sft_argv(tmp_path, monkeypatch, 2) if x != "--force"]
    assert demo.main(argv) == gates.RM_GATE_EXIT
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["rm_gate"]["passed"] is False
    assert [(r["round"], r["exact_match"]) for r in s["sft_rounds"]] == [(0, 0.25), (1, 0.5), (2, 0.75)]


def test_sft_at_full_exact_match_runs_no_more_rounds(tmp_path, monkeypatch, capsys):
    """Issue 53's digit sum (seed 1): the first 600 SFT steps reached 100% on the held-out RM
    prompts; a round cannot raise that, so none runs (the run spent 600 more steps on one).
    Every sample then right, there is no RM pair: a refusal (exit 3, summary.json with the
    reason and the remedies), not a bare SystemExit naming more samples of the same kind."""
    fake = FakeStages(monkeypatch, right=_right_by_stage({"sft": 1.0, "sft_more1": 1.0}))
    with pytest.raises(SystemExit) as stop:
        demo.main(_sft_argv(tmp_path, monkeypatch, 2))
    assert stop.value.code == gates.RM_GATE_EXIT and fake.ppo == []
    assert _sft_runs(fake) == ["sft"] and not any("nemo_rlhf.train_rm" in c for c in fake.cmds)
    text = capsys.readouterr().out
    assert "100.0%: no round can raise it, SFT stops here" in text
    assert "24 of 24 sampled answers to the RM prompts are right (100.0%)" in text
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(r["round"], r["exact_match"]) for r in s["sft_rounds"]] == [(0, 1.0)]
    assert s["exit_status"] == gates.RM_GATE_EXIT and s["rm_gate"]["passed"] is False
    assert s["rm_gate"]["natural_heldout_pairs"] == 0 and s["sft_heldout"]["exact_match"] == 1.0
    assert "--rm-temperature (now 0.7)" in s["rm_gate"]["remedies"][0]
    assert "near 100% leaves PPO nothing to gain" in s["rm_gate"]["remedies"][1]


def test_sft_stops_when_a_round_does_not_improve_and_keeps_the_best(tmp_path, monkeypatch, capsys):
    fake = FakeStages(monkeypatch, right=_right_by_stage({"sft": 0.5, "sft_more1": 0.5, "sft_more2": 1.0}))
    assert demo.main(_sft_argv(tmp_path, monkeypatch, 5)) == 0
    assert _sft_runs(fake) == ["sft", "sft_more1"]
    assert "no better than 50.0%: SFT stops here" in capsys.readouterr().out
    assert f"exp_manager.init_from={tmp_path}/out/sft/checkpoints/step_1" in fake.ppo[0]["args"]


# --- the sizing flags in rm_data/settings.json (a resume can tell what sizing was used) ---

SIZING = ("rm_heldout_sample_rounds", "rm_more_rounds", "sft_more_rounds")


def test_the_sizing_caps_are_recorded_and_a_resume_with_others_is_refused_naming_the_flag(tmp_path, monkeypatch):
    FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "--rm-heldout-sample-rounds", "1", "--rm-more-rounds", "0")) == 0
    path = tmp_path / "out" / "rm_data" / "settings.json"
    recorded = json.loads(path.read_text())
    assert {k: recorded[k] for k in SIZING} == {"rm_heldout_sample_rounds": 1, "rm_more_rounds": 0,
                                                "sft_more_rounds": 0}
    with pytest.raises(SystemExit, match=r"--rm-more-rounds 0 -> 2.*pass a new --out"):
        demo.main(_argv(tmp_path, monkeypatch, "--rm-heldout-sample-rounds", "1"))
    i = _argv(tmp_path, monkeypatch).index("--sft-more-rounds")
    argv = _argv(tmp_path, monkeypatch, "--rm-heldout-sample-rounds", "1", "--rm-more-rounds", "0")
    argv[i + 1] = "3"
    with pytest.raises(SystemExit, match=r"--sft-more-rounds 0 -> 3"):
        demo.main(argv)
    assert json.loads(path.read_text()) == recorded  # not overwritten


def test_a_settings_file_from_before_the_sizing_caps_says_so_and_records_them(tmp_path, capsys):
    path = tmp_path / "exp" / "rm_data" / "settings.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"rm_prompts": 256}))
    now = {"rm_prompts": 256, "rm_more_rounds": 2, "sft_more_rounds": 2}
    stages.check_stage_settings(path, now, added=("rm_more_rounds", "sft_more_rounds"))
    out = capsys.readouterr().out
    assert "written before it recorded these settings" in out and "--rm-more-rounds 2, --sft-more-rounds 2" in out
    assert json.loads(path.read_text()) == now
    with pytest.raises(SystemExit, match=r"--rm-more-rounds 2 -> 1"):  # recorded now: compared as any other
        stages.check_stage_settings(path, {**now, "rm_more_rounds": 1}, added=("rm_more_rounds", "sft_more_rounds"))


def test_sft_override_reaches_every_sft_job_of_the_recipe_after_its_own(tmp_path, monkeypatch):
    """--sft-override once applied to --task tiny only: a package.module:TASK run dropped it."""
    fake = FakeStages(monkeypatch, right=_right_by_stage({"sft": 0.25, "sft_more1": 0.5, "sft_more2": 0.5}))
    assert demo.main([*_sft_argv(tmp_path, monkeypatch, 2), "--sft-override", "optim.lr=3.0e-4",
                      "--sft-override", "trainer.max_steps=11"]) == 0
    sft_cmds = [c for c in fake.cmds if "nemo_rlhf.train_sft" in c]
    assert len(sft_cmds) == 3
    for cmd in sft_cmds:  # last, so Hydra takes the user's value over the profile's
        assert cmd[-2:] == ["optim.lr=3.0e-4", "trainer.max_steps=11"] and "trainer.max_steps=7" in cmd
    settings = json.loads((tmp_path / "out" / "rm_data" / "settings.json").read_text())
    assert settings["sft_override"] == ["optim.lr=3.0e-4", "trainer.max_steps=11"]
