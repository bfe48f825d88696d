"""Multi-turn episodes: KV cache kept across turns vs recomputing the prefix each turn (#51).

Runs ``--batch`` episodes of ``--turns`` policy turns (greedy, ``--new`` tokens per turn
unless EOS comes first) on a Llama-style megatron model (``bench_rollout.py``'s ``tiny``
shape: 4 layers, hidden 256, 4 heads / 2 KV heads, vocab 1024, random weights), each turn
answered by a scripted environment with an ``--obs``-token observation, through
:func:`nemo_rlhf.rollout.episodes.run_episodes`:

* ``kept``: the default path, one static KV cache for the whole episode (only the appended
  observation tokens are prefilled);
* ``recompute``: ``recompute_prefix=True``, one :func:`~nemo_rlhf.rollout.generate` call
  per turn whose prompt is the whole conversation so far (the prefix prefilled again each
  turn, the same tokens: ``--turns`` single-turn generations).

The two are interleaved (``--repeats`` pairs after one warm-up each) and the table gives the
median wall time, episodes/s, and the ratio of the medians with the median (min-max) of the
per-pair ratios, by wall time and by process CPU time (less sensitive to other jobs on a
shared machine); the episodes of both paths are checked to be the same tokens. On a shared
machine single runs are noisy: run it several times.

Run: ``python benchmarks/bench_multiturn.py`` (CPU, 1 thread by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

TINY = dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=688, vocab_size=1024, init_method_std=0.05)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8, help="episodes per call")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--new", type=int, default=32, help="tokens per policy turn")
    p.add_argument("--obs", type=int, default=32, help="tokens per observation")
    p.add_argument("--turns", type=int, default=3, help="policy turns per episode")
    p.add_argument("--repeats", type=int, default=5, help="timed pairs")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on a loaded shared machine 2 threads measured 40-75x slower)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Run the benchmark, print the table, return the medians and the ratio."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)

    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.envs import EnvLimits, Environment, StepResult
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import ModelConfig
    from nemo_rlhf.rollout import RolloutConfig
    from nemo_rlhf.rollout.episodes import run_episodes

    vocab = TINY["vocab_size"]
    total = args.prompt + args.turns * (args.new + args.obs)
    mcfg = ModelConfig(name="bench", max_position_embeddings=total + 8, **TINY)
    dims = initialize_distributed(ParallelConfig(), seed=0)
    model = build_model(mcfg, dims, seed=7).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab - 1, (args.prompt,), generator=g).tolist()
               for _ in range(args.batch)]
    obs_ids = torch.randint(1, vocab - 1, (args.obs,), generator=g).tolist()

    class Scripted(Environment):
        def reset(self, problem):
            self.k = 0
            return str(problem)

        def step(self, trajectory_so_far, last_action_text):
            self.k += 1
            if self.k >= args.turns:
                return StepResult(None, True, 1.0)
            return StepResult("obs", False)

    def run(recompute: bool):
        envs = [Scripted() for _ in prompts]
        return run_episodes(
            model, dims, envs, list(range(len(prompts))), RolloutConfig(greedy=True, max_new_tokens=args.new),
            EnvLimits(max_turns=args.turns, max_total_tokens=total + 1),
            encode_prompt=lambda text: prompts[int(text)], encode_observation=lambda text: obs_ids,
            decode_fn=lambda ids: "", eos_token_id=vocab - 1, pad_token_id=0, vocab_size=vocab,
            max_sequence_length=total + 8, call_index=0, recompute_prefix=recompute)

    load0 = os.getloadavg()[0]
    kept_out, re_out = run(False), run(True)  # warm-up, and the same tokens both ways
    same = [a.trajectory.token_ids == b.trajectory.token_ids for a, b in zip(kept_out, re_out)]
    times = {"kept": [], "recompute": []}
    cpu = {"kept": [], "recompute": []}
    for _ in range(args.repeats):
        for what in ("kept", "recompute"):
            t0, c0 = time.perf_counter(), time.process_time()
            run(what == "recompute")
            times[what].append(time.perf_counter() - t0)
            cpu[what].append(time.process_time() - c0)
    load1 = os.getloadavg()[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    pair = [r / k for k, r in zip(times["kept"], times["recompute"])]
    pair_cpu = [r / k for k, r in zip(cpu["kept"], cpu["recompute"])]
    turns = [e.trajectory.turns for e in kept_out]
    tokens = sum(len(e.trajectory) for e in kept_out)
    print(f"{args.batch} episodes x {args.turns} turns: prompt {args.prompt}, {args.new} new / turn, "
          f"{args.obs}-token observations; {tokens} tokens in all, turns {min(turns)}-{max(turns)}; "
          f"{args.threads} threads, load {load0:.2f} -> {load1:.2f}")
    print(f"same tokens both ways: {sum(same)}/{len(same)} episodes")
    for k in ("kept", "recompute"):
        print(f"  {k:9s}: median {med[k]:.3f} s wall ({args.batch / med[k]:.2f} episodes/s), "
              f"{med_cpu[k]:.3f} s process CPU")
    ratio = med["recompute"] / med["kept"]
    ratio_cpu = med_cpu["recompute"] / med_cpu["kept"]
    print(f"kept cache vs recompute: {ratio:.2f}x episodes/s by wall time (per pair: median "
          f"{statistics.median(pair):.2f}x, {min(pair):.2f}x-{max(pair):.2f}x); {ratio_cpu:.2f}x by "
          f"process CPU time (per pair: median {statistics.median(pair_cpu):.2f}x, "
          f"{min(pair_cpu):.2f}x-{max(pair_cpu):.2f}x)")
    return {"median_s": med, "median_cpu_s": med_cpu, "ratio": ratio, "ratio_cpu": ratio_cpu,
            "same_tokens": sum(same), "episodes": len(same)}


if __name__ == "__main__":
    main()
