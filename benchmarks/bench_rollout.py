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


def hf_worker(path: str, args) -> None:
    """Time ``LlamaForCausalLM.generate`` in a clean process (no megatron, no CPU shim)."""
    from transformers import LlamaForCausalLM

    blob = torch.load(path)
    hf = LlamaForCausalLM(_hf_config(_model_config(args))).eval()
    hf.load_state_dict(blob["hf_state"], strict=True)
    with torch.no_grad():
        theirs = hf(blob["probe_ids"]).logits[..., :args.vocab]
    result = {"logit_diff": float((theirs - blob["probe_logits"]).abs().max()), "runs": {}}
    eos = args.vocab - 1
    for B in args.batch:
        ids = _prompts(B, args)

        def run():
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=args.new, min_new_tokens=args.new,
                                   eos_token_id=eos, pad_token_id=0, use_cache=True)

        run()  # warm-up
        wall, cpu, out = _time(run, args.repeats)
        result["runs"][B] = {"wall": wall, "cpu": cpu, "tokens": out[:, args.prompt:]}
    torch.save(result, path + ".out")


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
    p.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    if args.hf_worker:
        return hf_worker(args.hf_worker, args)

    import subprocess
    import sys
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

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "hf.pt")
        torch.save({"hf_state": hf_state, "probe_ids": probe, "probe_logits": probe_logits}, path)
        argv = [a for a in sys.argv[1:]]
        subprocess.run([sys.executable, __file__, *argv, "--hf-worker", path], check=True)
        hf_res = torch.load(path + ".out")
    print(f"logits max |megatron - transformers| = {hf_res['logit_diff']:.2e} "
          f"(fp32, {args.prompt} tokens)")
    if hf_res["logit_diff"] > 1e-4:
        raise SystemExit("weight mapping is wrong: logits differ")

    eos = args.vocab - 1
    rows = []
    for B in args.batch:
        prompts = _prompts(B, args).tolist()
        kw = dict(eos_token_id=eos, pad_token_id=0, vocab_size=args.vocab,
                  max_sequence_length=args.prompt + args.new, call_index=0)

        def ours(cache: bool):
            cfg = RolloutConfig(max_new_tokens=args.new, min_new_tokens=args.new, greedy=True,
                                use_kv_cache=cache)
            return generate(model, dims, prompts, cfg, **kw)

        ours(True)  # warm-up (allocations, lazy init, rope cache)
        t_kv, c_kv, out_kv = _time(lambda: ours(True), args.repeats)
        t_re = c_re = float("nan")
        if not args.no_recompute:
            t_re, c_re, out_re = _time(lambda: ours(False), 1)
            assert torch.equal(out_re.response_ids, out_kv.response_ids), "kv != recompute"
        assert out_kv.response_ids.shape == (B, args.new)
        hf_run = hf_res["runs"][B]
        same = int((out_kv.response_ids == hf_run["tokens"]).all(-1).sum())
        n = B * args.new
        rows.append((B, n / t_kv, n / t_re, n / hf_run["wall"], n / c_kv, n / hf_run["cpu"], same))

    print(f"\nmodel: {mcfg.num_layers} layers, hidden {mcfg.hidden_size}, vocab "
          f"{mcfg.padded_vocab_size}, GQA {mcfg.num_attention_heads}/{mcfg.num_query_groups}; "
          f"prompt {args.prompt} + {args.new} new tokens; greedy; fp32; {args.threads} threads; "
          f"best of {args.repeats} (recompute: 1 run); transformers {_hf_version()} in a clean "
          f"process")
    print("generated tokens/s (wall clock; 'cpu' = per second of process CPU time)")
    print(f"{'batch':>5} {'kv':>9} {'recompute':>10} {'hf':>9} {'kv/hf':>7} {'kv/recomp':>10} "
          f"{'kv cpu':>9} {'hf cpu':>9} {'kv/hf cpu':>10} {'rows==hf':>9}")
    for B, kv, re, hft, kvc, hfc, same in rows:
        print(f"{B:>5} {kv:>9.1f} {re:>10.1f} {hft:>9.1f} {kv / hft:>7.2f} {kv / re:>10.2f} "
              f"{kvc:>9.1f} {hfc:>9.1f} {kvc / hfc:>10.2f} {same:>5}/{B}")


def _hf_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
