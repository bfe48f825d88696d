"""Rollout throughput: megatron KV-cache generation vs full recompute vs transformers.

Builds a small Llama-style megatron-core model (RMSNorm, SwiGLU, RoPE, GQA, no biases) and
a transformers ``LlamaForCausalLM`` with the SAME fp32 weights (:func:`megatron_to_hf_llama`),
checks that their logits match, then times greedy generation of ``--new`` tokens after
``--prompt``-token prompts at each batch size:

* ``kv``: :func:`nemo_rlhf.rollout.generate` with the KV cache (``use_kv_cache=True``);
* ``recompute``: the same loop re-running the whole sequence every step;
* ``hf``: ``LlamaForCausalLM.generate(use_cache=True)``.

Both generators produce the full length (``min_new_tokens = max_new_tokens``), so the work
is the same. Prints generated tokens/s and the ratios, and how many rows of ours and of
transformers' greedy outputs are identical (they may part after a near-tie in fp32).

Run: ``python benchmarks/bench_rollout.py`` (single process, CPU, 2 threads by default).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch


def megatron_to_hf_llama(sd: dict, num_layers: int, num_heads: int, num_query_groups: int,
                         ffn_hidden_size: int) -> dict:
    """Map a megatron-core GPT (local spec, Llama-style, TP=1, PP=1) state dict to HF Llama.

    megatron fuses QKV as ``[groups * (q_per_group + 2) * head_dim, hidden]``: for each
    query group, its ``q_per_group`` query heads, then the group's key head, then its value
    head. ``linear_fc1`` is ``[gate; up]`` stacked on the output dimension.

    Args:
        sd: megatron ``state_dict()`` (``_extra_state`` and value-head entries ignored).

    Returns:
        A ``LlamaForCausalLM`` state dict (``model.*`` and ``lm_head.weight``).
    """
    out = {
        "model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
        "model.norm.weight": sd["decoder.final_layernorm.weight"],
        "lm_head.weight": sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"]),
    }
    q_per_group = num_heads // num_query_groups
    for i in range(num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = sd[src + "self_attention.linear_qkv.weight"]
        hidden = qkv.shape[1]
        head_dim = qkv.shape[0] // (num_query_groups * (q_per_group + 2))
        qkv = qkv.view(num_query_groups, q_per_group + 2, head_dim, hidden)
        out[dst + "self_attn.q_proj.weight"] = qkv[:, :q_per_group].reshape(-1, hidden)
        out[dst + "self_attn.k_proj.weight"] = qkv[:, q_per_group].reshape(-1, hidden)
        out[dst + "self_attn.v_proj.weight"] = qkv[:, q_per_group + 1].reshape(-1, hidden)
        out[dst + "self_attn.o_proj.weight"] = sd[src + "self_attention.linear_proj.weight"]
        fc1 = sd[src + "mlp.linear_fc1.weight"]
        out[dst + "mlp.gate_proj.weight"] = fc1[:ffn_hidden_size]
        out[dst + "mlp.up_proj.weight"] = fc1[ffn_hidden_size:]
        out[dst + "mlp.down_proj.weight"] = sd[src + "mlp.linear_fc2.weight"]
        out[dst + "input_layernorm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = sd[src + "pre_mlp_layernorm.weight"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def _model_config(args):
    from nemo_rlhf.models.config import ModelConfig

    return ModelConfig(
        name="bench", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
        num_query_groups=2, ffn_hidden_size=args.ffn, vocab_size=args.vocab,
        max_position_embeddings=args.prompt + args.new, init_method_std=0.05,
    )


def _hf_config(mcfg):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=mcfg.padded_vocab_size, hidden_size=mcfg.hidden_size,
        intermediate_size=mcfg.ffn_hidden_size, num_hidden_layers=mcfg.num_layers,
        num_attention_heads=mcfg.num_attention_heads, num_key_value_heads=mcfg.num_query_groups,
        max_position_embeddings=mcfg.max_position_embeddings, rms_norm_eps=mcfg.layernorm_epsilon,
        rope_theta=float(mcfg.rotary_base), tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, torch_dtype=torch.float32,
    )


def _time(fn, repeats: int):
    """Best wall time and best process CPU time (both threads) over ``repeats`` runs."""
    best_wall, best_cpu, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        best_wall = min(best_wall, time.perf_counter() - w0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best_wall, best_cpu, out


def _prompts(batch: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, args.vocab - 1, (batch, args.prompt), generator=g)


def _hf_server(conn, path: str, args) -> None:
    """Serve ``LlamaForCausalLM.generate`` timings from a clean process (no megatron, no
    CPU shim): receives a batch size, answers ``(wall_s, cpu_s, tokens)``; None stops it."""
    import warnings as _w

    _w.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    from transformers import LlamaForCausalLM

    blob = torch.load(path)
    hf = LlamaForCausalLM(_hf_config(_model_config(args))).eval()
    hf.load_state_dict(blob["hf_state"], strict=True)
    with torch.no_grad():
        theirs = hf(blob["probe_ids"]).logits[..., :args.vocab]
    conn.send(float((theirs - blob["probe_logits"]).abs().max()))
    eos = args.vocab - 1
    while (B := conn.recv()) is not None:
        ids = _prompts(B, args)

        def run():
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=args.new, min_new_tokens=args.new,
                                   eos_token_id=eos, pad_token_id=0, use_cache=True)

        wall, cpu, out = _time(run, 1)
        conn.send((wall, cpu, out[:, args.prompt:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-recompute", action="store_true", help="skip the slow full-recompute run")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)

    import multiprocessing as mp
    import tempfile
    from pathlib import Path

    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.rollout import RolloutConfig, generate
    from nemo_rlhf.trainers.engine import model_forward

    mcfg = _model_config(args)
    dims = initialize_distributed(ParallelConfig(), seed=0)
    model = build_model(mcfg, dims, seed=7).eval()
    probe = torch.randint(0, args.vocab, (2, args.prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        probe_logits = model_forward(model, probe, torch.ones_like(probe))[0][..., :args.vocab]
    hf_state = megatron_to_hf_llama(model.state_dict(), mcfg.num_layers, mcfg.num_attention_heads,
                                    mcfg.num_query_groups, mcfg.ffn_hidden_size)

    eos = args.vocab - 1
    best = {}  # (B, what) -> (wall, cpu)
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "hf.pt")
        torch.save({"hf_state": hf_state, "probe_ids": probe, "probe_logits": probe_logits}, path)
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        server = ctx.Process(target=_hf_server, args=(child, path, args), daemon=True)
        server.start()
        logit_diff = conn.recv()
        print(f"logits max |megatron - transformers| = {logit_diff:.2e} (fp32, {args.prompt} tokens)")
        if logit_diff > 1e-4:
            raise SystemExit("weight mapping is wrong: logits differ")

        def ours(prompts, cache: bool):
            cfg = RolloutConfig(max_new_tokens=args.new, min_new_tokens=args.new, greedy=True,
                                use_kv_cache=cache)
            return generate(model, dims, prompts, cfg, eos_token_id=eos, pad_token_id=0,
                            vocab_size=args.vocab, max_sequence_length=args.prompt + args.new,
                            call_index=0)

        def keep(key, wall, cpu):
            old = best.get(key, (float("inf"), float("inf")))
            best[key] = (min(old[0], wall), min(old[1], cpu))

        prompts = {B: _prompts(B, args).tolist() for B in args.batch}
        for B in args.batch:  # warm-up both (allocations, lazy init, rope cache)
            ours(prompts[B], True)
            conn.send(B)
            conn.recv()
        # interleaved repeats: both sides see the same machine load, the best run counts
        for _ in range(args.repeats):
            for B in args.batch:
                wall, cpu, outputs[B, "kv"] = _time(lambda: ours(prompts[B], True), 1)
                keep((B, "kv"), wall, cpu)
                conn.send(B)
                wall, cpu, outputs[B, "hf"] = conn.recv()
                keep((B, "hf"), wall, cpu)
        conn.send(None)
        server.join()
    for B in args.batch:
        best[B, "re"] = (float("nan"), float("nan"))
        if not args.no_recompute:
            wall, cpu, out = _time(lambda: ours(prompts[B], False), 1)
            best[B, "re"] = (wall, cpu)
            assert torch.equal(out.response_ids, outputs[B, "kv"].response_ids), "kv != recompute"

    print(f"\nmodel: {mcfg.num_layers} layers, hidden {mcfg.hidden_size}, vocab "
          f"{mcfg.padded_vocab_size}, GQA {mcfg.num_attention_heads}/{mcfg.num_query_groups}; "
          f"prompt {args.prompt} + {args.new} new tokens; greedy; fp32; {args.threads} threads; "
          f"best of {args.repeats} interleaved runs (recompute: 1 run); transformers "
          f"{_hf_version()} in a separate clean process")
    print("generated tokens/s (wall clock; 'cpu' = per second of process CPU time)")
    print(f"{'batch':>5} {'kv':>9} {'recompute':>10} {'hf':>9} {'kv/hf':>7} {'kv/recomp':>10} "
          f"{'kv cpu':>9} {'hf cpu':>9} {'kv/hf cpu':>10} {'rows==hf':>9}")
    for B in args.batch:
        n = B * args.new
        kv, re, hf = (n / best[B, k][0] for k in ("kv", "re", "hf"))
        kvc, hfc = (n / best[B, k][1] for k in ("kv", "hf"))
        same = int((outputs[B, "kv"].response_ids == outputs[B, "hf"]).all(-1).sum())
        print(f"{B:>5} {kv:>9.1f} {re:>10.1f} {hf:>9.1f} {kv / hf:>7.2f} {kv / re:>10.2f} "
              f"{kvc:>9.1f} {hfc:>9.1f} {kvc / hfc:>10.2f} {same:>5}/{B}")


def _hf_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
