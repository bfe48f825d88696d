"""The demo's recipe on a task defined outside the package (``python -m launchers.demo
--task module:TASK --model tiny``), through the task interface only: a module written into
the test's folder, imported by its ``module:ATTRIBUTE`` path, its checker called by the
stages (other processes) under the name ``module:TASK.score``.

The tiny model starts from random weights, so it gets no sampled answer right: the recipe
must say so, refuse the task variant that has no demonstration writer (naming
``Task.demonstrate``), and with the writer do SFT on its demonstrations first, then sample
the RM data from the SFT model, train the RM from it and run PPO from it against the served
RM (InstructGPT's order). Cost kept down as tests/e2e/test_demo_tiny.py does (few steps) and
more: 8 letters of RM prompts, 60 SFT steps, 2 PPO steps of 16 rollouts; the refused run's
model and samples are reused by the second run (the recipe continues where it stopped)."""

from __future__ import annotations

import json

import pytest
import yaml

TASK_MODULE = '''
"""Next letter: "c+1=" -> "d" (a task of the nemo_rlhf.tasks.task.Task interface)."""
import dataclasses
import string

from nemo_rlhf.tasks.task import Task

PROBLEMS = [{"letter": c, "answer": chr(ord(c) + 1)} for c in string.ascii_lowercase[:-1]] * 4


def check(prompt, response, extras):
    return response.strip() == extras["answer"]


def edit(prompt, response, extras, right, rng):
    if not response.strip():
        return None
    return chr(ord(extras["answer"]) % 26 + ord("a")) if right else extras["answer"]


TASK = Task(name="next_letter", train=PROBLEMS[6:], heldout=PROBLEMS[:6], prompt_template="{letter}+1=",
            check=check, edit_answer=edit, demonstrate=lambda prompt, extras: extras["answer"],
            max_new_tokens=3)
NO_DEMOS = dataclasses.replace(TASK, demonstrate=None)
'''

ARGS = ["--model", "tiny", "--rm-prompts", "16", "--rm-val-prompts", "8", "--ppo-prompts", "32",
        "--sft-steps", "60", "--sft-rows", "64", "--rm-epochs", "10",
        "trainer.max_steps=2", "trainer.val_check_interval=2", "exp_manager.save_interval=2",
        "ppo.num_rollout_samples=16", "ppo.global_batch_size=16", "ppo.micro_batch_size=8",
        "ppo.forward_micro_batch_size=16"]
ARGS = ["--force", "--rm-heldout-sample-rounds", "0", "--rm-more-rounds", "0", "--sft-more-rounds", "0",
        *ARGS]  # the wiring, not the gate and the sizing loops (tests/unit/project/test_demo_gates.py, test_demo_sizing.py)


def test_a_task_the_model_cannot_do_gets_sft_first_then_rm_and_ppo(tmp_path, monkeypatch, capsys, forked_python):
    from launchers.demo import main

    (tmp_path / "next_letter_task.py").write_text(TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # this process imports it; the recipe tells the stages
    monkeypatch.delenv("PYTHONPATH", raising=False)
    out = tmp_path / "exp"
    args = ["--out", str(out), *ARGS]

    with pytest.raises(SystemExit) as refused:
        main(["--task", "next_letter_task:NO_DEMOS", *args])
    assert "got 0 of 64 sampled answers right" in str(refused.value)
    assert "give Task.demonstrate" in str(refused.value)
    assert "the model cannot do task 'next_letter'" in capsys.readouterr().out
    assert not (out / "sft").exists()

    assert main(["--task", "next_letter_task:TASK", *args]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["task"] == "next_letter" and s["model"] == "tiny" and s["sft_first"] is True
    assert s["initial_sample_accuracy"] == 0.0
    initial = [json.loads(x) for x in (out / "rm_data" / "initial_samples_train.jsonl").read_text().splitlines()]
    assert len(initial) == 64 and not any(r["correct"] for r in initial)  # the random model's, kept
    demos = [json.loads(x) for x in (out / "sft_data" / "sft.jsonl").read_text().splitlines()]
    assert len(demos) == 32 and all(d["response"] == chr(ord(d["prompt"][0]) + 1) for d in demos)
    # the RM data comes from the SFT model: right and wrong answers, so natural pairs
    assert 0.0 < s["rm_sample_accuracy"] < 1.0
    assert s["rm_pairs"]["train"] > 0 and s["rm_pairs"]["val_same_form"] > 0
    assert s["rm_heldout_pair_accuracy"] is not None
    assert s["rm_gate"]["natural_heldout_pairs"] == s["rm_pairs"]["val"] and "passed" in s["rm_gate"]
    # the RM gate's AUC: the SFT model's 4 answers to each of the 8 held-out RM prompts, scored by the RM
    auc = s["rm_gate"]["reward_auc"]
    scored = [json.loads(x) for x in (out / "rm_data" / "rm_auc_samples.jsonl").read_text().splitlines()]
    assert len(scored) == 32 and all(isinstance(r["rm_score"], float) for r in scored)
    assert auc["n_right"] + auc["n_wrong"] == 32 and auc["n_right"] == sum(r["correct"] > 0.5 for r in scored)
    assert s["defaults"]["kl.type"]["value"] == "pi"  # the tiny profile's PPO job (the config composed it)
    assert s["verdict"]["heldout_problems"] == 6 and s["verdict"]["line"].startswith("verdict: ")
    sft = s["checkpoints"]["sft"]
    assert sft.endswith("sft/checkpoints/step_60")
    for stage in ("rm", "ppo"):  # both start from the SFT model
        cfg = yaml.safe_load((out / stage / "checkpoints" / ("step_2" if stage == "ppo" else s["checkpoints"]["rm"]
                                                             .rsplit("/", 1)[-1]) / "config.yaml").read_text())
        assert (cfg["exp_manager"]["init_from"] if stage == "ppo" else cfg["rm"]["init_from"]) == sft
    assert cfg["trainer"]["eval_checker"] == "next_letter_task:TASK.score"
    # PPO ran its steps and evaluated the SFT model (not the random one) before them
    assert sorted(s["heldout_accuracy_by_step"]) == ["0", "2"] and sorted(s["kl_mean_by_step"]) == ["1", "2"]
    assert s["baseline_accuracy"] > 0.5
    # the original (random) model's held-out accuracy, measured once beside PPO's start (issue 54)
    assert s["baseline_model"] == "sft" and s["original_accuracy"] < s["baseline_accuracy"]
    original = json.loads((out / "original_eval.json").read_text())
    assert original["num_responses"] == 6 and original["accuracy"] == s["original_accuracy"]
    assert original["checkpoint"].endswith("model/checkpoints/step_0")
    rows = [json.loads(x) for x in (out / "ppo" / "eval_samples" / "step_000000.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    assert all(r["correct"] == float(r["response"].strip() == r["extras"]["answer"]) for r in rows)
