"""What the PPO job keeps of a run besides the weights: the resume fingerprint, the prompt
log, how a prompt batch splits over DP, and the trainer state (:func:`run_state`,
:func:`restore_run_state`) and its JSON form."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Optional

import torch

from nemo_rlhf.checkpoint import checkpoint_content_hash, resolve_checkpoint
from nemo_rlhf.distributed.split import dp_slice
from nemo_rlhf.trainers.collectives import bcast_text
from nemo_rlhf.trainers.ppo.config import PPOConfig

log = logging.getLogger("nemo_rlhf.ppo")


def file_hash(path) -> str:
    """The first 16 hex digits of the SHA-256 of a file, or of a dataset folder's files
    (parquet shards, a ``save_to_disk`` folder): their relative names and contents in name
    order."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for file in files:
        if path.is_dir():
            h.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def ppo_fingerprint(cfg: PPOConfig) -> dict:
    """What a resume must match: the model shape, the tokenizer and prompt files (hashes),
    and the reference (initial) weights -- the checksums of the ``init_from`` checkpoint's
    shards (independent of the layout), or the seed of a random initialisation."""
    ref = f"random-init:seed={cfg.trainer.seed}"
    if cfg.exp_manager.init_from:  # (with LoRA: the base the adapters sit on)
        ref = checkpoint_content_hash(resolve_checkpoint(cfg.exp_manager.init_from))
    return {"model": cfg.model.fingerprint(),
            "tokenizer": file_hash(Path(cfg.data.tokenizer_dir) / "tokenizer.json"),
            "train_prompts": file_hash(cfg.data.train_file), "reference": ref}


def log_prompt_ids(exp_dir, step: int, dp_rank: int, idx: list[int]) -> None:
    """Append a step's prompt ids to ``<exp_dir>/prompt_log.jsonl`` (one line per DP rank
    and attempt), so recovery can be audited: no prompt twice, none skipped."""
    path = Path(exp_dir) / "prompt_log.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "dp_rank": dp_rank, "prompt_ids": idx}) + "\n")


def dp_group_slice(global_idx: list[int], dp_rank: int, dp: int, n_samples_per_prompt: int
                   ) -> list[int]:
    """This DP rank's share of a global prompt batch, each prompt repeated
    ``n_samples_per_prompt`` times in a row: groups stay contiguous and on one rank.

    Args:
        global_idx: the step's prompt indices (all DP ranks), a multiple of ``dp`` long.

    Returns:
        ``len(global_idx) // dp * n_samples_per_prompt`` prompt indices.

    Raises:
        ValueError: if ``dp`` does not divide ``len(global_idx)``.
    """
    if len(global_idx) % dp:
        raise ValueError(f"{len(global_idx)} prompts do not split over {dp} data-parallel ranks")
    mine = global_idx[dp_slice(len(global_idx), dp_rank, dp)]  # dp divides it: per = n // dp each
    return [i for i in mine for _ in range(n_samples_per_prompt)]


def reward_change_message(changed: dict) -> Optional[str]:
    """The warning for reward sources that differ from the checkpoint's (``{name: (before,
    now)}``), or None."""
    return "; ".join(
        f"reward source {name!r} changed since the checkpoint ({_identity_text(before)} -> "
        f"{_identity_text(now)}): its normalisation statistics start over, the "
        f"reward-hacking guard's history is cleared and the initial policy's evaluation "
        f"is re-scored" for name, (before, now) in changed.items()) or None


def _identity_text(identity) -> str:
    if not identity:
        return "none recorded"
    return ", ".join(f"{k}={v}" for k, v in identity.items())


def jsonable(obj):
    """Tensors (and containers of them) as lists, for the JSON trainer state."""
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj




def run_state(trainer) -> dict:
    """A :class:`~nemo_rlhf.trainers.ppo.trainer.PPOTrainer`'s JSON-able state for a
    checkpoint: the step, the sampler's position, the KL controller, the reward sources'
    statistics and identities, the non-finite counter, the initial evaluation, the guard,
    and with ``rollout.mode=async`` the samples older weights made for the next steps."""
    sd = {
        "step": trainer.step,
        "sampler": trainer.sampler.state_dict(),
        "kl_controller": trainer.kl_ctl.state_dict(),
        "reward": jsonable(trainer.reward.state_dict()) if trainer.reward else {},
        "nonfinite_in_a_row": trainer.nonfinite_in_a_row,
        "initial_eval": trainer.evaluation.initial,
        "guard": trainer.guard.state_dict(),
        "reward_sources": trainer.reward.identities() if trainer.reward else {},
    }
    if trainer.async_rollout is not None:
        sd["async_rollout"] = trainer.async_rollout.state_dict(trainer)
    return sd


def restore_run_state(trainer, sd: dict) -> None:
    """The inverse of :func:`run_state` after the checkpoint's weights were loaded (the
    actor's weights version moves on); a reward source that is not the one the checkpoint
    recorded (a refreshed RM) gets its statistics reset, and every rank learns of it (the
    next step's metrics say ``reward/source_changed``; the initial evaluation is rescored;
    the guard starts over)."""
    trainer.step = int(sd["step"])
    trainer.weights_version += 1  # the checkpoint's weights were loaded
    trainer.sampler.load_state_dict(sd["sampler"])
    trainer.kl_ctl.load_state_dict(sd["kl_controller"])
    changed = {}
    if trainer.reward is not None:  # the scoring ranks, rank 0 among them
        changed = trainer.reward.changed_sources(sd.get("reward_sources") or {})
        if sd.get("reward"):
            trainer.reward.load_state_dict(sd["reward"], reset=list(changed))
    trainer.nonfinite_in_a_row = int(sd.get("nonfinite_in_a_row", 0))
    trainer.evaluation.initial = sd.get("initial_eval")
    if sd.get("guard"):
        trainer.guard.load_state_dict(sd["guard"])
    if trainer.async_rollout is not None:
        trainer.async_rollout.load_state_dict(sd.get("async_rollout") or {}, trainer.encoded)
    message = bcast_text(reward_change_message(changed))
    if message:
        log.warning("%s", message)
        trainer.reward_changed = message
        trainer.evaluation.rescore_initial = True
        trainer.guard.reset()


__all__ = ["dp_group_slice", "file_hash", "jsonable", "log_prompt_ids", "ppo_fingerprint", "restore_run_state",
           "reward_change_message", "run_state"]
