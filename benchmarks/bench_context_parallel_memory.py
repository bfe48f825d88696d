"""Peak memory per rank of one PPO step at ``parallel.context_parallel_size=2`` vs CP=1
(issue #52), on gloo ranks on the host.

One PPO step is the trainer's ``train_step`` with the rollout replaced by a synthetic one
(random tokens, a ``--prompt``-token prompt and a response filling the row to ``S``
tokens): the old / reference log-probs and values (forward-only passes), the advantages, and
the update (forward + backward of every micro-batch, the optimizer step). The rollout is left
out because CP does not split it: every CP rank decodes the whole sequence itself
(docs/parallelism.md), and decoding thousands of tokens on 2 cores is what this is not about.

Measured per rank, in the rank's own process:

- ``step_peak``: the high-water mark of the host tensor bytes allocated during the step
  above what was live when it began (the weights, gradients buffers and optimizer state:
  CP does not shard them), from the torch profiler's allocation records
  (``profile_memory=True``: every CPU allocation and free, summed in time order). This is
  the CPU counterpart of ``torch.cuda.max_memory_allocated() - memory_allocated()``, which is
  what is measured when the ranks run on GPUs (``tests/distributed/harness.py``: one GPU a
  rank when there are as many, else the host). Blocks allocated before the step and freed
  in it are not subtracted (the profiler warns it has no size for them): an upper bound.
- ``rss_max``: the process's resident-set high-water mark (``ru_maxrss``) after the step:
  coarse (the interpreter, torch, the allocator's caching, the profiler's own records).

Printed: one JSON line per (length, CP) run and a table with the CP2/CP1 ratio of
``step_peak`` (the issue's target: <= 0.6) per length. The two layouts' ``policy_loss`` /
``value_loss`` are printed too: the same step (tests/distributed/test_ppo_context_parallel.py
checks them within 1e-5).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/bench_context_parallel_memory.py \
        --lengths 1024 2048 4096 [--rows 2] [--chunk 1024] [--json PATH]

Model: ``conf/ppo_tiny.yaml``'s tiny Llama (2 layers, hidden 64, 4 heads, 2 KV groups) with
``model.max_position_embeddings`` = the length; ``--chunk`` is ``ppo.logprob_chunk_size``
(0: the logits path).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMPARED = ("policy_loss", "value_loss", "entropy", "grad_norm", "approx_kl", "kl_mean")
"""Step metrics printed for both layouts: the same step (CP=2 == CP=1 within 1e-5 on the
host, tests/distributed/test_ppo_context_parallel.py)."""


def synthetic_rollout(trainer, rows: int, prompt: int, length: int, seed: int):
    """A rollout source's ``rollout(step, idx)`` returning ``rows`` random rows of
    ``length`` tokens (``prompt`` of them the prompt), every response token real, on
    ``trainer.dims.device``; the same on every rank (seeded by ``seed``)."""
    from nemo_rlhf.rollout.generate import RolloutBatch

    vocab = trainer.cfg.model.vocab_size
    R = length - prompt

    def rollout(step, idx):
        g = torch.Generator().manual_seed(seed + step)
        ids = torch.randint(3, vocab, (rows, length), generator=g)
        dev = trainer.dims.device
        return RolloutBatch(
            input_ids=ids.to(dev), attention_mask=torch.ones(rows, length, dtype=torch.long, device=dev),
            prompt_length=prompt, response_ids=ids[:, prompt:].to(dev),
            response_mask=torch.ones(rows, R, dtype=torch.bool, device=dev),
            response_lengths=torch.full((rows,), R, dtype=torch.long, device=dev),
            ended=torch.zeros(rows, dtype=torch.bool, device=dev),
            truncated=torch.ones(rows, dtype=torch.bool, device=dev),
            logprobs=torch.full((rows, R), -float(torch.log(torch.tensor(float(vocab)))), device=dev),
            vocab_size=vocab)

    return rollout


def peak_step_bytes(prof) -> int:
    """The high-water mark of host bytes allocated minus freed during ``prof``, in time
    order (allocations and frees from the profiler's ``[memory]`` records; device frees or
    allocations, none here, are left out)."""
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, n in records:
        live += n
        peak = max(peak, live)
    return peak


def _worker(rank: int, tmp: str, length: int, cp: int, rows: int, prompt: int, chunk: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from nemo_rlhf.train_ppo import build
    from tests.ppo_helpers import compose_ppo, make_demo_data

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    trainer = build(compose_ppo(
        data, tmp / f"cp{cp}_{length}", f"parallel.context_parallel_size={cp}",
        f"model.max_position_embeddings={length}", f"ppo.num_rollout_samples={rows}",
        f"ppo.global_batch_size={rows}", f"ppo.micro_batch_size={rows}", f"ppo.forward_micro_batch_size={rows}",
        "ppo.ppo_epochs=1", "ppo.shuffle=false", f"ppo.logprob_chunk_size={chunk}",
        "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]"))
    trainer.rollout_source.rollout = synthetic_rollout(trainer, rows, prompt, length, seed=0)
    device = trainer.dims.device
    if device.type == "cuda":  # the allocator's own counters
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        metrics = trainer.train_step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            metrics = trainer.train_step()
        peak = peak_step_bytes(prof)
    return {"length": length, "cp": cp, "rank": rank, "device": str(device), "step_peak_mib": peak / 2**20,
            "rss_max_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            **{k: float(metrics[k]) for k in COMPARED}}


def compare(one: dict, two: dict) -> float:
    """The largest relative difference of :data:`COMPARED` between the CP=2 and the CP=1
    step's metrics (``|a - b| / max(1, |b|)``)."""
    return max(abs(two[k] - one[k]) / max(1.0, abs(one[k])) for k in COMPARED)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--rows", type=int, default=2, help="rollout rows (one micro-batch)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens of each row")
    ap.add_argument("--chunk", type=int, default=1024, help="ppo.logprob_chunk_size (0: logits)")
    ap.add_argument("--json", default=None, help="write the rows and the per-length summary here")
    args = ap.parse_args()
    if any(s % 4 or s <= args.prompt for s in args.lengths):
        raise SystemExit("--lengths: multiples of 4 (2 * CP) longer than --prompt")

    from tests.distributed.harness import run_ranks

    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in args.lengths:
            res = {}
            for cp in (1, 2):
                out = run_ranks(_worker, world_size=cp, tmp=tmp, length=length, cp=cp, rows=args.rows,
                                prompt=args.prompt, chunk=args.chunk)
                for r in out:
                    print(json.dumps(r), flush=True)
                res[cp] = max(out, key=lambda r: r["step_peak_mib"])  # the worst rank
            table.append((length, res[1], res[2]))
    summary = [{"length": length, "cp1_step_peak_mib": one["step_peak_mib"],
                "cp2_step_peak_mib": two["step_peak_mib"], "ratio": two["step_peak_mib"] / one["step_peak_mib"],
                "cp1_rss_max_mib": one["rss_max_mib"], "cp2_rss_max_mib": two["rss_max_mib"],
                "max_rel_metric_diff": compare(one, two), "device": one["device"]}
               for length, one, two in table]
    print(f"\nrows={args.rows} prompt={args.prompt} ppo.logprob_chunk_size={args.chunk} on {summary[0]['device']}; "
          "step_peak = tensor bytes above the step's start (max over ranks); rss = ru_maxrss; "
          f"metric diff = max relative difference of {', '.join(COMPARED)}")
    print("| S | CP=1 step_peak MiB | CP=2 step_peak MiB / rank | ratio | CP=1 rss MiB | CP=2 rss MiB | metric diff |")
    print("|---|---|---|---|---|---|---|")
    for r in summary:
        print(f"| {r['length']} | {r['cp1_step_peak_mib']:.1f} | {r['cp2_step_peak_mib']:.1f} | {r['ratio']:.2f} | "
              f"{r['cp1_rss_max_mib']:.0f} | {r['cp2_rss_max_mib']:.0f} | {r['max_rel_metric_diff']:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary,
                                               "rows": [x for _, o, t in table for x in (o, t)]}, indent=1))

if __name__ == "__main__":
    main()
