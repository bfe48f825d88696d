"""The checkpoints an evaluation reads: which policy checkpoints ``checkpoint`` /
``checkpoints`` / ``all_steps`` name (:func:`checkpoint_paths`), each one's saved config,
tokenizer and model config, the reference policy (loaded once, :class:`LazyReference`) and the
reward model (:func:`build_rm`). Errors name the config key."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from nemo_rlhf.checkpoint import (checkpoint_tokenizer_dir, is_complete, list_checkpoints, load_model_weights,
                                  read_metadata, resolve_checkpoint)
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed.parallel import ParallelConfig, validate_parallel_layout
from nemo_rlhf.evaluate.config import EvalConfig
from nemo_rlhf.models.actor_critic import build_model
from nemo_rlhf.models.config import ModelConfig
from nemo_rlhf.reward.rm_scorer import RMScorerConfig, RewardModelScorer, read_rm_checkpoint


def checkpoint_config(path: Path) -> dict:
    """The checkpoint's saved ``config.yaml`` as a dict; ``FileNotFoundError`` without one."""
    cfg_file = path / "config.yaml"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.yaml (the model and tokenizer come from it)")
    return OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=True)


def find_tokenizer_dir(path: Path, data: dict) -> str:
    """The checkpoint's own tokenizer copy, else its config's ``data.tokenizer_dir``
    (:func:`~nemo_rlhf.checkpoint.layout.checkpoint_tokenizer_dir`).

    Raises:
        FileNotFoundError: neither exists (names both; ``tokenizer_dir=`` overrides).
    """
    found = checkpoint_tokenizer_dir(path, data.get("tokenizer_dir"))
    if found is None:
        raise FileNotFoundError(
            f"{path}: no tokenizer/ folder in the checkpoint and its config's data.tokenizer_dir="
            f"{data.get('tokenizer_dir')!r} is not a tokenizer folder here; pass tokenizer_dir=<folder>")
    return found


def checkpoint_paths(cfg: EvalConfig) -> list[Path]:
    """The checkpoint folders ``cfg`` asks for, each once, sorted by step (stable).

    ``checkpoint`` alone (no ``all_steps``, no ``checkpoints``) gives exactly
    ``[resolve_checkpoint(checkpoint)]``, as before.

    Raises:
        FileNotFoundError: ``checkpoint`` / ``checkpoints[i]`` holds no complete checkpoint
            (the message names the key).
        ValueError: ``all_steps=true`` with ``checkpoint`` a single checkpoint folder.
    """
    if cfg.checkpoint and not cfg.all_steps and not cfg.checkpoints:
        return [resolve_checkpoint(cfg.checkpoint)]
    found: list[Path] = []
    if cfg.checkpoint and cfg.all_steps:
        root = Path(cfg.checkpoint)
        if is_complete(root):
            raise ValueError(f"all_steps=true: checkpoint={cfg.checkpoint!r} is one checkpoint folder; "
                             f"pass the checkpoints root holding its step_<N> folders")
        found = [p for _, p, complete in list_checkpoints(root) if complete]
        if not found:
            raise FileNotFoundError(f"checkpoint={cfg.checkpoint!r} with all_steps=true: no complete "
                                    f"step_<N> checkpoint under it")
    elif cfg.checkpoint:
        found = [resolve_named("checkpoint", cfg.checkpoint)]
    found += [resolve_named(f"checkpoints[{i}]", c) for i, c in enumerate(cfg.checkpoints)]
    unique, seen = [], set()
    for p in found:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    steps = [read_metadata(p).get("step") for p in unique]
    order = sorted(range(len(unique)), key=lambda j: (steps[j] is None, steps[j] or 0))
    return [unique[j] for j in order]


def resolve_named(key: str, value: str) -> Path:
    """:func:`~nemo_rlhf.checkpoint.resolve_checkpoint` of ``value``, its
    ``FileNotFoundError`` naming the config ``key``."""
    try:
        return resolve_checkpoint(value)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{key}={value!r}: {exc}") from None



def policy_model_config(saved: dict, tok: Tokenizer, path: Path) -> ModelConfig:
    """The checkpoint's ``model`` section with ``vocab_size`` 0 filled from ``tok`` (as
    :func:`~nemo_rlhf.trainers.common.setup_run` does)."""
    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved["model"]))
    if model_cfg.vocab_size == 0:
        return replace(model_cfg, vocab_size=tok.vocab_size)
    if model_cfg.vocab_size != tok.vocab_size:
        raise ValueError(f"{path}: model.vocab_size={model_cfg.vocab_size} but the tokenizer {tok.path} "
                         f"has {tok.vocab_size} tokens (tokenizer_dir override?)")
    return model_cfg


class LazyReference:
    """The reference policy, built once on first use and reused for every checkpoint."""

    def __init__(self, spec: str, dims, precision: str, seed: int) -> None:
        self.path = resolve_named("reference", spec)
        self.spec, self.dims, self.precision, self.seed = spec, dims, precision, seed
        self.model = None
        self.vocab_size: Optional[int] = None

    def get(self, vocab_size: int):
        """The model; raises ``ValueError`` (naming ``reference``) on another vocabulary."""
        if self.model is None:
            saved = checkpoint_config(self.path)
            model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved["model"]))
            if model_cfg.vocab_size == 0:
                model_cfg = replace(model_cfg, vocab_size=vocab_size)
            m = self.dims
            validate_parallel_layout(ParallelConfig(tensor_model_parallel_size=m.tp,
                                                    pipeline_model_parallel_size=m.pp),
                                     m.world_size, model_cfg.num_layers, model_cfg.num_attention_heads,
                                     model_cfg.num_query_groups)
            self.vocab_size = model_cfg.vocab_size
            self._check(vocab_size)
            self.model = build_model(model_cfg, self.dims, self.precision, kind="actor_critic", seed=self.seed)
            load_model_weights(self.path, self.model, skip_heads=True)
            self.model.eval()
        self._check(vocab_size)
        return self.model

    def _check(self, vocab_size: int) -> None:
        if self.vocab_size != vocab_size:
            raise ValueError(f"reference={self.spec!r}: model.vocab_size={self.vocab_size} but the "
                             f"evaluated policy's is {vocab_size}; the KL needs one vocabulary")


def build_rm(cfg: EvalConfig, dims):
    """The in-process :class:`~nemo_rlhf.reward.rm_scorer.RewardModelScorer` of
    ``cfg.rm_checkpoint`` (its own precision, else ``cfg.precision``); a missing checkpoint
    raises ``FileNotFoundError`` naming ``rm_checkpoint``."""
    try:
        info = read_rm_checkpoint(cfg.rm_checkpoint)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"rm_checkpoint={cfg.rm_checkpoint!r}: {exc}") from None
    # the RM's own precision (as the RM server); this job's where the checkpoint names none
    scorer_cfg = RMScorerConfig(checkpoint=str(info.path), micro_batch_size=cfg.forward_micro_batch_size,
                                precision=None if info.precision else cfg.precision)
    return RewardModelScorer(scorer_cfg, dims, info)


