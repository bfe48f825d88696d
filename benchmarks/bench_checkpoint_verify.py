"""What verify-after-save costs: ``save_checkpoint`` of one model and its AdamW state with
``verify=False`` (the tensor digests are still taken and written) and ``verify=True`` (the
written shards read back and compared before publication), interleaved, in one process.

Printed: the bytes saved, seconds per save (median of ``--repeats``) for each, the ratio,
the digest-only part (``shard_digests`` alone, timed on the same state) and, for
comparison, ``nemo-rlhf-ckpt validate --deep``'s recomputation (``deep_problems`` on the
loaded tensors). Random weights of the ``--model`` preset (no download); bf16-mixed by
default, so bf16 weights, fp32 masters and two fp32 Adam moments are saved, as in training.

Usage: python benchmarks/bench_checkpoint_verify.py [--model smollm2_135m]
           [--precision bf16-mixed] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2_135m", help="conf/model preset")
    p.add_argument("--precision", default="bf16-mixed", help="trainer.precision of the saved model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="folder for the checkpoints (default: a temporary one)")
    a = p.parse_args()

    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.checkpoint.digests import deep_problems, shard_digests
    from nemo_rlhf.checkpoint.io import _materialize_adam_state, _model_sharded_state_dict, \
        _optimizer_sharded_state_dict, load_full_tensors
    from nemo_rlhf.distributed import LaunchEnv, ParallelConfig, destroy_distributed, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.engine import wrap_ddp
    from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig

    out = Path(a.out or tempfile.mkdtemp(prefix="bench_ckpt_"))
    cfg = load_model_preset(a.model)
    dims = initialize_distributed(ParallelConfig(), seed=1, launch_env=LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"))
    try:
        model = wrap_ddp(build_model(cfg, dims, precision=a.precision, seed=1))
        opt = MixedPrecisionOptimizer(model, OptimizerConfig(lr=1e-5))
        _materialize_adam_state(opt)

        def state():
            sd = _model_sharded_state_dict(model)
            opt_sd, _ = _optimizer_sharded_state_dict(dict(sd), opt)
            sd["optimizer"], sd["optimizer_masters"] = opt_sd["optimizer"], opt_sd["masters"]
            return sd

        times = {"verify=False": [], "verify=True": [], "digests only": []}
        step = 0
        for _ in range(a.repeats):
            for verify in (False, True):
                step += 1
                t0 = time.perf_counter()
                save_checkpoint(out, step, model, opt, {}, None, dims, verify=verify)
                times[f"verify={verify}"].append(time.perf_counter() - t0)
                shutil.rmtree(out / f"step_{step}")
            sd = state()
            t0 = time.perf_counter()
            tensors, _ = shard_digests(sd)
            times["digests only"].append(time.perf_counter() - t0)
        nbytes = sum(st.data.numel() * st.data.element_size() for st in tensors)
        last = save_checkpoint(out, step + 1, model, opt, {}, None, dims)
    finally:
        destroy_distributed()
    full = load_full_tensors(last)
    t0 = time.perf_counter()
    problems = deep_problems(last, full)
    deep_s = time.perf_counter() - t0
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model {a.model}, {a.precision}: {nbytes / 2**30:.2f} GiB of tensors saved "
          f"({len(tensors)} shards), torch threads {torch.get_num_threads()}, {a.repeats} repeats")
    for k, v in med.items():
        print(f"  {k:<14} {v:7.2f} s   ({v / med['verify=False']:.2f}x of a save without read-back)")
    print(f"  read-back adds {med['verify=True'] - med['verify=False']:.2f} s "
          f"({(med['verify=True'] - med['verify=False']) / med['verify=False']:.0%} of the save)")
    print(f"  validate --deep's recomputation: {deep_s:.2f} s, problems: {problems or 'none'}")
    if a.out is None:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
