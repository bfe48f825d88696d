"""The transport of ``rollout.mode=async``: what crosses between the trainer's
:class:`~nemo_rlhf.rollout.remote.RolloutController` and the rollout workers, and the
worker's side of it (:func:`serve_rollout_worker`).

Two channels:

* **control and samples**: a ``torch.distributed.TCPStore`` the controller hosts (its
  address in ``<exp_dir>/rollout_controller``). Per worker ``w`` and message number
  ``n`` the controller writes ``cmd/<w>/<n>`` (a pickled dict: ``weights``, ``generate`` or
  ``stop``); the worker answers ``ack/<w>/<n>`` (weights: version, checksum, seconds) or
  ``res/<w>/<n>`` (a :class:`RolloutResult`: token ids and log-probs as host tensors, which
  leave the worker's device there: :func:`batch_to_host`). Each worker adds 1 to ``hb/<w>``
  every second (a heartbeat); one silent for ``rollout.worker_timeout_s`` is reported dead.
* **weights**: a process group of the controller (rank 0) and the workers (ranks 1..R),
  built on the same store but apart from the trainers' default group: NCCL where the
  weights live on CUDA, gloo on the host (:func:`open_weights_group`). A weights message is
  followed by one point-to-point send per tensor (the full tensors of
  :func:`~nemo_rlhf.models.hf_mapping.model_full_tensors`, in the manifest's order), and
  the worker checks a checksum of the bits it received against the sender's
  (:func:`bits_checksum`): a mismatch stops the job.

A generated item's batch has two forms besides the :class:`RolloutBatch` itself: host
tensors (:func:`batch_to_host` / :func:`batch_from_host`, what a worker sends) and JSON
(:func:`batch_to_json` / :func:`batch_from_json`, what a checkpoint keeps of the buffered
items; :func:`result_to_json` / :func:`result_from_json` for the whole item). A multi-turn
batch (``EpisodeRolloutBatch``, #51) crosses the same way: its tensors (the padded layout
with the holed ``response_mask``) as tensors, its episodes as plain host data
(:func:`episode_to_json` / :func:`episode_from_json`), bit for bit.

Fault injection (tests): ``NEMO_RLHF_FAULT=corrupt_weights:<version>`` makes a worker
change one received element of that weights version before its checksum.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from nemo_rlhf.distributed.fault_spec import FAULT_ENV, spec_matches
from nemo_rlhf.rollout.episodes import Episode, EpisodeRolloutBatch
from nemo_rlhf.rollout.generate import RolloutBatch
from nemo_rlhf.rollout.trajectory import POLICY, Trajectory

log = logging.getLogger("nemo_rlhf.rollout.remote")

ADDRESS_FILE = "rollout_controller"
"""Name of the controller's address file in the experiment folder (``host:port``)."""
EPISODES_FIELD = "episodes"
"""The field of a multi-turn batch that holds its episodes (host objects)."""
HEARTBEAT_S = 1.0
"""Seconds between a worker's heartbeats."""
POLL_S = 0.002
"""The controller's idle wait between scans of its workers."""


class RolloutWorkerError(RuntimeError):
    """A rollout worker died, went silent, failed, or received corrupted weights."""


@dataclass
class RolloutItem:
    """One unit of rollout work: one DP rank's prompts of one PPO step."""

    step: int
    """The PPO step (1-based) that trains on these samples."""
    dp_rank: int
    """The DP rank the samples are for (it mixes into the sampling seeds, as in sync mode)."""
    prompt_indices: list[int]
    """Indices into the prompt dataset, each repeated ``rollout.n_samples_per_prompt`` times."""
    prompts: list[list[int]]
    """The prompts' token ids (so a worker needs no dataset)."""
    version: int
    """The weights version that generates them (see the module docstring)."""
    problems: Optional[list[dict]] = None
    """With ``env.name`` (multi-turn episodes, #51): each row's problem, ``{"prompt": text,
    **extras}`` (JSON-able), which the environment's ``reset`` reads; None for single-turn
    items."""


@dataclass
class RolloutResult:
    """A generated item, as it crosses from a worker to the controller."""

    item: RolloutItem
    version: int
    """The weights version that generated it."""
    batch: dict
    """:class:`~nemo_rlhf.rollout.generate.RolloutBatch`'s fields, tensors on the host."""
    worker: int
    generate_s: float
    """Seconds the worker spent generating it."""


def episode_to_json(episode: Episode) -> dict:
    """One multi-turn :class:`~nemo_rlhf.rollout.episodes.Episode` as plain JSON-able host
    data: the trajectory's ``token_ids`` (prompt included), ``prompt_length``, ``logprobs``
    (one Python float per token, 0 off the policy), ``segments`` (``[kind, start, end]``)
    and ``truncated``; the episode's ``turn_rewards``, ``infos``, ``stop_reason``,
    ``env_time_s`` and ``messages``. The loss mask is not stored: the segments give it. ``infos`` are kept
    as the environment returned them (JSON-able for a checkpoint's copy: the built-in
    environments' are)."""
    tr = episode.trajectory
    return {"token_ids": list(tr.token_ids), "prompt_length": tr.prompt_length, "logprobs": list(tr.logprobs),
            "segments": [[s.kind, s.start, s.end] for s in tr.segments], "truncated": tr.truncated,
            "turn_rewards": list(episode.turn_rewards), "infos": list(episode.infos),
            "stop_reason": episode.stop_reason, "env_time_s": episode.env_time_s,
            "messages": [dict(m) for m in episode.messages]}


def episode_from_json(obj: dict) -> Episode:
    """The inverse of :func:`episode_to_json`: the trajectory is rebuilt by appending its
    segments again (``append_policy`` / ``append_env``: the same checks as when it was
    made), so ``loss_mask`` follows from the segments.

    Raises:
        ValueError: segments that do not tile ``token_ids`` after the prompt, or a form
            whose policy segments fail :meth:`~nemo_rlhf.rollout.trajectory.Trajectory.append_policy`.
    """
    ids, lps, p = obj["token_ids"], obj["logprobs"], obj["prompt_length"]
    tr = Trajectory(ids[:p])
    for kind, start, end in obj["segments"]:
        if start != len(tr.token_ids) or not start < end <= len(ids):
            raise ValueError(f"episode_from_json: segment {kind} [{start}, {end}) does not follow the "
                             f"{len(tr.token_ids)} tokens before it (of {len(ids)})")
        if kind == POLICY:
            tr.append_policy(ids[start:end], lps[start:end])
        else:
            tr.append_env(ids[start:end])
    if len(tr.token_ids) != len(ids):
        raise ValueError(f"episode_from_json: segments cover {len(tr.token_ids)} of {len(ids)} tokens")
    if obj["truncated"]:
        tr.mark_truncated()
    return Episode(trajectory=tr, turn_rewards=list(obj["turn_rewards"]), infos=list(obj["infos"]),
                   stop_reason=obj["stop_reason"], env_time_s=obj["env_time_s"],
                   messages=[dict(m) for m in obj.get("messages", [])])  # absent: written before #51's messages


def batch_to_host(batch) -> dict:
    """A ``RolloutBatch``'s fields with every tensor moved to the host (the boundary where
    samples leave a worker's device). For a multi-turn
    :class:`~nemo_rlhf.trainers.ppo.episode_source.EpisodeRolloutBatch` the ``episodes``
    field becomes a list of :func:`episode_to_json` forms (so the host form is also
    JSON-able: :func:`batch_to_json` keeps it as it is)."""
    out = {f.name: (getattr(batch, f.name).cpu() if torch.is_tensor(getattr(batch, f.name))
                    else getattr(batch, f.name)) for f in fields(batch)}
    if EPISODES_FIELD in out:
        out[EPISODES_FIELD] = [episode_to_json(ep) for ep in out[EPISODES_FIELD]]
    return out


def batch_from_host(fields_: dict, device: torch.device):
    """The inverse of :func:`batch_to_host`: a ``RolloutBatch`` on ``device``, or an
    ``EpisodeRolloutBatch`` (its episodes rebuilt by :func:`episode_from_json`) when the
    fields hold ``episodes``."""
    kw = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in fields_.items()}
    if EPISODES_FIELD not in kw:
        return RolloutBatch(**kw)
    kw[EPISODES_FIELD] = [episode_from_json(e) for e in kw[EPISODES_FIELD]]
    return EpisodeRolloutBatch(**kw)


def batch_to_json(fields_: dict) -> dict:
    """:func:`batch_to_host`'s fields as JSON-able values: each tensor as ``{"dtype",
    "shape", "data"}`` (flat list), other fields as they are. Exact for integer, bool and
    float32/float64 tensors (bf16/fp16 values are exact in a float too)."""
    return {k: ({"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape), "data": v.reshape(-1).tolist()}
                if torch.is_tensor(v) else v) for k, v in fields_.items()}


def batch_from_json(obj: dict) -> dict:
    """The inverse of :func:`batch_to_json`: host tensors in their dtype and shape."""
    return {k: (torch.tensor(v["data"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
                if isinstance(v, dict) and "dtype" in v else v) for k, v in obj.items()}


def result_to_json(r: RolloutResult) -> dict:
    """A generated item as a checkpoint keeps it (JSON-able; the prompts' token ids and
    problems left out: the resumed run has them by index)."""
    return {"step": r.item.step, "dp_rank": r.item.dp_rank, "version": r.version,
            "prompt_indices": r.item.prompt_indices, "item_version": r.item.version,
            "generate_s": r.generate_s, "batch": batch_to_json(r.batch)}


def result_from_json(obj: dict, encoded: list, problems: Optional[list] = None) -> RolloutResult:
    """The inverse of :func:`result_to_json` (``encoded``: the prompts' token ids by index;
    ``problems``: the prompts' problems by index, for a multi-turn item, else None;
    ``worker`` -1: restored, not generated; ``generate_s`` 0 when the checkpoint predates it)."""
    idx = obj["prompt_indices"]
    item = RolloutItem(step=obj["step"], dp_rank=obj["dp_rank"], prompt_indices=idx,
                       prompts=[encoded[i] for i in idx], version=obj["item_version"],
                       problems=None if problems is None else [problems[i] for i in idx])
    return RolloutResult(item=item, version=obj["version"], batch=batch_from_json(obj["batch"]), worker=-1,
                         generate_s=obj.get("generate_s", 0.0))


def bits_checksum(tensors: dict[str, torch.Tensor]) -> int:
    """A position-weighted sum of the tensors' bits (fp32 as int32, bf16/fp16 as int16),
    in int64 on the tensors' own device: equal for bit-identical tensors, and different
    for a changed, missing or moved element with overwhelming probability. Keys in sorted
    order; each element's weight is ``(index mod 65521) + 1``."""
    total = 0
    for key in sorted(tensors):
        t = tensors[key].detach().contiguous().reshape(-1)
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        bits = t.view(ints)
        chunk = 1 << 22
        for start in range(0, bits.numel(), chunk):
            part = bits[start:start + chunk].to(torch.int64)
            w = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64) % 65521 + 1
            total = (total + int((part * w).sum())) % (1 << 61)
    return total


def dump_message(obj) -> bytes:
    """A control message or result as the store carries it (pickled)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def open_weights_group(store, rank: int, size: int, device: torch.device, timeout_s: float):
    """The weights' process group of the controller (rank 0) and the workers, on ``store``
    (prefix ``weights``): NCCL for CUDA tensors, gloo on the host. Collective: every member
    calls it."""
    prefixed = dist.PrefixStore("weights", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


def write_address(exp_dir, host: str, port: int, num_workers: int) -> Path:
    """``host:port num_workers`` into ``<exp_dir>/rollout_controller`` (written to a
    temporary name and renamed: a reader never sees half a line). ``launchers.local``
    starts the workers when it appears."""
    path = Path(exp_dir) / ADDRESS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{ADDRESS_FILE}.{os.getpid()}")
    tmp.write_text(f"{host}:{port} {num_workers}\n")
    os.replace(tmp, path)
    return path


def read_address(exp_dir, timeout_s: float) -> tuple[str, int]:
    """``(host, port)`` from ``<exp_dir>/rollout_controller`` once it exists.

    Raises:
        RolloutWorkerError: no address file within ``timeout_s``.
    """
    path = Path(exp_dir) / ADDRESS_FILE
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise RolloutWorkerError(f"no rollout controller address in {path} after {timeout_s:g} s "
                                     f"(rollout.worker_start_timeout_s): is the trainer running with "
                                     f"rollout.mode=async and this exp_manager.exp_dir?")
        time.sleep(0.1)
    host, port = path.read_text().split()[0].rsplit(":", 1)
    return host, int(port)


def serve_rollout_worker(index: int, exp_dir, timeout_s: float, device: torch.device,
                         load_weights: Callable[[dict], None], generate: Callable[[RolloutItem, int], object],
                         connect_timeout_s: Optional[float] = None) -> int:
    """A rollout worker's loop: connect to the controller, then load weights, generate and
    answer until told to stop. Returns the exit code (0: stopped by the controller).

    Args:
        index: this worker's index, ``0 .. rollout.num_workers - 1``.
        exp_dir: the trainer's experiment folder (the address file).
        timeout_s: ``rollout.worker_timeout_s`` (the weights group).
        connect_timeout_s: ``rollout.worker_start_timeout_s`` (None: ``timeout_s``): how long
            to wait for the controller's address and store.
        device: where this worker's model lives (receive buffers are made there).
        load_weights: ``full tensors -> None``, into the worker's model.
        generate: ``(item, version) -> RolloutBatch`` with the loaded weights.

    Raises:
        RolloutWorkerError: no controller within ``timeout_s``.
    """
    deadline = time.monotonic() + (timeout_s if connect_timeout_s is None else connect_timeout_s)
    while True:
        host, port = read_address(exp_dir, max(deadline - time.monotonic(), 0.1))
        try:  # (a previous run's file names a dead port: read it again until the new one is there)
            store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
            store.get("group_size")
            break
        except Exception as exc:  # noqa: BLE001 - an old file, a controller not up yet
            log.info("rollout worker %d: no controller at %s:%d yet (%s)", index, host, port, exc)
        if time.monotonic() > deadline:
            raise RolloutWorkerError(f"rollout worker {index}: could not connect to the controller at "
                                     f"{host}:{port} within rollout.worker_start_timeout_s")
        time.sleep(0.5)
    stop = threading.Event()

    def beat():
        beat_store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        while not stop.is_set():
            try:
                beat_store.add(f"hb/{index}", 1)
            except Exception:  # noqa: BLE001 - the controller is gone: so is the job
                log.error("rollout worker %d: the controller at %s:%d is gone; exiting", index, host, port)
                os._exit(1)
            stop.wait(HEARTBEAT_S)

    threading.Thread(target=beat, name="rollout-heartbeat", daemon=True).start()
    store.set(f"hello/{index}", dump_message({"host": socket.gethostname(), "pid": os.getpid(), "device": str(device)}))
    group = open_weights_group(store, index + 1, int(store.get("group_size")), device, timeout_s)
    version, seq = -1, 0
    log.info("rollout worker %d connected to %s:%d", index, host, port)
    try:
        while True:
            key = f"cmd/{index}/{seq}"
            while not store.check([key]):  # (raises once the controller is gone)
                time.sleep(POLL_S)
            msg = pickle.loads(store.get(key))
            store.delete_key(key)
            reply = f"{index}/{seq}"
            seq += 1
            if msg["op"] == "stop":
                return 0
            if msg["op"] == "weights":
                tensors = {}
                for name, shape, dtype in msg["manifest"]:
                    buf = torch.empty(shape, dtype=dtype, device=device)
                    group.recv([buf], 0, 0).wait()
                    tensors[name] = buf
                if spec_matches(os.environ.get(FAULT_ENV), "corrupt_weights", msg["version"]):
                    first = tensors[msg["manifest"][0][0]].view(-1)  # a bit flipped on the way (a test)
                    first[0] = -first[0] if first[0] != 0 else 1
                try:
                    checksum = bits_checksum(tensors)
                    load_weights(tensors)
                    version = msg["version"]
                    store.set(f"ack/{reply}", dump_message({"version": version, "checksum": checksum}))
                except Exception as exc:  # noqa: BLE001 - reported to the controller
                    store.set(f"ack/{reply}", dump_message({"error": f"{type(exc).__name__}: {exc}"}))
                del tensors
                continue
            item: RolloutItem = msg["item"]
            t0 = time.perf_counter()
            try:
                if version != item.version:
                    raise RolloutWorkerError(f"asked for step {item.step} with weights version {item.version} "
                                             f"but holds version {version}")
                batch = generate(item, version)
                res = RolloutResult(item=item, version=version, batch=batch_to_host(batch), worker=index,
                                    generate_s=time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 - reported to the controller
                log.exception("rollout worker %d: generating step %d failed", index, item.step)
                res = f"{type(exc).__name__}: {exc}"
            store.set(f"res/{reply}", dump_message(res))
    finally:
        stop.set()


__all__ = ["ADDRESS_FILE", "HEARTBEAT_S", "POLL_S", "RolloutItem", "RolloutResult", "RolloutWorkerError",
           "EPISODES_FIELD", "batch_from_host", "batch_from_json", "batch_to_host", "batch_to_json", "bits_checksum",
           "dump_message", "episode_from_json", "episode_to_json",
           "open_weights_group", "read_address", "result_from_json", "result_to_json", "serve_rollout_worker",
           "write_address"]
