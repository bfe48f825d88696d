"""The calc tool task end to end on the tiny model (#51).

1. (``slow``) The tiny model's random weights, SFT on ``calc:TASK``'s demonstrations (the
   call, the tool's result, the answer as segments: the loss on the two policy turns only;
   the recipe's own SFT stage arguments), then greedy held-out episodes with
   ``env.name=digit_calculator`` through ``benchmarks/tool_task_eval.py``
   (``trainer.max_steps=0``). Measured (docs/tasks.md, "A tool task"; 200 held-out
   problems, SFT 200 steps on 512 demonstrations): with the tool after SFT 92.5% (model seed
   1) and 96.0% (seed 2) with the observation masked out of the SFT loss, 80.5% and 82.5%
   when SFT also trained on it; every episode calling the tool. Bounds, on the first 64
   held-out problems: accuracy >= 0.4 and every episode calling the tool at least 0.9 of
   the time.
2. The recipe itself (``python -m launchers.demo --task <calc, 16 held-out problems> --reward
   checker``): the random model's episodes all wrong, so SFT on segmented demonstrations,
   the SFT model's sampled episodes, one PPO step on episodes, and the before / after table
   with the tool; every evaluation ran episodes (``episode`` / ``turns`` in the rows)."""

from __future__ import annotations

import json
import os
import time
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(cmd, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # 373 s on 2 shared cores at load ~20 (SFT 200 steps most of it); not timed idle
def test_sft_on_tool_demonstrations_makes_the_tiny_model_use_the_calculator(tmp_path, forked_python):
    from launchers.recipe import PROFILES
    from nemo_rlhf.tasks.calc import TASK
    from nemo_rlhf.tasks.task import demonstration_rows, write_prompt_files

    py, profile = sys.executable, PROFILES["tiny"]
    model = tmp_path / "model"
    _run([py, "-m", "launchers.recipe", "init-tiny", str(model), "1"], REPO)
    ckpt, tok = model / "checkpoints" / "step_0", model / "checkpoints" / "step_0" / "tokenizer"
    data, sft_data = tmp_path / "data", tmp_path / "sft_data"
    write_prompt_files(TASK, data, n_rm=32, n_rm_val=16, n_ppo=512)  # the measured run's files

    def demos(name):
        rows = [json.loads(x) for x in (data / name).read_text().splitlines()]
        return "".join(json.dumps(r) + "\n" for r in demonstration_rows(TASK, rows))

    sft_data.mkdir()
    (sft_data / "sft.jsonl").write_text(demos("ppo_prompts.jsonl"))
    (sft_data / "sft_val.jsonl").write_text(demos("rm_val_prompts.jsonl"))
    heldout = (data / "eval.jsonl").read_text().splitlines()[:64]
    (data / "eval64.jsonl").write_text("\n".join(heldout) + "\n")

    class A:
        precision = "32"

    _run([py, "-m", "nemo_rlhf.train_sft", *profile.sft_overrides(A, tmp_path / "sft", ckpt, sft_data, 200, tok,
                                                                   profile)], REPO)
    cmd_args = ["--checker", "nemo_rlhf.tasks.calc:TASK.score",
                f"exp_manager.init_from={tmp_path / 'sft' / 'checkpoints' / 'step_200'}",
                f"data.train_file={data / 'ppo_prompts.jsonl'}", f"data.val_file={data / 'eval64.jsonl'}",
                f"data.tokenizer_dir={tok}", "data.max_seq_length=64", "rollout.max_new_tokens=8",
                "env.name=digit_calculator", "env.max_turns=2", "env.max_total_tokens=64", "reward.rm_weight=0",
                "reward.functions=[{name: 'nemo_rlhf.tasks.calc:TASK.score'}]",
                f"exp_manager.exp_dir={tmp_path / 'ppo'}", "exp_manager.resume=none", "trainer.val_check_interval=0",
                "trainer.sample_table_every=0", "exp_manager.save_interval=0", "trainer.seed=1",
                "trainer.max_steps=0"]
    out = _run([py, str(REPO / "benchmarks" / "tool_task_eval.py"), *cmd_args], REPO)
    before = [json.loads(x) for x in out.splitlines() if x.startswith('{"heldout": "before"')][0]
    assert before["n"] == 64
    assert before["tool_call_rate"] >= 0.9, before
    assert before["accuracy"] >= 0.4, before

    # the first PPO step's batch token by token (--show-batch; docs/tasks.md, "Why PPO does not
    # fix the copy errors"), checked against docs/multi-turn.md's layout by hand: an episode is
    # call, EOS, the tool's "<product>=", answer, EOS; the mask holes exactly at the tool's tokens;
    # at step 1 (no update yet) the old log-probs are the behaviour ones and the reference's, so the
    # KL and its reward are 0 and the one token reward is the score on the final EOS; the critic
    # starts at 0, so GAE's return is score * lam^(policy tokens after t): the observation skipped
    lam = 0.95  # ppo.lam (conf/ppo.yaml's schema default)
    shown = _run([py, str(REPO / "benchmarks" / "tool_task_eval.py"), "--show-batch", "2",
                  *[x for x in cmd_args if x != "trainer.max_steps=0"]], REPO)
    batch = json.loads([x for x in shown.splitlines() if x.startswith('{"first_batch"')][0])["first_batch"]
    assert batch["estimator"] == "gae" and not any(x.startswith('{"heldout"') for x in shown.splitlines())
    checked = 0
    for r in batch["rows"]:
        call, _, rest = "".join(r["tokens"]).partition("<eos>")
        if r["score"] != 1.0 or call != r["prompt"].replace("<bos>", ""):
            continue  # the hand check below is for a right episode with a well-formed call
        product = rest.split("=", 1)[0]
        n_call, n_obs = len(call) + 1, len(product) + 1
        assert r["tokens"] == [*call, "<eos>", *product, "=", *product, "<eos>"], r["tokens"]
        assert r["loss_mask"] == [1] * n_call + [0] * n_obs + [1] * (len(product) + 1)
        policy = [t for t, m in enumerate(r["loss_mask"]) if m]
        for t in policy:
            assert abs(r["old_logprob"][t] - r["behaviour_logprob"][t]) < 1e-4
            assert abs(r["ref_logprob"][t] - r["old_logprob"][t]) < 1e-6
        assert r["token_reward"] == [0.0] * (len(r["tokens"]) - 1) + [1.0]
        assert r["value"] == [0.0] * len(r["tokens"])
        for k, t in enumerate(policy):
            assert abs(r["return"][t] - lam ** (len(policy) - 1 - k)) < 1e-4, (t, r["return"])
        assert all(r["advantage"][t] == 0.0 and r["return"][t] == 0.0 for t in range(n_call, n_call + n_obs))
        checked += 1
    assert checked >= 1, batch["rows"]


TASK_MODULE = """
import dataclasses
from nemo_rlhf.tasks.calc import TASK
SMALL = dataclasses.replace(TASK, name="calc_small", heldout=TASK.heldout[:16])
"""


# 79 s of CPU (user 73 + sys 6, this process and its stages, OMP_NUM_THREADS=1) on the 2-core
# Xeon; wall 544 s at load 17-54, so not timed idle
def test_the_recipe_runs_the_tool_task_through_sft_and_ppo_with_episodes(tmp_path, monkeypatch, capsys,
                                                                         forked_python):
    """Fails on 8f8f2c7: the recipe sampled single-turn and stopped after SFT ("the recipe
    samples single-turn")."""
    from launchers.demo import main
    from nemo_rlhf.tasks.calc import calc_answer

    (tmp_path / "calc_small_task.py").write_text(TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    out = tmp_path / "exp"
    t0 = time.perf_counter()
    assert main(["--task", "calc_small_task:SMALL", "--model", "tiny", "--model-seed", "1", "--reward", "checker",
                 "--out", str(out), "--rm-prompts", "8", "--rm-val-prompts", "1", "--ppo-prompts", "256",
                 "--sft-steps", "120", "--sft-rows", "256", "--sft-more-rounds", "0",
                 "trainer.max_steps=1", "trainer.val_check_interval=1", "exp_manager.save_interval=1",
                 "ppo.num_rollout_samples=16", "ppo.global_batch_size=16", "ppo.micro_batch_size=8",
                 "ppo.forward_micro_batch_size=16"]) == 0
    wall = time.perf_counter() - t0
    printed = capsys.readouterr().out
    s = json.loads((out / "summary.json").read_text())
    assert s["env"] == "digit_calculator" and s["sft_first"] is True and s["reward"] == "checker"
    demos = [json.loads(x) for x in (out / "sft_data" / "sft.jsonl").read_text().splitlines()]
    assert len(demos) == 256 and all([g["kind"] for g in d["segments"]] == ["policy", "env", "policy"] for d in demos)
    # the random model's episodes: no tool call, nothing right; the SFT model's: calls and right answers
    assert s["original_accuracy"] == 0.0 and s["original_episode"]["tool_call_rate"] == 0.0
    assert s["baseline_episode"]["tool_calls_mean"] >= 0.9, s["baseline_episode"]
    assert s["baseline_accuracy"] >= 0.25, s  # measured 0.75 (seed 1; after the PPO step 0.6875)
    assert 0.0 < s["rm_sample_accuracy"] and not (out / "rm").exists()  # sampled episodes, no RM
    cfg = (out / "ppo" / "checkpoints" / "step_1" / "config.yaml").read_text()
    assert "name: digit_calculator" in cfg
    # a tool task's PPO job gets the tiny profile's optim.lr (docs/tasks.md, "Why PPO does not fix
    # the copy errors"), recorded with its reason
    from omegaconf import OmegaConf
    assert OmegaConf.create(cfg).optim.lr == 1e-5 and s["defaults"]["optim.lr"]["value"] == 1e-5
    rows = [json.loads(x) for x in (out / "ppo" / "eval_samples" / "step_000000.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(r["turns"] in (1, 2) and r["episode"].endswith(r["response"]) for r in rows)
    assert all(r["correct"] == float(calc_answer(r["response"]) == r["extras"]["answer"]) for r in rows)
    assert sum(r["turns"] == 2 and r["correct"] for r in rows) >= 4  # right answers after a tool call
    samples = [json.loads(x) for x in (out / "rm_data" / "samples_train.jsonl").read_text().splitlines()]
    assert len(samples) == 32 and all("episode" in r and "turns" in r for r in samples)
    assert "with the tool: episodes with digit_calculator" in printed and "tool calls" in printed
    print(f"recipe on calc_small: {wall:.0f} s wall; SFT {s['baseline_accuracy']:.4f}, "
          f"PPO {s['ppo_accuracy']:.4f}")
