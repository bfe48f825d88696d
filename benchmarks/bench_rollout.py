"""Rollout throughput: megatron KV-cache generation vs full recompute vs transformers.

Builds a Llama-style megatron-core model (RMSNorm, SwiGLU, RoPE, GQA, no biases) and a
transformers ``LlamaForCausalLM`` with the SAME fp32 weights (mapped with the project's
:mod:`nemo_rlhf.tools.hf_convert`), checks that their logits match, then times greedy
generation of ``--new`` tokens after ``--prompt``-token prompts at each batch size:

* ``kv``: :func:`nemo_rlhf.rollout.generate` with the KV cache (``use_kv_cache=True``);
* ``recompute``: the same loop re-running the whole sequence every step;
* ``hf``: ``LlamaForCausalLM.generate(use_cache=True)``, in a separate clean process
  (no megatron, no CPU shim).

Models (``--model``):

* ``tiny`` (default): 4 layers, hidden 256, 4 heads / 2 KV heads, vocab 1024; 64 new tokens;
* ``smollm2``: the SmolLM2-135M shape (``conf/model/llama.yaml``: 30 layers, hidden 576,
  9 heads / 3 KV heads, ffn 1536, vocab 49152, RoPE base 1e5, tied embeddings), random
  weights; 32 new tokens; no full-recompute run unless ``--recompute``. With ``--hf-dir``
  pointing at a Hugging Face ``LlamaForCausalLM`` folder (``config.json`` + safetensors),
  its architecture and weights are loaded into both sides instead.

``--sample`` samples (temperature 0.7, top-p 0.9, top-k off) on both sides instead of
decoding greedily; the rows then differ (different random streams).

Device and precision: both sides run on the device the project's distributed set-up picks
(the GPU of this process when CUDA is present, else the host). The weight mapping is
checked in fp32; with ``--dtype bf16`` both models are then cast to bfloat16 for the timed
runs (ours rebuilt with ``trainer.precision=bf16-mixed`` and filled with the same weights).
On a GPU every timed call is bracketed by ``torch.cuda.synchronize``. ``--json PATH`` also
writes the results as JSON (``benchmarks/gpu_check.py`` reads them).

Both generators produce the full length (``min_new_tokens = max_new_tokens``: no EOS stop),
so the work is the same. ``kv`` and ``hf`` runs are interleaved (``--repeats`` pairs per
batch size, after one warm-up each), so both see the same machine load; the table gives
the **median** over the repeats and the ratio of the medians, with the median (min-max) of
the per-pair ratios, and the load average before/after. On a shared machine single runs
are noisy: run it several times and take the median of the ratios. Also printed: how many
rows of ours and of transformers' greedy outputs are identical (they may part after a
near-tie in fp32).

Run: ``python benchmarks/bench_rollout.py`` (CPU, 2 threads by default; transformers runs
in a spawned process); ``python benchmarks/bench_rollout.py --model smollm2 [--hf-dir
/path/to/hf]``; on a GPU ``python benchmarks/bench_rollout.py --model smollm2 --dtype bf16
--batch 8 64``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch

SAMPLE = dict(temperature=0.7, top_p=0.9)
"""``--sample``: the sampling setting on both sides (top-k off)."""

TINY = dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=688, vocab_size=1024, init_method_std=0.05)


def _model_config(args):
    """The megatron :class:`ModelConfig` of ``args.model`` (or of ``args.hf_dir``)."""
    from dataclasses import replace

    from nemo_rlhf.models.config import ModelConfig, load_model_preset

    max_pos = args.prompt + args.new
    if args.hf_dir:
        from nemo_rlhf.tools.hf_convert import model_config_from_hf, read_hf_config

        cfg, arch = model_config_from_hf(read_hf_config(args.hf_dir), "bench")
        if arch != "llama":
            raise SystemExit(f"--hf-dir {args.hf_dir}: model_type {arch!r}, expected llama")
        return replace(cfg, max_position_embeddings=max(max_pos, cfg.max_position_embeddings))
    if args.model == "smollm2":
        return replace(load_model_preset("llama", vocab_size=49152, init_method_std=0.02),
                       name="bench", max_position_embeddings=max_pos)
    return ModelConfig(name="bench", max_position_embeddings=max_pos, **TINY)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``--dtype``: the timed models' parameter dtype."""


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: str = "cpu"):
    """``(wall seconds, process CPU seconds, result)`` of one call (queued GPU work
    included: synchronised before and after on a CUDA device)."""
    _sync(device)
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    _sync(device)
    return time.perf_counter() - w0, time.process_time() - c0, out


def _prompts(batch: int, args, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab - 1, (batch, args.prompt), generator=g)


def _hf_server(conn, path: str, args) -> None:
    """Serve ``LlamaForCausalLM.generate`` timings from a clean process (no megatron, no
    CPU shim): receives a batch size, answers ``(wall_s, cpu_s, tokens [B, new])``; None
    stops it."""
    import warnings as _w

    _w.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    blob = torch.load(path)
    hf = LlamaForCausalLM(LlamaConfig(**blob["hf_config"])).eval()
    missing, unexpected = hf.load_state_dict(blob["hf_state"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.to(args.device)
    vocab = blob["vocab"]
    with torch.no_grad():
        theirs = hf(blob["probe_ids"].to(args.device)).logits[..., :vocab].float().cpu()
    conn.send(float((theirs - blob["probe_logits"]).abs().max()))
    hf.to(DTYPES[args.dtype])
    eos = vocab - 1
    while (B := conn.recv()) is not None:
        ids = _prompts(B, args, vocab).to(args.device)

        sampling = (dict(do_sample=True, temperature=SAMPLE["temperature"],
                         top_p=SAMPLE["top_p"], top_k=0) if args.sample else dict(do_sample=False))

        def run():
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), **sampling,
                                   max_new_tokens=args.new, min_new_tokens=args.new,
                                   eos_token_id=eos, pad_token_id=0, use_cache=True)

        wall, cpu, out = _time(run, args.device)
        conn.send((wall, cpu, out[:, args.prompt:].cpu()))


def parse_args(argv=None) -> argparse.Namespace:
    """The benchmark's options (``--help``); defaults filled in per model."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                   help="tiny (4 layers, hidden 256) or the SmolLM2-135M shape")
    p.add_argument("--hf-dir", default=None,
                   help="HF LlamaForCausalLM folder: its architecture and weights on both sides")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=None,
                   help="new tokens (default 64 for tiny, 32 for smollm2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="interleaved kv/hf pairs per batch")
    p.add_argument("--sample", action="store_true",
                   help=f"sample ({SAMPLE}) instead of greedy decoding, on both sides")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="also time full recompute (default: on for tiny, off for smollm2)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="parameter dtype of the timed models (the mapping check is fp32)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    if args.hf_dir:
        args.model = "smollm2"
    if args.new is None:
        args.new = 32 if args.model == "smollm2" else 64
    if args.recompute is None:
        args.recompute = args.model == "tiny"
    return args


def main(argv=None) -> dict:
    """Run the benchmark and print the table; return (and with ``--json`` write) the
    results (see :func:`_results`)."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]

    import multiprocessing as mp
    import tempfile
    from pathlib import Path

    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.rollout import RolloutConfig, generate
    from nemo_rlhf.tools import hf_convert
    from nemo_rlhf.models.engine import model_forward

    mcfg = _model_config(args)
    vocab = mcfg.vocab_size
    dims = initialize_distributed(ParallelConfig(), seed=0)
    args.device = str(dims.device)
    model = build_model(mcfg, dims, seed=7).eval()
    if args.hf_dir:
        hf_weights = hf_convert.read_hf_weights(Path(args.hf_dir))
        tensors = dict(hf_convert.model_full_tensors(model))  # keeps the value head's
        tensors.update(hf_convert.hf_to_megatron(hf_weights, mcfg, "llama"))
        hf_convert.fill_model(model, tensors)
        del hf_weights
    probe = torch.randint(0, vocab, (2, args.prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ids = probe.to(dims.device)
        probe_logits = model_forward(model, ids, torch.ones_like(ids))[0][..., :vocab].cpu()
    hf_state = hf_convert.megatron_to_hf(hf_convert.model_full_tensors(model), mcfg, "llama")
    hf_cfg = hf_convert.hf_config(mcfg, "llama", torch.float32)
    hf_cfg.pop("architectures", None)

    eos = vocab - 1
    times = {}  # (B, what) -> [(wall, cpu), ...]
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "hf.pt")
        torch.save({"hf_state": hf_state, "hf_config": hf_cfg, "vocab": vocab,
                    "probe_ids": probe, "probe_logits": probe_logits}, path)
        del hf_state
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        server = ctx.Process(target=_hf_server, args=(child, path, args), daemon=True)
        server.start()
        logit_diff = conn.recv()
        scale = float(probe_logits.abs().max())
        print(f"logits max |megatron - transformers| = {logit_diff:.2e} (max |logit| {scale:.1f};"
              f" fp32, {args.prompt} tokens)")
        if logit_diff > 1e-4 * max(1.0, scale):
            raise SystemExit("weight mapping is wrong: logits differ")
        if args.dtype != "fp32":  # the same weights, cast: ours rebuilt at that precision
            cast = build_model(mcfg, dims, "bf16-mixed", seed=7).eval()
            hf_convert.fill_model(cast, dict(hf_convert.model_full_tensors(model)))
            model = cast

        def ours(prompts, cache: bool):
            sampling = dict(greedy=False, seed=0, **SAMPLE) if args.sample else dict(greedy=True)
            cfg = RolloutConfig(max_new_tokens=args.new, min_new_tokens=args.new,
                                use_kv_cache=cache, **sampling)
            return generate(model, dims, prompts, cfg, eos_token_id=eos, pad_token_id=0,
                            vocab_size=vocab, max_sequence_length=args.prompt + args.new,
                            call_index=0)

        prompts = {B: _prompts(B, args, vocab).tolist() for B in args.batch}
        for B in args.batch:  # warm-up both (allocations, lazy init, rope cache)
            ours(prompts[B], True)
            conn.send(B)
            conn.recv()
        # interleaved repeats: both sides see the same machine load
        for _ in range(args.repeats):
            for B in args.batch:
                wall, cpu, outputs[B, "kv"] = _time(lambda: ours(prompts[B], True), args.device)
                times.setdefault((B, "kv"), []).append((wall, cpu))
                conn.send(B)
                wall, cpu, outputs[B, "hf"] = conn.recv()
                times.setdefault((B, "hf"), []).append((wall, cpu))
        conn.send(None)
        server.join()
    for B in args.batch:
        times[B, "re"] = [(float("nan"), float("nan"))]
        if args.recompute:
            wall, cpu, out = _time(lambda: ours(prompts[B], False), args.device)
            times[B, "re"] = [(wall, cpu)]
            # sampled tokens can part after a last-bit difference, and bf16 greedy ones
            # after a near-tie
            if not args.sample and args.dtype == "fp32":
                assert torch.equal(out.response_ids, outputs[B, "kv"].response_ids), \
                    "kv != recompute"

    print(f"\nmodel: {args.model}{' (' + args.hf_dir + ')' if args.hf_dir else ''}, "
          f"{mcfg.num_layers} layers, hidden {mcfg.hidden_size}, vocab {mcfg.padded_vocab_size}, "
          f"GQA {mcfg.num_attention_heads}/{mcfg.num_query_groups}; prompt {args.prompt} + "
          f"{args.new} new tokens; {'sampling ' + str(SAMPLE) if args.sample else 'greedy'}; "
          f"{args.dtype} on {args.device}; {args.threads} threads; median of "
          f"{args.repeats} interleaved kv/hf runs (recompute: 1 run); transformers "
          f"{_hf_version()} in a separate clean process")
    print("generated tokens/s (wall clock; 'cpu' = per second of process CPU time); "
          "'pairs' = median (min-max) of the per-pair kv/hf ratios")
    print(f"load average (1 min) before / after: {load0:.2f} / {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs (other processes on the CPUs make the timings noisy)")
    print(f"{'batch':>5} {'kv':>9} {'recompute':>10} {'hf':>9} {'kv/hf':>7} {'pairs':>17} "
          f"{'kv/recomp':>10} {'kv cpu':>9} {'hf cpu':>9} {'kv/hf cpu':>10} {'rows==hf':>9}")

    def med(key, i):
        return statistics.median(t[i] for t in times[key])

    rows = []
    for B in args.batch:
        n = B * args.new
        kv, re, hf = (n / med((B, k), 0) for k in ("kv", "re", "hf"))
        kvc, hfc = (n / med((B, k), 1) for k in ("kv", "hf"))
        pairs = [h[0] / k[0] for k, h in zip(times[B, "kv"], times[B, "hf"])]
        same = int((outputs[B, "kv"].response_ids == outputs[B, "hf"]).all(-1).sum())
        rng = f"{statistics.median(pairs):.2f} ({min(pairs):.2f}-{max(pairs):.2f})"
        print(f"{B:>5} {kv:>9.1f} {re:>10.1f} {hf:>9.1f} {kv / hf:>7.2f} {rng:>17} "
              f"{kv / re:>10.2f} {kvc:>9.1f} {hfc:>9.1f} {kvc / hfc:>10.2f} {same:>5}/{B}")
        rows.append({"batch": B, "kv_tokens_per_s": kv, "hf_tokens_per_s": hf,
                     "kv_over_hf": kv / hf, "pair_ratios": pairs,
                     "recompute_tokens_per_s": None if re != re else re,
                     "rows_identical_to_hf": same})
    results = {"model": args.model, "hf_dir": args.hf_dir, "device": args.device,
               "dtype": args.dtype, "prompt_tokens": args.prompt, "new_tokens": args.new,
               "sampling": SAMPLE if args.sample else "greedy", "repeats": args.repeats,
               "logits_max_abs_diff_fp32": logit_diff, "transformers": _hf_version(),
               "num_layers": mcfg.num_layers, "hidden_size": mcfg.hidden_size,
               "padded_vocab_size": mcfg.padded_vocab_size, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


def _hf_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
