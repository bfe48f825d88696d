"""Training forward + backward over a rollout of varied lengths: padded rows vs the token
budget vs sequence packing, same model, same rows, one process.

A PPO rollout is ``[B, P + R]``: prompts left-padded to the longest prompt, responses
right-padded to the longest response. When lengths vary, most of that block is padding.
This runs the training pass of the PPO trainer (megatron's schedule through
``nemo_rlhf.models.engine.forward_backward``, the fused chunked log-probs of the response
tokens, the values, a loss over the response tokens) over the same rows, micro-batched
three ways (the trainer's own planner, ``nemo_rlhf.trainers.ppo.micro_batches``):

  rows     ``--micro`` rows per micro-batch over the rollout's full width
           (``ppo.max_tokens_per_micro_batch=0``, the default)
  budget   micro-batches by ``--budget`` padded tokens, each cut to its rows' columns
           (``ppo.max_tokens_per_micro_batch``)
  packed   the same budget with the sequences packed into rows of ``--row-length`` tokens
           (``ppo.sequence_packing=true``, ``ppo.packed_row_length``)

Printed per mode: micro-batches, computed tokens (rows x columns, or packed rows x width),
the padding fraction, seconds per pass (median of ``--repeats``, the modes interleaved)
and the ratio to ``rows``; and the largest difference of the packed and budget runs'
loss from the padded one (fp32: summation order only).

Lengths: prompts uniform in ``[--prompt-min, --prompt-max]`` tokens, responses drawn
log-uniform in ``[1, --response-max]`` (many short answers, a few long ones, as sampled
responses with a stop token are). Random weights of the ``--model`` preset.

Usage: python benchmarks/bench_packing.py [--model smollm2_135m] [--batch 32]
           [--budget 4096] [--row-length 512] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch


def _lengths(batch: int, prompt_min: int, prompt_max: int, response_max: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(prompt_min, prompt_max + 1, (batch,), generator=g).tolist()
    u = torch.rand(batch, generator=g)
    responses = [max(1, min(response_max, int(math.exp(x * math.log(response_max))))) for x in u.tolist()]
    return prompts, responses


def _rollout(prompts, responses, vocab: int, seed: int):
    """input_ids / attention_mask ``[B, P+R]`` and response_mask ``[B, R]`` (host)."""
    P, R, B = max(prompts), max(responses), len(prompts)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, vocab, (B, P + R), generator=g)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        attention[i, P - p:P + r] = 1
        response_mask[i, :r] = True
    return ids * attention, attention, response_mask, P


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2_135m", help="conf/model preset (random weights)")
    p.add_argument("--vocab", type=int, default=1000, help="vocabulary of presets without one")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=128)
    p.add_argument("--response-max", type=int, default=384)
    p.add_argument("--micro", type=int, default=4, help="rows per micro-batch of the rows mode")
    p.add_argument("--budget", type=int, default=4096, help="ppo.max_tokens_per_micro_batch")
    p.add_argument("--row-length", type=int, default=1024, help="ppo.packed_row_length")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.engine import forward_backward, wrap_ddp
    from nemo_rlhf.models.logprobs import LogprobRequest, response_logprobs, response_values
    from nemo_rlhf.trainers.ppo.micro_batches import plan_micro_batches, row_extents, take
    from nemo_rlhf.distributed import ParallelConfig, destroy_distributed, initialize_distributed

    prompts, responses = _lengths(a.batch, a.prompt_min, a.prompt_max, a.response_max, a.seed)
    dims = initialize_distributed(ParallelConfig(), seed=a.seed)
    try:
        cfg = load_model_preset(a.model)
        if not cfg.vocab_size:  # presets without a tokenizer's vocabulary (tiny)
            cfg = load_model_preset(a.model, vocab_size=a.vocab)
        vocab = cfg.vocab_size
        ids, attention, response_mask, P = _rollout(prompts, responses, vocab, a.seed)
        model = wrap_ddp(build_model(cfg, dims, seed=a.seed).train())
        tensors = {"input_ids": ids, "attention_mask": attention, "response_mask": response_mask}
        n_tokens = response_mask.sum().float().to(dims.device)
        real = int(attention.sum())
        extents = row_extents(attention, response_mask, P)

        def loss_fn(output, mb):
            out, values = output
            pl = mb.get("prompt_length", P)
            lp, ent = response_logprobs(out, (mb["input_ids"], pl), dims, 1.0, vocab_size=vocab)
            m = mb["response_mask"]
            v = response_values(values, pl, lp.shape[1])
            loss = torch.where(m, -lp - 0.01 * ent + 0.5 * v ** 2, 0.0).sum() / n_tokens
            return loss, {"loss": loss.detach()}

        def micro_batches(mode):
            if mode == "rows":
                return [{k: v[s:s + a.micro] for k, v in tensors.items()} for s in range(0, a.batch, a.micro)]
            plans = plan_micro_batches(*extents, P, list(range(a.batch)), a.batch, a.budget,
                                       pack=mode == "packed", row_length=a.row_length)
            return [take(plan, tensors, P, dims.device) for plan in plans]

        modes = ("rows", "budget", "packed")
        batches = {m: micro_batches(m) for m in modes}
        computed = {m: sum(mb["packed"].tokens() if "packed" in mb else mb["input_ids"].numel()
                           for mb in batches[m]) for m in modes}
        times = {m: [] for m in modes}
        losses = {}
        for rep in range(a.repeats + 1):  # the first round warms up, untimed
            for m in modes:
                model.zero_grad_buffer()
                t0 = time.perf_counter()
                res = forward_backward(model, batches[m], loss_fn, variable_shapes=m != "rows",
                                       device=dims.device,
                                       logprob_request=LogprobRequest(P, (1.0,), vocab, chunk_size=1024))
                if rep:
                    times[m].append(time.perf_counter() - t0)
                losses[m] = float(sum(r["loss"] for r in res))
    finally:
        destroy_distributed()

    print(f"model {a.model} (random weights), {a.batch} rows: prompts {a.prompt_min}-{a.prompt_max}, "
          f"responses 1-{a.response_max} (log-uniform) -> block [{a.batch}, {ids.shape[1]}], "
          f"{real} real tokens; fp32, {a.threads} threads, median of {a.repeats}")
    base = statistics.median(times["rows"])
    for m in modes:
        t = statistics.median(times[m])
        print(f"  {m:7s} micro-batches {len(batches[m]):3d}  computed tokens {computed[m]:7d}  padding "
              f"{1 - real / computed[m]:6.1%}  {t:7.2f} s/pass  {t / base:5.2f}x rows")
    print(f"  |loss - rows' loss|: budget {abs(losses['budget'] - losses['rows']):.2e}, "
          f"packed {abs(losses['packed'] - losses['rows']):.2e} (loss {losses['rows']:.4f})")


if __name__ == "__main__":
    main()
