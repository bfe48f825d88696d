"""The PPO trainer's side of ``rollout.mode=async`` (:mod:`nemo_rlhf.rollout.remote`).

Every trainer rank holds an :class:`AsyncRollout`; global rank 0 also holds the
:class:`~nemo_rlhf.rollout.remote.RolloutController`. Per PPO step ``s``:

* :meth:`AsyncRollout.take` (every rank, in the trainer's rollout step): rank 0 submits
  the items of the steps up to ``s + max_staleness`` (each DP rank's prompts, from a
  look-ahead copy of the trainer's sampler, so the same prompts in the same order as
  ``sync``), waits for step ``s``'s items and broadcasts them (host objects); each rank
  moves its own DP rank's samples to ``dims.device``.
* :meth:`AsyncRollout.publish` (every rank of DP rank 0, after the update): the actor's full
  weights gathered over TP (LoRA merged, value head left out), copied and handed to the
  controller as version ``s``.
* the trainer recomputes old log-probs and values with its current weights (version
  ``s - 1``); the samples' own log-probs (the behaviour policy's) feed
  ``ppo.rollout_is_cap`` / ``ppo.rollout_mask_threshold``: the decoupled PPO objective of
  AReaL (Fu et al. 2025, eq. 5: the clipped ratio against the recomputed proximal policy,
  weighted by the proximal-over-behaviour ratio, limited at the cap by
  ``ppo.rollout_is_mode``: truncated, or masked above it as AReaL's code does).

Checkpoints: :meth:`AsyncRollout.state_dict` (rank 0) holds the samples of the steps
``s + 1 .. s + max_staleness``, which the resumed run cannot regenerate (they were made by
versions before ``s``); steps after those are regenerated from the checkpoint's weights
(version ``s``), exactly as the uninterrupted run generated them. A resume is therefore
bit-identical to the uninterrupted run, and every prompt is trained on once. The state also
records the layout that keys the buffered items (:meth:`AsyncRollout.layout`: the DP size,
``ppo.num_rollout_samples``, ``rollout.n_samples_per_prompt``, ``rollout.max_staleness``);
a run resumed with another layout, or whose sampler draws other prompts for those steps,
drops them and regenerates them from the checkpoint's weights (fresher than the bound
asks), logging what changed.
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch
import torch.distributed as dist

from nemo_rlhf.models.engine import unwrap
from nemo_rlhf.models.full_tensors import gather_full_tensors
from nemo_rlhf.models.heads import is_head_param
from nemo_rlhf.models.lora_hf import merge_adapters, split_adapters
from nemo_rlhf.rollout.remote import (RolloutController, RolloutItem, RolloutResult, RolloutWorkerError,
                                      batch_from_host)
from nemo_rlhf.trainers.ppo.state import dp_group_slice

log = logging.getLogger("nemo_rlhf.ppo")


def check_async_layout(rollout, dims) -> None:
    """``rollout.mode=async`` needs PP=1 and EP=1 (the weights are gathered over the TP
    group of DP rank 0 only).

    Raises:
        ValueError: naming ``parallel.pipeline_model_parallel_size`` or
            ``parallel.expert_model_parallel_size``.
    """
    if rollout.mode != "async":
        return
    if dims.pp > 1:
        raise ValueError(f"rollout.mode=async needs parallel.pipeline_model_parallel_size=1 (got {dims.pp}): "
                         f"the weights sent to the rollout workers are gathered over TP only; use "
                         f"rollout.mode=sync with pipeline parallelism")
    if getattr(dims, "ep", 1) > 1:
        raise ValueError(f"rollout.mode=async needs parallel.expert_model_parallel_size=1 (got {dims.ep}): "
                         f"the weights sent to the rollout workers are gathered over TP only; use "
                         f"rollout.mode=sync with expert parallelism")


def full_weights(model, dims, lora_scale: Optional[float]) -> dict[str, torch.Tensor]:
    """The actor's full (TP=1) weights, as the rollout workers load them: gathered over the
    TP group (collective there), LoRA adapters merged (``W + scale * B A``), the value head
    left out, every tensor a copy (the live parameters change in the next update)."""
    full = gather_full_tensors(unwrap(model), dims.tp_group if dims.tp > 1 else None, skip=is_head_param)
    full, adapters = split_adapters(full)
    if adapters:
        full = merge_adapters(full, adapters, lora_scale)
    return {k: v.detach().clone() for k, v in full.items()}


class AsyncRollout:
    """See the module docstring.

    Args:
        cfg: the PPO job's config (``rollout``, ``ppo``, ``trainer.max_steps``).
        dims: this rank's :class:`~nemo_rlhf.distributed.ParallelDims`.
    """

    def __init__(self, cfg, dims):
        self.cfg, self.dims = cfg, dims
        r = cfg.rollout
        self.k = r.max_staleness
        self.controller = (RolloutController(cfg.exp_manager.exp_dir, r.num_workers, r.max_staleness, r.max_staleness + 1,
                                             r.worker_timeout_s, dims.device, r.controller_port,
                                             start_timeout_s=r.worker_start_timeout_s,
                                             wait_timeout_s=r.wait_timeout_s)
                           if dims.rank == 0 else None)
        self.started = False
        self.start_version = 0
        self.submitted = 0
        self.lookahead = None
        self._restored: list[RolloutResult] = []
        self.metrics: dict = {}

    def layout(self) -> dict:
        """What keys the buffered items (``(step, dp_rank)``, each with its share of the
        step's prompts, made by the version :meth:`version_for` names): stored in
        :meth:`state_dict` and compared at :meth:`load_state_dict`."""
        return {"dp": self.dims.dp, "num_rollout_samples": self.cfg.ppo.num_rollout_samples,
                "n_samples_per_prompt": self.cfg.rollout.n_samples_per_prompt, "max_staleness": self.k}

    # --- set-up ----------------------------------------------------------------------------
    def start(self, trainer) -> None:
        """Connect the workers (rank 0) and publish the current weights as version
        ``trainer.step``; collective. Called before the trainer's sampler draws the next
        step's prompts (the look-ahead copy starts there)."""
        failure = None
        if self.controller is not None:
            try:
                self.controller.start()
            except RolloutWorkerError as exc:
                failure = exc
        trainer.collectives.raise_together(failure, "starting the rollout workers", RolloutWorkerError)
        self.start_version = self.submitted = trainer.step
        if self.controller is not None:
            self.controller.begin_at(trainer.step)  # (a resumed run's back-pressure counts from there)
            self.lookahead = copy.deepcopy(trainer.sampler)
            self._check_restored_prompts(trainer)
            if self._restored:
                self.controller.preload(self._restored)
                self.submitted = max(r.item.step for r in self._restored)
                for _ in range(self.submitted - trainer.step):  # their prompts were drawn already
                    self.lookahead.next_global_batch(self._batch_prompts())
                self._restored = []
        self.started = True
        self.publish(trainer, trainer.step)

    def _check_restored_prompts(self, trainer) -> None:
        """Drop the restored items (logged) unless they are exactly the items this run would
        submit for their steps: every DP rank's, with the prompts the sampler draws."""
        if not self._restored:
            return
        n, dp = self.cfg.rollout.n_samples_per_prompt, self.dims.dp
        got = {(r.item.step, r.item.dp_rank): r.item.prompt_indices for r in self._restored}
        probe, want = copy.deepcopy(trainer.sampler), {}
        for step in range(trainer.step + 1, max(s for s, _ in got) + 1):
            idx = probe.next_global_batch(self._batch_prompts())
            want.update({(step, r): dp_group_slice(idx, r, dp, n) for r in range(dp)})
        if got != want:
            log.warning("rollout.mode=async resume: the checkpoint's %d buffered samples (steps %s) are not "
                        "the prompts this run's sampler draws for those steps (DP size %d): dropped and "
                        "regenerated from the checkpoint's weights (version %d)", len(got),
                        sorted({s for s, _ in got}), dp, trainer.step)
            self._restored = []

    def _batch_prompts(self) -> int:
        return self.cfg.ppo.num_rollout_samples // self.cfg.rollout.n_samples_per_prompt

    def version_for(self, step: int) -> int:
        """The weights version that generates step ``step``'s samples."""
        return max(step - 1 - self.k, self.start_version)

    # --- per step ----------------------------------------------------------------------------
    def publish(self, trainer, version: int) -> None:
        """The actor's weights after ``version`` steps to the controller (collective over the
        TP group of DP rank 0; the other DP ranks do nothing)."""
        if self.dims.dp_rank != 0:
            return
        tensors = full_weights(trainer.model, self.dims, self.cfg.model.lora.scale if self.cfg.model.lora.enabled
                               else None)
        if self.controller is not None:
            self.controller.publish(version, tensors)

    def _submit_until(self, step: int, encoded: list) -> None:
        last = min(step + self.k, self.cfg.trainer.max_steps)
        n, dp = self.cfg.rollout.n_samples_per_prompt, self.dims.dp
        while self.submitted < last:
            self.submitted += 1
            idx = self.lookahead.next_global_batch(self._batch_prompts())
            for r in range(dp):
                mine = dp_group_slice(idx, r, dp, n)
                self.controller.submit(RolloutItem(step=self.submitted, dp_rank=r, prompt_indices=mine,
                                                   prompts=[encoded[i] for i in mine],
                                                   version=self.version_for(self.submitted)))
        self.controller.retain_from(self.version_for(self.submitted + 1))

    def take(self, trainer, idx: list[int]):
        """This DP rank's samples of the step ``trainer.step + 1`` (a ``RolloutBatch`` on
        ``dims.device``); collective. ``idx``: the prompts the trainer's sampler drew for
        this rank (checked against the item's).

        Raises:
            RolloutWorkerError: on every rank, when a worker failed (naming it).
        """
        if not self.started:
            raise RuntimeError("AsyncRollout.take before start (the trainer starts it before drawing prompts)")
        step = trainer.step + 1
        box: list = [None]
        if self.controller is not None:
            try:
                self._submit_until(step, trainer.encoded)
                results, metrics = self.controller.take(step, self.dims.dp)
                box = [("ok", [(r.item.prompt_indices, r.batch) for r in results], metrics)]
            except RolloutWorkerError as exc:
                box = [("error", str(exc), None)]
        if self.dims.world_size > 1:
            dist.broadcast_object_list(box, src=0)  # host objects
        status, payload, metrics = box[0]
        if status == "error":
            raise RolloutWorkerError(payload)
        prompt_indices, fields_ = payload[self.dims.dp_rank]
        if prompt_indices != list(idx):
            raise RolloutWorkerError(f"step {step}: the rollout item's prompts {prompt_indices[:4]}... are not "
                                     f"the sampler's {list(idx)[:4]}... (DP rank {self.dims.dp_rank})")
        self.metrics = metrics or {}
        return batch_from_host(fields_, self.dims.device)

    # --- checkpoints --------------------------------------------------------------------------
    def state_dict(self, trainer) -> dict:
        """Rank 0: the samples of steps ``step + 1 .. step + max_staleness`` that versions
        before ``step = trainer.step`` generated (waits for those in flight), JSON-able;
        elsewhere ``{}``. Collective (a worker's failure raises on every rank).

        Raises:
            RolloutWorkerError: a worker failed before those samples arrived.
        """
        step, results, failure = trainer.step, [], None
        if self.controller is not None and self.started:
            needs_old = range(step + 1, min(step + self.k, self.cfg.trainer.max_steps) + 1)
            needs_old = [s for s in needs_old if self.version_for(s) < step]
            try:
                results = self.controller.results_for(needs_old, self.dims.dp) if needs_old else []
            except RolloutWorkerError as exc:
                failure = exc
        trainer.collectives.raise_together(failure, "saving the rollout buffer", RolloutWorkerError)
        if self.controller is None or not self.started:
            return {}
        out = []
        for r in results:
            out.append({"step": r.item.step, "dp_rank": r.item.dp_rank, "version": r.version,
                        "prompt_indices": r.item.prompt_indices, "item_version": r.item.version,
                        "generate_s": r.generate_s,
                        "batch": {k: ({"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                                       "data": v.reshape(-1).tolist()} if torch.is_tensor(v) else v)
                                  for k, v in r.batch.items()}})
        return {"max_staleness": self.k, "layout": self.layout(), "buffered": out}

    def load_state_dict(self, sd: dict, encoded: list) -> None:
        """Samples a checkpoint carried (rank 0 keeps them for :meth:`start`). A checkpoint
        written in sync mode carries none; one written with another :meth:`layout` (DP size,
        ``ppo.num_rollout_samples``, ``rollout.n_samples_per_prompt``,
        ``rollout.max_staleness``; a checkpoint from before the layout was stored: its
        ``max_staleness``) has its samples dropped, logged naming each change ``old -> new``:
        the steps after it are generated from its weights (fresher than the bound asks).
        :meth:`start` drops them too when the sampler draws other prompts for their steps."""
        self._restored = []
        if self.controller is None or not sd or not sd.get("buffered"):
            return
        old = sd.get("layout") or {"max_staleness": sd.get("max_staleness")}
        names = {"dp": "DP size", "num_rollout_samples": "ppo.num_rollout_samples",
                 "n_samples_per_prompt": "rollout.n_samples_per_prompt", "max_staleness": "rollout.max_staleness"}
        changed = [f"{names[k]} {old[k]} -> {v}" for k, v in self.layout().items() if k in old and old[k] != v]
        outside = sorted({i for b in sd["buffered"] for i in b["prompt_indices"] if not 0 <= i < len(encoded)})
        if outside:
            changed.append(f"prompt indices {outside[:4]} outside the {len(encoded)} prompts of data.train_file")
        if changed:
            log.warning("rollout.mode=async resume: the checkpoint's %d buffered samples (steps %s) are dropped "
                        "and regenerated from its weights: %s", len(sd["buffered"]),
                        sorted({b["step"] for b in sd["buffered"]}), ", ".join(changed))
            return
        for b in sd["buffered"]:
            batch = {k: (torch.tensor(v["data"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
                         if isinstance(v, dict) and "dtype" in v else v) for k, v in b["batch"].items()}
            item = RolloutItem(step=b["step"], dp_rank=b["dp_rank"], prompt_indices=b["prompt_indices"],
                               prompts=[encoded[i] for i in b["prompt_indices"]], version=b["item_version"])
            self._restored.append(RolloutResult(item=item, version=b["version"], batch=batch, worker=-1,
                                                generate_s=b.get("generate_s", 0.0)))

    def close(self) -> None:
        if self.controller is not None:
            self.controller.close()


__all__ = ["AsyncRollout", "check_async_layout", "full_weights"]
