"""The multi-process layout job shared by ``reshard`` and ``import-hf --tp/--pp``, and the
tensor comparison that verifies what they wrote.

:func:`layout_job` checks a checkpoint against a new TP/PP layout and gathers what a rank
needs; :func:`spawn_layout` starts ``tp * pp`` gloo processes on this machine, each of
which builds the model at the new layout, loads the source (dist_checkpointing reshards on
load) and saves it; :func:`compare_checkpoints` compares full tensors exactly.

Leaves out choosing the output folder, publishing or discarding it (the commands do) and
megatron's DistributedOptimizer state (refused: only a run on GPUs can rebuild it).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from nemo_rlhf.checkpoint import load_checkpoint, read_metadata, read_trainer_state, save_checkpoint
from nemo_rlhf.distributed import ParallelConfig, destroy_distributed, initialize_distributed
from nemo_rlhf.distributed.parallel import free_port
from nemo_rlhf.models.config import ModelConfig
from nemo_rlhf.tools.ckpt._common import CLIError, first_line, full_tensors, quiet
from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig


def check_layout(model, tp: int, pp: int) -> None:
    """``--tp``/``--pp`` against the model (the offline job's world size is ``tp * pp``)."""
    if tp < 1 or pp < 1:
        raise CLIError(f"--tp {tp} --pp {pp}: both must be >= 1")
    groups = model.num_query_groups or model.num_attention_heads
    tps = [d for d in range(1, groups + 1) if groups % d == 0 and model.num_attention_heads % d == 0
           and model.padded_vocab_size % d == 0]
    if tp not in tps:
        raise CLIError(f"--tp {tp} must divide model.num_attention_heads={model.num_attention_heads}, "
                       f"num_query_groups={groups} and the padded vocabulary "
                       f"{model.padded_vocab_size}; valid --tp: {tps}")
    if model.num_layers % pp:
        raise CLIError(f"--pp {pp} must divide model.num_layers={model.num_layers}; valid --pp: "
                       f"{[d for d in range(1, model.num_layers + 1) if model.num_layers % d == 0]}")


def layout_job(src: Path, out: Path, tp: int, pp: int, cfg: dict, model, with_optimizer: bool) -> dict:
    """Everything a resharding rank needs (plain, picklable values)."""
    from megatron.core import dist_checkpointing

    from nemo_rlhf.tools.hf_convert import check_shapes  # lazy: megatron where needed

    check_layout(model, tp, pp)
    meta = read_metadata(src)
    tensors = dist_checkpointing.load_tensors_metadata(str(src / "dist"))
    keys = set(tensors)
    try:
        check_shapes({k[len("model."):]: v.global_shape for k, v in tensors.items()
                      if k.startswith("model.")}, model)
    except ValueError as exc:
        raise CLIError(f"{src}: {exc}") from None
    kind = "reward" if "model.reward_head.weight" in keys else "actor_critic"
    dtype = str(tensors["model.embedding.word_embeddings.weight"].dtype)
    precision = (cfg.get("trainer") or {}).get("precision") or {
        "torch.bfloat16": "bf16-mixed", "torch.float16": "fp16-mixed"}.get(dtype, "32")
    optim = None
    if with_optimizer and meta.get("has_optimizer"):
        if (meta.get("optimizer_format") or "adamw") != "adamw":
            raise CLIError(f"{src} holds megatron DistributedOptimizer state "
                           f"(optim.use_distributed_optimizer=true), which this offline tool "
                           f"cannot rebuild: resume the run at the new layout on GPUs (it "
                           f"reshards on load), or pass --model-only to reshard the weights")
        if not isinstance(cfg.get("optim"), dict):
            raise CLIError(f"{src} holds optimizer state but config.yaml has no optim section; "
                           "pass --model-only to reshard the weights alone")
        optim = cfg["optim"]
    new_cfg = dict(cfg)
    new_cfg["parallel"] = {**(cfg.get("parallel") or {}), "tensor_model_parallel_size": tp,
                           "pipeline_model_parallel_size": pp}
    return {"src": str(src), "out": str(out), "tp": tp, "pp": pp, "model": asdict(model),
            "precision": str(precision), "kind": kind,
            "has_head": any(k.startswith(("model.value_head.", "model.reward_head.")) for k in keys),
            "critic": any(k.startswith("critic.") for k in keys),
            "optim": optim, "step": int(meta["step"]), "trainer_state": read_trainer_state(src),
            "config": new_cfg, "fingerprint": meta.get("fingerprint") or {}}


def _layout_rank(rank: int, world: int, port: int, job: dict) -> None:
    """One rank of a resharding job (spawned): build at the new layout, load, save."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    quiet()
    import torch

    from nemo_rlhf.models.actor_critic import build_model  # lazy: megatron after quiet()

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg = ModelConfig(**job["model"])
    try:
        dims = initialize_distributed(ParallelConfig(job["tp"], job["pp"]), seed=0,
                                      num_layers=cfg.num_layers,
                                      num_attention_heads=cfg.num_attention_heads,
                                      num_query_groups=cfg.num_query_groups)
        model = build_model(cfg, dims, job["precision"], kind=job["kind"])
        if not job["has_head"] and hasattr(model, model.head_name):
            delattr(model, model.head_name)
        def optimizer_of(stage):
            if job["optim"] is None:
                return None
            return MixedPrecisionOptimizer(stage, OptimizerConfig(**job["optim"]),
                                           mp_group=dims.mp_group,
                                           fp16=job["precision"] == "fp16-mixed")

        opt = optimizer_of(model)
        critic = None
        if job["critic"]:  # a separate critic (critic.mode=separate), resharded alike
            critic_model = build_model(cfg, dims, job["precision"], kind="critic")
            critic = (critic_model, optimizer_of(critic_model))
        load_checkpoint(job["src"], model, opt, critic=critic)
        save_checkpoint(job["out"], job["step"], model, opt, job["trainer_state"], job["config"],
                        dims, job["fingerprint"], critic=critic)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException;
        # re-raised as an Exception so torch.multiprocessing reports it instead of a dump
        raise RuntimeError(f"rank {rank}: {type(exc).__name__}: {first_line(exc)}") from None
    finally:
        destroy_distributed()


def spawn_layout(job: dict) -> None:
    """Run a :func:`layout_job` in ``tp * pp`` spawned processes; a rank's error becomes one
    ``RuntimeError`` line."""
    import torch.multiprocessing as mp

    world = job["tp"] * job["pp"]
    try:
        mp.start_processes(_layout_rank, args=(world, free_port(), job), nprocs=world, join=True,
                           start_method="spawn")
    except Exception as exc:  # noqa: BLE001 - a rank's error, reported as one line
        lines = [x for x in str(exc).splitlines() if x.strip()]
        raise RuntimeError(f"resharding process failed: {lines[-1] if lines else exc}") from None


def compare_checkpoints(a, b: Path, expected: dict | None = None,
                        prefixes: tuple = ("model.", "optimizer.")) -> tuple[list[str], int]:
    """``(differences, tensors compared)`` between two checkpoints' full tensors whose keys
    start with ``prefixes`` (``expected`` instead of ``a``'s when given): missing / extra
    keys, shape, dtype or value differences (exact equality)."""
    import torch

    ta = expected if expected is not None else full_tensors(a)
    ta = {k: v for k, v in ta.items() if k.startswith(prefixes)}
    tb = {k: v for k, v in full_tensors(b).items() if k.startswith(prefixes)}
    out = [f"{k}: missing in {b}" for k in sorted(set(ta) - set(tb))]
    out += [f"{k}: not in the source" for k in sorted(set(tb) - set(ta))]
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k], tb[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            out.append(f"{k}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif not torch.equal(x, y):
            out.append(f"{k}: values differ (max abs {float((x.float() - y.float()).abs().max()):.3g})")
    return out, len(ta)
