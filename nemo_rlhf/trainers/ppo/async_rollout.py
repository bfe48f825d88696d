"""The PPO trainer's side of ``rollout.mode=async``: :class:`RemoteRolloutSource`, the
:class:`~nemo_rlhf.trainers.ppo.rollout_source.RolloutSource` whose samples the rollout
workers generate (:mod:`nemo_rlhf.rollout.remote`, :mod:`nemo_rlhf.rollout.transport`).

Every trainer rank holds one; global rank 0 also holds the
:class:`~nemo_rlhf.rollout.remote.RolloutController`. The trainer calls it as it calls the
local source; per PPO step ``s``:

* :meth:`RemoteRolloutSource.rollout` (every rank, in the trainer's rollout step): rank 0
  submits the items of the steps up to ``s + max_staleness`` (each DP rank's prompts, from a
  look-ahead copy of the trainer's sampler, so the same prompts in the same order as
  ``sync``; each item's weights version from the
  :class:`~nemo_rlhf.rollout.staleness.StalenessSchedule` it shares with the controller),
  waits for step ``s``'s items and broadcasts them (host objects); each rank moves its own
  DP rank's samples to ``dims.device``.
* :meth:`RemoteRolloutSource.after_update` (every TP rank of DP rank 0 and CP rank 0): the
  actor's full weights gathered over TP (LoRA merged, value head left out), copied and
  handed to the controller as version ``s``. Under context parallelism the CP ranks hold
  the same weights (CP does not shard them), so only CP rank 0 gathers: once per version,
  not once per CP rank; the CP ranks of a DP rank take the same item (its ``dp_rank``).
* the trainer recomputes old log-probs and values with its current weights (version
  ``s - 1``); the samples' own log-probs (the behaviour policy's) feed
  ``ppo.rollout_is_cap`` / ``ppo.rollout_mask_threshold``: the decoupled PPO objective of
  AReaL (Fu et al. 2025, eq. 5: the clipped ratio against the recomputed proximal policy,
  weighted by the proximal-over-behaviour ratio, limited at the cap by
  ``ppo.rollout_is_mode``: truncated, or masked above it as AReaL's code does).

Checkpoints: :meth:`RemoteRolloutSource.state_dict` (rank 0) holds the samples of the steps
``s + 1 .. s + max_staleness``, which the resumed run cannot regenerate (they were made by
versions before ``s``); steps after those are regenerated from the checkpoint's weights
(version ``s``), exactly as the uninterrupted run generated them. A resume is therefore
bit-identical to the uninterrupted run, and every prompt is trained on once. The state also
records the layout that keys the buffered items (:meth:`RemoteRolloutSource.layout`: the DP size,
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
from nemo_rlhf.rollout.remote import RolloutController
from nemo_rlhf.rollout.staleness import StalenessSchedule
from nemo_rlhf.rollout.transport import (RolloutItem, RolloutResult, RolloutWorkerError, batch_from_host,
                                         result_from_json, result_to_json)
from nemo_rlhf.trainers.ppo.episode_source import (episode_metric_sums, episode_metrics_from_sums, episode_texts,
                                                   is_episode_batch, run_episode_batch)
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


class RemoteRolloutSource:
    """The rollout workers' samples as a
    :class:`~nemo_rlhf.trainers.ppo.rollout_source.RolloutSource` (see the module
    docstring); built by :func:`~nemo_rlhf.trainers.ppo.rollout_source.build_rollout_source`
    for ``rollout.mode=async``. Holds no rollout engine: the held-out evaluation's greedy
    decode (:meth:`generate`) is the actor's own (megatron's KV-cache decode).

    Args:
        cfg: the PPO job's config (``rollout``, ``ppo.num_rollout_samples``,
            ``trainer.max_steps``, ``model.lora``, ``exp_manager.exp_dir``).
        dims: this rank's :class:`~nemo_rlhf.distributed.ParallelDims`.
        actor: the :class:`~nemo_rlhf.trainers.ppo.roles.PolicyRole` (its ``model`` is
            published; its ``weights_version`` names the evaluation decode's weights).
        encoded: the training prompts' token ids, by index.
        sampler: the trainer's prompt sampler (copied for the look-ahead, never advanced).
        collectives: the job's :class:`~nemo_rlhf.trainers.collectives.JobCollectives`
            (``raise_together``).
        timers: the trainer's :class:`~nemo_rlhf.metrics.timers.Timers` (``publish_weights``).
        eval_engine: the decode :meth:`generate` uses (a
            :class:`~nemo_rlhf.rollout.engines.MegatronRolloutEngine`).
        tokenizer: with ``env.name``: the held-out evaluation's episodes
            (:meth:`generate_episodes`) encode and decode with it.
        prompts: with ``env.name``: the training prompt rows (``.prompt``, ``.extras``), by
            index: each item carries its rows' problems (``{"prompt": text, **extras}``).

    With ``env.name`` (multi-turn episodes, #51) the workers run one episode per row and the
    items come back as ``EpisodeRolloutBatch``; :meth:`rollout` adds the step's
    ``episode/*`` metrics (summed over DP, as ``EpisodeRolloutSource`` does). Staleness
    counts per item: every episode of an item is generated by the one version it names.
    """

    def __init__(self, cfg, dims, actor, encoded: list, sampler, collectives, timers, eval_engine,
                 tokenizer=None, prompts: Optional[list] = None):
        self.cfg, self.tok = cfg, tokenizer
        self.problems = ([{"prompt": p.prompt, **p.extras} for p in prompts]
                         if cfg.env.enabled and prompts is not None else None)
        if cfg.env.enabled and (self.problems is None or tokenizer is None):
            raise ValueError(f"env.name={cfg.env.name!r}: RemoteRolloutSource needs the prompt rows (prompts=) "
                             f"and the tokenizer (tokenizer=) for the episodes")
        self.dims, self.actor, self.encoded, self.sampler = dims, actor, encoded, sampler
        self.collectives, self.timers, self.eval_engine = collectives, timers, eval_engine
        r = cfg.rollout
        self.rollout_cfg, self.max_steps = r, cfg.trainer.max_steps
        self.num_rollout_samples = cfg.ppo.num_rollout_samples
        self.lora_scale = cfg.model.lora.scale if cfg.model.lora.enabled else None
        self.schedule = StalenessSchedule(r.max_staleness)
        self.controller = (RolloutController(cfg.exp_manager.exp_dir, r.num_workers, self.schedule,
                                             r.worker_timeout_s, dims.device, r.controller_port,
                                             start_timeout_s=r.worker_start_timeout_s,
                                             wait_timeout_s=r.wait_timeout_s)
                           if dims.rank == 0 else None)
        self.started = False
        self.step = 0
        """The last step trained (:meth:`begin`, :meth:`after_update`)."""
        self.submitted = 0
        self.lookahead = None
        self._restored: list[RolloutResult] = []
        self._metrics: dict = {}

    def layout(self) -> dict:
        """What keys the buffered items (``(step, dp_rank)``, each with its share of the
        step's prompts, made by the version the schedule names): stored in
        :meth:`state_dict` and compared at :meth:`load_state_dict`."""
        return {"dp": self.dims.dp, "num_rollout_samples": self.num_rollout_samples,
                "n_samples_per_prompt": self.rollout_cfg.n_samples_per_prompt,
                "max_staleness": self.schedule.max_staleness}

    # --- set-up ----------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Before the prompts of step ``step + 1`` are drawn: the first call connects the
        workers (rank 0) and publishes the current weights as version ``step``; collective
        then (later calls do nothing). The look-ahead copy of the sampler starts here."""
        if self.started:
            return
        failure = None
        if self.controller is not None:
            try:
                self.controller.start()
            except RolloutWorkerError as exc:
                failure = exc
        self.collectives.raise_together(failure, "starting the rollout workers", RolloutWorkerError)
        self.step = self.submitted = step
        self.schedule.begin_at(step)
        if self.controller is not None:
            self.controller.begin_at(step)  # (a resumed run's back-pressure counts from there)
            self.lookahead = copy.deepcopy(self.sampler)
            self._check_restored_prompts(step)
            if self._restored:
                self.controller.preload(self._restored)
                self.submitted = max(r.item.step for r in self._restored)
                for _ in range(self.submitted - step):  # their prompts were drawn already
                    self.lookahead.next_global_batch(self._batch_prompts())
                self._restored = []
        self.started = True
        self._publish(step)

    def _check_restored_prompts(self, step: int) -> None:
        """Drop the restored items (logged) unless they are exactly the items this run would
        submit for their steps: every DP rank's, with the prompts the sampler draws."""
        if not self._restored:
            return
        n, dp = self.rollout_cfg.n_samples_per_prompt, self.dims.dp
        got = {(r.item.step, r.item.dp_rank): r.item.prompt_indices for r in self._restored}
        probe, want = copy.deepcopy(self.sampler), {}
        for s in range(step + 1, max(s for s, _ in got) + 1):
            idx = probe.next_global_batch(self._batch_prompts())
            want.update({(s, r): dp_group_slice(idx, r, dp, n) for r in range(dp)})
        if got != want:
            log.warning("rollout.mode=async resume: the checkpoint's %d buffered samples (steps %s) are not "
                        "the prompts this run's sampler draws for those steps (DP size %d): dropped and "
                        "regenerated from the checkpoint's weights (version %d)", len(got),
                        sorted({s for s, _ in got}), dp, step)
            self._restored = []

    def _batch_prompts(self) -> int:
        return self.num_rollout_samples // self.rollout_cfg.n_samples_per_prompt

    # --- per step ----------------------------------------------------------------------------
    def _publish(self, version: int) -> None:
        """The actor's weights after ``version`` steps to the controller (collective over the
        TP group of DP rank 0 and CP rank 0; the other DP and CP ranks do nothing: CP
        replicates the weights)."""
        if self.dims.dp_rank != 0 or getattr(self.dims, "cp_rank", 0) != 0:
            return
        tensors = full_weights(self.actor.model, self.dims, self.lora_scale)
        if self.controller is not None:
            self.controller.publish(version, tensors)

    def after_update(self, step: int) -> None:
        """Step ``step``'s update is done: its weights (version ``step``) to the workers."""
        self.step = step
        with self.timers("publish_weights"):
            self._publish(step)

    def _submit_until(self, step: int) -> None:
        last = self.schedule.last_step_ahead(step, self.max_steps)
        n, dp = self.rollout_cfg.n_samples_per_prompt, self.dims.dp
        while self.submitted < last:
            self.submitted += 1
            idx = self.lookahead.next_global_batch(self._batch_prompts())
            for r in range(dp):
                mine = dp_group_slice(idx, r, dp, n)
                self.controller.submit(RolloutItem(
                    step=self.submitted, dp_rank=r, prompt_indices=mine, prompts=[self.encoded[i] for i in mine],
                    version=self.schedule.version_for(self.submitted),
                    problems=None if self.problems is None else [self.problems[i] for i in mine]))
        self.controller.retain_from(self.schedule.version_for(self.submitted + 1))

    def rollout(self, step: int, prompt_indices: list[int]):
        """This DP rank's samples of step ``step`` (a ``RolloutBatch``, with ``env.name`` an
        ``EpisodeRolloutBatch``, on ``dims.device``);
        collective. ``prompt_indices``: the prompts the trainer's sampler drew for this rank
        (checked against the item's).

        Raises:
            RolloutWorkerError: on every rank, when a worker failed (naming it), or when the
                item's prompts are not ``prompt_indices``.
            RuntimeError: before :meth:`begin`.
        """
        if not self.started:
            raise RuntimeError("RemoteRolloutSource.rollout before begin (the trainer begins it before drawing "
                               "prompts)")
        box: list = [None]
        if self.controller is not None:
            try:
                self._submit_until(step)
                results, metrics = self.controller.take(step, self.dims.dp)
                box = [("ok", [(r.item.prompt_indices, r.batch) for r in results], metrics)]
            except RolloutWorkerError as exc:
                box = [("error", str(exc), None)]
        if self.dims.world_size > 1:
            dist.broadcast_object_list(box, src=0)  # host objects
        status, payload, metrics = box[0]
        if status == "error":
            raise RolloutWorkerError(payload)
        got, fields_ = payload[self.dims.dp_rank]
        if got != list(prompt_indices):
            raise RolloutWorkerError(f"step {step}: the rollout item's prompts {got[:4]}... are not "
                                     f"the sampler's {list(prompt_indices)[:4]}... (DP rank {self.dims.dp_rank})")
        self._metrics = metrics or {}
        batch = batch_from_host(fields_, self.dims.device)
        if is_episode_batch(batch):  # (every rank calls rollout: the DP sum is collective)
            sums = torch.tensor(episode_metric_sums(batch.episodes), dtype=torch.float64, device=self.dims.device)
            self._metrics.update(episode_metrics_from_sums(self.collectives.dp_sum(sums).tolist()))
        return batch

    def generate(self, prompts, cfg, *, call_index: int):
        """The actor's own decode of ``prompts`` (the held-out evaluation's), as
        :meth:`~nemo_rlhf.rollout.engines.RolloutEngine.generate`."""
        return self.eval_engine.generate(self.actor.model, prompts, cfg, call_index=call_index,
                                         weights_version=self.actor.weights_version)

    def generate_episodes(self, problems: list[dict], cfg, *, call_index: int):
        """The held-out evaluation's episodes (``env.name``): on the trainer's ranks with the
        actor's own decode (megatron's, whatever ``rollout.engine``), as
        :meth:`~nemo_rlhf.trainers.ppo.episode_source.EpisodeRolloutSource.generate_episodes`
        does; every rank calls it with its rows."""
        batch = run_episode_batch(self.cfg, self.dims, self.actor.model, self.tok, list(problems), cfg,
                                  call_index=call_index)
        batch.episode_texts = episode_texts(batch, self.tok)
        return batch

    def metrics(self) -> dict:
        """The last step's ``async/*`` metrics and ``generated_tokens_per_s`` (rank 0's
        controller, broadcast with the samples; ``generated_tokens_per_s`` counts policy
        tokens only), and with ``env.name`` its ``episode/*`` metrics."""
        return {**self.eval_engine.metrics(), **self._metrics}

    # --- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Rank 0: the samples of steps ``step + 1 .. step + max_staleness`` that versions
        before ``step`` (the last step trained) generated (waits for those in flight),
        JSON-able (:func:`~nemo_rlhf.rollout.transport.result_to_json`); elsewhere ``{}``.
        Collective (a worker's failure raises on every rank).

        Raises:
            RolloutWorkerError: a worker failed before those samples arrived.
        """
        step, results, failure = self.step, [], None
        if self.controller is not None and self.started:
            needs_old = range(step + 1, self.schedule.last_step_ahead(step, self.max_steps) + 1)
            needs_old = [s for s in needs_old if self.schedule.version_for(s) < step]
            try:
                results = self.controller.results_for(needs_old, self.dims.dp) if needs_old else []
            except RolloutWorkerError as exc:
                failure = exc
        self.collectives.raise_together(failure, "saving the rollout buffer", RolloutWorkerError)
        if self.controller is None or not self.started:
            return {}
        return {"max_staleness": self.schedule.max_staleness, "layout": self.layout(),
                "buffered": [result_to_json(r) for r in results]}

    def load_state_dict(self, sd: dict) -> None:
        """Samples a checkpoint carried (rank 0 keeps them for :meth:`begin`). A checkpoint
        written in sync mode carries none; one written with another :meth:`layout` (DP size,
        ``ppo.num_rollout_samples``, ``rollout.n_samples_per_prompt``,
        ``rollout.max_staleness``; a checkpoint from before the layout was stored: its
        ``max_staleness``) has its samples dropped, logged naming each change ``old -> new``:
        the steps after it are generated from its weights (fresher than the bound asks).
        :meth:`begin` drops them too when the sampler draws other prompts for their steps."""
        self._restored = []
        if self.controller is None or not sd or not sd.get("buffered"):
            return
        old = sd.get("layout") or {"max_staleness": sd.get("max_staleness")}
        names = {"dp": "DP size", "num_rollout_samples": "ppo.num_rollout_samples",
                 "n_samples_per_prompt": "rollout.n_samples_per_prompt", "max_staleness": "rollout.max_staleness"}
        changed = [f"{names[k]} {old[k]} -> {v}" for k, v in self.layout().items() if k in old and old[k] != v]
        encoded = self.encoded
        outside = sorted({i for b in sd["buffered"] for i in b["prompt_indices"] if not 0 <= i < len(encoded)})
        if outside:
            changed.append(f"prompt indices {outside[:4]} outside the {len(encoded)} prompts of data.train_file")
        if changed:
            log.warning("rollout.mode=async resume: the checkpoint's %d buffered samples (steps %s) are dropped "
                        "and regenerated from its weights: %s", len(sd["buffered"]),
                        sorted({b["step"] for b in sd["buffered"]}), ", ".join(changed))
            return
        self._restored = [result_from_json(b, encoded, self.problems) for b in sd["buffered"]]

    def close(self) -> None:
        """Stop the controller and the workers (rank 0; idempotent)."""
        if self.controller is not None:
            self.controller.close()
        self.eval_engine.close()


__all__ = ["RemoteRolloutSource", "check_async_layout", "full_weights"]
