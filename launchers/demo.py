"""The demo pipeline behind ``make demo``: data -> SFT -> RM -> served RM + PPO -> evaluation.

    python -m launchers.demo [--out experiments/demo] [--nproc 1] [-- <extra PPO overrides>]

Every stage is the project's own entry point run as a subprocess (exactly what a user would
run by hand), and every stage is skipped when its output already exists (rerunning the demo
after an interruption continues where it stopped; the PPO stage auto-resumes). At the end
it prints the SFT baseline and the PPO policy's held-out exact-match accuracy, the RM's
held-out preference accuracy, and the wall time of each stage, and writes them to
``<out>/summary.json``.

The task (``nemo_rlhf/data/demo_task.py``): arithmetic with operator precedence (``3+3*6=``
-> ``21``), where the SFT data was labelled by a noisy labeller that often evaluates left
to right; the RM is trained on (correct, typical mistake) pairs; PPO against the served RM
should move the policy towards the correct answers.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="experiments/demo", help="experiment root")
    ap.add_argument("--data", default="data/demo", help="demo dataset folder")
    ap.add_argument("--nproc", type=int, default=1, help="PPO trainer ranks (torchrun)")
    ap.add_argument("ppo_overrides", nargs="*", help="extra Hydra overrides for the PPO job")
    a = ap.parse_args(argv)
    out, data = REPO / a.out, REPO / a.data
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


def _rm_accuracy(rm_exp: Path):
    """The RM's last validation accuracy, from its metrics log if it wrote one."""
    path = rm_exp / "metrics.jsonl"
    if not path.exists():
        return None
    acc = None
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for k in ("val/accuracy", "val_accuracy", "val/acc"):
            if k in row:
                acc = row[k]
    return acc


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
