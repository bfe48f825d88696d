"""What the PPO job keeps of a run besides the weights: the resume fingerprint, the prompt
log, how a prompt batch splits over DP, and the trainer state (:func:`run_state`,
:func:`restore_run_state`) and its JSON form."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
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


def run_state(*, step: int, sampler, kl_ctl, reward, nonfinite_in_a_row: int, initial_eval, guard,
              rollout_state: dict) -> dict:
    """The PPO run's JSON-able state for a checkpoint, from its parts: the step, the
    sampler's position, the KL controller, the reward sources' statistics and identities
    (``reward``: a ``CombinedReward`` on the scoring ranks, else None), the non-finite
    counter, the initial evaluation, the guard, and the rollout source's state
    (``rollout_state``; kept under ``async_rollout`` when not empty: with
    ``rollout.mode=async`` the samples older weights made for the next steps)."""
    sd = {
        "step": step,
        "sampler": sampler.state_dict(),
        "kl_controller": kl_ctl.state_dict(),
        "reward": jsonable(reward.state_dict()) if reward else {},
        "nonfinite_in_a_row": nonfinite_in_a_row,
        "initial_eval": initial_eval,
        "guard": guard.state_dict(),
        "reward_sources": reward.identities() if reward else {},
    }
    if rollout_state:
        sd["async_rollout"] = rollout_state
    return sd


@dataclass
class RestoredRun:
    """What :func:`restore_run_state` read back that the trainer holds as plain values."""

    step: int
    nonfinite_in_a_row: int
    initial_eval: Optional[dict]
    reward_changed: Optional[str]
    """The warning logged (every rank) when a reward source is not the one the checkpoint
    recorded (a refreshed RM); None otherwise."""


def restore_run_state(sd: dict, *, sampler, kl_ctl, reward, guard, rollout_source) -> RestoredRun:
    """The inverse of :func:`run_state` after the checkpoint's weights were loaded: the
    sampler, KL controller, reward sources, guard and rollout source load their parts in
    place; the plain values come back. A reward source that is not the one the checkpoint
    recorded (a refreshed RM) gets its statistics reset, and every rank learns of it
    (collective: :func:`~nemo_rlhf.trainers.collectives.bcast_text`): the guard starts
    over, and the caller marks the next step's metrics (``reward/source_changed``) and
    rescores the initial evaluation."""
    sampler.load_state_dict(sd["sampler"])
    kl_ctl.load_state_dict(sd["kl_controller"])
    changed = {}
    if reward is not None:  # the scoring ranks, rank 0 among them
        changed = reward.changed_sources(sd.get("reward_sources") or {})
        if sd.get("reward"):
            reward.load_state_dict(sd["reward"], reset=list(changed))
    if sd.get("guard"):
        guard.load_state_dict(sd["guard"])
    rollout_source.load_state_dict(sd.get("async_rollout") or {})
    message = bcast_text(reward_change_message(changed))
    if message:
        log.warning("%s", message)
        guard.reset()
    return RestoredRun(step=int(sd["step"]), nonfinite_in_a_row=int(sd.get("nonfinite_in_a_row", 0)),
                       initial_eval=sd.get("initial_eval"), reward_changed=message)


__all__ = ["RestoredRun", "dp_group_slice", "file_hash", "jsonable", "log_prompt_ids", "ppo_fingerprint", "restore_run_state",
           "reward_change_message", "run_state"]
