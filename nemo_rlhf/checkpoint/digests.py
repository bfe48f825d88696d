"""Tensor digests: a checkpoint proven to hold what the model held.

File checksums (``metadata.json``'s ``files``) prove that the files are the ones written; they
say nothing about whether the bytes written were the tensors the trainer had (a stale buffer,
a shard written from the wrong rank or a storage layer returning other data would all be
checksummed faithfully). So :func:`~nemo_rlhf.checkpoint.io.save_checkpoint` also takes, from
memory, a sha256 of every tensor shard it saves (model with its value / reward head, a separate
critic, Adam moments, fp32 masters), writes them to ``digests/rank_<r>.json``, reads the written
shards back and compares before the checkpoint is published; ``nemo-rlhf-ckpt validate --deep``
recomputes them offline from the unsharded tensors.

What is digested: every ``ShardedTensor`` this rank writes (its main replicas; a DP replica
is written, and digested, once). Not digested (covered by the file checksums only): the
``ShardedObject`` entries (optimizer hyper-parameters, megatron's extra state) and the RNG
files, which are written from host objects in one step.

Cost: one sha256 of each shard's bytes at save (threads; a device tensor is copied to the
host one at a time) and one more after reading the shards back, so the bytes are hashed
twice and read once more (just written: usually from the page cache). The read-back streams
one shard per thread through the checkpoint's own index, with no collective
(``exp_manager.verify_after_save=false`` turns it off; the digests are still written).
Measured by ``benchmarks/bench_checkpoint_verify.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

DIGESTS_SUBDIR = "digests"
"""Folder of a checkpoint holding ``rank_<r>.json``: the digests of the shards rank ``r`` wrote."""


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 hex of a tensor's bytes in row-major order (its dtype's bit patterns: two
    tensors have the same digest iff they are bit-identical with the same dtype and numel).
    A device tensor is copied to the host first."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def entry_name(entry: dict) -> str:
    """``key`` and, for a shard of a larger tensor, its offset: how an error names a tensor."""
    offset = entry["offset"]
    return entry["key"] if not any(offset) else f"{entry['key']} (shard at offset {tuple(offset)})"


def shard_digests(sharded: dict) -> tuple[list, list[dict]]:
    """The ShardedTensors of ``sharded`` this rank writes, and their digests taken now.

    ``sharded`` is the dict given to megatron's ``dist_checkpointing.save``; its factories
    are applied in place first (as the save itself does: the same tensors are written).

    Returns:
        ``(tensors, entries)``: entry ``i`` describes ``tensors[i]``: ``key``, ``offset`` (its
        global offset, prepended axes included), ``prepend``, ``shape`` (local), ``dtype``
        and ``sha256``.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    apply_factories(sharded)
    tensors = [v for v in nested_values(sharded)
               if isinstance(v, ShardedTensor) and v.data is not None and is_main_replica(v.replica_id)]
    with ThreadPoolExecutor(_workers()) as pool:
        digests = list(pool.map(lambda st: tensor_digest(st.data), tensors))
    entries = [{"key": st.key, "offset": [int(x) for x in st.global_offset], "prepend": int(st.prepend_axis_num),
                "shape": [int(x) for x in st.local_shape], "dtype": str(st.data.dtype).removeprefix("torch."),
                "sha256": d} for st, d in zip(tensors, digests)]
    return tensors, entries


def write_rank_digests(ckpt: Path, rank: int, entries: list[dict]) -> None:
    """Write ``ckpt/digests/rank_<rank>.json``."""
    folder = Path(ckpt) / DIGESTS_SUBDIR
    folder.mkdir(exist_ok=True)
    (folder / f"rank_{rank}.json").write_text(json.dumps(entries))


def read_digests(ckpt: Path) -> Optional[list[dict]]:
    """Every rank's digest entries of a checkpoint; None if it has none (written before
    digests were taken).

    Raises:
        ValueError: a digest file is not valid JSON (names the file).
    """
    folder = Path(ckpt) / DIGESTS_SUBDIR
    files = sorted(folder.glob("rank_*.json")) if folder.is_dir() else []
    if not files:
        return None
    out = []
    for f in files:
        try:
            out += json.loads(f.read_text())
        except ValueError as exc:
            raise ValueError(f"{f}: not valid JSON ({exc})") from None
    return out


def read_back_problems(entries: list[dict], dist_dir: Path) -> list[str]:
    """Read the shards of ``entries`` back from the written checkpoint ``dist_dir`` and
    compare each with its digest.

    Each shard is read as a load would read it (the storage item that the checkpoint's own
    index, ``.metadata``, names for the tensor key and offset), one at a time per thread: no
    collective, and no host copy of the whole state.

    Returns:
        One line per shard whose bytes on disk differ from its digest or that cannot be read
        (naming the tensor); empty: all match.
    """
    import io

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    dist_dir = Path(dist_dir)
    try:
        storage = FileSystemReader(str(dist_dir)).read_metadata().storage_data
    except Exception as exc:  # noqa: BLE001 - any failure to read the index is the finding
        return [f"{dist_dir}/.metadata: unreadable ({type(exc).__name__}: {exc})"]

    def check(e: dict) -> Optional[str]:
        info = storage.get(MetadataIndex(e["key"], torch.Size(e["offset"])))
        if info is None:
            return f"{entry_name(e)}: saved, but not in the written checkpoint's index"
        if info.transform_descriptors:
            return f"{entry_name(e)}: stored with transforms {list(info.transform_descriptors)} (not verifiable here)"
        try:
            with open(dist_dir / info.relative_path, "rb") as fh:
                fh.seek(info.offset)
                raw = fh.read(info.length)
            t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - an unreadable shard is the finding
            return f"{entry_name(e)}: unreadable in {info.relative_path} ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        d = tensor_digest(t)
        if d != e["sha256"] or t.numel() != math.prod(e["shape"]):
            return f"{entry_name(e)}: on disk sha256 {d[:12]}..., in memory at save {e['sha256'][:12]}..."
        return None

    with ThreadPoolExecutor(_workers()) as pool:
        return [x for x in pool.map(check, entries) if x]


def deep_problems(ckpt: Path, full: dict) -> list[str]:
    """Recompute a checkpoint's digests from its unsharded tensors (``full``: ``{key:
    tensor}``, :func:`~nemo_rlhf.checkpoint.io.load_full_tensors`) and compare.

    Returns:
        One line per shard that differs or is missing, or one line saying the checkpoint has
        no digests; empty: every saved tensor is what the trainer held at save.
    """
    try:
        entries = read_digests(ckpt)
    except ValueError as exc:
        return [str(exc)]
    if entries is None:
        return [f"no {DIGESTS_SUBDIR}/ (a checkpoint written before tensor digests): nothing to compare"]

    def check(e: dict) -> Optional[str]:
        t = full.get(e["key"])
        if t is None:
            return f"{entry_name(e)}: digested at save, not in the checkpoint"
        p, off, shape = e["prepend"], e["offset"], e["shape"]
        index = tuple(off[:p]) + tuple(slice(o, o + s) for o, s in zip(off[p:], shape))
        try:
            piece = t[index]
        except IndexError:
            return f"{entry_name(e)}: shape {tuple(shape)} at that offset is outside the saved {tuple(t.shape)}"
        if str(piece.dtype).removeprefix("torch.") != e["dtype"] or list(piece.shape) != list(shape):
            return f"{entry_name(e)}: saved as {piece.dtype} {tuple(piece.shape)}, digested as {e['dtype']} {tuple(shape)}"
        d = tensor_digest(piece)
        if d != e["sha256"]:
            return f"{entry_name(e)}: sha256 {d[:12]}..., in memory at save {e['sha256'][:12]}..."
        return None

    with ThreadPoolExecutor(_workers()) as pool:
        return [x for x in pool.map(check, entries) if x]
