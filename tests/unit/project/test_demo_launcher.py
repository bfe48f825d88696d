"""launchers.demo: an output folder made with other RM-stage settings is refused, not reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launchers.demo import _check_stage_settings


def test_stage_settings_are_recorded_then_a_change_is_refused_naming_the_flag(tmp_path):
    path = tmp_path / "exp" / "rm_data" / "settings.json"
    _check_stage_settings(path, {"rm_edit_pairs": 0, "rm_prompts": 256})
    assert json.loads(path.read_text()) == {"rm_edit_pairs": 0, "rm_prompts": 256}
    _check_stage_settings(path, {"rm_edit_pairs": 0, "rm_prompts": 256})  # same: continues
    with pytest.raises(SystemExit, match=r"--rm-edit-pairs 0 -> 2.*pass a new --out"):
        _check_stage_settings(path, {"rm_edit_pairs": 2, "rm_prompts": 256})
    assert json.loads(path.read_text())["rm_edit_pairs"] == 0  # not overwritten


def test_the_smollm2_rm_stage_overrides_compose_into_the_rm_job(tmp_path, monkeypatch):
    """The demo's RM command line is accepted by Hydra and the schema (it once passed
    ``rm.extra_val_files={...}``, which Hydra refuses, and only the whole demo found out)."""
    from argparse import Namespace

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import nemo_rlhf.train_rm  # noqa: F401  (registers the schema)
    from launchers.demo import REPO, RM_STATS_PAIRS, main, smollm2_rm_overrides
    from nemo_rlhf.trainers.rm import RMRunConfig

    import launchers.demo as demo

    defaults = {}
    monkeypatch.setattr(demo, "run_smollm2", lambda a: defaults.update(vars(a)) or 0)
    assert main([]) == 0  # the flags' defaults: what `make demo` runs
    a = Namespace(**defaults)
    assert (a.reward, a.rm_edit_pairs, a.rm_freeze_layers) == ("rm", 4, 10)
    overrides = smollm2_rm_overrides(a, tmp_path / "rm", "/ckpt/step_0", tmp_path / "train.jsonl", 39,
                                     tmp_path / "rm_data", "/tok")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = OmegaConf.to_object(compose("rm", overrides=overrides))
    assert isinstance(cfg, RMRunConfig)
    assert cfg.rm.extra_val_files == {"same_form": str(tmp_path / "rm_data" / "same_form_val.jsonl")}
    assert (cfg.rm.freeze_layers, cfg.rm.init_from, cfg.rm.reward_stats_max_pairs) == (10, "/ckpt/step_0",
                                                                                      RM_STATS_PAIRS)
    assert (cfg.trainer.max_steps, cfg.optim.lr, cfg.model.num_layers) == (39, a.rm_lr, 30)
    assert cfg.data.system_prompt.startswith("You are a helpful AI assistant")


def test_an_evaluation_file_is_reused_only_for_the_same_checkpoint(tmp_path, monkeypatch):
    """A refresh round continues the PPO run: its final evaluation must be of the new final
    checkpoint, not the file left by the previous demo run."""
    import launchers.demo as demo

    calls = []

    def fake_run(cmd, log):
        calls.append(cmd)
        ckpt = next(c.split("=", 1)[1] for c in cmd if c.startswith("checkpoint="))
        out = next(c.split("=", 1)[1] for c in cmd if c.startswith("out="))
        Path(out).write_text(json.dumps({"checkpoint": ckpt, "accuracy": len(calls)}))

    monkeypatch.setattr(demo, "_run", fake_run)
    out, log = tmp_path / "ppo_eval.json", tmp_path / "eval.log"
    step10, step15 = tmp_path / "ckpt" / "step_10", tmp_path / "ckpt" / "step_15"
    assert demo._evaluate(step10, tmp_path, out, log)["accuracy"] == 1
    assert demo._evaluate(step10, tmp_path, out, log)["accuracy"] == 1  # reused
    assert demo._evaluate(step15, tmp_path, out, log)["accuracy"] == 2  # a newer checkpoint
    assert len(calls) == 2


def test_refresh_flags_that_cannot_work_are_refused_naming_them(tmp_path):
    from argparse import Namespace

    from launchers.demo import _first_stage_steps

    a = Namespace(refresh_rounds=1, refresh_ppo_steps=None)
    assert _first_stage_steps(a, 10) == 5 and a.refresh_ppo_steps == 5  # split evenly
    assert _first_stage_steps(Namespace(refresh_rounds=0, refresh_ppo_steps=None), 10) == 10
    with pytest.raises(SystemExit, match=r"trainer.max_steps=10 leaves no PPO step.*--refresh-rounds 2 "
                                         r"--refresh-ppo-steps 5"):
        _first_stage_steps(Namespace(refresh_rounds=2, refresh_ppo_steps=5), 10)


def test_rm_reward_stats_cap_must_be_positive():
    from nemo_rlhf.trainers.rm import RMConfig

    with pytest.raises(ValueError, match=r"rm.reward_stats_max_pairs=0: must be >= 1"):
        RMConfig(reward_stats_max_pairs=0)


def test_a_refresh_without_an_rm_reward_is_refused_before_any_stage(capsys):
    from launchers.demo import main

    with pytest.raises(SystemExit):
        main(["--reward", "checker", "--refresh-rounds", "1"])
    assert "--refresh-rounds refreshes the served RM; it needs --reward rm or both" in capsys.readouterr().err


def test_before_and_after_come_from_the_ppo_runs_own_evaluation_files(tmp_path):
    """The demo's before/after numbers are the trainer's eval_samples files, averaged;
    a step the run did not evaluate gives None (the demo then runs nemo_rlhf.evaluate)."""
    from launchers.demo import _ppo_evaluation

    rows = [{"prompt": f"p{i}", "response": f"r{i}", "score": 2.5, "correct": float(i % 2),
             "length": 10 + i, "just_the_number": 1.0 if i == 0 else 0.0} for i in range(4)]
    (tmp_path / "eval_samples").mkdir()
    (tmp_path / "eval_samples" / "step_000010.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    got = _ppo_evaluation(tmp_path, 10, num_examples=3)
    assert got["accuracy"] == 0.5 and got["mean_response_length"] == 11.5
    assert got["just_the_number"] == 0.25 and got["num_responses"] == 4
    assert got["examples"] == [{"prompt": "p0", "response": "r0", "correct": 0.0},
                               {"prompt": "p1", "response": "r1", "correct": 1.0},
                               {"prompt": "p2", "response": "r2", "correct": 0.0}]
    assert _ppo_evaluation(tmp_path, 5) is None
    for r in rows:
        del r["just_the_number"]
    (tmp_path / "eval_samples" / "step_000000.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    assert "just_the_number" not in _ppo_evaluation(tmp_path, 0)


@pytest.mark.parametrize("bf16_fast", [True, False])
def test_the_smollm2_recipe_follows_the_precision_auto_resolves_to(monkeypatch, bf16_fast):
    """``make demo`` resolves ``--precision auto`` once and takes that precision's recipe
    (bf16: twice the RM passes, 3x the PPO lr); explicit flags and PPO overrides still win."""
    import launchers.demo as demo
    import nemo_rlhf.models.config as mc

    monkeypatch.setattr(mc.resolve_precision, "__defaults__", (lambda: (bf16_fast, "fake"),))
    seen = {}
    monkeypatch.setattr(demo, "run_smollm2", lambda a: seen.update(vars(a)) or 0)
    assert demo.main([]) == 0
    want = "bf16-mixed" if bf16_fast else "32"
    assert seen["precision"] == want
    assert seen["rm_epochs"] == demo.SMOLLM2_RECIPE[want]["rm_epochs"]
    assert seen["ppo_recipe"] == [f"optim.lr={demo.SMOLLM2_RECIPE[want]['ppo_lr']}"]
    assert demo.main(["--precision", "32", "--rm-epochs", "0.3", "optim.lr=2e-5"]) == 0
    assert (seen["precision"], seen["rm_epochs"], seen["ppo_recipe"], seen["ppo_overrides"]) == (
        "32", 0.3, ["optim.lr=1e-05"], ["optim.lr=2e-5"])
    monkeypatch.setattr(demo, "run_tiny", lambda a: seen.update(vars(a)) or 0)
    assert demo.main(["--task", "tiny"]) == 0
    assert (seen["precision"], seen["ppo_recipe"]) == ("32", [])
