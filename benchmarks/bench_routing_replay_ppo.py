"""Train-rollout mismatch over PPO steps of a tiny MoE, with and without routing replay
(``moe.routing_replay``, R3, issue #52).

The megatron rollout engine decodes with the training model itself, so its behaviour
log-probs equal the trainer's up to the KV cache's rounding. To stand in for an inference
engine with other numerics, each rollout here runs on the actor's weights rounded to bfloat16
(kept in float32: the same code path; the float32 weights are put back right after the
decode), as ``benchmarks/bench_routing_replay.py`` does for one forward. The trainer then
computes the old log-probs with the float32 weights, replaying the rollout's routes or not,
and logs its mismatch metrics (``rollout_train_logprob_diff_mean`` / ``_max``,
``rollout_train_k3_kl``: :func:`nemo_rlhf.trainers.ppo.step_metrics.rollout_quality`). Printed:
one JSON line per (replay, seed, step) and a summary (means over steps and seeds, the max of
the max).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/bench_routing_replay_ppo.py [--steps 4] [--seeds 0 1] [--json PATH]

Model: ``conf/ppo_tiny.yaml`` as an 8-expert (``--experts``) top-2 MoE (``model.moe_ffn_hidden_size=32``), its
routers re-drawn N(0, 1) after the build (as the other routing-replay benchmark: top-2
choices that differ by token), on the demo task with a length reward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KEYS = ("rollout_train_logprob_diff_mean", "rollout_train_logprob_diff_max", "rollout_train_k3_kl")


def bf16_rollouts(trainer) -> None:
    """Every rollout of ``trainer`` decodes with its actor's weights rounded to bfloat16."""
    source_rollout = trainer.rollout_source.rollout

    def rollout(step, idx):
        params = list(trainer.model.parameters())
        kept = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.copy_(p.to(torch.bfloat16).float())
        try:
            return source_rollout(step, idx)
        finally:
            with torch.no_grad():
                for p, k in zip(params, kept):
                    p.copy_(k)

    trainer.rollout_source.rollout = rollout


def run(tmp: Path, replay: bool, seed: int, steps: int, rows: int, new_tokens: int, experts: int) -> list[dict]:
    from nemo_rlhf.models.routing_replay import moe_routers
    from nemo_rlhf.train_ppo import build
    from tests.ppo_helpers import compose_ppo, make_demo_data

    cfg = compose_ppo(make_demo_data(tmp / "data"), tmp / f"exp_{replay}_{seed}",
                      f"model.num_moe_experts={experts}", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
                      f"moe.routing_replay={str(replay).lower()}", f"trainer.max_steps={steps}",
                      f"trainer.seed={seed}", f"rollout.seed={seed}", f"ppo.num_rollout_samples={rows}",
                      f"ppo.global_batch_size={rows // 2}", "ppo.forward_micro_batch_size=8",
                      "ppo.micro_batch_size=4", f"rollout.max_new_tokens={new_tokens}",
                      "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]")
    trainer = build(cfg)
    with torch.no_grad():
        for r in moe_routers(trainer.model):
            r.weight.normal_(0.0, 1.0, generator=torch.Generator(r.weight.device).manual_seed(3 + seed))
    bf16_rollouts(trainer)
    out = []
    try:
        for step in range(1, steps + 1):
            m = trainer.train_step()
            trainer.step += 1
            row = {"replay": replay, "seed": seed, "step": step, **{k: float(m[k]) for k in KEYS},
                   "reward_mean": float(m["reward_mean"])}
            print(json.dumps(row), flush=True)
            out.append(row)
    finally:
        trainer.close()
        from nemo_rlhf.distributed import destroy_distributed
        destroy_distributed()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--json", default=None, help="also write the summary and the rows here")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for replay in (False, True):
            for seed in args.seeds:
                rows += run(Path(tmp), replay, seed, args.steps, args.rows, args.max_new_tokens, args.experts)
    summary = {}
    for replay in (False, True):
        mine = [r for r in rows if r["replay"] == replay]
        summary["with_replay" if replay else "without_replay"] = {
            "rollout_train_logprob_diff_mean": sum(r["rollout_train_logprob_diff_mean"] for r in mine) / len(mine),
            "rollout_train_logprob_diff_max": max(r["rollout_train_logprob_diff_max"] for r in mine),
            "rollout_train_k3_kl": sum(r["rollout_train_k3_kl"] for r in mine) / len(mine)}
    result = {"summary": summary, "steps": args.steps, "seeds": args.seeds, "experts": args.experts}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
