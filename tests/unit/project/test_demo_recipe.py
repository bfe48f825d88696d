"""launchers/recipe.py with its stages faked (no model runs, seconds): ``make demo`` runs the
stage commands it ran before the recipe took a task; a task the model can do goes straight
to the RM data; one it cannot do gets SFT on its demonstrations first (and a model still at
zero after SFT is refused naming the flags). The real stages on a tiny model:
tests/e2e/test_demo_task.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import launchers.demo as demo
import launchers.stages as stages
from nemo_rlhf.data.sample_rows import sample_row

TASK_MODULE = '''
from nemo_rlhf.tasks.task import Task

PROBLEMS = [{"word": w, "answer": w.upper()} for w in ("ant bee cat dog eel fox gnu hen ibis jay kiwi "
                                                        "lark mole newt owl pig").split()]
TASK = Task(name="upper", train=PROBLEMS[4:], heldout=PROBLEMS[:4], prompt_template="Upper: {word} ->",
            check=lambda p, r, ex: r == ex["answer"],
            edit_answer=lambda p, r, ex, right, rng: r.lower() if right else ex["answer"],
            demonstrate=lambda p, ex: ex["answer"])
'''


class FakeStages:
    """``stages.run_stage`` / ``latest_checkpoint`` / ``ppo_stage`` / ``ppo_evaluation`` / the
    model set-up, recorded. An ``nemo_rlhf.evaluate`` stage writes ``num_samples`` rows per
    prompt, the first ``right(checkpoint) * num_samples`` of them right (with
    ``rm_checkpoint``, each scored ``rm_score(right, sample index)``)."""

    def __init__(self, monkeypatch, right, rm_accuracy=0.9):
        self.cmds, self.ppo, self.right, self.rm_accuracy = [], [], right, rm_accuracy
        self.rm_score = lambda ok, k: float(ok)  # with rm_checkpoint: the RM's score of a sample (AUC 1 here)
        monkeypatch.setattr(stages, "run_stage", self.run)
        monkeypatch.setattr(stages, "latest_checkpoint", self.latest)
        monkeypatch.setattr(stages, "ppo_stage", self.ppo_stage)
        monkeypatch.setattr(stages, "ppo_evaluation", lambda exp, step, num_examples=8: {
            "accuracy": 0.5, "mean_response_length": 2.0, "examples": []})
        import launchers.gates as gates

        # the model set-up is faked (no tokenizer folder): the prompt-length check counts characters
        monkeypatch.setattr(gates, "prompt_token_lengths", lambda tok, prompts, template, system: [
            1 + len(p) for p in prompts])
        import nemo_rlhf.tools.real_model as real_model

        monkeypatch.setattr(real_model, "setup", lambda path: {"checkpoint": "/MODEL/step_0",
                                                               "tokenizer_dir": "/MODEL/tokenizer"})

    def run(self, cmd, log):
        stages.note_process()  # as the real run_stage: a stage process started
        self.cmds.append([str(c) for c in cmd[1:]])
        args = dict(c.split("=", 1) for c in cmd if "=" in c and not c.startswith(("-", "+")))
        if "samples_out" in args:
            n = int(args["num_samples"])
            out = []
            for row in (json.loads(x) for x in Path(args["data"]).read_text().splitlines()):
                extras = {k: v for k, v in row.items() if k != "prompt"}
                for k in range(n):
                    ok = k < self.right(args["checkpoint"]) * n
                    answer = str(extras["answer"])
                    wrong = str(int(answer) + 1) if answer.isdigit() else answer.lower()
                    more = {"rm_score": self.rm_score(ok, k)} if "rm_checkpoint" in args else {}
                    if "env.name" in args:  # episodes (#51): as the evaluator writes them, with their messages
                        more.update(turns=2, messages=[
                            {"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": "call"},
                            {"role": "tool", "content": "result"},
                            {"role": "assistant", "content": answer if ok else wrong}])
                    out.append(sample_row(row["prompt"], answer if ok else wrong, float(ok), 2, extras, sample=k,
                                          **more))
            Path(args["samples_out"]).write_text("".join(json.dumps(r) + "\n" for r in out))
            if "rm_checkpoint" in args:  # as the evaluator: its result JSON names the RM that scored them
                Path(args["out"]).write_text(json.dumps({"checkpoint": args["checkpoint"],
                                                         "rm_checkpoint": args["rm_checkpoint"]}))
        elif "nemo_rlhf.train_rm" in cmd:  # what the RM job logs: its held-out pair accuracy (the RM gate)
            exp = Path(args["exp_manager.exp_dir"])
            exp.mkdir(parents=True, exist_ok=True)
            (exp / "metrics.jsonl").write_text(json.dumps({"step": 1, "val/accuracy": self.rm_accuracy}) + "\n")
        elif "out" in args and "nemo_rlhf.evaluate" in cmd:  # a greedy held-out evaluation
            Path(args["out"]).write_text(json.dumps({"checkpoint": args["checkpoint"], "examples": [],
                                                     "accuracy": self.right(args["checkpoint"]),
                                                     "mean_response_length": 3.0}))

    def latest(self, exp):
        exp = str(exp)
        made = [c for c in self.cmds if f"exp_manager.exp_dir={exp}" in c or (c[1:3] == ["launchers.recipe",
                                                                                         "init-tiny"] and c[3] == exp)]
        if Path(exp).name == "ppo" and self.ppo:
            return Path(exp) / "checkpoints" / f"step_{self.ppo[-1]['steps']}"
        return Path(exp) / "checkpoints" / ("step_0" if exp.endswith("model") else "step_1") if made else None

    def ppo_stage(self, ppo_args, rm, ppo_exp, config_name, nproc, max_steps):
        if self.ppo and self.ppo[-1]["steps"] >= max_steps:
            return  # as the real stage: a finished run is not even resumed
        stages.note_process()
        self.ppo.append({"args": list(ppo_args), "rm": str(rm), "config": config_name, "steps": max_steps})
        ppo_exp.mkdir(parents=True, exist_ok=True)  # what the trainer writes: its config, its metrics
        (ppo_exp / "config.yaml").write_text("kl:\n  type: pi\n  target: 6.0\n")
        (ppo_exp / "metrics.jsonl").write_text(json.dumps({"step": max_steps, "kl_mean": 6.3012}) + "\n")

    def modules(self):
        return [c[1] if c[0] == "-m" else c[0] for c in self.cmds]


def test_the_default_demo_runs_the_stage_commands_it_ran_before(tmp_path, monkeypatch):
    """``make demo``'s stages, as recorded from launchers/demo.py before the recipe took a
    task (commit 02f2a98; the RM's step count follows the pairs, so it is computed)."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    out, data = tmp_path / "out", tmp_path / "data"
    assert demo.main(["--out", str(out), "--data", str(data), "--precision", "32"]) == 0

    def sample(split, seed):
        prompts = "rm_prompts" if split == "train" else "rm_val_prompts"
        return ["-m", "nemo_rlhf.evaluate", "checkpoint=/MODEL/step_0", f"data={data}/{prompts}.jsonl",
                f"out={out}/rm_data/samples_{split}.json", "max_new_tokens=24", "checker=two_digit_addition",
                "extra_checkers=[just_the_number]", "precision=32", "temperature=0.7", "num_samples=4",
                f"samples_out={out}/rm_data/samples_{split}.jsonl", f"seed={seed}", "num_examples=0",
                "batch_size=128"]

    pairs = sum(1 for _ in (out / "rm_data" / "preference_train.jsonl").open())
    steps = max(1, int(0.6 * pairs // 16))
    rm = ["-m", "nemo_rlhf.train_rm", "model=smollm2_135m", f"exp_manager.exp_dir={out}/rm",
          "rm.init_from=/MODEL/step_0", "rm.freeze_layers=10",
          f"data.train_file={out}/rm_data/preference_train.jsonl",
          f"data.val_file={out}/rm_data/preference_val.jsonl", "data.tokenizer_dir=/MODEL/tokenizer",
          f"+rm.extra_val_files.same_form={out}/rm_data/same_form_val.jsonl", "data.chat_template=chatml",
          "data.system_prompt='You are a helpful AI assistant named SmolLM, trained by Hugging Face'",
          "data.max_seq_length=96", f"trainer.max_steps={steps}", "trainer.global_batch_size=16",
          "trainer.micro_batch_size=8", f"trainer.val_check_interval={steps}", "trainer.log_every_n_steps=5",
          "optim.lr=0.0001", "optim.min_lr=1e-05", "optim.warmup_steps=3", "model.value_head_init_std=0.02",
          "rm.reward_stats_max_pairs=256", "trainer.precision=32"]
    # the RM gate's AUC: the policy's held-out samples, drawn as the RM's, scored by the RM (issue 53)
    auc = [*sample("val", 2), f"rm_checkpoint={out}/rm/checkpoints/step_1"]
    auc[4], auc[11] = f"out={out}/rm_data/rm_auc_samples.json", f"samples_out={out}/rm_data/rm_auc_samples.jsonl"
    assert fake.cmds == [sample("train", 1), sample("val", 2), rm, auc]
    assert fake.ppo == [{"args": ["exp_manager.init_from=/MODEL/step_0", f"data.train_file={data}/ppo_prompts.jsonl",
                                  f"data.val_file={data}/eval.jsonl", "data.tokenizer_dir=/MODEL/tokenizer",
                                  "rollout.max_new_tokens=24", "trainer.precision=32", "optim.lr=1e-05"],
                         "rm": f"{out}/rm/checkpoints/step_1", "config": "ppo_smollm2", "steps": 10}]
    settings = json.loads((out / "rm_data" / "settings.json").read_text())
    assert "task" not in settings  # an experiments/smollm2 folder made before continues
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "smollm2 two-digit addition" and "sft_first" not in summary


def _custom(tmp_path, monkeypatch):
    (tmp_path / "pkg_upper_task.py").write_text(TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    return ["--task", "pkg_upper_task:TASK", "--model", "tiny", "--out", str(tmp_path / "out"),
            "--rm-prompts", "6", "--rm-val-prompts", "3", "--ppo-prompts", "10", "--sft-steps", "7",
            "--force", "--rm-heldout-sample-rounds", "0", "--sft-more-rounds", "0"]  # 3 held-out pairs: < 20
    # (the gate and the held-out sampling rounds: tests/unit/project/test_demo_gates.py, test_demo_sizing.py)


def test_a_task_the_model_can_do_goes_straight_to_the_rm_data(tmp_path, monkeypatch):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_custom(tmp_path, monkeypatch)) == 0
    out = tmp_path / "out"
    assert fake.modules() == ["launchers.recipe", "nemo_rlhf.evaluate", "nemo_rlhf.evaluate", "nemo_rlhf.train_rm",
                              "nemo_rlhf.evaluate"]  # the RM's AUC on the held-out samples (the RM gate)
    assert all("checker=pkg_upper_task:TASK.score" in c for c in fake.cmds[1:3])
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]  # the stages import it
    (ppo,) = fake.ppo
    assert ppo["config"] == "ppo_tiny" and f"exp_manager.init_from={out}/model/checkpoints/step_0" in ppo["args"]
    assert "trainer.eval_checker='pkg_upper_task:TASK.score'" in ppo["args"]
    pairs = [json.loads(x) for x in (out / "rm_data" / "preference_train.jsonl").read_text().splitlines()]
    assert {p.get("edit") for p in pairs} == {None, "wrong_answer", "right_answer"}  # natural and counterfactual
    assert all(p["chosen"] == p["chosen"].upper() != p["rejected"] for p in pairs)
    s = json.loads((out / "summary.json").read_text())
    assert s["sft_first"] is False and s["initial_sample_accuracy"] is None and s["rm_sample_accuracy"] == 0.5


def test_a_task_the_model_cannot_do_gets_sft_on_its_demonstrations_first(tmp_path, monkeypatch, capsys):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.0 if ckpt.endswith("/model/checkpoints/step_0") else 0.5)
    assert demo.main(_custom(tmp_path, monkeypatch)) == 0
    out = tmp_path / "out"
    assert fake.modules() == ["launchers.recipe", "nemo_rlhf.evaluate", "nemo_rlhf.train_sft", "nemo_rlhf.evaluate",
                              "nemo_rlhf.evaluate", "nemo_rlhf.train_rm", "nemo_rlhf.evaluate",  # the RM gate's AUC
                              "nemo_rlhf.evaluate"]  # the original model's held-out accuracy
    assert "the model cannot do task 'upper': 0 of 24 sampled answers" in capsys.readouterr().out
    sft = f"{out}/sft/checkpoints/step_1"
    assert f"sft.init_from={out}/model/checkpoints/step_0" in fake.cmds[2] and "trainer.max_steps=7" in fake.cmds[2]
    assert all(f"checkpoint={sft}" in c for c in fake.cmds[3:5])  # the RM data: the SFT model's samples
    assert f"rm.init_from={sft}" in fake.cmds[5] and f"exp_manager.init_from={sft}" in fake.ppo[0]["args"]
    demos = [json.loads(x) for x in (out / "sft_data" / "sft.jsonl").read_text().splitlines()]
    ppo_prompts = [json.loads(x)["prompt"] for x in (out / "data" / "ppo_prompts.jsonl").read_text().splitlines()]
    assert [d["prompt"] for d in demos] == ppo_prompts and all(d["response"] == d["prompt"][7:-3].upper()
                                                               for d in demos)
    assert (out / "rm_data" / "initial_samples_train.jsonl").is_file()
    s = json.loads((out / "summary.json").read_text())
    assert s["sft_first"] is True and s["initial_sample_accuracy"] == 0.0 and s["checkpoints"]["sft"] == sft


def test_a_model_still_at_zero_after_sft_is_refused_naming_the_flags(tmp_path, monkeypatch):
    FakeStages(monkeypatch, right=lambda ckpt: 0.0)
    with pytest.raises(SystemExit, match=r"after SFT \(7 steps on 2000 demonstrations\) the model still got 0 of "
                                         r"24 sampled answers right; raise --sft-steps or --sft-rows"):
        demo.main(_custom(tmp_path, monkeypatch))


@pytest.mark.parametrize("argv, needle", [
    (["--task", "addition"], "--task 'addition': give smollm2, tiny or package.module:TASK"),
    (["--task", "tiny", "--model", "tiny"], "--model applies to --task package.module:TASK"),
    (["--task", "no_such_module_here:TASK"], "cannot import 'no_such_module_here'"),
])
def test_a_bad_task_or_model_flag_is_refused_naming_it(argv, needle, capsys):
    with pytest.raises(SystemExit) as err:
        demo.main(argv)
    assert needle in str(err.value) + capsys.readouterr().err


def test_a_custom_tasks_ppo_arguments_compose_into_the_ppo_job(tmp_path, monkeypatch):
    """The checker reaches the PPO job by its ``module:TASK.score`` name, for the held-out
    evaluation and, with ``--reward both``, in the reward."""
    from tests.conf_helpers import typed_job

    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main([*_custom(tmp_path, monkeypatch), "--reward", "both"]) == 0
    (ppo,) = fake.ppo
    cfg = typed_job(ppo["config"], ppo["args"])
    assert cfg.trainer.eval_checker == "pkg_upper_task:TASK.score" and cfg.trainer.eval_extra_checkers == []
    assert [f.name for f in cfg.reward.functions] == ["pkg_upper_task:TASK.score"]
    assert (cfg.data.max_seq_length, cfg.rollout.max_new_tokens, cfg.guards.gold_window) == (64, 8, 1)


def test_task_max_seq_length_replaces_the_profiles_in_every_job(tmp_path, monkeypatch, capsys):
    """``Task.max_seq_length`` (a tool task's episode is longer than the profile's single-turn
    length) is the ``data.max_seq_length`` of the SFT, RM and PPO jobs, printed as a pick."""
    from tests.conf_helpers import typed_job

    argv = _custom(tmp_path, monkeypatch)  # (writes the module: the task with max_seq_length replaces it)
    (tmp_path / "pkg_upper_task.py").write_text(TASK_MODULE.replace('demonstrate=lambda p, ex: ex["answer"])',
                                                                    'demonstrate=lambda p, ex: ex["answer"], '
                                                                    'max_seq_length=80)'))
    monkeypatch.delitem(sys.modules, "pkg_upper_task", raising=False)  # an earlier test imported the plain one
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.0 if ckpt.endswith("/model/checkpoints/step_0") else 0.5)
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    assert "default: max_seq_length = 80 (Task.max_seq_length, not the tiny profile's 64" in out
    jobs = [c for c in fake.cmds if "nemo_rlhf.train_sft" in c or "nemo_rlhf.train_rm" in c]
    assert len(jobs) == 2 and all("data.max_seq_length=80" in c and "data.max_seq_length=64" not in c for c in jobs)
    (ppo,) = fake.ppo
    assert typed_job(ppo["config"], ppo["args"]).data.max_seq_length == 80


def test_relative_out_and_data_resolve_against_the_working_directory(tmp_path, monkeypatch):
    """Run from the folder holding the task (docs/tasks.md), ``--out run --data d`` write
    there, not into the repository (issue 54: they were ``REPO / a.out``)."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    argv = _custom(tmp_path, monkeypatch)
    argv[argv.index("--out") + 1] = "run_rel"
    monkeypatch.chdir(tmp_path)
    assert demo.main([*argv, "--data", "data_rel"]) == 0
    assert (tmp_path / "run_rel" / "summary.json").is_file()
    assert (tmp_path / "data_rel" / "ppo_prompts.jsonl").is_file()
    assert not (stages.REPO / "run_rel").exists() and not (stages.REPO / "data_rel").exists()
    assert f"data.train_file={tmp_path}/data_rel/ppo_prompts.jsonl" in fake.ppo[0]["args"]
    assert all(f"exp_manager.exp_dir={tmp_path}/run_rel/rm" in c for c in fake.cmds if "nemo_rlhf.train_rm" in c)


def test_the_tiny_demo_and_its_stages_take_relative_paths_from_the_working_directory(tmp_path, monkeypatch):
    import sys

    seen = {}
    monkeypatch.setattr(demo, "run_tiny", lambda a: seen.update(vars(a)) or 0)
    monkeypatch.chdir(tmp_path)
    assert demo.main(["--task", "tiny", "--out", "o", "--data", "~/d"]) == 0
    assert (seen["out"], seen["data"]) == (str(tmp_path / "o"), str(Path.home() / "d"))
    # a stage (its relative override paths) runs there too, as the PPO stage does
    stages.run_stage([sys.executable, "-c", "import os; print('cwd=' + os.getcwd())"], tmp_path / "stage.log")
    assert f"cwd={tmp_path}" in (tmp_path / "stage.log").read_text()


def test_with_sft_first_the_summary_has_the_original_the_sft_and_the_ppo_rows(tmp_path, monkeypatch, capsys):
    """PPO's step 0 is the SFT model; the original model's held-out accuracy is measured
    once (one greedy ``nemo_rlhf.evaluate`` of it, reused by a rerun) and every row says
    what it is; the KL line names the target and the ratio (issue 54)."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.0 if ckpt.endswith("/model/checkpoints/step_0") else 0.5)
    monkeypatch.setattr(stages, "ppo_evaluation", lambda exp, step, num_examples=8: {
        "accuracy": 0.5 if step == 0 else 0.75, "mean_response_length": 2.0, "examples": []})
    assert demo.main(_custom(tmp_path, monkeypatch)) == 0
    out = tmp_path / "out"
    greedy = [c for c in fake.cmds if c[1] == "nemo_rlhf.evaluate" and not any("samples_out" in x for x in c)]
    assert len(greedy) == 1 and f"checkpoint={out}/model/checkpoints/step_0" in greedy[0]
    assert f"data={out}/data/eval.jsonl" in greedy[0]
    s = json.loads((out / "summary.json").read_text())
    assert (s["baseline_model"], s["original_accuracy"], s["baseline_accuracy"], s["ppo_accuracy"]) == (
        "sft", 0.0, 0.5, 0.75)
    assert (s["final_kl_mean"], s["kl_type"], s["kl_target"], s["final_kl_to_target"]) == (6.3012, "pi", 6.0, 1.05)
    text = capsys.readouterr().out
    table = text[text.index("held-out accuracy (greedy"):].splitlines()[1:4]
    assert [row.split(":")[0].strip() for row in table] == [
        "original model (before SFT)", "SFT model (PPO's start, step 0)", "PPO policy (step 60)"]
    assert [row.split(":")[1].split("%")[0].strip() for row in table] == ["0.0", "50.0", "75.0"]
    assert "+25.0 points over PPO's start" in table[2]
    assert "final kl_mean (nats/seq)    : 6.30 (kl.target 6 of kl.type=pi: 1.05x)" in text
    # a rerun reuses the original model's evaluation
    fake.cmds.clear()
    assert demo.main(_custom(tmp_path, monkeypatch)) == 0
    assert not [c for c in fake.cmds if c[1] == "nemo_rlhf.evaluate"]


def test_without_sft_the_summary_says_the_baseline_is_the_original_model(tmp_path, monkeypatch, capsys):
    FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_custom(tmp_path, monkeypatch)) == 0
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["baseline_model"] == "original" and "original_accuracy" not in s
    text = capsys.readouterr().out
    table = text[text.index("held-out accuracy (greedy"):].splitlines()[1:3]
    assert [row.split(":")[0].strip() for row in table] == ["original model (PPO's start, step 0)",
                                                            "PPO policy (step 60)"]


def test_a_rerun_that_skips_every_stage_keeps_the_timings_of_the_run_that_did_the_work(tmp_path, monkeypatch,
                                                                                        capsys):
    """Issue 54: the rerun's summary had zeros for every stage. The SFT stage's time is
    labelled as including the first sampling (of the model that could not do the task)."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.0 if ckpt.endswith("/model/checkpoints/step_0") else 0.5)
    assert demo.main(_custom(tmp_path, monkeypatch)) == 0
    path = tmp_path / "out" / "summary.json"
    first = json.loads(path.read_text())
    assert list(first["wall_time_s"]) == ["model_setup", "data", "first_samples_and_sft", "rm_samples", "rm",
                                          "rm_auc", "ppo", "refresh", "eval"]
    assert first["wall_time_s_kept"] == []
    worked = {k: 100.0 + i for i, k in enumerate(first["wall_time_s"])}  # what a real run would have taken
    path.write_text(json.dumps({**first, "wall_time_s": worked}))
    n_cmds, n_ppo = len(fake.cmds), len(fake.ppo)
    capsys.readouterr()
    assert demo.main(_custom(tmp_path, monkeypatch)) == 0
    assert (len(fake.cmds), len(fake.ppo)) == (n_cmds, n_ppo)  # every stage skipped
    again = json.loads(path.read_text())
    assert again["wall_time_s"] == worked and again["wall_time_s_kept"] == list(worked)
    assert "kept from the run that did the work" in capsys.readouterr().out
    # a rerun that does some work (a longer PPO) times that stage anew and keeps the others
    assert demo.main([*_custom(tmp_path, monkeypatch), "trainer.max_steps=70"]) == 0
    third = json.loads(path.read_text())
    assert third["wall_time_s_kept"] == [k for k in worked if k != "ppo"]
    assert third["wall_time_s"]["ppo"] < 100.0 and third["wall_time_s"]["rm"] == worked["rm"]


def _help_groups(capsys) -> dict[str, str]:
    """``--help``: each flag -> the title of the group it is listed under."""
    import re

    with pytest.raises(SystemExit):
        demo.main(["--help"])
    groups, group = {}, None
    for line in capsys.readouterr().out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            group = line[:-1]
        m = re.match(r"  (--[a-z0-9-]+)", line)
        if m and group:
            groups[m.group(1)] = group
    return groups


RECIPE_GROUP = "the recipe (--task smollm2 and --task package.module:TASK)"
SMOLLM2_GROUP = "the SmolLM2 model's RM (--task smollm2, or --task package.module:TASK --model smollm2)"


def test_help_labels_the_flags_by_where_they_apply_and_they_do_apply_there(tmp_path, monkeypatch, capsys):
    """Issue 54: --help marked flags "smollm2:" that a package.module:TASK run uses too.
    The recipe's flags change a custom task's stages (tiny model); the SmolLM2 RM's
    flags change a custom task's RM job on that model."""
    groups = _help_groups(capsys)
    for flag in ("--reward", "--rm-prompts", "--rm-samples-per-prompt", "--rm-temperature", "--rm-epochs",
                 "--rm-edit-pairs", "--rm-val-prompts", "--ppo-prompts"):
        assert groups[flag] == RECIPE_GROUP, flag
    assert groups["--rm-lr"] == groups["--rm-freeze-layers"] == SMOLLM2_GROUP
    assert {groups[f] for f in ("--model", "--sft-steps", "--sft-rows", "--model-seed")} == {
        "--task package.module:TASK only"}
    assert groups["--rm-override"] == "--task tiny only"
    assert {g for f, g in groups.items() if f.startswith("--refresh-")} == {
        "the refresh rounds (every task; needs the RM reward)"}
    assert {groups[f] for f in ("--out", "--data", "--nproc", "--precision", "--sft-override")} == {"every task"}

    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    argv = _custom(tmp_path, monkeypatch)
    assert demo.main([*argv, "--rm-samples-per-prompt", "3", "--rm-temperature", "0.9", "--rm-epochs", "2",
                      "--reward", "both"]) == 0
    samples = [c for c in fake.cmds if any(x.startswith("samples_out=") for x in c)]
    assert samples and all("num_samples=3" in c and "temperature=0.9" in c for c in samples)
    pairs = sum(1 for _ in (tmp_path / "out" / "rm_data" / "preference_train.jsonl").open())
    (rm,) = [c for c in fake.cmds if c[1] == "nemo_rlhf.train_rm"]
    assert f"trainer.max_steps={max(1, int(2 * pairs // 16))}" in rm
    assert "reward.functions=[{name: 'pkg_upper_task:TASK.score'}]" in fake.ppo[0]["args"]

    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    argv[argv.index("--model") + 1] = "smollm2"
    argv[argv.index("--out") + 1] = str(tmp_path / "out_smollm2")
    assert demo.main([*argv, "--precision", "32", "--rm-lr", "2e-4", "--rm-freeze-layers", "3"]) == 0
    (rm,) = [c for c in fake.cmds if c[1] == "nemo_rlhf.train_rm"]
    assert "optim.lr=0.0002" in rm and "rm.freeze_layers=3" in rm


FAKE_TRAINER = """
import sys
print("fake trainer stdout", " ".join(sys.argv[1:]))
print("fake trainer stderr", file=sys.stderr)
"""


def test_the_ppo_stage_log_sits_in_out_logs_with_the_other_stages(tmp_path, monkeypatch, capsys):
    """Issue 54: the PPO trainer's output went to the console only. The real PPO stage
    (launchers.local, no RM) with a stand-in trainer script."""
    import dataclasses

    import launchers.local as local

    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    real = local.run_ppo_with_rm
    monkeypatch.setattr(local, "run_ppo_with_rm", lambda overrides, cfg: real(
        overrides, dataclasses.replace(cfg, trainer_module=str(script))))
    stages.ppo_stage(["+probe=1"], None, tmp_path / "out" / "ppo", "ppo_tiny", 1, 2)
    log = (tmp_path / "out" / "logs" / "ppo.log").read_text()
    assert log.startswith("# ") and "fake_trainer.py --config-name ppo_tiny +probe=1" in log.splitlines()[0]
    assert "fake trainer stdout --config-name ppo_tiny +probe=1" in log and "fake trainer stderr" in log
    assert "fake trainer stdout" in capsys.readouterr().out  # and on the console, as before


def _checkpoint(root: Path, step: int, complete: bool = True, corrupt: bool = False) -> Path:
    """A ``step_<step>`` folder of one 1000-byte file with its recorded size and sha256
    (``corrupt``: the file changed after the save), ``COMPLETE`` when ``complete``; ``latest``
    names it."""
    import hashlib

    path = root / f"step_{step}"
    path.mkdir(parents=True)
    data = bytes(range(200)) * 5
    (path / "model.bin").write_bytes(data)
    (path / "metadata.json").write_text(json.dumps(
        {"step": step, "files": {"model.bin": [len(data), hashlib.sha256(data).hexdigest()]}}))
    if corrupt:
        (path / "model.bin").write_bytes(data[::-1])
    if complete:
        (path / "COMPLETE").write_text("")
        (root / "latest").write_text(path.name)
    return path


def _stage_folders(out: Path) -> dict:
    ppo, rm, bad = out / "ppo" / "checkpoints", out / "rm" / "checkpoints", out / "refresh" / "round_1" / "rm" / "checkpoints"
    for step in (5, 10):
        _checkpoint(ppo, step)
    _checkpoint(ppo, 12, complete=False)  # a save in progress: never touched
    _checkpoint(rm, 3)
    _checkpoint(bad, 1)
    _checkpoint(bad, 2, corrupt=True)
    return {"ppo": ppo, "rm": rm, "bad": bad}


def test_keep_last_checkpoint_keeps_each_stages_newest_verified_checkpoint(tmp_path, monkeypatch, capsys):
    """``--keep-last-checkpoint``: after the run, each stage folder keeps its newest complete
    checkpoint (what later stages took, what a rerun resumes from), and only when it
    verifies; an incomplete save and a folder whose newest does not verify stay as they are."""
    FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    argv = _custom(tmp_path, monkeypatch)
    f = _stage_folders(tmp_path / "out")
    assert demo.main([*argv, "--keep-last-checkpoint"]) == 0
    names = lambda root: sorted(p.name for p in root.iterdir())  # noqa: E731
    assert names(f["ppo"]) == ["latest", "step_10", "step_12"]
    assert names(f["rm"]) == ["latest", "step_3"]
    assert names(f["bad"]) == ["latest", "step_1", "step_2"]
    text = capsys.readouterr().out
    assert f"--keep-last-checkpoint: {f['ppo']}: kept step_10, deleted step_5 (0.00 GB)" in text
    assert f"{f['bad']}: kept every checkpoint, the newest (step_2) does not verify: model.bin: checksum mismatch" in text


def test_without_keep_last_checkpoint_nothing_is_deleted(tmp_path, monkeypatch):
    FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    f = _stage_folders(tmp_path / "out")
    assert demo.main(_custom(tmp_path, monkeypatch)) == 0
    assert sorted(p.name for p in f["ppo"].iterdir()) == ["latest", "step_10", "step_12", "step_5"]


def test_the_tiny_demo_prunes_with_keep_last_checkpoint(tmp_path, monkeypatch):
    FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    f = _stage_folders(tmp_path / "out")
    assert demo.main(["--task", "tiny", "--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"),
                      "--keep-last-checkpoint"]) == 0
    assert sorted(p.name for p in f["ppo"].iterdir()) == ["latest", "step_10", "step_12"]
