"""launchers.demo: an output folder made with other RM-stage settings is refused, not reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import launchers.stages as stages
from launchers.stages import check_stage_settings


def test_stage_settings_are_recorded_then_a_change_is_refused_naming_the_flag(tmp_path):
    path = tmp_path / "exp" / "rm_data" / "settings.json"
    check_stage_settings(path, {"rm_edit_pairs": 0, "rm_prompts": 256})
    assert json.loads(path.read_text()) == {"rm_edit_pairs": 0, "rm_prompts": 256}
    check_stage_settings(path, {"rm_edit_pairs": 0, "rm_prompts": 256})  # same: continues
    with pytest.raises(SystemExit, match=r"--rm-edit-pairs 0 -> 2.*pass a new --out"):
        check_stage_settings(path, {"rm_edit_pairs": 2, "rm_prompts": 256})
    assert json.loads(path.read_text())["rm_edit_pairs"] == 0  # not overwritten


def test_the_smollm2_rm_stage_overrides_compose_into_the_rm_job(tmp_path, monkeypatch):
    """The demo's RM command line is accepted by Hydra and the schema (it once passed
    ``rm.extra_val_files={...}``, which Hydra refuses, and only the whole demo found out)."""
    from argparse import Namespace

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import nemo_rlhf.train_rm  # noqa: F401  (registers the schema)
    from launchers.demo import main
    from launchers.stages import REPO, RM_STATS_PAIRS, smollm2_rm_overrides
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
    calls = []

    def fake_run(cmd, log):
        calls.append(cmd)
        ckpt = next(c.split("=", 1)[1] for c in cmd if c.startswith("checkpoint="))
        out = next(c.split("=", 1)[1] for c in cmd if c.startswith("out="))
        Path(out).write_text(json.dumps({"checkpoint": ckpt, "accuracy": len(calls)}))

    monkeypatch.setattr(stages, "run_stage", fake_run)
    out, log = tmp_path / "ppo_eval.json", tmp_path / "eval.log"
    step10, step15 = tmp_path / "ckpt" / "step_10", tmp_path / "ckpt" / "step_15"
    assert stages.evaluate_checkpoint(step10, tmp_path, out, log)["accuracy"] == 1
    assert stages.evaluate_checkpoint(step10, tmp_path, out, log)["accuracy"] == 1  # reused
    assert stages.evaluate_checkpoint(step15, tmp_path, out, log)["accuracy"] == 2  # a newer checkpoint
    assert len(calls) == 2


def test_refresh_flags_that_cannot_work_are_refused_naming_them(tmp_path):
    from argparse import Namespace

    from launchers.stages import first_stage_steps

    a = Namespace(refresh_rounds=1, refresh_ppo_steps=None)
    assert first_stage_steps(a, 10) == 5 and a.refresh_ppo_steps == 5  # split evenly
    assert first_stage_steps(Namespace(refresh_rounds=0, refresh_ppo_steps=None), 10) == 10
    with pytest.raises(SystemExit, match=r"trainer.max_steps=10 leaves no PPO step.*--refresh-rounds 2 "
                                         r"--refresh-ppo-steps 5"):
        first_stage_steps(Namespace(refresh_rounds=2, refresh_ppo_steps=5), 10)


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
    from launchers.stages import ppo_evaluation

    rows = [{"prompt": f"p{i}", "response": f"r{i}", "score": 2.5, "correct": float(i % 2),
             "length": 10 + i, "just_the_number": 1.0 if i == 0 else 0.0} for i in range(4)]
    (tmp_path / "eval_samples").mkdir()
    (tmp_path / "eval_samples" / "step_000010.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    got = ppo_evaluation(tmp_path, 10, num_examples=3)
    assert got["accuracy"] == 0.5 and got["mean_response_length"] == 11.5
    assert got["just_the_number"] == 0.25 and got["num_responses"] == 4
    assert got["examples"] == [{"prompt": "p0", "response": "r0", "correct": 0.0},
                               {"prompt": "p1", "response": "r1", "correct": 1.0},
                               {"prompt": "p2", "response": "r2", "correct": 0.0}]
    assert ppo_evaluation(tmp_path, 5) is None
    for r in rows:
        del r["just_the_number"]
    (tmp_path / "eval_samples" / "step_000000.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    assert "just_the_number" not in ppo_evaluation(tmp_path, 0)


@pytest.mark.parametrize("bf16_fast", [True, False])
def test_the_smollm2_recipe_follows_the_precision_auto_resolves_to(monkeypatch, bf16_fast):
    """``make demo`` resolves ``--precision auto`` once and takes that precision's recipe
    (bf16: twice the RM passes, 3x the PPO lr, twice the rollouts a step); explicit flags and PPO overrides still win."""
    import launchers.demo as demo
    import nemo_rlhf.models.config as mc

    monkeypatch.setattr(mc.resolve_precision, "__defaults__", (lambda: (bf16_fast, "fake"),))
    seen = {}
    monkeypatch.setattr(demo, "run_smollm2", lambda a: seen.update(vars(a)) or 0)
    assert demo.main([]) == 0
    want = "bf16-mixed" if bf16_fast else "32"
    assert seen["precision"] == want
    assert seen["rm_epochs"] == demo.SMOLLM2_RECIPE[want]["rm_epochs"]
    assert seen["ppo_recipe"] == ({"bf16-mixed": ["optim.lr=3e-05", "ppo.num_rollout_samples=64",
                                                  "ppo.global_batch_size=32"],
                                   "32": ["optim.lr=1e-05"]}[want])
    assert demo.main(["--precision", "32", "--rm-epochs", "0.3", "optim.lr=2e-5"]) == 0
    assert (seen["precision"], seen["rm_epochs"], seen["ppo_recipe"], seen["ppo_overrides"]) == (
        "32", 0.3, ["optim.lr=1e-05"], ["optim.lr=2e-5"])
    monkeypatch.setattr(demo, "run_tiny", lambda a: seen.update(vars(a)) or 0)
    assert demo.main(["--task", "tiny"]) == 0
    assert (seen["precision"], seen["ppo_recipe"]) == ("32", [])


def test_refresh_verdict_keeps_the_refreshed_rm_only_when_it_ranks_the_unseen_pairs_better():
    from launchers.stages import refresh_verdict

    keep, why = refresh_verdict(0.557, 0.633, 79, 0.05)  # docs/demo.md: seed 2's round
    assert keep and "63.3%" in why and "55.7%" in why and "+7.6 points" in why and why.endswith("is used")
    keep, why = refresh_verdict(0.550, 0.578, 109, 0.05)  # seed 1234's round: +2.8 points
    assert not keep and why.endswith("the current RM is kept")
    assert refresh_verdict(0.5, 0.55, 10, 0.05)[0]  # exactly the margin: used
    assert not refresh_verdict(None, None, 0, 0.05)[0]  # nothing to check: kept
    assert "cannot be checked" in refresh_verdict(None, None, 0, 0.05)[1]
    assert refresh_verdict(None, None, 0, -1.0)[0] and refresh_verdict(0.9, 0.1, 5, -1.0)[0]  # unchecked


def _fake_round(tmp_path, monkeypatch, before: float, after: float, min_gain: float):
    """One refresh round of ``launchers.stages.refresh_rounds`` with every stage faked: the
    policy's samples (4 prompts: 2 trained on, 2 unseen; the RM wrong on every trained
    pair), an RM job that writes ``val_policy_unseen/accuracy`` ``before`` at step 0 and
    ``after`` at its end, and a PPO stage that records the RM it was given."""
    from argparse import Namespace

    prompts = tmp_path / "ppo_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(6)))
    base_pairs = tmp_path / "preference.jsonl"
    base_pairs.write_text("".join(json.dumps({"prompt": "q", "chosen": f"c{i}", "rejected": f"r{i}"}) + "\n"
                                  for i in range(8)))
    out, first_rm = tmp_path / "out", tmp_path / "rm" / "checkpoints" / "step_5"
    first_rm.mkdir(parents=True)
    ppo = tmp_path / "ppo" / "checkpoints" / "step_2"
    ppo.mkdir(parents=True)
    seen = {}

    def fake_run(cmd, log):  # nemo_rlhf.evaluate: two answers per prompt, right then wrong
        seen["evaluate"] = cmd
        data = Path(next(c.split("=", 1)[1] for c in cmd if c.startswith("data=")))
        rows = [json.loads(x) for x in data.read_text().splitlines()]
        path = Path(next(c.split("=", 1)[1] for c in cmd if c.startswith("samples_out=")))
        path.write_text("".join(json.dumps({"prompt": r["prompt"], "response": resp, "correct": c,
                                            "rm_score": -c, "extras": {"answer": r["answer"]}}) + "\n"
                                for r in rows for resp, c in (("right", 1.0), ("wrong", 0.0))))

    def train_rm(exp, init_from, train_file, steps, extra=()):
        seen["train_rm"] = (init_from, train_file, steps, list(extra))
        (exp / "checkpoints" / f"step_{steps}").mkdir(parents=True)
        (exp / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_policy_unseen/accuracy": before}) + "\n"
                                           + json.dumps({"step": steps, "val_policy_unseen/accuracy": after}) + "\n")

    def latest(exp):
        steps = sorted((exp / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
        return steps[-1] if steps else None

    monkeypatch.setattr(stages, "run_stage", fake_run)
    monkeypatch.setattr(stages, "latest_checkpoint", latest)
    monkeypatch.setattr(stages, "ppo_stage", lambda args, rm, exp, name, nproc, steps: seen.update(ppo=(rm, steps)))
    a = Namespace(refresh_rounds=1, refresh_prompts=2, refresh_heldout_prompts=2, refresh_samples_per_prompt=2,
                  refresh_pairs_per_prompt=2, refresh_replay=1.0, refresh_rm_steps=3, refresh_rm_epochs=2.0,
                  refresh_ppo_steps=1, refresh_min_gain=min_gain, rm_temperature=0.7, nproc=1)
    rounds, rm = stages.refresh_rounds(a, out=out, logs=tmp_path / "logs", first_rm=first_rm, ppo_exp=tmp_path / "ppo",
                                      ppo_args=[], config_name="ppo_tiny", base_steps=2, prompts=prompts,
                                      base_pairs=base_pairs, train_rm=train_rm, rm_batch=4, eval_args=[])
    return rounds[0], rm, seen, out


@pytest.mark.parametrize("before,after,kept", [(0.50, 0.75, True), (0.50, 0.52, False)])
def test_a_refresh_round_is_checked_on_unseen_prompts_before_ppo_uses_its_rm(tmp_path, monkeypatch, before,
                                                                               after, kept):
    first_rm = tmp_path / "rm" / "checkpoints" / "step_5"
    r, rm, seen, out = _fake_round(tmp_path, monkeypatch, before, after, min_gain=0.05)
    refreshed = out / "rm_round_1" / "checkpoints" / "step_3"
    # the policy answered the 2 trained and the 2 unseen prompts in one sampling run
    rdir = out / "refresh" / "round_1"
    assert [json.loads(x)["prompt"] for x in (rdir / "prompts.jsonl").read_text().splitlines()] == [
        "p0", "p1", "p2", "p3"]
    # new pairs from the trained prompts only; the check pairs from the unseen ones only
    assert r["disagreement"]["prompts"] == 2 and r["pairs_added"] == 2
    unseen = [json.loads(x) for x in (rdir / "policy_unseen_pairs.jsonl").read_text().splitlines()]
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in unseen] == [("p2", "right", "wrong"),
                                                                           ("p3", "right", "wrong")]
    # the RM job validates them before its first step and after its last
    assert seen["train_rm"][0] == str(first_rm)
    assert seen["train_rm"][3] == ["trainer.val_at_start=true",
                                   f"+rm.extra_val_files.policy_unseen={rdir / 'policy_unseen_pairs.jsonl'}"]
    check = r["rm_policy_unseen"]
    assert (check["pairs"], check["before"], check["after"], check["kept_refreshed_rm"]) == (2, before, after, kept)
    # PPO continues against the refreshed RM only when it ranked the unseen pairs better by 5 points
    assert seen["ppo"] == ((refreshed if kept else first_rm), 3) and rm == (refreshed if kept else first_rm)
    assert r["rm_checkpoint"] == str(rm)
    # the round's pairs join the pool either way
    assert len((rdir / "preference_pool.jsonl").read_text().splitlines()) == 8 + 2


def test_a_negative_min_gain_uses_the_refreshed_rm_unchecked(tmp_path, monkeypatch):
    r, rm, seen, out = _fake_round(tmp_path, monkeypatch, 0.9, 0.1, min_gain=-1.0)
    assert rm == out / "rm_round_1" / "checkpoints" / "step_3" and r["rm_policy_unseen"]["kept_refreshed_rm"]


@pytest.mark.parametrize("config_name", ["ppo_smollm2", "ppo_tiny"])
def test_the_demo_recipes_keep_the_kl_floor_their_tables_were_measured_with(config_name):
    """docs/demo.md's SmolLM2 tables ran kl.type=pi with the floor at init_kl_coef (the
    default until #50, now 1e-3): the recipe pins it; the tiny demo does not use pi."""
    from tests.conf_helpers import typed_job

    kl = typed_job(config_name, []).kl
    if config_name == "ppo_tiny":
        assert kl.type == "adaptive"
    else:
        assert kl.type == "pi" and kl.pi_min_coef == kl.init_kl_coef == 0.02


def test_the_kl_summary_names_the_runs_target_and_the_ratio(tmp_path):
    """From the PPO run's own config.yaml: a target only for the adaptive and pi
    controllers; the ratio rounded to 0.01 (issue 54)."""

    exp = tmp_path / "ppo"
    exp.mkdir()
    assert stages.kl_summary(exp) == {"final_kl_mean": None, "kl_type": None, "kl_target": None,
                                     "final_kl_to_target": None}
    (exp / "metrics.jsonl").write_text('{"step": 1, "kl_mean": 0.5}\n{"step": 2, "kl_mean": 0.987}\n')
    (exp / "config.yaml").write_text("kl:\n  type: adaptive\n  target: 1.0\n")
    k = stages.kl_summary(exp)
    assert (k["final_kl_mean"], k["kl_target"], k["final_kl_to_target"]) == (0.987, 1.0, 0.99)
    assert stages.kl_line(k) == "0.99 (kl.target 1 of kl.type=adaptive: 0.99x)"
    (exp / "config.yaml").write_text("kl:\n  type: fixed\n  target: 1.0\n")
    k = stages.kl_summary(exp)
    assert k["kl_target"] is None and k["final_kl_to_target"] is None
    assert stages.kl_line(k) == "0.99 (kl.type=fixed: no target)"
