"""``nemo-rlhf-ckpt reshard``: rewrite a verified checkpoint at another TP/PP layout into a
new checkpoints folder (the :mod:`.spawn` layout job), then compare every model, critic
and (unless ``--model-only``) optimizer tensor with the source; a difference leaves the
result unpublished (no COMPLETE marker, no ``latest``) and exits 1.

Leaves out the data-parallel size (any DP loads a checkpoint) and per-rank RNG streams
(the result holds the resharding processes' own).
"""

from __future__ import annotations

from nemo_rlhf.tools.ckpt._common import (
    EXIT_OK,
    check_out,
    discard_out,
    emit,
    empty_out,
    model_config,
    read_yaml,
    resolve_ckpt,
    verified,
)
from nemo_rlhf.tools.ckpt.spawn import compare_checkpoints, layout_job, spawn_layout


def cmd_reshard(args) -> int:
    src = verified(resolve_ckpt(args.ckpt))
    cfg = read_yaml(src)
    model = model_config(cfg, src)
    job = layout_job(src, check_out(args.out), args.tp, args.pp, cfg, model, not args.model_only)
    out, created = empty_out(args.out)
    try:
        spawn_layout(job)
        dst = out / f"step_{job['step']}"
        prefixes = (("model.", "critic.", "optimizer.", "critic_optimizer.")
                    if job["optim"] is not None else ("model.", "critic."))
        problems, n = compare_checkpoints(src, dst, prefixes=prefixes)
    except BaseException:
        discard_out(out, created)
        raise
    if problems:
        (dst / "COMPLETE").unlink(missing_ok=True)
        (out / "latest").unlink(missing_ok=True)
        raise RuntimeError(f"verification failed, {dst} unpublished: {'; '.join(problems[:5])}")
    emit(args, {"source": str(src), "output": str(dst), "tp": args.tp, "pp": args.pp,
                "optimizer": job["optim"] is not None, "tensors_verified": n},
         [f"resharded {src} -> {dst} (tp={args.tp}, pp={args.pp}; optimizer "
          f"{'included' if job['optim'] is not None else 'not included'}); "
          f"verified {n} tensors identical to the source"])
    return EXIT_OK
