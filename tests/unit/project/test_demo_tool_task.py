"""launchers/recipe.py with a task that names an environment (``Task.env``, #51), its stages
faked as in test_demo_recipe.py: the PPO stage and every ``nemo_rlhf.evaluate`` stage get
``env.name`` and ``Task.env_overrides`` (the samples, the SFT gate and the held-out
evaluations run episodes); a task without one gets no ``env.*`` argument; a tool task trains
no RM with ``--reward checker`` and, with ``--reward rm|both``, one on pairs of whole
conversations; ``--refresh-rounds`` is refused on a tool task before any stage."""

from __future__ import annotations

import json

import pytest

import launchers.demo as demo
from tests.unit.project.test_demo_recipe import TASK_MODULE, FakeStages

TOOL_MODULE = TASK_MODULE + '''
import dataclasses
TOOL = dataclasses.replace(TASK, env="digit_calculator", env_overrides=("env.max_turns=2",))
'''


def _argv(tmp_path, monkeypatch, attr):
    (tmp_path / "pkg_tool_task.py").write_text(TOOL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return ["--task", f"pkg_tool_task:{attr}", "--model", "tiny", "--out", str(tmp_path / "out"),
            "--rm-prompts", "6", "--rm-val-prompts", "3", "--ppo-prompts", "10", "--sft-steps", "7",
            "--force", "--rm-heldout-sample-rounds", "0", "--sft-more-rounds", "0", "--reward", "checker"]


def test_a_tool_tasks_env_reaches_the_ppo_stage_and_every_evaluation(tmp_path, monkeypatch):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "TOOL")) == 0
    (ppo,) = fake.ppo
    i = ppo["args"].index("env.name='digit_calculator'")
    assert ppo["args"][i + 1] == "env.max_turns=2"
    evals = [c for c in fake.cmds if c[:2] == ["-m", "nemo_rlhf.evaluate"]]
    assert evals and all("env.name='digit_calculator'" in c and "env.max_turns=2" in c for c in evals)
    assert "nemo_rlhf.train_rm" not in fake.modules()  # no RM on a tool task
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["env"] == "digit_calculator" and s["rm_gate"]["applies"] is False


def test_a_task_without_env_passes_no_env_argument(tmp_path, monkeypatch):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "TASK")) == 0
    (ppo,) = fake.ppo
    assert not any(a.startswith("env.") for a in ppo["args"])
    assert not any(a.startswith("env.") for c in fake.cmds for a in c)
    assert "nemo_rlhf.train_rm" in fake.modules()


def test_a_tool_task_whose_sft_model_gets_nothing_right_names_the_sft_flags(tmp_path, monkeypatch):
    FakeStages(monkeypatch, right=lambda ckpt: 0.0)
    with pytest.raises(SystemExit, match=r"after SFT .* still got 0 of 24 sampled answers right; raise --sft-steps"):
        demo.main(_argv(tmp_path, monkeypatch, "TOOL"))


@pytest.mark.parametrize("reward", ["rm", "both"])
def test_a_tool_task_with_an_rm_reward_trains_the_rm_on_whole_conversations(tmp_path, monkeypatch, reward):
    """``--reward rm|both`` on a tool task: the RM's training, held-out and same-form pairs
    are pairs of whole conversations (the episodes' messages, no ``prompt``), the AUC gate's
    evaluation runs episodes scored by the RM, and PPO is served that RM."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    argv = _argv(tmp_path, monkeypatch, "TOOL")
    argv[argv.index("--reward") + 1] = reward
    assert demo.main(argv) == 0
    assert "nemo_rlhf.train_rm" in fake.modules()
    rm_data = tmp_path / "out" / "rm_data"
    for name in ("preference_train", "preference_val", "same_form_val"):
        pairs = [json.loads(x) for x in (rm_data / f"{name}.jsonl").read_text().splitlines()]
        assert pairs, name
        for p in pairs:
            assert "prompt" not in p and [m["role"] for m in p["chosen"]] == ["user", "assistant", "tool", "assistant"]
            assert p["chosen"][0] == p["rejected"][0] and p["chosen"][-1] != p["rejected"][-1]
    (auc,) = [c for c in fake.cmds if any(x.startswith("rm_checkpoint=") for x in c)]
    assert "env.name='digit_calculator'" in auc
    (ppo,) = fake.ppo
    assert ppo["rm"] != "None" and "env.name='digit_calculator'" in ppo["args"]
    assert ("reward.rm_weight=0" in ppo["args"]) is False
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["rm_gate"]["applies"] is True and s["rm_heldout_pair_accuracy"] == 0.9


def test_a_tool_task_with_refresh_rounds_is_refused_before_any_stage(tmp_path, monkeypatch):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    argv = _argv(tmp_path, monkeypatch, "TOOL")
    argv[argv.index("--reward") + 1] = "rm"
    with pytest.raises(SystemExit, match=r"--refresh-rounds 1 is not supported on a tool task yet.*"
                                         r"single-turn texts.*--refresh-rounds 0"):
        demo.main([*argv, "--refresh-rounds", "1"])
    assert fake.cmds == [] and fake.ppo == []


def test_task_calc_is_the_calc_tool_task_on_the_tiny_model(tmp_path, monkeypatch):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(["--task", "calc", "--reward", "checker", "--out", str(tmp_path / "out"), "--rm-prompts", "6",
                      "--rm-val-prompts", "3", "--ppo-prompts", "10", "--sft-more-rounds", "0"]) == 0
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["task"] == "calc" and s["model"] == "tiny" and s["env"] == "digit_calculator"
    assert s["defaults"]["model"]["value"] == "tiny"
    (ppo,) = fake.ppo
    assert ppo["config"] == "ppo_tiny" and "env.name='digit_calculator'" in ppo["args"]


def test_a_tool_task_on_the_tiny_model_gets_the_profiles_tool_task_lr_with_its_reason(tmp_path, monkeypatch,
                                                                                     capsys):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "TOOL")) == 0
    (ppo,) = fake.ppo
    assert [x for x in ppo["args"] if x.startswith("optim.lr=")] == ["optim.lr=1e-05"]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["defaults"]["optim.lr"]["value"] == 1e-05
    reason = s["defaults"]["optim.lr"]["reason"]
    assert "not conf/ppo_tiny.yaml's 0.0001" in reason and "Why PPO does not fix the copy errors" in reason
    assert f"default: optim.lr = 1e-05 ({reason})" in capsys.readouterr().out


def test_a_task_without_env_keeps_the_configs_lr(tmp_path, monkeypatch):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "TASK")) == 0
    (ppo,) = fake.ppo
    assert not any(x.startswith("optim.lr=") for x in ppo["args"])
    assert "optim.lr" not in json.loads((tmp_path / "out" / "summary.json").read_text())["defaults"]


def test_the_users_lr_on_a_tool_task_wins(tmp_path, monkeypatch):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "TOOL") + ["optim.lr=3e-5"]) == 0
    (ppo,) = fake.ppo
    assert [x for x in ppo["args"] if x.startswith("optim.lr=")] == ["optim.lr=3e-5"]
    d = json.loads((tmp_path / "out" / "summary.json").read_text())["defaults"]["optim.lr"]
    assert d == {"value": "3e-5", "reason": "your override"}
