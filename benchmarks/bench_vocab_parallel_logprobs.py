"""Peak memory of the log-prob/entropy paths, from the final hidden states to their gradients.

One run, same inputs: hidden states ``[tokens, hidden]`` and an output weight ``[vocab,
hidden]`` (vocabulary 128k, 2k tokens: the fp32 logits alone are 1 GiB), forward + backward
of ``sum(logprobs * a) + sum(entropy * b)`` into the gradients of both. Each variant runs in
a fresh subprocess and reports its peak resident memory above the baseline (inputs
allocated, before the forward); the ratios against ``naive`` are printed. The gradient of
the weight (``vocab x hidden`` fp32) is part of every variant's peak.

Variants:
  naive        logits = hidden @ W^T, torch.log_softmax, gather, entropy by autograd
  logits_tp1   logits = hidden @ W^T, then nemo_rlhf's vocab-parallel function (the path of
               ``ppo.logprob_chunk_size=0``)
  chunked_tp1  nemo_rlhf's fused chunked output layer (``chunked_linear_logprobs``,
               ``--chunk`` tokens at a time; the default PPO path)
  chunked_tp2  the same on one rank's half of the vocabulary (per-rank memory at TP=2)

Before the memory runs, the chunked path's values and gradients are checked against the
naive ones in this process at the same vocabulary on ``--check-tokens`` tokens (max abs
differences printed; fp32).

Usage: python benchmarks/bench_vocab_parallel_logprobs.py [--vocab 128000] [--tokens 2048]
           [--hidden 256] [--chunk 256]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS counter (VmHWM)


def _inputs(vocab: int, tokens: int, hidden: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / hidden ** 0.5
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    a, b = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)
    return h, w, ids, a, b


def _run(variant: str, h, w, ids, a, b, chunk: int):
    """Forward + backward of one variant on leaf tensors ``h`` and ``w`` (their ``.grad`` is
    set); returns (logprobs, entropy, grad_h, grad_w)."""
    import torch

    from nemo_rlhf.models.vocab_parallel import chunked_linear_logprobs, vocab_parallel_logprobs

    h.requires_grad_(True)
    w.requires_grad_(True)
    if variant == "naive":
        logp_all = torch.log_softmax(torch.nn.functional.linear(h, w), dim=-1)
        lp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
    elif variant == "logits_tp1":
        lp, ent = vocab_parallel_logprobs(torch.nn.functional.linear(h, w).unsqueeze(0), ids.unsqueeze(0))
        lp, ent = lp[0], ent[0]
    else:
        lp, ent = chunked_linear_logprobs(h, w, ids, chunk_size=chunk)
    ((lp * a).sum() + (ent * b).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def child(variant: str, vocab: int, tokens: int, hidden: int, chunk: int) -> None:
    import time

    import torch

    torch.manual_seed(0)
    v = vocab // 2 if variant == "chunked_tp2" else vocab
    h, w, ids, a, b = _inputs(v, tokens, hidden)
    _reset_peak()
    base = _rss_mb()
    t0 = time.perf_counter()
    _run("chunked_tp1" if variant == "chunked_tp2" else variant, h, w, ids, a, b, chunk)
    dt = time.perf_counter() - t0
    print(json.dumps({"variant": variant, "peak_mb": _rss_mb() - base, "seconds": dt}))


def check(vocab: int, tokens: int, hidden: int, chunk: int) -> dict:
    """Max abs difference of the chunked path from the naive one (values and gradients)."""
    ref = _run("naive", *_inputs(vocab, tokens, hidden, seed=1), chunk)
    got = _run("chunked_tp1", *_inputs(vocab, tokens, hidden, seed=1), chunk)
    return {name: float((x - y).abs().max()) for name, x, y in
            zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), got, ref)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--check-tokens", type=int, default=64)
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.vocab, a.tokens, a.hidden, a.chunk)
        return
    diffs = check(a.vocab, a.check_tokens, a.hidden, a.chunk)
    print(f"chunked vs naive, vocab={a.vocab} tokens={a.check_tokens} fp32, max abs difference: "
          + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    res = {}
    for v in ("naive", "logits_tp1", "chunked_tp1", "chunked_tp2"):
        out = subprocess.run([sys.executable, __file__, "--child", v, "--vocab", str(a.vocab),
                              "--tokens", str(a.tokens), "--hidden", str(a.hidden), "--chunk", str(a.chunk)],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        res[v] = json.loads(out)
    logits_mb = a.vocab * a.tokens * 4 / 2**20
    grad_w_mb = a.vocab * a.hidden * 4 / 2**20
    print(f"vocab={a.vocab} tokens={a.tokens} hidden={a.hidden} chunk={a.chunk}: fp32 logits "
          f"{logits_mb:.0f} MiB, weight gradient {grad_w_mb:.0f} MiB (fwd+bwd)")
    n = res["naive"]["peak_mb"]
    for v, r in res.items():
        print(f"  {v:12s} peak above inputs {r['peak_mb']:8.0f} MiB  ({n / max(r['peak_mb'], 1e-9):5.1f}x "
              f"below naive)  {r['seconds']:.2f} s")


if __name__ == "__main__":
    main()
