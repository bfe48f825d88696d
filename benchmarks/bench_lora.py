"""LoRA vs full fine-tuning: one PPO step at the SmolLM2-135M shape, model state and peak RSS.

Each variant runs in its own subprocess (so the peaks do not mix) and takes one PPO step of
:class:`nemo_rlhf.trainers.ppo.trainer.PPOTrainer` (rollout, old log-probs and values,
reference log-probs, one optimizer step) on random weights of ``--model``:

  full   every parameter trained; ``reference.mode=offload`` (a host copy of the weights)
  lora   ``model.lora.enabled`` (rank ``--rank``, alpha ``--alpha``, the four target
         modules); ``reference.mode=adapters_off`` (no reference weights)

Printed per variant: trainable parameters, the bytes of the trained parameters, their
gradients (megatron's fp32 ``main_grad`` buffers), the optimizer state (Adam moments and any
fp32 masters), the reference weights (``ReferencePolicy.weight_bytes()``), the peak RSS of
the process (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) and the step's seconds; then
the ratios lora / full. The reward is a fixed random number per row (no RM: it would add
the same memory to both sides). fp32.

Usage: python benchmarks/bench_lora.py [--model smollm2_135m] [--rank 16] [--alpha 32]
           [--batch 8] [--prompt 64] [--new 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class _Tok:
    """The trainer only needs the special ids."""

    def __init__(self, vocab: int):
        self.eos_id, self.pad_id = vocab - 1, 0

    def decode(self, ids):
        return " ".join(map(str, ids))


def _bytes(t) -> int:
    return t.numel() * t.element_size()


def run_variant(a: argparse.Namespace, variant: str, work: Path) -> dict:
    import torch

    torch.set_num_threads(a.threads)
    from nemo_rlhf.data.datasets import PromptSample
    from nemo_rlhf.distributed import initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import LoRAConfig, load_model_preset
    from nemo_rlhf.models.engine import wrap_ddp
    from nemo_rlhf.trainers.optimizers import build_optimizer
    from nemo_rlhf.trainers.ppo.config import PPOConfig, validate_batch_sizes
    from nemo_rlhf.trainers.ppo.reference import ReferencePolicy
    from nemo_rlhf.trainers.ppo.trainer import PPOTrainer

    cfg = PPOConfig()
    cfg.model = load_model_preset(a.model, max_position_embeddings=a.prompt + a.new,
                                  hidden_dropout=0.0, attention_dropout=0.0)
    lora = variant == "lora"
    if lora:
        cfg.model.lora = LoRAConfig(enabled=True, rank=a.rank, alpha=a.alpha)
    cfg.reference.mode = "adapters_off" if lora else "offload"
    cfg.trainer.seed, cfg.trainer.precision = a.seed, "32"
    cfg.exp_manager.exp_dir = str(work / f"{variant}_exp")
    (work / "tok").mkdir(exist_ok=True)
    (work / "tok" / "tokenizer.json").write_text("{}")
    (work / "prompts.jsonl").write_text("")
    cfg.data.tokenizer_dir, cfg.data.train_file = str(work / "tok"), str(work / "prompts.jsonl")
    cfg.rollout.max_new_tokens = cfg.rollout.min_new_tokens = a.new
    cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p = 1.0, 0, 1.0
    cfg.rollout.stop_token_ids, cfg.rollout.stop_strings = [], []
    p = cfg.ppo
    p.num_rollout_samples = p.global_batch_size = a.batch
    p.micro_batch_size = p.forward_micro_batch_size = a.batch
    p.ppo_epochs = 1
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-5, 0
    vocab = cfg.model.vocab_size

    dims = initialize_distributed(cfg.parallel, seed=a.seed, num_layers=cfg.model.num_layers,
                                  num_attention_heads=cfg.model.num_attention_heads,
                                  num_query_groups=cfg.model.num_query_groups)
    validate_batch_sizes(cfg.ppo, dims.dp)

    def make_stage():
        return build_model(cfg.model, dims, "32", kind="actor_critic", seed=a.seed)

    model = make_stage()
    reference = ReferencePolicy(model, cfg.reference.mode, build_fn=make_stage, device=dims.device)
    ddp = wrap_ddp(model)
    optimizer = build_optimizer(ddp, cfg.optim, dims, "32")
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(1, vocab - 1, (a.batch * 2, a.prompt), generator=g).tolist()
    prompts = [PromptSample(prompt_ids=x, prompt="", extras={}) for x in ids]
    trainer = PPOTrainer(cfg, dims, ddp, optimizer, reference, None, _Tok(vocab), prompts, None)

    def score(idx, batch):
        return torch.randn(batch.input_ids.shape[0], generator=g), {}

    trainer.score = score
    t0 = time.perf_counter()
    m = trainer.train_step()
    step_s = time.perf_counter() - t0

    trained = [q for q in ddp.parameters() if q.requires_grad]
    grads = sum(_bytes(q.main_grad) for q in trained if getattr(q, "main_grad", None) is not None)
    inner = getattr(optimizer, "optimizer", optimizer)
    state = sum(_bytes(v) for st in inner.state.values() for v in st.values() if hasattr(v, "numel"))
    masters = getattr(optimizer, "masters", [])
    state += sum(_bytes(mm) for mm, q in zip(masters, getattr(optimizer, "params", [])) if mm is not q)
    return {
        "variant": variant, "total_params": sum(q.numel() for q in ddp.parameters()),
        "trainable_params": sum(q.numel() for q in trained),
        "param_bytes": sum(_bytes(q) for q in ddp.parameters()),
        "trained_param_bytes": sum(_bytes(q) for q in trained),
        "grad_bytes": grads, "optimizer_bytes": state,
        "reference_bytes": reference.weight_bytes(), "reference_host_bytes": reference.host_bytes(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": step_s, "kl_mean": m.get("kl_mean"),
    }


def _child(a: argparse.Namespace, variant: str, work: Path) -> dict:
    out = work / f"{variant}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_variant", variant, "--_work", str(work),
           "--_args", json.dumps(vars(a))]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(a.threads)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not out.exists():
        sys.stdout.write(proc.stdout[-6000:])
        raise SystemExit(f"{variant} failed (exit {proc.returncode})")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2_135m", help="conf/model preset (random weights)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", help="also write both variants' raw results here")
    p.add_argument("--_variant", help=argparse.SUPPRESS)
    p.add_argument("--_work", help=argparse.SUPPRESS)
    p.add_argument("--_args", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._variant:
        ns = argparse.Namespace(**json.loads(a._args))
        res = run_variant(ns, a._variant, Path(a._work))
        (Path(a._work) / f"{a._variant}.json").write_text(json.dumps(res))
        return
    res = {}
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        for v in ("full", "lora"):
            print(f"{v} ...", flush=True)
            res[v] = _child(a, v, Path(tmp))
    mib = lambda n: f"{n / 2**20:10.1f}"  # noqa: E731
    print(f"\n{a.model} (random weights), fp32, one PPO step: {a.batch} rollouts of {a.prompt} + {a.new} "
          f"tokens, {a.threads} threads; LoRA rank {a.rank}, alpha {a.alpha:g}, all four target modules")
    rows = [("trainable params", "trainable_params", lambda n: f"{n:10d}"),
            ("params MiB (all)", "param_bytes", mib), ("trained params MiB", "trained_param_bytes", mib),
            ("grads MiB", "grad_bytes", mib), ("optimizer state MiB", "optimizer_bytes", mib),
            ("reference weights MiB", "reference_bytes", mib), ("peak RSS MiB", "peak_rss_bytes", mib),
            ("step s", "step_s", lambda x: f"{x:10.2f}")]
    print(f"  {'':24s} {'full':>10s} {'lora':>10s} {'lora/full':>10s}")
    for label, key, fmt in rows:
        f, lo = res["full"][key], res["lora"][key]
        ratio = f"{lo / f:10.4f}" if f else f"{'-':>10s}"
        print(f"  {label:24s} {fmt(f)} {fmt(lo)} {ratio}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), **res}, indent=2))


if __name__ == "__main__":
    main()
