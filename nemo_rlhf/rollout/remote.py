"""Rollout workers on their own processes and devices, fed by a controller on the trainer
(``rollout.mode=async``).

The trainer's global rank 0 runs a :class:`RolloutController` (a thread beside the training
loop; the trainer reaches it through
:class:`~nemo_rlhf.trainers.ppo.rollout_source.RemoteRolloutSource`); each rollout worker
(:func:`~nemo_rlhf.rollout.transport.serve_rollout_worker`, started as
``python -m nemo_rlhf.rollout_worker``) holds a full (TP=1, PP=1) copy of the actor and a
rollout engine (megatron's KV-cache decode or vLLM). What crosses between them and how
(a TCPStore for control and samples, a process group for the weights) is
:mod:`nemo_rlhf.rollout.transport`.

Versions and staleness: the :class:`~nemo_rlhf.rollout.staleness.StalenessSchedule` the
controller shares with the trainer's source. Each :class:`RolloutItem` names the version
that generates it (the schedule's); an item waits for its version to be published, and for
back-pressure: at most ``buffer_size = max_staleness + 1`` steps are in flight or waiting to
be taken (the workers wait meanwhile); :meth:`RolloutController.take` checks the bound
again. Generation of step ``s`` overlaps the training of steps ``s - max_staleness .. s - 1``.

Simplified: the controller sends weights to one worker at a time (point to point, not a
broadcast tree); a dead worker stops the job (its restart and the trainer's auto-resume
regenerate what was lost) rather than being replaced; the weights of a pipeline-parallel
trainer are not gathered (``rollout.mode=async`` needs PP=1).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from nemo_rlhf.rollout.staleness import StalenessSchedule
from nemo_rlhf.rollout.transport import (ADDRESS_FILE, POLL_S, RolloutItem, RolloutResult, RolloutWorkerError,
                                         bits_checksum, dump_message, open_weights_group, write_address)

log = logging.getLogger("nemo_rlhf.rollout.remote")


@dataclass
class _Worker:
    index: int
    seq: int = 0
    version: int = -1
    busy: Optional[RolloutItem] = None
    busy_key: str = ""
    heartbeat: int = -1
    heard_at: float = field(default_factory=time.monotonic)
    idle_since: float = field(default_factory=time.monotonic)
    info: dict = field(default_factory=dict)


class RolloutController:
    """The trainer-side end of ``rollout.mode=async`` (global rank 0 only).

    Args:
        exp_dir: the experiment folder (the address file goes there).
        num_workers: ``rollout.num_workers``.
        schedule: the :class:`~nemo_rlhf.rollout.staleness.StalenessSchedule` (shared with
            the trainer's source): its ``buffer_size`` bounds the steps in flight or waiting,
            its bound is checked again at :meth:`take`.
        worker_timeout_s: ``rollout.worker_timeout_s``.
        device: where the weights live (``dims.device``): picks NCCL or gloo.
        port: ``rollout.controller_port`` (0: any free port).
        start_timeout_s: ``rollout.worker_start_timeout_s`` (None: ``worker_timeout_s``).
        wait_timeout_s: ``rollout.wait_timeout_s`` (None: ``worker_timeout_s``): how long
            :meth:`take` and :meth:`results_for` wait for the items they need.

    :meth:`start` opens the store, writes the address file and waits for every worker
    (up to ``start_timeout_s``); the main thread then calls :meth:`publish` after each
    optimizer step, :meth:`submit` for the steps ahead and :meth:`take` for the step it
    trains; a thread dispatches items and weights meanwhile. :meth:`results_for` and
    :meth:`preload` carry generated samples through a checkpoint.

    Raises (from :meth:`start`, :meth:`take`, :meth:`results_for`):
    :class:`RolloutWorkerError` naming the worker, what happened and the timeout; from
    :meth:`take` and :meth:`results_for` also when an item they need was never submitted
    (at once) or did not arrive within ``wait_timeout_s`` (naming the steps, DP ranks and
    what the workers were doing).
    """

    def __init__(self, exp_dir, num_workers: int, schedule: StalenessSchedule,
                 worker_timeout_s: float, device: torch.device, port: int = 0,
                 start_timeout_s: Optional[float] = None, wait_timeout_s: Optional[float] = None):
        self.start_timeout_s = worker_timeout_s if start_timeout_s is None else start_timeout_s
        self.wait_timeout_s = worker_timeout_s if wait_timeout_s is None else wait_timeout_s
        self.exp_dir, self.num_workers = Path(exp_dir), num_workers
        self.schedule = schedule
        self.timeout_s, self.device, self.port = worker_timeout_s, device, port
        self.cond = threading.Condition()
        self.pending: deque[RolloutItem] = deque()
        self.results: dict[tuple[int, int], RolloutResult] = {}
        self.expected: set[tuple[int, int]] = set()
        """``(step, dp_rank)`` of every item submitted or preloaded and not yet taken."""
        self.taken_step = 0
        """The last step :meth:`take` returned (items up to it are consumed)."""
        self.versions: dict[int, list] = {}
        """Published weights still needed: version -> [full tensors, manifest, checksum or
        None until the first send]."""
        self.keep_from = 0
        """Versions below it are needed by no future item (set by :meth:`retain_from`)."""
        self.workers = [_Worker(i) for i in range(num_workers)]
        self.error: Optional[str] = None
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.store = None
        self.group = None
        self.stats = dict.fromkeys(("weight_sync_s", "weight_sync_bytes", "weight_syncs", "worker_idle_s",
                                    "generate_s"), 0.0)

    # --- set-up ---------------------------------------------------------------------------
    def start(self) -> None:
        host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
        timeout = datetime.timedelta(seconds=self.start_timeout_s)
        self.store = dist.TCPStore(host, self.port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s))
        self.store.set("group_size", str(self.num_workers + 1))
        write_address(self.exp_dir, host, self.store.port, self.num_workers)
        log.info("rollout controller at %s:%d, waiting for %d worker(s)", host, self.store.port,
                 self.num_workers)
        keys = [f"hello/{w.index}" for w in self.workers]
        try:
            self.store.wait(keys, timeout)
        except Exception as exc:  # noqa: BLE001 - a DistStoreError or a timeout
            missing = [k for k in keys if not self.store.check([k])]
            raise RolloutWorkerError(
                f"rollout.mode=async: {len(missing)} of {self.num_workers} rollout worker(s) did not "
                f"connect within rollout.worker_start_timeout_s={self.start_timeout_s:g} s "
                f"({', '.join(missing)}; "
                f"address file {self.exp_dir / ADDRESS_FILE}); start them with "
                f"`python -m nemo_rlhf.rollout_worker --worker-index i <the trainer's overrides>` "
                f"(launchers.local and the Slurm launcher do): {exc}") from None
        for w in self.workers:
            w.info = pickle.loads(self.store.get(f"hello/{w.index}"))
            w.heartbeat, w.heard_at = self.store.add(f"hb/{w.index}", 0), time.monotonic()
        self.group = open_weights_group(self.store, 0, self.num_workers + 1, self.device, self.timeout_s)
        self._thread = threading.Thread(target=self._run, name="rollout-controller", daemon=True)
        self._thread.start()

    # --- the main thread's calls ----------------------------------------------------------
    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """The actor's weights after ``version`` steps (full tensors, already copied off the
        live parameters), for the items that name this version."""
        manifest = [(k, tuple(tensors[k].shape), tensors[k].dtype) for k in sorted(tensors)]
        with self.cond:  # (the checksum: by the thread, at the first send)
            self.versions[version] = [tensors, manifest, None]
            self.cond.notify_all()

    def begin_at(self, step: int) -> None:
        """The run starts (or resumes) after step ``step``: steps up to it count as taken, so
        the back-pressure bound (``buffer_size`` steps after the last taken) lets the next
        steps' items through. Call before the first :meth:`submit`."""
        with self.cond:
            self.taken_step = step
            self.cond.notify_all()

    def retain_from(self, version: int) -> None:
        """No item submitted from now on needs a version below ``version``: such versions
        are freed once no queued item needs them."""
        with self.cond:
            self.keep_from = version
            self._prune()

    def _prune(self) -> None:
        needed = min([it.version for it in self.pending] + [self.keep_from])
        for v in [v for v in self.versions if v < needed]:
            del self.versions[v]

    def submit(self, item: RolloutItem) -> None:
        """Queue an item (steps in order)."""
        with self.cond:
            self.pending.append(item)
            self.expected.add((item.step, item.dp_rank))
            self.cond.notify_all()

    def preload(self, results: list[RolloutResult]) -> None:
        """Samples a checkpoint carried (:meth:`results_for` before the save): they are
        taken as if generated now."""
        with self.cond:
            for r in results:
                self.results[(r.item.step, r.item.dp_rank)] = r
                self.expected.add((r.item.step, r.item.dp_rank))
            self.cond.notify_all()

    def _wait(self, keys: list[tuple[int, int]], what: str) -> None:
        """Until every ``(step, dp_rank)`` of ``keys`` is in :attr:`results` (``self.cond``
        held). Raises :class:`RolloutWorkerError` at once for a key never submitted (it
        would never come), when a worker failed, and after ``wait_timeout_s``."""
        never = [k for k in keys if k not in self.results and k not in self.expected]
        if self.error:
            raise RolloutWorkerError(self.error)
        if never:
            raise RolloutWorkerError(
                f"rollout.mode=async: {what} needs the items (step, DP rank) {never}, which were never "
                f"submitted (submitted and not taken: {sorted(self.expected)[:8]}): the trainer's layout "
                f"(DP size, ppo.num_rollout_samples, rollout.n_samples_per_prompt) is not the one the "
                f"items were made for")
        t0 = time.monotonic()
        deadline = t0 + self.wait_timeout_s
        while not all(k in self.results for k in keys):
            if self.error:
                raise RolloutWorkerError(self.error)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RolloutWorkerError(self._late(keys, what, time.monotonic() - t0))
            self.cond.wait(timeout=min(0.5, left))

    def _late(self, keys: list[tuple[int, int]], what: str, waited: float) -> str:
        """The message of a wait past ``wait_timeout_s``: what is missing and where it is."""
        missing = [k for k in keys if k not in self.results]
        busy = [f"worker {w.index}: step {w.busy.step} DP rank {w.busy.dp_rank} (weights version "
                f"{w.busy.version})" if w.busy is not None else f"worker {w.index}: idle"
                for w in self.workers]
        queued = [f"step {it.step} DP rank {it.dp_rank} (weights version {it.version}"
                  f"{'' if it.version in self.versions else ', not published yet'})"
                  for it in list(self.pending)[:4]]
        return (f"rollout.mode=async: {what} waited {waited:.1f} s for the items (step, DP rank) {missing} "
                f"(rollout.wait_timeout_s={self.wait_timeout_s:g}); {'; '.join(busy)}; queued: "
                f"{', '.join(queued) or 'none'}; raise rollout.wait_timeout_s if generating a step's "
                f"samples takes longer")

    def results_for(self, steps: range, dp: int) -> list[RolloutResult]:
        """The generated items of ``steps`` (every DP rank), waiting for those in flight;
        left in the buffer (a checkpoint's copy)."""
        keys = [(s, r) for s in steps for r in range(dp)]
        with self.cond:
            self._wait(keys, f"saving the rollout buffer (steps {list(steps)})")
            return [self.results[k] for k in keys]

    def take(self, step: int, dp: int) -> tuple[list[RolloutResult], dict]:
        """The ``dp`` items of ``step`` (DP rank order), once generated, and the step's
        ``async/*`` metrics and ``generated_tokens_per_s``: the step's generated (response)
        tokens over the generation seconds its items' workers reported, summed over the items
        (``async/step_generate_s``): one worker's throughput, not the wait's; NaN when an item's
        seconds are unknown (restored from a checkpoint written before they were kept). Blocks;
        raises :class:`RolloutWorkerError` when a worker failed, a sample is past the staleness
        bound, or an item was never submitted or is late (:meth:`_wait`)."""
        t0 = time.perf_counter()
        keys = [(step, r) for r in range(dp)]
        with self.cond:
            self._wait(keys, f"taking step {step}")
            depth = len({s for s, _ in self.results})  # steps ready, this one included
            out = [self.results.pop(k) for k in keys]
            self.expected.difference_update(keys)
            self.taken_step = step
            stats = dict(self.stats)
            self.stats = dict.fromkeys(self.stats, 0.0)
            self.cond.notify_all()
        stale = [self.schedule.staleness(step, r.version) for r in out]
        if not all(self.schedule.within_bound(step, r.version) for r in out):  # never by construction; checked
            raise RolloutWorkerError(f"step {step}: samples of weights versions {[r.version for r in out]} "
                                     f"(the trainer holds version {step - 1}): outside 0 .. "
                                     f"rollout.max_staleness={self.schedule.max_staleness}")
        rows = [r.batch["input_ids"].shape[0] for r in out]
        gen_s = sum(r.generate_s for r in out)
        tokens = sum(float(r.batch["response_mask"].sum()) for r in out)
        known = all(r.generate_s > 0 for r in out)
        metrics = {"async/staleness_mean": sum(s * n for s, n in zip(stale, rows)) / sum(rows),
                   "async/staleness_max": float(max(stale)), "async/buffer_depth": float(depth),
                   "async/trainer_wait_s": time.perf_counter() - t0,
                   "async/step_generate_s": gen_s if known else float("nan"),
                   "generated_tokens_per_s": tokens / gen_s if known else float("nan")}
        metrics.update({f"async/{k}": v for k, v in stats.items()})
        return out, metrics

    def close(self) -> None:
        """Stop the thread and tell every worker to exit (idempotent)."""
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self.store is not None:
            for w in self.workers:
                try:
                    self._command(w, {"op": "stop"})
                except Exception:  # noqa: BLE001 - a worker already gone
                    pass
            self.store = None

    # --- the thread ------------------------------------------------------------------------
    def _command(self, w: _Worker, msg: dict) -> str:
        key = f"{w.index}/{w.seq}"
        self.store.set(f"cmd/{key}", dump_message(msg))
        w.seq += 1
        return key

    def _fail(self, message: str) -> None:
        with self.cond:
            if self.error is None:
                self.error = message
                log.error("%s", message)
            self.cond.notify_all()

    def _run(self) -> None:
        if self.device.type == "cuda":  # the current device is per thread: the weights' own
            torch.cuda.set_device(self.device)
        try:
            while True:
                with self.cond:
                    if self._stop or self.error:
                        return
                if not self._scan():
                    time.sleep(POLL_S)
        except Exception as exc:  # noqa: BLE001 - reported to the main thread by take()
            self._fail(f"rollout controller: {type(exc).__name__}: {exc}")

    def _scan(self) -> bool:
        progressed = False
        now = time.monotonic()
        for w in self.workers:
            beat = self.store.add(f"hb/{w.index}", 0)
            if beat != w.heartbeat:
                w.heartbeat, w.heard_at = beat, now
            elif now - w.heard_at > self.timeout_s:
                self._fail(f"rollout worker {w.index} ({w.info.get('host')}, pid {w.info.get('pid')}) sent "
                           f"no heartbeat for {now - w.heard_at:.0f} s (rollout.worker_timeout_s="
                           f"{self.timeout_s:g}): it died or hangs; the job stops (a resume regenerates its "
                           f"samples)")
                return False
            if w.busy is not None:
                progressed |= self._collect(w)
            if w.busy is None:
                progressed |= self._dispatch(w)
        return progressed

    def _collect(self, w: _Worker) -> bool:
        key = f"res/{w.busy_key}"
        if not self.store.check([key]):
            return False
        res = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        if isinstance(res, str):  # the worker's error
            self._fail(f"rollout worker {w.index} failed generating step {w.busy.step} (DP rank "
                       f"{w.busy.dp_rank}): {res}")
            return False
        with self.cond:
            self.results[(res.item.step, res.item.dp_rank)] = res
            self.stats["generate_s"] += res.generate_s
            self.cond.notify_all()
        w.busy, w.idle_since = None, time.monotonic()
        return True

    def _next_item(self) -> Optional[tuple[RolloutItem, tuple]]:
        with self.cond:
            if not self.pending:
                return None
            item = self.pending[0]
            if item.step > self.taken_step + self.schedule.buffer_size or item.version not in self.versions:
                return None  # back-pressure, or its weights are not published yet
            self.pending.popleft()
            weights = self.versions[item.version]
            self._prune()
        if weights[2] is None:
            weights[2] = bits_checksum(weights[0])  # off the trainer's thread
        return item, weights

    def _dispatch(self, w: _Worker) -> bool:
        nxt = self._next_item()
        if nxt is None:
            return False
        item, (tensors, manifest, checksum) = nxt
        self.stats["worker_idle_s"] += time.monotonic() - w.idle_since
        if w.version != item.version:
            self._send_weights(w, item.version, tensors, manifest, checksum)
        w.busy_key = self._command(w, {"op": "generate", "item": item})
        w.busy = item
        return True

    def _send_weights(self, w: _Worker, version: int, tensors: dict, manifest: list, checksum: int) -> None:
        t0 = time.perf_counter()
        key = self._command(w, {"op": "weights", "version": version, "manifest": manifest})
        for name, _, _ in manifest:
            self.group.send([tensors[name]], w.index + 1, 0).wait()
        ack_key = f"ack/{key}"
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([ack_key]):
            if time.monotonic() > deadline:
                raise RolloutWorkerError(f"rollout worker {w.index} did not acknowledge weights version "
                                         f"{version} within rollout.worker_timeout_s={self.timeout_s:g} s")
            time.sleep(POLL_S)
        ack = pickle.loads(self.store.get(ack_key))
        self.store.delete_key(ack_key)
        if ack.get("error"):
            raise RolloutWorkerError(f"rollout worker {w.index} could not load weights version {version}: "
                                     f"{ack['error']}")
        if ack["checksum"] != checksum:
            raise RolloutWorkerError(f"rollout worker {w.index}: weights version {version} arrived corrupted "
                                     f"(checksum {ack['checksum']} vs the trainer's {checksum})")
        w.version = version
        self.stats["weight_sync_s"] += time.perf_counter() - t0
        self.stats["weight_sync_bytes"] += float(sum(t.numel() * t.element_size() for t in tensors.values()))
        self.stats["weight_syncs"] += 1


__all__ = ["RolloutController"]
