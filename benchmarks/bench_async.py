"""Synchronous vs asynchronous PPO on the same devices: samples/s, overlap, phase split.

The same PPO workload (``conf/ppo_tiny.yaml`` on the tiny demo's data; ``--model`` a preset
of ``conf/model/``, random weights; reward: the e2e tests' length reward) runs twice
through ``launchers.local``, each process single-threaded:

  sync   2 trainer ranks (DP=2): each rank generates its half of the rollout, then trains
  async  1 trainer rank + 1 rollout worker (``rollout.mode=async``, ``max_staleness``
         ``--staleness``, ``ppo.rollout_is_cap=2``): the worker generates step s+1 while
         the trainer trains step s

Printed: seconds per step (median of the steps after ``--warmup``), samples/s and the
async/sync ratio; the phase split of both (``timing/*``: rollout, reward, forward passes,
train, weight publication); for async the worker's generation seconds, the trainer's wait,
and the overlap fraction ``1 - trainer_wait / generate`` (the share of generation hidden
behind training). Then a *model* (not a measurement) of a GPU layout: a step of ``D``
devices split into ``R`` rollout and ``D - R`` trainer devices, from the measured
one-device phase times, assuming generation scales as ``devices ** decode_scaling`` and
the rest linearly; printed for each ``R``.

Usage: python benchmarks/bench_async.py [--model tiny|smollm2_135m] [--steps 8] [--warmup 2]
           [--samples 32] [--new 16] [--staleness 1] [--gpus 8] [--decode-scaling 0.7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(a: argparse.Namespace, mode: str, work: Path) -> list[dict]:
    from tests.ppo_helpers import make_demo_data

    data = make_demo_data(work / "data")
    exp = work / mode
    ov = [f"data.train_file={data}/ppo_prompts.jsonl", f"data.val_file={data}/eval.jsonl",
          f"data.tokenizer_dir={data}/tokenizer", f"exp_manager.exp_dir={exp}", f"model={a.model}",
          f"trainer.max_steps={a.steps}", "trainer.val_check_interval=0", "trainer.sample_table_every=0",
          "exp_manager.save_interval=0", f"ppo.num_rollout_samples={a.samples}",
          f"ppo.global_batch_size={a.samples}", f"ppo.micro_batch_size={a.micro}",
          f"ppo.forward_micro_batch_size={a.micro}", f"rollout.max_new_tokens={a.new}", "rollout.min_new_tokens=" +
          str(a.new), "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "reward.normalization=none",
          "trainer.precision=32", "exp_manager.verify_after_save=false"]
    nproc = 2
    if mode == "async":
        nproc = 1
        ov += ["rollout.mode=async", f"rollout.max_staleness={a.staleness}", "ppo.rollout_is_cap=2.0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "launchers.local", "--no-rm", "--nproc", str(nproc), "--config-name", "ppo_tiny",
           "--", *ov]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{mode} run failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    print(f"  {mode}: {time.perf_counter() - t0:.0f} s for the whole command", flush=True)
    return [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]


def _median(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--decode-scaling", type=float, default=0.7)
    a = p.parse_args()
    sys.path.insert(0, str(REPO))
    print(f"bench_async: model={a.model}, {a.samples} samples x {a.new} new tokens per step, {a.steps} steps "
          f"(first {a.warmup} not timed), {os.cpu_count()} CPUs, one thread per process", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {mode: _run(a, mode, Path(tmp)) for mode in ("sync", "async")}
    timed = {m: [r for r in rs if r["step"] > a.warmup] for m, rs in rows.items()}
    step_s = {m: _median(timed[m], "timing/step_s") for m in timed}
    sps = {m: a.samples / step_s[m] for m in step_s}
    print("\nper step (median seconds)        sync (2 trainer ranks)   async (1 trainer + 1 worker)")
    for key in ("timing/step_s", "timing/rollout_s", "timing/reward_s", "timing/old_logprobs_values_s",
                "timing/reference_logprobs_s", "timing/train_s", "timing/publish_weights_s",
                "async/generate_s", "async/trainer_wait_s", "async/weight_sync_s", "async/worker_idle_s"):
        print(f"  {key:32s} {_median(timed['sync'], key):10.3f}           {_median(timed['async'], key):10.3f}")
    gen = sum(r.get("async/generate_s", 0.0) for r in timed["async"])
    wait = sum(r.get("async/trainer_wait_s", 0.0) for r in timed["async"])
    overlap = 1.0 - wait / gen if gen else 0.0
    stale = [r["async/staleness_max"] for r in rows["async"]]
    print(f"\nsamples/s: sync {sps['sync']:.2f}, async {sps['async']:.2f}: async/sync = "
          f"{sps['async'] / sps['sync']:.2f}x")
    print(f"overlap fraction (generation hidden behind training): {overlap:.2f}; staleness per step {stale}")

    # the model: one-device phase times from the async run (its trainer and worker are one
    # device each: generation = the worker's, the rest = the trainer's step minus its wait)
    t_gen = _median(timed["async"], "async/generate_s")
    t_rest = _median(timed["async"], "timing/step_s") - _median(timed["async"], "async/trainer_wait_s")
    d, s = a.gpus, a.decode_scaling
    sync_step = t_gen / d ** s + t_rest / d
    print(f"\nMODEL (not a measurement): D={d} devices, one-device generation {t_gen:.3f} s and the rest "
          f"{t_rest:.3f} s per step (measured above), generation scaling as devices^{s}, the rest linearly; "
          f"sync on all D: {sync_step:.4f} s/step")
    for r in range(1, d):
        async_step = max(t_gen / r ** s, t_rest / (d - r))
        print(f"  R={r} rollout + {d - r} trainer devices: {async_step:.4f} s/step, speed-up {sync_step / async_step:.2f}x")


if __name__ == "__main__":
    main()
