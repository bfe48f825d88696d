"""Peak memory of the vocab-parallel log-prob/entropy path vs a naive full-vocab log_softmax.

One run, same logits: vocabulary 128k, 2k tokens (fp32 logits = 1 GiB), forward + backward
of ``sum(logprobs) + sum(entropy)``. Each variant runs in a fresh subprocess and reports
its peak resident memory above the baseline (inputs allocated); the ratio is printed.

Variants:
  naive      gather the full vocabulary, torch.log_softmax, gather, entropy by autograd
  fused_tp1  nemo_rlhf's vocab-parallel function on the whole vocabulary (TP=1)
  fused_tp2  the same function on one rank's half of the vocabulary (per-rank memory at
             TP=2; the max/sum-exp all-reduces move [tokens] scalars, not the vocabulary)

Usage: python benchmarks/bench_vocab_parallel_logprobs.py [--vocab 128000] [--tokens 2048]
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


def child(variant: str, vocab: int, tokens: int) -> None:
    import time

    import torch

    from nemo_rlhf.models.vocab_parallel import vocab_parallel_logprobs

    torch.manual_seed(0)
    v_local = vocab // 2 if variant == "fused_tp2" else vocab
    logits = torch.randn(1, tokens, v_local).requires_grad_(True)
    ids = torch.randint(0, v_local, (1, tokens))
    _reset_peak()
    base = _rss_mb()
    t0 = time.perf_counter()
    if variant == "naive":
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        lp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
    else:
        lp, ent = vocab_parallel_logprobs(logits, ids)
    (lp.sum() + ent.sum()).backward()
    dt = time.perf_counter() - t0
    print(json.dumps({"variant": variant, "peak_mb": _rss_mb() - base, "seconds": dt}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.vocab, a.tokens)
        return
    res = {}
    for v in ("naive", "fused_tp1", "fused_tp2"):
        out = subprocess.run([sys.executable, __file__, "--child", v, "--vocab", str(a.vocab),
                              "--tokens", str(a.tokens)], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
        res[v] = json.loads(out)
    logits_mb = a.vocab * a.tokens * 4 / 2**20
    print(f"vocab={a.vocab} tokens={a.tokens} fp32 logits={logits_mb:.0f} MiB (fwd+bwd)")
    for v, r in res.items():
        print(f"  {v:10s} peak above inputs {r['peak_mb']:8.0f} MiB  "
              f"({r['peak_mb'] / logits_mb:4.2f}x logits)  {r['seconds']:.2f} s")
    n = res["naive"]["peak_mb"]
    print(f"ratio fused_tp1 / naive peak memory: {res['fused_tp1']['peak_mb'] / n:.2f}")
    print(f"ratio fused_tp2 (per rank) / naive peak memory: {res['fused_tp2']['peak_mb'] / n:.2f}")


if __name__ == "__main__":
    main()
