"""launchers/recipe.py with a task that names an environment (``Task.env``, #51), its stages
faked as in test_demo_recipe.py: the PPO stage gets ``env.name`` and ``Task.env_overrides``;
a task without one gets no ``env.*`` argument; a tool task whose single-turn samples are all
wrong after SFT is stopped naming the single-turn sampling."""

from __future__ import annotations

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


def test_a_tool_tasks_env_reaches_the_ppo_stage(tmp_path, monkeypatch):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "TOOL")) == 0
    (ppo,) = fake.ppo
    i = ppo["args"].index("env.name='digit_calculator'")
    assert ppo["args"][i + 1] == "env.max_turns=2"


def test_a_task_without_env_passes_no_env_argument(tmp_path, monkeypatch):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_argv(tmp_path, monkeypatch, "TASK")) == 0
    (ppo,) = fake.ppo
    assert not any(a.startswith("env.") for a in ppo["args"])


def test_a_tool_task_at_zero_single_turn_is_stopped_naming_the_single_turn_sampling(tmp_path, monkeypatch):
    FakeStages(monkeypatch, right=lambda ckpt: 0.0)
    with pytest.raises(SystemExit, match=r"Task.env='digit_calculator'\): 0 of 24 sampled answers right; the "
                                         r"recipe samples single-turn.*benchmarks/tool_task_eval.py"):
        demo.main(_argv(tmp_path, monkeypatch, "TOOL"))
