"""The GPU check's steps for issue #52: context parallelism and MoE routing replay.

Called by ``benchmarks/gpu_check.py`` (:class:`GPUCheck`) after its PPO runs, each step a
subprocess with a timeout and its log in ``<work>/logs/<step>.log`` like the others:

* ``context_parallel``: ``benchmarks/bench_context_parallel_memory.py`` -- one PPO step
  (synthetic rollout of ``S`` tokens, the forward-only passes, the update) at
  ``parallel.context_parallel_size=1`` on one rank and at CP=2 on two. On a GPU machine it
  needs 2 GPUs (one rank a GPU, NCCL; ``tests/distributed/harness.py``) and is skipped,
  saying so, with fewer; ``S`` = :data:`CP_LENGTHS_GPU`, peak memory from
  ``torch.cuda.max_memory_allocated``. With ``--cpu``: gloo ranks on the host, ``S`` =
  :data:`CP_LENGTHS_CPU`, the profiler's allocation records. Passes when every length's
  step metrics (``policy_loss``, ``value_loss``, ``entropy``, ``grad_norm``, ``approx_kl``,
  ``kl_mean``) at CP=2 equal CP=1's within :data:`CP_TOL_GPU` (GPU: other reduction orders)
  or :data:`CP_TOL_CPU` relative; the CP2/CP1 peak-memory ratio per length is reported
  (the issue's target is <= 0.6; not a pass condition).
* ``routing_replay``: ``benchmarks/bench_routing_replay_ppo.py`` -- PPO steps of a tiny
  8-expert top-2 MoE whose rollouts decode on bfloat16-rounded weights, with
  ``moe.routing_replay`` off and on, on one device (the GPU, or the host with ``--cpu``).
  Passes when both runs' mismatch metrics (``rollout_train_logprob_diff_mean`` / ``_max``,
  ``rollout_train_k3_kl``) are finite; reports them side by side (replay lowers the max
  only where a route flipped: docs/models.md, Routing replay).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CP_LENGTHS_GPU = (2048, 8192)
"""Sequence lengths of the GPU run (tokens a row, 2 rows)."""
CP_LENGTHS_CPU = (256,)
"""... of the ``--cpu`` dry run."""
CP_TOL_GPU = 1e-4
CP_TOL_CPU = 1e-5
"""Largest relative difference ``|a - b| / max(1, |b|)`` of a step metric, CP=2 vs CP=1."""


def context_parallel(check) -> bool:
    """The ``context_parallel`` step of ``check`` (a :class:`GPUCheck`); see the module
    docstring. Returns whether it passed (True when skipped)."""
    gpus = 0 if check.cpu else check.torch.cuda.device_count()
    if not check.cpu and gpus < 2:
        check.skip("context_parallel", f"{gpus} GPU visible: CP=2 runs one rank a GPU and needs 2 "
                   "(the host's gloo tests cover CP=2 == CP=1: tests/distributed/test_ppo_context_parallel.py)")
        return True
    out = check.work / "bench_context_parallel_memory.json"
    lengths = CP_LENGTHS_CPU if check.cpu else CP_LENGTHS_GPU
    cmd = [check.python, str(REPO / "benchmarks" / "bench_context_parallel_memory.py"), "--lengths",
           *map(str, lengths), "--rows", "2", "--json", str(out)]
    step, rc = check.run("context_parallel", cmd, check.args.timeout_bench)
    bench = json.loads(out.read_text()) if rc == 0 and out.is_file() else None
    check.report["context_parallel"] = bench
    if bench is None:
        return check.settle(step, False, f"exit {rc}")
    tol = CP_TOL_CPU if check.cpu else CP_TOL_GPU
    rows = bench["summary"]
    ok = all(r["max_rel_metric_diff"] <= tol for r in rows)
    detail = "; ".join(f"S={r['length']}: peak {r['cp1_step_peak_mib']:.0f} -> {r['cp2_step_peak_mib']:.0f} MiB/rank "
                       f"({r['ratio']:.2f}x), metrics diff {r['max_rel_metric_diff']:.1e}" for r in rows)
    return check.settle(step, ok, f"{detail} (tolerance {tol:g}; on {rows[0]['device']})")


def routing_replay(check) -> bool:
    """The ``routing_replay`` step of ``check``; see the module docstring."""
    out = check.work / "bench_routing_replay_ppo.json"
    size = (["--steps", "1", "--seeds", "0", "--rows", "8", "--max-new-tokens", "8"] if check.cpu
            else ["--steps", "2", "--seeds", "0", "--rows", "32", "--max-new-tokens", "24"])
    cmd = [check.python, str(REPO / "benchmarks" / "bench_routing_replay_ppo.py"), *size, "--json", str(out)]
    step, rc = check.run("routing_replay", cmd, check.args.timeout_bench)
    bench = json.loads(out.read_text()) if rc == 0 and out.is_file() else None
    check.report["routing_replay"] = bench
    if bench is None:
        return check.settle(step, False, f"exit {rc}")
    s = bench["summary"]
    ok = all(isinstance(v, (int, float)) and math.isfinite(v) for run in s.values() for v in run.values())
    detail = ", ".join(f"{key}: " + " / ".join(f"{s[k][key]:.2e}" for k in ("without_replay", "with_replay"))
                       for key in ("rollout_train_logprob_diff_mean", "rollout_train_logprob_diff_max",
                                   "rollout_train_k3_kl"))
    return check.settle(step, ok, f"without / with replay: {detail}")


def run_steps(check) -> None:
    """Both steps, one after the other (each in its own subprocess)."""
    context_parallel(check)
    routing_replay(check)
