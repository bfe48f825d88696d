"""``nemo-rlhf-ckpt``: list, inspect, validate, reshard, prune and convert checkpoints.

Usage (``python -m nemo_rlhf.tools.ckpt_cli`` or the ``nemo-rlhf-ckpt`` console script)::

    nemo-rlhf-ckpt list <exp_dir | checkpoints_dir>
    nemo-rlhf-ckpt inspect <ckpt>
    nemo-rlhf-ckpt validate <ckpt>
    nemo-rlhf-ckpt resume-info <exp_dir> [--resume auto|none|<ckpt>]
    nemo-rlhf-ckpt reshard <ckpt> --tp N --pp M --out <new_checkpoints_dir> [--model-only]
    nemo-rlhf-ckpt prune <exp_dir> --keep N [--dry-run]
    nemo-rlhf-ckpt export-hf <ckpt> --out <dir> [--arch llama|qwen2|gpt2] [--rm] [--dtype D]
    nemo-rlhf-ckpt import-hf <hf_dir> --out <ckpt_dir> [--tp N --pp M] [--model-name NAME]
                                   [--chat-template chatml --system-prompt TEXT]

``<ckpt>`` is a ``step_<N>`` folder, or a checkpoint root / experiment folder (its newest
complete checkpoint). Every command takes ``--json`` (machine-readable stdout) and
``--debug`` (tracebacks). Exit codes: 0 ok, 1 problems found or a step failed, 2 bad input
(one line on stderr naming the path and the problem). Outputs are never written into a
non-empty folder.

``reshard`` and ``import-hf --tp/--pp`` spawn ``tp * pp`` gloo processes on this machine
(megatron builds the model at the new layout, dist_checkpointing reshards on load), then
compare every model and optimizer tensor of the result with the source. Simplified: the
RNG states a resharded checkpoint holds are those of the resharding processes (a layout
change cannot carry per-rank RNG streams over); ``config.yaml``'s ``parallel`` section is
updated to the new layout, everything else (step, trainer state, fingerprint) is copied.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

from nemo_rlhf.checkpoint import (
    CheckpointError,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_metadata,
    read_trainer_state,
    save_checkpoint,
    verify_checkpoint,
)
from nemo_rlhf.checkpoint.io import load_full_tensors
from nemo_rlhf.checkpoint.policy import prune_plan, select_resume_checkpoint
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed import ParallelConfig, destroy_distributed, initialize_distributed
from nemo_rlhf.distributed.parallel import free_port
from nemo_rlhf.models.config import ModelConfig
from nemo_rlhf.trainers.optim import MixedPrecisionOptimizer, OptimizerConfig

EXIT_OK, EXIT_PROBLEMS, EXIT_BAD_INPUT = 0, 1, 2
KEY_METRICS = ("reward_mean", "kl_mean", "train/loss", "val/loss", "train/accuracy",
               "val/accuracy", "eval/reward", "response_length", "policy_loss", "value_loss")


class CLIError(Exception):
    """Bad input: reported as one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + error
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def _quiet() -> None:
    """Silence import-time chatter (TE/Apex fallbacks) so stderr carries only our lines."""
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


# --------------------------------------------------------------------------- paths
def _existing(arg: str) -> Path:
    p = Path(arg)
    if not p.exists():
        raise CLIError(f"{p}: no such file or directory")
    return p


def _ckpt_root(p: Path) -> Path:
    """``<exp_dir>/checkpoints`` when ``p`` is an experiment folder, else ``p``."""
    return p / "checkpoints" if (p / "checkpoints").is_dir() else p


def _resolve_ckpt(arg: str) -> Path:
    """A complete ``step_<N>`` folder: ``arg`` itself, or the newest under it."""
    p = _existing(arg)
    if (p / "COMPLETE").is_file():
        return p
    if p.is_dir() and any(_ckpt_root(p).glob("step_*/COMPLETE")):  # cheap test before torch
        found = find_latest_checkpoint(_ckpt_root(p))
        if found is not None:
            return found
    raise CLIError(f"{p}: not a complete checkpoint (no COMPLETE marker) and no complete "
                   "checkpoint under it")


def _verified(ckpt: Path) -> Path:
    """``ckpt`` if its files match their recorded checksums (sources of reshard/export)."""
    problems = verify_checkpoint(ckpt)
    if problems:
        raise CLIError(f"{ckpt} is damaged ({'; '.join(problems[:3])}); see `validate`")
    return ckpt


def _check_out(arg: str) -> Path:
    """An output folder that must be absent or empty (checked before any work)."""
    p = Path(arg)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise CLIError(f"{p}: output exists and is not an empty folder (nothing is overwritten; "
                       "choose a new folder)")
    return p


def _empty_out(arg: str) -> tuple[Path, bool]:
    """``(path, created)``: create the output folder (see :func:`_check_out`)."""
    p = _check_out(arg)
    created = not p.exists()
    p.mkdir(parents=True, exist_ok=True)
    return p, created


def _discard_out(p: Path, created: bool) -> None:
    """Remove what a failed command wrote into its (previously absent or empty) output."""
    if created:
        shutil.rmtree(p, ignore_errors=True)
    elif p.is_dir():
        for child in p.iterdir():
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink()


def _read_yaml(ckpt: Path) -> dict:
    f = ckpt / "config.yaml"
    if not f.is_file():
        raise CLIError(f"{ckpt}: no config.yaml (the model architecture is unknown)")
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.to_container(OmegaConf.load(f), resolve=True)
    except Exception as exc:  # noqa: BLE001 - yaml / interpolation errors
        raise CLIError(f"{f}: unreadable ({_first_line(exc)})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise CLIError(f"{f}: no 'model' section")
    return cfg


def _model_config(cfg: dict, ckpt: Path):
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg["model"]))
    except Exception as exc:  # noqa: BLE001 - omegaconf raises several types
        raise CLIError(f"{ckpt}/config.yaml: invalid model section: {_first_line(exc)}") from None


def _dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _emit(args, doc: dict, lines: list[str]) -> None:
    print(json.dumps(doc, indent=2, default=str) if args.json else "\n".join(lines))


def _layout(meta: dict) -> str:
    par = meta.get("parallel") or {}
    return f"tp{par.get('tp', '?')} pp{par.get('pp', '?')} dp{par.get('dp', '?')}" if par else "-"


# --------------------------------------------------------------------------- list
def _metrics_by_step(exp_dir: Path) -> dict[int, dict]:
    """Last ``metrics.jsonl`` line of every step (a resumed run may repeat a step)."""
    out, f = {}, exp_dir / "metrics.jsonl"
    for line in f.read_text().splitlines() if f.is_file() else []:
        try:
            row = json.loads(line)
            out[int(row["step"])] = row
        except (ValueError, KeyError, TypeError):  # a torn last line after a crash
            continue
    return out


def cmd_list(args) -> int:
    p = _existing(args.path)
    root = _ckpt_root(p)
    temps = sorted(root.glob(".tmp_step_*")) if root.is_dir() else []
    steps = []
    if any(root.glob("step_*")):  # cheap test before importing torch
        steps = list_checkpoints(root)
    if not steps and not temps:
        hint = "; it is one checkpoint: use inspect" if (p / "COMPLETE").is_file() else ""
        raise CLIError(f"{p}: no checkpoints (expected step_<N> folders in it or in "
                       f"{p / 'checkpoints'}){hint}")
    latest_file = root / "latest"
    latest = latest_file.read_text().strip() if latest_file.is_file() else None
    metrics = _metrics_by_step(root.parent if root.name == "checkpoints" else root)
    rows = []
    for step, path, ok in steps:
        meta, state = {}, {}
        if ok:
            try:
                meta = json.loads((path / "metadata.json").read_text())
                state = read_trainer_state(path)
            except (OSError, ValueError):
                pass
        rows.append({"step": step, "path": str(path), "status": "complete" if ok else "incomplete",
                     "latest": path.name == latest, "size_bytes": _dir_size(path),
                     "parallel": meta.get("parallel"), "has_optimizer": meta.get("has_optimizer"),
                     "metrics": {k: v for k, v in {**(state.get("metrics") or {}), **state,
                                                   **metrics.get(step, {})}.items()
                                 if type(v) in (int, float) and k != "step"}})
    for t in temps:
        rows.append({"step": int(t.name.rsplit("_", 1)[1]) if t.name[10:].isdigit() else None,
                     "path": str(t), "status": "temp", "latest": False, "size_bytes": _dir_size(t),
                     "parallel": None, "has_optimizer": None, "metrics": {}})
    lines = [f"checkpoints in {root} (latest -> {latest or 'none'})",
             f"  {'step':>6}  {'status':<11} {'size':>10}  {'layout':<13} metrics"]
    for r in rows:
        shown = [k for k in KEY_METRICS if k in r["metrics"]] or list(r["metrics"])[:4]
        text = " ".join(f"{k}={r['metrics'][k]:.4g}" for k in shown)
        if r["status"] == "temp":
            text = f"unpublished save ({Path(r['path']).name})"
        elif r["status"] == "incomplete":
            text = "no COMPLETE marker: never loaded"
        status = r["status"] + (" *" if r["latest"] else "")
        layout = _layout({"parallel": r["parallel"]}) if r["parallel"] else "-"
        step = r["step"] if r["step"] is not None else "?"
        lines.append(f"  {step:>6}  {status:<11} {_size(r['size_bytes']):>10}  {layout:<13} {text}")
    lines.append("  (* = the checkpoint 'latest' names)")
    _emit(args, {"root": str(root), "latest": latest, "checkpoints": rows}, lines)
    return EXIT_OK


# --------------------------------------------------------------------------- inspect
def _model_summary(m) -> str:
    groups = m.num_query_groups or m.num_attention_heads
    return (f"{m.name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
            f"heads / {groups} KV groups, ffn {m.ffn_hidden_size or 4 * m.hidden_size}, vocab "
            f"{m.vocab_size} (padded {m.padded_vocab_size}), {m.normalization}, {m.activation}, "
            f"{m.position_embedding_type}, "
            f"{'tied' if m.share_embeddings_and_output_weights else 'untied'} embeddings")


def cmd_inspect(args) -> int:
    from nemo_rlhf.tools.hf_convert import infer_arch  # lazy: quick, quiet CLI
    ckpt = _resolve_ckpt(args.ckpt)
    meta = read_metadata(ckpt)
    cfg = _read_yaml(ckpt)
    model = _model_config(cfg, ckpt)
    try:
        arch = infer_arch(model)
    except ValueError as exc:
        arch = f"none ({exc})"
    from megatron.core import dist_checkpointing

    tensors = []
    for key, sh in sorted(dist_checkpointing.load_tensors_metadata(str(ckpt / "dist")).items()):
        tensors.append({"key": key, "shape": list(sh.global_shape),
                        "dtype": str(sh.dtype).replace("torch.", "")})
    n_params = sum(math.prod(t["shape"]) for t in tensors if t["key"].startswith("model."))
    state = read_trainer_state(ckpt)
    data, trainer = cfg.get("data") or {}, cfg.get("trainer") or {}
    doc = {"path": str(ckpt), "step": meta.get("step"), "parallel": meta.get("parallel"),
           "has_optimizer": meta.get("has_optimizer"), "optimizer_step": meta.get("optimizer_step"),
           "fingerprint": meta.get("fingerprint"), "model": asdict(model), "hf_arch": arch,
           "tokenizer_dir": data.get("tokenizer_dir"), "precision": trainer.get("precision"),
           "trainer_state": state, "num_model_parameters": n_params, "tensors": tensors}
    lines = [f"checkpoint {ckpt}",
             f"  step {meta.get('step')}, saved at {_layout(meta)}; optimizer state: "
             f"{'yes (step %s)' % meta.get('optimizer_step') if meta.get('has_optimizer') else 'no'}",
             f"  model: {_model_summary(model)}", f"  HF architecture: {arch}",
             f"  tokenizer_dir: {data.get('tokenizer_dir')}; precision: {trainer.get('precision')}",
             f"  fingerprint: {json.dumps(meta.get('fingerprint'), default=str)}",
             f"  trainer_state: {json.dumps(state, default=str)[:300]}",
             f"  tensors ({len(tensors)}; {n_params:,} model parameters incl. vocabulary padding):"]
    width = max((len(t["key"]) for t in tensors), default=0)
    lines += [f"    {t['key']:<{width}}  {str(t['shape']):<18} {t['dtype']}" for t in tensors]
    _emit(args, doc, lines)
    return EXIT_OK


# --------------------------------------------------------------------------- validate
def cmd_validate(args) -> int:
    p = _existing(args.ckpt)
    looks_like = (p / "dist").is_dir() or (p / "metadata.json").is_file() or (p / "COMPLETE").is_file()
    if not looks_like:
        p = _resolve_ckpt(args.ckpt)
    problems, n_tensors = [], 0
    if not (p / "COMPLETE").is_file():
        problems.append("no COMPLETE marker (an unpublished or interrupted save)")
    else:
        problems += verify_checkpoint(p)
        for name in ("trainer_state.json", "metadata.json"):
            try:
                json.loads((p / name).read_text())
            except (OSError, ValueError) as exc:
                problems.append(f"{name}: unreadable ({exc})")
        try:
            import torch

            full = load_full_tensors(p)
            tensors = {k: v for k, v in full.items() if torch.is_tensor(v)}
            n_tensors = len(tensors)
            bad = [k for k, v in tensors.items()
                   if v.is_floating_point() and not torch.isfinite(v).all()]
            problems += [f"{k}: non-finite values" for k in bad]
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - any load failure is the finding (torch's
            # CheckpointException derives from BaseException)
            problems.append(f"not loadable: {type(exc).__name__}: {_first_line(exc)}")
    doc = {"path": str(p), "ok": not problems, "problems": problems, "tensors_loaded": n_tensors}
    if problems:
        _emit(args, doc, [f"INVALID {p}:"] + [f"  - {x}" for x in problems])
        print(f"nemo-rlhf-ckpt validate: {p}: {len(problems)} problem(s)", file=sys.stderr)
        return EXIT_PROBLEMS
    _emit(args, doc, [f"OK {p}: checksums match, {n_tensors} tensors load"])
    return EXIT_OK


def _first_line(exc: BaseException) -> str:
    """The informative line of an error message (the last one of an embedded traceback)."""
    text = str(exc)
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    if not lines:
        return ""
    return (lines[-1] if "Traceback" in text else lines[0])[:300]


# --------------------------------------------------------------------------- resume-info
def cmd_resume_info(args) -> int:
    p = _existing(args.exp_dir)
    if not p.is_dir():
        raise CLIError(f"{p}: not a folder (expected an experiment folder)")
    # the trainer looks in <exp_dir>/checkpoints, which a fresh experiment may not have yet
    root = p if p.name == "checkpoints" or any(p.glob("step_*")) else p / "checkpoints"
    import logging

    logging.getLogger("nemo_rlhf.ppo").setLevel(logging.ERROR)  # the reason names what was skipped
    try:
        path, why = select_resume_checkpoint(args.resume, root)
    except CheckpointError as exc:
        raise CLIError(str(exc)) from None
    doc = {"checkpoints": str(root), "resume": args.resume, "path": str(path) if path else None,
           "reason": why, "step": None}
    if path is not None:
        doc["step"] = read_trainer_state(path).get("step", int(path.name.split("_")[1]))
        lines = [f"would resume from {path} (step {doc['step']}): {why}"]
    else:
        lines = [f"would start fresh: {why}"]
    unverified = find_latest_checkpoint(root) if args.resume == "auto" else None
    if unverified is not None and unverified != path:
        doc["sft_rm_would_load"] = str(unverified)
        lines.append(f"note: SFT/RM trainers pick the newest complete checkpoint without checksum "
                     f"verification and would load {unverified}")
    _emit(args, doc, lines)
    return EXIT_OK


# --------------------------------------------------------------------------- prune
def cmd_prune(args) -> int:
    p = _existing(args.exp_dir)
    if args.keep < 1:
        raise CLIError(f"--keep {args.keep}: must be >= 1 (the newest complete checkpoint is "
                       "never deleted)")
    root = _ckpt_root(p)
    if not list_checkpoints(root) and not list(root.glob(".tmp_step_*")):
        raise CLIError(f"{p}: no checkpoints to prune")
    delete, kept = prune_plan(root, args.keep)
    if not args.dry_run:
        for path, _ in delete:
            (path / "COMPLETE").unlink(missing_ok=True)  # never half-deleted yet "complete"
            shutil.rmtree(path)
    verb = "would delete" if args.dry_run else "deleted"
    lines = [f"{verb} {path} ({why})" for path, why in delete]
    lines += [f"kept {path} ({why})" for path, why in kept]
    _emit(args, {"dry_run": args.dry_run, "deleted" if not args.dry_run else "would_delete":
                 [str(x) for x, _ in delete], "kept": [str(x) for x, _ in kept]}, lines)
    return EXIT_OK


# --------------------------------------------------------------------------- layout workers

def _layout_rank(rank: int, world: int, port: int, job: dict) -> None:
    """One rank of a resharding job (spawned): build at the new layout, load, save."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _quiet()
    import torch

    from nemo_rlhf.models.actor_critic import build_model  # lazy: megatron after _quiet()

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
        raise RuntimeError(f"rank {rank}: {type(exc).__name__}: {_first_line(exc)}") from None
    finally:
        destroy_distributed()


def _spawn_layout(job: dict) -> None:
    import torch.multiprocessing as mp

    world = job["tp"] * job["pp"]
    try:
        mp.start_processes(_layout_rank, args=(world, free_port(), job), nprocs=world, join=True,
                           start_method="spawn")
    except Exception as exc:  # noqa: BLE001 - a rank's error, reported as one line
        lines = [x for x in str(exc).splitlines() if x.strip()]
        raise RuntimeError(f"resharding process failed: {lines[-1] if lines else exc}") from None


def _tensors(path: Path) -> dict:
    import torch

    return {k: v for k, v in load_full_tensors(path).items() if torch.is_tensor(v)}


def compare_checkpoints(a, b: Path, expected: dict | None = None,
                        prefixes: tuple = ("model.", "optimizer.")) -> tuple[list[str], int]:
    """``(differences, tensors compared)`` between two checkpoints' full tensors whose keys
    start with ``prefixes`` (``expected`` instead of ``a``'s when given): missing / extra
    keys, shape, dtype or value differences (exact equality)."""
    import torch

    ta = expected if expected is not None else _tensors(a)
    ta = {k: v for k, v in ta.items() if k.startswith(prefixes)}
    tb = {k: v for k, v in _tensors(b).items() if k.startswith(prefixes)}
    out = [f"{k}: missing in {b}" for k in sorted(set(ta) - set(tb))]
    out += [f"{k}: not in the source" for k in sorted(set(tb) - set(ta))]
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k], tb[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            out.append(f"{k}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif not torch.equal(x, y):
            out.append(f"{k}: values differ (max abs {float((x.float() - y.float()).abs().max()):.3g})")
    return out, len(ta)


def _layout_job(src: Path, out: Path, tp: int, pp: int, cfg: dict, model, with_optimizer: bool) -> dict:
    """Everything a resharding rank needs (plain, picklable values)."""
    from megatron.core import dist_checkpointing

    from nemo_rlhf.tools.hf_convert import check_shapes  # lazy: quick, quiet CLI

    _check_layout(model, tp, pp)
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


def _check_layout(model, tp: int, pp: int) -> None:
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


def cmd_reshard(args) -> int:
    src = _verified(_resolve_ckpt(args.ckpt))
    cfg = _read_yaml(src)
    model = _model_config(cfg, src)
    job = _layout_job(src, _check_out(args.out), args.tp, args.pp, cfg, model, not args.model_only)
    out, created = _empty_out(args.out)
    try:
        _spawn_layout(job)
        dst = out / f"step_{job['step']}"
        prefixes = (("model.", "critic.", "optimizer.", "critic_optimizer.")
                    if job["optim"] is not None else ("model.", "critic."))
        problems, n = compare_checkpoints(src, dst, prefixes=prefixes)
    except BaseException:
        _discard_out(out, created)
        raise
    if problems:
        (dst / "COMPLETE").unlink(missing_ok=True)
        (out / "latest").unlink(missing_ok=True)
        raise RuntimeError(f"verification failed, {dst} unpublished: {'; '.join(problems[:5])}")
    _emit(args, {"source": str(src), "output": str(dst), "tp": args.tp, "pp": args.pp,
                 "optimizer": job["optim"] is not None, "tensors_verified": n},
          [f"resharded {src} -> {dst} (tp={args.tp}, pp={args.pp}; optimizer "
           f"{'included' if job['optim'] is not None else 'not included'}); "
           f"verified {n} tensors identical to the source"])
    return EXIT_OK


# --------------------------------------------------------------------------- HF export
def cmd_export_hf(args) -> int:
    from nemo_rlhf.tools import hf_convert as hc  # lazy: quick, quiet CLI
    ckpt = _verified(_resolve_ckpt(args.ckpt))
    cfg = _read_yaml(ckpt)
    model = _model_config(cfg, ckpt)
    try:
        arch = args.arch or hc.infer_arch(model)
        problems = hc.arch_problems(model, arch)
    except ValueError as exc:
        raise CLIError(f"{ckpt}: {exc}") from None
    if problems:
        raise CLIError(f"{ckpt}: cannot export as {arch}: {'; '.join(problems)}")
    if args.dtype is not None and args.dtype not in hc.DTYPES:
        raise CLIError(f"--dtype {args.dtype}: valid choices are {sorted(hc.DTYPES)}")
    tok_dir = None
    if not args.no_tokenizer:
        tok_dir = Path(args.tokenizer_dir or (cfg.get("data") or {}).get("tokenizer_dir") or "")
        if not str(tok_dir) or not (tok_dir / "tokenizer.json").is_file():
            raise CLIError(f"tokenizer folder {str(tok_dir) or '(none in config.yaml)'} has no "
                           "tokenizer.json; pass --tokenizer-dir DIR or --no-tokenizer")
    _check_out(args.out)
    full = {k[len("model."):]: v for k, v in _tensors(ckpt).items() if k.startswith("model.")}
    if args.rm:
        if hc.REWARD_W not in full:
            raise CLIError(f"{ckpt}: no reward_head tensors (not a reward model); drop --rm to "
                           "export the actor")
        bias = float(full[hc.REWARD_B].reshape(-1)[0]) if hc.REWARD_B in full else 0.0
        if bias != 0.0 and not args.drop_rm_bias:
            raise CLIError(f"{ckpt}: reward_head.bias={bias:.6g} is non-zero and HF's "
                           f"{hc.get_arch(arch).seq_cls} has no bias; refusing (pass --drop-rm-bias "
                           f"to export anyway: every score shifts by {-bias:.6g}, preferences and "
                           "Bradley-Terry probabilities are unchanged)")
    try:
        tensors = hc.megatron_to_hf(full, model, arch, reward=args.rm)
    except ValueError as exc:
        raise CLIError(f"{ckpt}: {exc}") from None
    dtype = hc.DTYPES[args.dtype] if args.dtype else full[hc.WORD].dtype
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    out, created = _empty_out(args.out)
    try:
        ids = hc.export_tokenizer(tok_dir, out, model.max_position_embeddings) if tok_dir else {}
        config = hc.hf_config(model, arch, dtype, reward=args.rm, token_ids=ids)
        hc.write_hf_folder(out, tensors, config)
    except BaseException:
        _discard_out(out, created)
        raise
    cls = config["architectures"][0]
    _emit(args, {"source": str(ckpt), "output": str(out), "arch": arch, "class": cls,
                 "dtype": str(dtype).replace("torch.", ""), "tensors": len(tensors),
                 "tokenizer": str(tok_dir) if tok_dir else None},
          [f"exported {ckpt} -> {out} as {cls} ({len(tensors)} tensors, "
           f"{str(dtype).replace('torch.', '')}; tokenizer: {tok_dir or 'not copied'})"])
    return EXIT_OK


# --------------------------------------------------------------------------- HF import
def cmd_import_hf(args) -> int:
    from nemo_rlhf.tools import hf_convert as hc  # lazy: quick, quiet CLI
    src = _existing(args.hf_dir)
    if not src.is_dir():
        raise CLIError(f"{src}: not a folder (expected a Hugging Face model folder)")
    try:
        hf_cfg = hc.read_hf_config(src)
        model, arch = hc.model_config_from_hf(hf_cfg, args.model_name or src.resolve().name)
        hc.find_weight_files(src)
    except KeyError as exc:
        raise CLIError(f"{src}/config.json lacks {exc}") from None
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc) if str(src) in str(exc) else f"{src}: {exc}") from None
    tok_src = Path(args.tokenizer_dir) if args.tokenizer_dir else src
    if not tok_src.is_dir():
        raise CLIError(f"{tok_src}: no such tokenizer folder")
    if args.system_prompt and not args.chat_template:
        raise CLIError("--system-prompt needs --chat-template (a system message needs a chat template)")
    _check_out(args.out)
    _check_layout(model, args.tp, args.pp)
    hf = hc.read_hf_weights(src)
    try:
        tensors = hc.hf_to_megatron(hf, model, arch)
    except ValueError as exc:
        raise CLIError(f"{src}: {exc}") from None
    dtype = hc.hf_weights_dtype(hf)
    precision = {"bfloat16": "bf16-mixed", "float16": "fp16-mixed"}.get(str(dtype)[6:], "32")
    out, created = _empty_out(args.out)
    try:
        tok_dest = out / "tokenizer"
        try:
            hc.import_tokenizer(tok_src, tok_dest)
        except (FileNotFoundError, ValueError) as exc:
            raise CLIError(str(exc)) from None
        warn = _vocab_warning(tok_dest, model.vocab_size)
        data = {"tokenizer_dir": str(tok_dest.resolve())}
        if args.chat_template:
            data.update(chat_template=args.chat_template, system_prompt=args.system_prompt)
        config = {"model": asdict(model), "data": data,
                  "parallel": asdict(ParallelConfig(args.tp, args.pp)),
                  "trainer": {"precision": precision}}
        state = {"step": 0, "source": {"hf_dir": str(src.resolve()), "model_type": arch,
                                       "architectures": hf_cfg.get("architectures")}}
        fingerprint = {"model": model.fingerprint(), "source": f"hf:{src.resolve()}"}
        single_root = out if args.tp * args.pp == 1 else out / ".import_tp1"
        single = hc.save_imported_checkpoint(single_root, model, tensors, precision, config, state,
                                             fingerprint)
        final = single
        if args.tp * args.pp > 1:
            job = _layout_job(single, out, args.tp, args.pp, config, model, False)
            _spawn_layout(job)
            final = out / "step_0"
        problems, _ = compare_checkpoints(None, final, {f"model.{k}": v for k, v in tensors.items()})
        if problems:
            raise RuntimeError(f"verification failed: {'; '.join(problems[:5])}")
        if single_root != out:
            shutil.rmtree(single_root)
        preset = _write_model_preset(out, model)
    except BaseException:
        _discard_out(out, created)
        raise
    if warn:
        print(f"nemo-rlhf-ckpt import-hf: warning: {warn}", file=sys.stderr)
    hint = (f"--config-dir {preset.parents[1]} model={preset.stem} "
            f"data.tokenizer_dir={tok_dest.resolve()}")
    _emit(args, {"source": str(src), "output": str(final), "arch": arch, "model": asdict(model),
                 "precision": precision, "tokenizer_dir": str(tok_dest.resolve()),
                 "model_preset": str(preset), "tp": args.tp, "pp": args.pp, "overrides": hint},
          [f"imported {src} ({arch}) -> {final} (tp={args.tp}, pp={args.pp}, precision {precision})",
           f"  tokenizer: {tok_dest}; model preset: {preset}; no value head (PPO initialises it)",
           f"  start from it with: {hint} exp_manager.init_from={final} (PPO) or "
           f"sft.init_from / rm.init_from={final}"])
    return EXIT_OK


def _write_model_preset(out: Path, model) -> Path:
    """``<out>/conf/model/<name>.yaml``: the model section as a Hydra preset, for
    ``--config-dir <out>/conf model=hf_<name>`` on the training entry points (the ``hf_``
    prefix keeps it from being shadowed by a built-in preset of the same name)."""
    from omegaconf import OmegaConf

    stem = "hf_" + re.sub(r"[^A-Za-z0-9_.-]", "_", model.name)
    f = out / "conf" / "model" / f"{stem}.yaml"
    f.parent.mkdir(parents=True)
    f.write_text("# written by nemo-rlhf-ckpt import-hf\n" + OmegaConf.to_yaml(asdict(model)))
    return f


def _vocab_warning(tok_dir: Path, vocab_size: int) -> str | None:
    n = Tokenizer(tok_dir).vocab_size
    if n != vocab_size:
        return (f"the tokenizer has {n} tokens but the model's vocabulary is {vocab_size} rows; "
                f"SFT/RM runs check model.vocab_size against the tokenizer and will refuse it")
    return None


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    p = _Parser(prog="nemo-rlhf-ckpt",
                description="List, inspect, validate, reshard, prune and convert checkpoints.",
                epilog="Exit codes: 0 ok, 1 problems found or a step failed, 2 bad input.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def add(name, fn, help_):
        s = sub.add_parser(name, parents=[common], help=help_, description=help_)
        s.set_defaults(func=fn)
        return s

    s = add("list", cmd_list, "checkpoints of an experiment: step, status, size, layout, metrics")
    s.add_argument("path", help="experiment folder or its checkpoints/ folder")
    s = add("inspect", cmd_inspect, "config summary, fingerprint, tensor shapes and dtypes")
    s.add_argument("ckpt")
    s = add("validate", cmd_validate, "checksums, shard presence and loadability")
    s.add_argument("ckpt")
    s = add("resume-info", cmd_resume_info, "what an auto-resume would load, and why")
    s.add_argument("exp_dir")
    s.add_argument("--resume", default="auto", help="exp_manager.resume: auto, none or a path")
    s = add("reshard", cmd_reshard, "rewrite a checkpoint at another TP/PP layout (verified)")
    s.add_argument("ckpt")
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--pp", type=int, default=1)
    s.add_argument("--out", required=True, help="new (empty) checkpoints folder")
    s.add_argument("--model-only", action="store_true", help="leave the optimizer state out")
    s = add("prune", cmd_prune, "delete old checkpoints and stale temporary saves")
    s.add_argument("exp_dir")
    s.add_argument("--keep", type=int, required=True, help="complete checkpoints to keep (>= 1)")
    s.add_argument("--dry-run", action="store_true")
    s = add("export-hf", cmd_export_hf, "write a Hugging Face folder (safetensors + config)")
    s.add_argument("ckpt")
    s.add_argument("--out", required=True)
    s.add_argument("--arch", default=None, help="llama, qwen2 or gpt2 (default: inferred)")
    s.add_argument("--rm", action="store_true", help="export the reward model (SequenceClassification)")
    s.add_argument("--drop-rm-bias", action="store_true", help="export an RM with a non-zero bias")
    s.add_argument("--dtype", default=None,
                   help="float32, bfloat16 or float16 (default: the checkpoint's)")
    s.add_argument("--tokenizer-dir", default=None, help="instead of config.yaml's data.tokenizer_dir")
    s.add_argument("--no-tokenizer", action="store_true")
    s = add("import-hf", cmd_import_hf, "convert a local Hugging Face model into a step_0 checkpoint")
    s.add_argument("hf_dir")
    s.add_argument("--out", required=True)
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--pp", type=int, default=1)
    s.add_argument("--model-name", default=None, help="model.name (default: the folder's name)")
    s.add_argument("--tokenizer-dir", default=None, help="tokenizer files (default: hf_dir)")
    s.add_argument("--chat-template", default=None, choices=["chatml"],
                   help="prompt format recorded in the checkpoint's config (data.chat_template)")
    s.add_argument("--system-prompt", default=None,
                   help="system message recorded as data.system_prompt (needs --chat-template)")
    return p


def main(argv=None) -> int:
    """Entry point; returns the exit code (the console script exits with it)."""
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            _quiet()
            return args.func(args)
    except CLIError as exc:
        print(f"nemo-rlhf-ckpt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - one line unless --debug
        if args.debug:
            raise
        print(f"nemo-rlhf-ckpt {args.command}: failed: {type(exc).__name__}: {_first_line(exc)} "
              "(--debug shows the traceback)", file=sys.stderr)
        return EXIT_PROBLEMS


if __name__ == "__main__":
    sys.exit(main())
