"""The reward-model checkpoint behind the RM server: a :class:`Scorer` over any TP/PP layout.

:class:`RewardModelScorer` loads a reward-model checkpoint written by
:func:`nemo_rlhf.checkpoint.save_checkpoint` (architecture from the checkpoint's
``config.yaml``, weights resharded by dist_checkpointing to this job's TP/PP layout) and
turns (prompt, response) pairs into scalar scores:

* text items are laid out exactly as the RM trainer's preference data
  (:mod:`nemo_rlhf.data.datasets`): ``[BOS] + encode(format_prompt(prompt, chat_template,
  system_prompt))`` followed by ``encode(response) + [EOS]``, with the chat template and
  system prompt of the checkpoint's ``data`` section;
* token-id items are taken as given, ``prompt_ids + response_ids`` (the caller's prompt
  ids already hold BOS and the template; a response that stopped at EOS carries it, a
  truncated one does not -- exactly the ids the policy produced; a multi-turn episode's
  trajectory ids when the RM shares the policy's tokenizer and template);
* conversation items (``messages``: a whole multi-turn episode) are rendered by
  :func:`~nemo_rlhf.data.datasets.encode_conversation` with the checkpoint's chat
  template and system prompt, the function the RM trainer renders conversation pairs
  with (so the served layout is the trained one); the response is the final assistant
  message;
* rows are right-padded, run through :func:`nemo_rlhf.models.engine.forward_backward`
  with ``forward_only=True`` (so pipeline parallelism works), and the score is the reward
  head's output at each row's last valid token (:func:`gather_last_token`).

Multi-rank: every rank builds the same scorer. Global rank 0 serves HTTP; its batch thread
calls :meth:`RewardModelScorer.score_batch`, which tokenises, broadcasts
``{"op": "score", "seqs": ...}`` with ``broadcast_object_list`` and joins the forward; the
other ranks sit in :meth:`RewardModelScorer.serve_worker_loop`, which receives each batch,
joins the forward and returns on ``{"op": "stop"}`` (sent by :meth:`close`). Each
data-parallel replica scores a contiguous slice of the batch; the last pipeline stage's
TP-rank-0 of every replica sends its scores to rank 0 with ``gather_object``.

Simplified on purpose:

- The batch travels as pickled Python lists (``broadcast_object_list``), not as pre-sized
  tensors: one extra copy per batch, negligible next to the forward.
- A forward that fails on one rank is reported to rank 0 through the gather, but a
  failure *inside* a pipeline exchange (a dead rank) cannot be recovered: the job must be
  restarted (torchrun / srun then stop the remaining ranks).
- Sequences longer than ``max_seq_length`` are refused by default (:class:`ItemTooLong`
  from :meth:`RewardModelScorer.check_items`, which the server runs before batching: HTTP
  413 for that request alone); ``overlong_policy: truncate`` cuts the response as the RM
  trainer's ``truncate`` policy does. The limit is the model's position range, not the
  RM trainer's ``data.max_seq_length``: the layout of the tokens matches training, the
  length cap is the serving job's choice.
- No length bucketing: each data-parallel slice is padded to its longest row.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from omegaconf import MISSING, OmegaConf

from nemo_rlhf.checkpoint import (
    TOKENIZER_SUBDIR,
    CheckpointError,
    load_model_weights,
    read_metadata,
    read_trainer_state,
    resolve_checkpoint,
)
from nemo_rlhf.config import check_choice
from nemo_rlhf.data.datasets import encode_conversation, encode_prompt, encode_response, pad_right
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed.split import chunk_slices, dp_slice
from nemo_rlhf.models.actor_critic import build_model, gather_last_token
from nemo_rlhf.models.config import PRECISIONS, ModelConfig, agree_on_precision
from nemo_rlhf.models.engine import forward_backward
from nemo_rlhf.reward.batching import ItemRejected, ItemTooLong, ScoreItem, validate_token_ids

__all__ = [
    "OVERLONG_POLICIES",
    "RMCheckpointInfo",
    "RMScorerConfig",
    "RewardModelScorer",
    "read_rm_checkpoint",
]

logger = logging.getLogger(__name__)

OVERLONG_POLICIES = ("error", "truncate")
REWARD_STAT_KEYS = ("reward_mean", "reward_std")
"""Trainer-state keys of the RM's score statistics over its training set, written by
:meth:`nemo_rlhf.trainers.rm.RMTrainer.on_fit_end` (with ``reward_stats_count``)."""


@dataclass
class RMScorerConfig:
    """How the RM server loads and runs a reward-model checkpoint."""

    checkpoint: str = MISSING
    """RM checkpoint: a ``step_<N>`` folder, or a checkpoint root (its newest complete step)."""
    tokenizer_dir: Optional[str] = None
    """Tokenizer folder; None: the checkpoint config's ``data.tokenizer_dir``."""
    micro_batch_size: int = 8
    """Rows per forward micro-batch on one data-parallel replica."""
    max_seq_length: Optional[int] = None
    """Longest prompt + response in tokens; None: the model's ``max_position_embeddings``."""
    overlong_policy: str = "error"
    """Rows over ``max_seq_length``: ``error`` (that request gets HTTP 413) or ``truncate`` (cut the response)."""
    precision: Optional[str] = None
    """``32``, ``bf16-mixed`` or ``fp16-mixed``; None: the checkpoint config's ``trainer.precision``."""

    def __post_init__(self) -> None:
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size!r}: must be an integer >= 1")
        if self.max_seq_length is not None and self.max_seq_length < 1:
            raise ValueError(f"max_seq_length={self.max_seq_length}: must be >= 1 or null "
                             f"(null: the model's max_position_embeddings)")
        check_choice("overlong_policy", self.overlong_policy, OVERLONG_POLICIES)
        if self.precision is not None:
            self.precision = str(self.precision)
            check_choice("precision", self.precision, PRECISIONS, note=" or null (the checkpoint's)")


@dataclass(frozen=True)
class RMCheckpointInfo:
    """What a reward-model checkpoint says about itself (``config.yaml``, metadata, state)."""

    path: Path
    """The ``step_<N>`` folder."""
    step: int
    """Its step counter (``metadata.json``)."""
    model: Any
    """:class:`~nemo_rlhf.models.config.ModelConfig` from the config's ``model`` section."""
    tokenizer_dir: Optional[str]
    """``data.tokenizer_dir`` of the config (None when the config has none)."""
    chat_template: Optional[str]
    """``data.chat_template`` (None: raw prompt)."""
    system_prompt: Optional[str]
    """``data.system_prompt``."""
    precision: Optional[str]
    """``trainer.precision`` (None when the config has none)."""
    trainer_state: dict
    """``trainer_state.json``."""


def read_rm_checkpoint(path: str | Path) -> RMCheckpointInfo:
    """Read the architecture, data layout and trainer state of a reward-model checkpoint.

    Args:
        path: a ``step_<N>`` folder, or a checkpoint root (its newest complete checkpoint).

    Raises:
        FileNotFoundError: no complete checkpoint at or under ``path``.
        CheckpointError: no ``config.yaml``, or a config without a ``model`` section.
        ValueError: a ``model`` section that is not a valid ModelConfig (names the key).
    """
    p = resolve_checkpoint(path)
    meta = read_metadata(p)
    cfg_file = p / "config.yaml"
    if not cfg_file.is_file():
        raise CheckpointError(f"{p}: no config.yaml; the model architecture cannot be known")
    cfg = OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=True)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise CheckpointError(f"{cfg_file}: no 'model' section (the architecture)")
    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg["model"]))
    data = cfg["data"] if isinstance(cfg.get("data"), dict) else {}
    trainer = cfg["trainer"] if isinstance(cfg.get("trainer"), dict) else {}
    precision = trainer.get("precision")  # absent: the scorer config must name it
    return RMCheckpointInfo(
        path=p,
        step=int(meta["step"]),
        model=model,
        tokenizer_dir=data.get("tokenizer_dir"),
        chat_template=data.get("chat_template"),
        system_prompt=data.get("system_prompt"),
        precision=None if precision is None else str(precision),
        trainer_state=read_trainer_state(p),
    )


def _resolve_tokenizer_dir(cfg: RMScorerConfig, info: RMCheckpointInfo) -> str:
    if cfg.tokenizer_dir is not None:
        if not Path(cfg.tokenizer_dir).exists():
            raise FileNotFoundError(f"tokenizer_dir={cfg.tokenizer_dir!r}: no such folder")
        return cfg.tokenizer_dir
    own = Path(info.path) / TOKENIZER_SUBDIR
    if (own / "tokenizer.json").is_file():
        return str(own)  # the checkpoint's own copy: a moved checkpoint keeps its tokenizer
    if not info.tokenizer_dir:
        raise ValueError(f"{info.path}/config.yaml has no data.tokenizer_dir; pass tokenizer_dir=<folder>")
    if not Path(info.tokenizer_dir).exists():
        raise FileNotFoundError(
            f"data.tokenizer_dir={info.tokenizer_dir!r} from {info.path}/config.yaml does not exist "
            f"(relative to {os.getcwd()}); pass tokenizer_dir=<folder> to override it")
    return info.tokenizer_dir


class RewardModelScorer:
    """A reward-model checkpoint as the RM server's :class:`~nemo_rlhf.reward.batching.Scorer`.

    Built on every rank of the serving job (the constructor's checkpoint load is a
    collective). Rank 0 hands it to :func:`~nemo_rlhf.reward.server.serve`; the other
    ranks call :meth:`serve_worker_loop`.

    Args:
        cfg: checkpoint and run options.
        dims: this process's :class:`~nemo_rlhf.distributed.ParallelDims`.
        info: the checkpoint's facts when already read (:func:`read_rm_checkpoint`).

    Attributes:
        vocab_size: ``model.vocab_size``; token ids must lie in ``[0, vocab_size)``.
        takes_conversations: True: ``messages`` items are rendered with the checkpoint's
            chat template (:func:`~nemo_rlhf.data.datasets.encode_conversation`).

    Raises:
        CheckpointError: missing/incomplete checkpoint, missing tensors or reward head.
        FileNotFoundError: the tokenizer folder does not exist.
        ValueError: a tokenizer larger than the model's vocabulary; a bad layout.
    """

    takes_conversations = True

    def __init__(self, cfg: RMScorerConfig, dims, info: Optional[RMCheckpointInfo] = None) -> None:
        if dims.device.type == "cuda":
            torch.cuda.set_device(dims.device)  # the current device is per thread
        self.cfg = cfg
        self.dims = dims
        self.info = info if info is not None else read_rm_checkpoint(cfg.checkpoint)
        self.tokenizer_dir = _resolve_tokenizer_dir(cfg, self.info)
        self.tokenizer = Tokenizer(self.tokenizer_dir)
        model_cfg = self.info.model
        if model_cfg.vocab_size == 0:
            model_cfg.vocab_size = self.tokenizer.vocab_size
        if self.tokenizer.vocab_size > model_cfg.vocab_size:
            raise ValueError(
                f"tokenizer {self.tokenizer_dir} has {self.tokenizer.vocab_size} tokens but the "
                f"checkpoint's model.vocab_size is {model_cfg.vocab_size}: wrong tokenizer_dir?")
        self.model_cfg = model_cfg
        self.vocab_size = model_cfg.vocab_size
        self.precision = cfg.precision or self.info.precision
        if self.precision is None:
            raise ValueError(f"{self.info.path}/config.yaml has no trainer.precision; pass precision=32 "
                             f"(or bf16-mixed / fp16-mixed)")
        self.max_seq_length = cfg.max_seq_length or model_cfg.max_position_embeddings
        if self.max_seq_length > model_cfg.max_position_embeddings:
            raise ValueError(f"max_seq_length={self.max_seq_length} exceeds the model's "
                             f"max_position_embeddings={model_cfg.max_position_embeddings}")
        self.precision = agree_on_precision(self.precision, dims)
        self.model = build_model(model_cfg, dims, self.precision, kind="reward")
        try:
            load_model_weights(self.info.path, self.model)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} -- is {self.info.path} a reward-model checkpoint "
                                  f"(written by nemo_rlhf.train_rm)?") from exc
        self.model.eval()
        self._closed = False
        logger.info("rank %d: reward model %s step %d loaded (tp=%d pp=%d dp=%d)", dims.rank,
                    self.info.path, self.info.step, dims.tp, dims.pp, dims.dp)

    # ------------------------------------------------------------------ tokenisation
    def encode(self, item: ScoreItem, index: int = 0) -> list[int]:
        """Token ids of one item: ``prompt_ids + response_ids`` (see the module docstring;
        a conversation's prompt is everything before its final assistant message).

        Raises (both ``ValueError`` subclasses, naming ``items[index]``):
            ItemTooLong: a row over ``max_seq_length`` (policy ``error``, or a prompt alone
                too long under ``truncate``).
            ItemRejected: untokenisable text, an empty sequence, a token id outside
                ``[0, vocab_size)``.
        """
        where = f"items[{index}]"
        try:
            if item.is_tokens:
                prompt = validate_token_ids(list(item.prompt_ids), self.vocab_size, f"{where}.prompt_ids")
                response = validate_token_ids(list(item.response_ids), self.vocab_size, f"{where}.response_ids")
            elif item.is_conversation:
                prompt, response = encode_conversation(self.tokenizer, list(item.messages),
                                                       self.info.chat_template, self.info.system_prompt)
            else:
                prompt = encode_prompt(self.tokenizer, item.prompt, self.info.chat_template,
                                       self.info.system_prompt)
                response = encode_response(self.tokenizer, item.response)
        except ValueError as exc:
            message = str(exc) if item.is_tokens else f"{where}: {exc}"
            raise ItemRejected(message, where) from None
        total = len(prompt) + len(response)
        if total == 0:
            raise ItemRejected(f"{where}: empty sequence (no prompt and no response tokens)", where)
        if total > self.max_seq_length:
            room = self.max_seq_length - len(prompt)
            if self.cfg.overlong_policy == "error" or room < 1:
                raise ItemTooLong(
                    f"{where}: {total} tokens (prompt {len(prompt)} + response {len(response)}) exceed "
                    f"max_seq_length={self.max_seq_length}"
                    + ("; set overlong_policy=truncate to cut the response" if room >= 1 else ""),
                    where)
            response = response[:room]
        return prompt + response

    def check_items(self, items: list[ScoreItem]) -> None:
        """Raises what :meth:`encode` raises for the first of ``items`` (one request's
        items; ``index`` = position in that list) that :meth:`score_batch` would refuse:
        :class:`ItemTooLong` over ``max_seq_length`` after the ``overlong_policy``,
        :class:`ItemRejected` otherwise. Local to rank 0 (no collective); tokenises text."""
        for i, item in enumerate(items):
            self.encode(item, i)

    # ------------------------------------------------------------------ scoring
    def score_batch(self, items: list[ScoreItem]) -> list[float]:
        """Scores ``items`` on all ranks (rank 0 only; the others are in
        :meth:`serve_worker_loop`). Returns ``[len(items)]`` floats, the reward at each
        row's last valid token, raw (not normalised).

        Raises:
            ValueError: a bad item (:class:`ItemRejected` / :class:`ItemTooLong`, see
                :meth:`encode`), before any collective, so the ranks stay in step.
            RuntimeError: closed scorer, called on a rank other than 0, or a rank's forward failed.
        """
        if self._closed:
            raise RuntimeError("RewardModelScorer.score_batch after close()")
        if self.dims.rank != 0:
            raise RuntimeError(f"score_batch runs on global rank 0 only (this is rank {self.dims.rank}); "
                               f"other ranks call serve_worker_loop()")
        seqs = [self.encode(it, i) for i, it in enumerate(items)]
        if not seqs:
            return []
        if self.dims.world_size > 1:
            dist.broadcast_object_list([{"op": "score", "seqs": seqs}], src=0)
        return self._score_collective(seqs)

    def serve_worker_loop(self) -> None:
        """Ranks != 0: join every batch rank 0 broadcasts, until the stop message.

        Raises:
            RuntimeError: on rank 0, or on an unknown message.
        """
        if self.dims.rank == 0:
            raise RuntimeError("serve_worker_loop runs on ranks != 0; rank 0 serves HTTP")
        batches = 0
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            msg = box[0]
            if msg["op"] == "stop":
                logger.info("rank %d: stop received after %d batches", self.dims.rank, batches)
                self._closed = True
                return
            if msg["op"] != "score":
                raise RuntimeError(f"rank {self.dims.rank}: unknown message op {msg['op']!r}")
            self._score_collective(msg["seqs"])
            batches += 1

    def close(self) -> None:
        """Rank 0: releases the other ranks from :meth:`serve_worker_loop`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.dims.rank == 0 and self.dims.world_size > 1:
            dist.broadcast_object_list([{"op": "stop"}], src=0)

    def _score_collective(self, seqs: list[list[int]]) -> Optional[list[float]]:
        """Every rank: score this replica's slice, gather the slices on rank 0.

        Returns the ``[len(seqs)]`` scores on rank 0, None elsewhere.
        """
        dims = self.dims
        n = len(seqs)
        mine = dp_slice(n, dims.dp_rank, dims.dp)
        lo = mine.start
        try:
            local: Any = ("ok", lo, self.forward_scores(seqs[mine]))
        except Exception as exc:  # noqa: BLE001 - reported to rank 0 through the gather
            if dims.world_size == 1:
                raise
            logger.exception("rank %d: reward model forward failed", dims.rank)
            local = ("error", dims.rank, f"{type(exc).__name__}: {exc}")
        if dims.world_size == 1:
            return local[2]
        if local[0] == "ok" and (local[2] is None or dims.tp_rank != 0):
            local = None  # not a last-stage TP-rank-0: nothing to report
        gathered = [None] * dims.world_size if dims.rank == 0 else None
        dist.gather_object(local, gathered, dst=0)
        if dims.rank != 0:
            return None
        errors = [f"rank {g[1]}: {g[2]}" for g in gathered if g is not None and g[0] == "error"]
        if errors:
            raise RuntimeError("reward model forward failed on " + "; ".join(errors))
        scores: list[Optional[float]] = [None] * n
        for g in gathered:
            if g is not None:
                scores[g[1]:g[1] + len(g[2])] = g[2]
        if any(s is None for s in scores):
            raise RuntimeError(f"reward model: {sum(s is None for s in scores)} of {n} scores missing "
                               f"after the gather (layout tp={dims.tp} pp={dims.pp} dp={dims.dp})")
        return scores

    def forward_scores(self, seqs: list[list[int]]) -> Optional[list[float]]:
        """This pipeline's forward over ``seqs`` (every stage of one replica calls it with the
        same rows).

        Args:
            seqs: token-id lists, each of length ``1..max_seq_length``.

        Returns:
            On the last pipeline stage ``[len(seqs)]`` floats (reward at each row's last
            valid token); on other stages None. ``[]`` for no rows.
        """
        if not seqs:
            return [] if self.dims.is_last_stage else None
        mbs = self.cfg.micro_batch_size
        filler = (-len(seqs)) % mbs  # the last micro-batch is topped up with 1-token rows
        rows = list(seqs) + [[self.tokenizer.pad_id]] * filler
        input_ids_BS, mask_BS = pad_right(rows, self.tokenizer.pad_id)
        input_ids_BS, mask_BS = input_ids_BS.to(self.dims.device), mask_BS.to(self.dims.device)
        micro_batches = [
            {"input_ids": input_ids_BS[s], "attention_mask": mask_BS[s], "lengths": mask_BS[s].sum(-1)}
            for s in chunk_slices(len(rows), mbs)
        ]

        def read_scores(rewards_BS, mb):
            return torch.zeros((), device=rewards_BS.device), {"scores": gather_last_token(rewards_BS, mb["lengths"])}

        with torch.no_grad():
            stats = forward_backward(self.model, micro_batches, read_scores, forward_only=True)
        if not self.dims.is_last_stage:
            return None
        scores_B = torch.cat([s["scores"] for s in stats]).float()[:len(seqs)]
        if not torch.isfinite(scores_B).all():
            bad = (~torch.isfinite(scores_B)).nonzero().flatten().tolist()
            raise RuntimeError(f"reward model produced non-finite scores at rows {bad[:8]}")
        return scores_B.cpu().tolist()

    # ------------------------------------------------------------------ description
    def metadata(self) -> dict[str, Any]:
        """JSON-able description served under ``/metadata`` -> ``scorer``.

        Keys: ``model_name``, ``checkpoint_path``, ``checkpoint_step``, ``tokenizer_dir``,
        ``tokenizer_fingerprint`` (:attr:`~nemo_rlhf.data.tokenizer.Tokenizer.fingerprint`:
        a client whose policy has the same one, chat template and system prompt may send
        a trajectory's own ids), ``vocab_size``, ``reward_mean`` / ``reward_std`` / ``reward_stats_count`` (the RM
        trainer's statistics; None when the checkpoint has none), ``chat_template``, ``system_prompt``,
        ``max_seq_length``, ``overlong_policy``, ``precision``, ``parallel``.
        """
        state = self.info.trainer_state
        stats = {k: (float(state[k]) if state.get(k) is not None else None) for k in REWARD_STAT_KEYS}
        stats["reward_stats_count"] = state.get("reward_stats_count")
        return {
            "model_name": self.model_cfg.name,
            "checkpoint_path": str(self.info.path.resolve()),
            "checkpoint_step": self.info.step,
            "tokenizer_dir": str(Path(self.tokenizer_dir).resolve()),
            "tokenizer_fingerprint": self.tokenizer.fingerprint,
            "vocab_size": self.vocab_size,
            **stats,
            "chat_template": self.info.chat_template,
            "system_prompt": self.info.system_prompt,
            "max_seq_length": self.max_seq_length,
            "overlong_policy": self.cfg.overlong_policy,
            "precision": self.precision,
            "parallel": self.dims.describe(),
        }
