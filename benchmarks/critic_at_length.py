"""The critic at length, measured (#52): shared-backbone vs separate critic, plain GAE vs the
VAPO / VC-PPO features, on the long chain task with the tiny model.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/critic_at_length.py --out experiments/critic_at_length

Stages, each skipped when its output exists (a rerun continues; ``--out`` keeps everything):

1. data (``<out>/data``): ``--task`` (:data:`nemo_rlhf.tasks.chain.TASK`: 47 steps, a
   517-token correct response; ``nemo_rlhf.tasks.chain:TASK_2K``: 2040 tokens): SFT demonstrations of the PPO prompts
   (:func:`~nemo_rlhf.tasks.task.demonstration_rows`), the PPO prompts, the first
   ``--eval-n`` held-out problems;
2. the tiny model with random weights (``python -m launchers.recipe init-tiny``) and one SFT
   (``conf/sft_tiny.yaml``, ``--sft-steps``, the task's lengths by
   :func:`~nemo_rlhf.tasks.chain.chain_overrides`), the start of every PPO run;
3. PPO (``conf/ppo_tiny.yaml``, reward: the task's checker, 1 for a right final answer, or
   with ``--reward prefix`` the share of lines right before the first slip, at the last
   token either way; no RM) for every arm x seed, ``--parallel`` runs at a time (each one process, one rank):
   ``critic.mode`` shared / separate x ``plain`` (``ppo.lam=0.95`` for both the critic's
   targets and the advantages) / ``vapo`` (``trainer.critic_warmup_steps=--warmup``
   ``ppo.lam_critic=1.0 ppo.lam_policy_alpha=0.05``: VC-PPO's value pretraining and
   Monte-Carlo critic targets, VAPO's length-adaptive policy lambda); the held-out
   evaluation (greedy, the checker) at step 0 and at the last step;
4. the table, from each run's ``metrics.jsonl``: held-out accuracy before / after (and the
   held-out share of lines right before the first slip, ``eval/<prefix_score>``),
   ``explained_variance`` early (mean of the first two steps) and late (the last two),
   ``critic/value_error_pos_<lo>-<hi>`` (mean ``|V - R|`` by response-position bucket, at
   the first and at the last step), the reward (the share of right rollouts) at the first and
   the last step, the wall time; written to ``<out>/table.md`` and ``<out>/results.json``.

The seeds vary PPO (``trainer.seed``: sampling, the separate critic's value-head init) from
the one SFT model. Simplified: one SFT model for every run (its seed ``--model-seed``); the
KL controller is conf/ppo_tiny.yaml's in every arm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ARMS = {
    "plain": ["ppo.lam=0.95"],
    "vapo": ["ppo.lam_critic=1.0", "ppo.lam_policy_alpha=0.05"],  # + trainer.critic_warmup_steps
}
"""Arm name -> its PPO overrides (``vapo`` also gets ``trainer.critic_warmup_steps``)."""
CRITICS = ("shared", "separate")
BUCKETS = ("0-1", "8-15", "64-127", "256-511", "512-1023", "1024-2047")
"""The value-error buckets the table shows (each present when a response reached it)."""


def _jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _latest(exp: Path):
    from launchers.stages import latest_checkpoint

    return latest_checkpoint(exp)


def _run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        code = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    if code:
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}; see {log}")


def prepare(a, task, lengths: list[str]) -> tuple[Path, Path]:
    """Stages 1-2: the data files, the tiny model and its SFT; ``(data dir, SFT checkpoint)``."""
    from nemo_rlhf.tasks.task import demonstration_rows

    out, data = Path(a.out), Path(a.out) / "data"
    if not (data / "eval.jsonl").exists():
        data.mkdir(parents=True, exist_ok=True)
        train = [task.prompt_row(p) for p in task.train]
        heldout = [task.prompt_row(p) for p in task.heldout[:a.eval_n]]
        (data / "sft_val.jsonl").write_text(_jsonl(demonstration_rows(task, train[:32])))
        (data / "sft.jsonl").write_text(_jsonl(demonstration_rows(task, train[32:])))
        (data / "ppo_prompts.jsonl").write_text(_jsonl(train[32:]))
        (data / "eval.jsonl").write_text(_jsonl(heldout))
    model = out / "model"
    if _latest(model) is None:
        _run([sys.executable, "-m", "launchers.recipe", "init-tiny", str(model), str(a.model_seed)],
             out / "logs" / "model.log")
    sft = out / "sft"
    if _latest(sft) is None:
        t0 = time.time()
        _run([sys.executable, "-m", "nemo_rlhf.train_sft", "--config-name", "sft_tiny",
              f"exp_manager.exp_dir={sft}", f"sft.init_from={_latest(model)}",
              f"data.train_file={data / 'sft.jsonl'}", f"data.val_file={data / 'sft_val.jsonl'}",
              f"data.tokenizer_dir={_latest(model) / 'tokenizer'}", *lengths[:2],
              f"trainer.max_steps={a.sft_steps}", f"trainer.val_check_interval={a.sft_steps}",
              f"trainer.global_batch_size={a.sft_batch}", f"trainer.micro_batch_size={a.sft_batch}",
              f"trainer.log_every_n_steps={max(1, a.sft_steps // 10)}", "sft.num_sample_prompts=2",
              f"sft.sample_max_new_tokens={task.max_new_tokens}", f"trainer.seed={a.model_seed}",
              *a.sft_override], out / "logs" / "sft.log")
        (sft / "wall_s.txt").write_text(f"{time.time() - t0:.0f}\n")
    return data, _latest(sft)


PREFIX = "nemo_rlhf.tasks.chain:prefix_score"
CHARS = "nemo_rlhf.tasks.chain:char_score"
"""The partial-credit reward functions (``--reward prefix`` / ``chars``), both also evaluated
on the held-out set (``eval/<name>``)."""


def ppo_command(a, checker: str, data: Path, sft: Path, lengths: list[str], critic: str, arm: str,
                seed: int, exp: Path) -> list[str]:
    """The PPO job of one run (stage 3)."""
    reward = {"final": checker, "prefix": PREFIX, "chars": CHARS}[a.reward]
    warmup = [f"trainer.critic_warmup_steps={a.warmup}"] if arm == "vapo" and a.warmup else []
    return [sys.executable, "-m", "nemo_rlhf.train_ppo", "--config-name", "ppo_tiny",
            f"exp_manager.exp_dir={exp}", "exp_manager.resume=none", f"exp_manager.init_from={sft}",
            f"data.train_file={data / 'ppo_prompts.jsonl'}", f"data.val_file={data / 'eval.jsonl'}",
            f"data.tokenizer_dir={sft / 'tokenizer'}", *lengths,
            f"trainer.max_steps={a.ppo_steps}", f"trainer.val_check_interval={a.ppo_steps}",
            "trainer.sample_table_every=0", "exp_manager.save_interval=0", f"trainer.seed={seed}",
            f"trainer.eval_checker='{checker}'", f"trainer.eval_extra_checkers=['{PREFIX}','{CHARS}']",
            "reward.rm_weight=0", f"reward.functions=[{{name: '{reward}'}}]",
            "reward.normalization=fixed", "guards.gold_window=1",
            f"ppo.num_rollout_samples={a.rollouts}", f"ppo.global_batch_size={a.rollouts // 2}",
            f"ppo.micro_batch_size={a.rollouts // 4}", f"ppo.forward_micro_batch_size={a.rollouts // 2}",
            f"critic.mode={critic}", *ARMS[arm], *warmup, *a.ppo_override]


def _rows(exp: Path) -> list[dict]:
    path = exp / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def summarize(exp: Path, steps: int) -> dict:
    """One run's numbers from its ``metrics.jsonl`` (stage 4)."""
    rows = _rows(exp)
    by_step: dict[int, dict] = {}
    for r in rows:
        by_step.setdefault(int(r["step"]), {}).update(r)
    train = [by_step[s] for s in sorted(by_step) if s >= 1 and "explained_variance" in by_step[s]]

    def mean(key, part):
        vals = [r[key] for r in part if key in r]
        return sum(vals) / len(vals) if vals else None

    first, last = (train[0], train[-1]) if train else ({}, {})
    return {
        "acc_before": by_step.get(0, {}).get("eval/accuracy"), "acc_after": by_step.get(steps, {}).get("eval/accuracy"),
        "prefix_before": by_step.get(0, {}).get(f"eval/{PREFIX}"),
        "prefix_after": by_step.get(steps, {}).get(f"eval/{PREFIX}"),
        "chars_before": by_step.get(0, {}).get(f"eval/{CHARS}"),
        "chars_after": by_step.get(steps, {}).get(f"eval/{CHARS}"),
        "ev_early": mean("explained_variance", train[:2]), "ev_late": mean("explained_variance", train[-2:]),
        "reward_first": first.get("reward_mean"), "reward_last": last.get("reward_mean"),
        "length_first": first.get("response_length"), "length_last": last.get("response_length"),
        "value_error_first": {b: first.get(f"critic/value_error_pos_{b}") for b in BUCKETS},
        "value_error_last": {b: last.get(f"critic/value_error_pos_{b}") for b in BUCKETS},
        "steps_logged": len(train),
    }


def _f(x, pct=False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if pct else f"{x:.2f}"


def table(results: list[dict]) -> str:
    """The markdown table of every run (stage 4)."""
    shown = [b for b in BUCKETS if any(r["value_error_last"].get(b) is not None for r in results)]
    head = ["critic", "arm", "seed", "held-out before", "after", "lines right before", "after",
            "chars right before", "after", "EV early", "EV late", "reward first", "last",
            *[f"|V-R| {b} first/last" for b in shown], "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["critic"], r["arm"], str(r["seed"]), _f(r["acc_before"], True), _f(r["acc_after"], True),
                 _f(r["prefix_before"], True), _f(r["prefix_after"], True),
                 _f(r["chars_before"], True), _f(r["chars_after"], True),
                 _f(r["ev_early"]), _f(r["ev_late"]), _f(r["reward_first"]), _f(r["reward_last"]),
                 *[f"{_f(r['value_error_first'].get(b))} / {_f(r['value_error_last'].get(b))}" for b in shown],
                 f"{r['wall_s']:.0f}" if r.get("wall_s") is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="experiments/critic_at_length")
    ap.add_argument("--task", default="nemo_rlhf.tasks.chain:TASK",
                    help="a chain task, package.module:ATTRIBUTE (TASK: 47 lines, a 517-token response)")
    ap.add_argument("--model-seed", type=int, default=1)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--sft-batch", type=int, default=16)
    ap.add_argument("--ppo-steps", type=int, default=8)
    ap.add_argument("--rollouts", type=int, default=32, help="ppo.num_rollout_samples (a multiple of 4)")
    ap.add_argument("--warmup", type=int, default=2, help="trainer.critic_warmup_steps of the vapo arm")
    ap.add_argument("--eval-n", type=int, default=64, help="held-out problems evaluated")
    ap.add_argument("--reward", choices=("final", "prefix", "chars"), default="final",
                    help="final: the task's checker (1 for a right final number); prefix: the share of "
                         "lines right before the first slip (nemo_rlhf.tasks.chain:prefix_score); chars: "
                         "the share of the chain's characters right at their position (:char_score)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--critics", nargs="+", default=list(CRITICS), choices=CRITICS)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--parallel", type=int, default=2, help="PPO runs at a time")
    ap.add_argument("--sft-override", action="append", default=[], help="KEY=VALUE of the SFT job (repeatable)")
    ap.add_argument("--ppo-override", action="append", default=[], help="KEY=VALUE of every PPO job (repeatable)")
    ap.add_argument("--prepare-only", action="store_true", help="stop after the SFT")
    a = ap.parse_args(argv)
    if a.rollouts % 4:
        raise SystemExit(f"--rollouts={a.rollouts}: must be a multiple of 4 (mini- and micro-batches)")
    from nemo_rlhf.tasks.chain import chain_overrides
    from nemo_rlhf.tasks.task import load_task

    task, checker = load_task(a.task)
    lengths = chain_overrides(task)
    out = Path(a.out)
    t0 = time.time()
    data, sft = prepare(a, task, lengths)
    print(f"SFT model: {sft} ({time.time() - t0:.0f} s this run)", flush=True)
    if a.prepare_only:
        return 0
    runs = [(c, arm, s) for s in a.seeds for c in a.critics for arm in a.arms]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p]])}
    pending, running, wall = list(runs), {}, {}
    while pending or running:
        while pending and len(running) < a.parallel:
            c, arm, s = pending.pop(0)
            exp = out / "ppo" / f"{c}_{arm}_seed{s}"
            if (exp / "done.json").exists():
                wall[(c, arm, s)] = json.loads((exp / "done.json").read_text())["wall_s"]
                continue
            exp.mkdir(parents=True, exist_ok=True)
            log = (out / "logs" / f"ppo_{c}_{arm}_seed{s}.log").open("w")
            cmd = ppo_command(a, checker, data, sft, lengths, c, arm, s, exp)
            running[(c, arm, s)] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env),
                                    time.time(), exp, log)
            print(f"started {c} {arm} seed {s}", flush=True)
        time.sleep(5)
        for key, (proc, start, exp, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[key]
            if proc.returncode:
                print(f"FAILED ({proc.returncode}): {key}, see {log.name}", flush=True)
                continue
            wall[key] = time.time() - start
            (exp / "done.json").write_text(json.dumps({"wall_s": wall[key]}))
            print(f"done {key} in {wall[key]:.0f} s", flush=True)
    results = [{"critic": c, "arm": arm, "seed": s, "wall_s": wall.get((c, arm, s)),
                **summarize(out / "ppo" / f"{c}_{arm}_seed{s}", a.ppo_steps)} for c, arm, s in runs]
    md = table(results)
    (out / "results.json").write_text(json.dumps({"args": vars(a), "runs": results}, indent=2))
    (out / "table.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
