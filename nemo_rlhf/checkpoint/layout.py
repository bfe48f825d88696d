"""A checkpoint on disk: its folder layout, and finding, reading and verifying one.

Layout of ``<root>/step_<N>/``::

    dist/                  megatron dist_checkpointing: model (incl. value/reward head) and
                           optimizer state (Adam moments, fp32 masters; or megatron's
                           DistributedOptimizer's own layout) as sharded tensors, so a
                           checkpoint written at one TP/PP/DP loads at another
    rng/rank_<r>.pt        python, numpy, torch and megatron TP-tracker RNG states per rank
                           (:mod:`.rng`)
    trainer_state.json     counters, sampler position, KL controller, reward stats, ...
    config.yaml            the run's resolved config
    metadata.json          step, parallel layout, fingerprint, optimizer format and Adam
                           step counts (per parameter, by layout-independent name), the
                           files' sizes and sha256
    digests/rank_<r>.json  sha256 of every tensor shard rank r wrote, taken from memory
                           (:mod:`.digests`); the written shards are read back and compared
                           before publication
    tokenizer/             a copy of the run's tokenizer files
    COMPLETE               written last, before the rename

``<root>/latest`` is a one-line text file naming the newest published ``step_<N>``. A folder
without ``COMPLETE`` is never picked (:func:`find_latest_checkpoint`). Writing and loading
the tensors: :mod:`.io`.

Nothing here needs megatron or a process group: the offline tools (``nemo-rlhf-ckpt``) and
the launchers read checkpoints through this module alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from nemo_rlhf.checkpoint.digests import DIGESTS_SUBDIR

class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not match the run."""


COMPLETE = "COMPLETE"


LATEST = "latest"


TOKENIZER_SUBDIR = "tokenizer"
"""Folder of a checkpoint holding a copy of the run's tokenizer files
(:data:`TOKENIZER_FILES`): a checkpoint moved to another folder, filesystem or cluster
still has its tokenizer (:func:`checkpoint_tokenizer_dir`)."""


TOKENIZER_FILES = ("tokenizer.json", "special_tokens.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja")
"""The files of a tokenizer folder that :class:`~nemo_rlhf.data.tokenizer.Tokenizer` and the
HF export read (those present are copied; nothing else of the folder, e.g. model weights)."""


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def step_dir(root: Path, step: int) -> Path:
    """``<root>/step_<step>``."""
    return Path(root) / f"step_{int(step)}"


def is_complete(path: Path) -> bool:
    """Whether ``path`` is a published checkpoint (has the COMPLETE marker)."""
    return (Path(path) / COMPLETE).is_file()


def list_checkpoints(root: Path) -> list[tuple[int, Path, bool]]:
    """``(step, path, complete)`` for every ``step_<N>`` folder under ``root``, by step."""
    root = Path(root)
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit():
                out.append((int(p.name[5:]), p, is_complete(p)))
    return sorted(out)


def find_latest_checkpoint(root: Path) -> Optional[Path]:
    """Newest complete checkpoint under ``root`` (``latest`` if it is valid), else None."""
    root = Path(root)
    latest = root / LATEST
    complete = [p for _, p, ok in list_checkpoints(root) if ok]
    if latest.is_file():
        named = root / latest.read_text().strip()
        if is_complete(named) and (not complete or named == complete[-1]):
            return named
    return complete[-1] if complete else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder: ``path`` itself if complete, else the newest one under it, else
    the newest one under ``path/checkpoints`` (an experiment folder).

    Raises:
        FileNotFoundError: no complete checkpoint at or under ``path``.
    """
    path = Path(path)
    if is_complete(path):
        return path
    found = find_latest_checkpoint(path) or find_latest_checkpoint(path / "checkpoints")
    if found is None:
        raise FileNotFoundError(f"{path}: neither a complete checkpoint nor a folder holding one")
    return found


def read_metadata(path: Path) -> dict:
    """``metadata.json`` of a checkpoint.

    Raises:
        CheckpointError: not a complete checkpoint.
    """
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path}: not a complete checkpoint (no {COMPLETE} marker)")
    return json.loads((path / "metadata.json").read_text())


def read_trainer_state(path: Path) -> dict:
    """``trainer_state.json`` of a checkpoint."""
    return json.loads((Path(path) / "trainer_state.json").read_text())


def checkpoint_content_hash(path: Path) -> str:
    """The first 16 hex digits of a SHA-256 over a checkpoint's recorded file checksums
    (``metadata.json`` ``files``): the same for a copy anywhere, independent of the layout
    it is loaded at; another for any changed shard."""
    files = read_metadata(path).get("files") or {}
    digest = hashlib.sha256(json.dumps(sorted((k, v[1]) for k, v in files.items())).encode())
    return digest.hexdigest()[:16]


def checkpoint_tokenizer_dir(path: Path, saved: Optional[str] = None) -> Optional[str]:
    """The tokenizer folder of the checkpoint at ``path``: its own copy
    (``path/tokenizer``, written by :func:`save_checkpoint`) when there is one, else the
    config's ``data.tokenizer_dir`` (``saved``; checkpoints from before the copy) if it is a
    folder here, else ``<path's parent>/tokenizer`` (``import-hf``'s layout), else None.

    Args:
        path: a checkpoint folder (``step_<N>``).
        saved: ``data.tokenizer_dir`` of its ``config.yaml`` (absolute, or relative to the
            working directory of the run that wrote it).
    """
    path = Path(path)
    if (path / TOKENIZER_SUBDIR / "tokenizer.json").is_file():
        return str(path / TOKENIZER_SUBDIR)
    for candidate in (Path(saved) if saved else None, path.parent / TOKENIZER_SUBDIR):
        if candidate is not None and candidate.is_dir():
            return str(candidate)
    return None


def copy_tokenizer(config: Optional[dict], ckpt: Path) -> None:
    """Copy the :data:`TOKENIZER_FILES` of ``config["data"]["tokenizer_dir"]`` (when it names
    a folder holding ``tokenizer.json``) into ``ckpt/tokenizer``."""
    src = ((config or {}).get("data") or {}).get("tokenizer_dir")
    if not src or not (Path(src) / "tokenizer.json").is_file():
        return
    dst = ckpt / TOKENIZER_SUBDIR
    dst.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, dst / name)


def file_checksums(path: Path) -> dict[str, list]:
    """``{relative path: [size in bytes, sha256 hex]}`` of the shard, RNG, digest and
    tokenizer files."""
    out = {}
    for sub in ("dist", "rng", DIGESTS_SUBDIR, TOKENIZER_SUBDIR):
        for f in sorted((Path(path) / sub).rglob("*")):
            if f.is_file():
                h = hashlib.sha256()
                with open(f, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 22), b""):
                        h.update(chunk)
                out[str(f.relative_to(path))] = [f.stat().st_size, h.hexdigest()]
    return out


def verify_checkpoint(path: Path) -> list[str]:
    """Problems found in a checkpoint's files (empty list: every file present and intact).

    Compares each file listed in ``metadata.json`` with its recorded size and sha256, and
    reports files that are missing, truncated, changed, or unlisted.
    """
    path = Path(path)
    try:
        meta = read_metadata(path)
    except (CheckpointError, ValueError) as exc:
        return [str(exc)]
    recorded = meta.get("files")
    if recorded is None:
        return [f"{path}: metadata.json has no file checksums"]
    problems = []
    for rel, (size, digest) in recorded.items():
        f = path / rel
        if not f.is_file():
            problems.append(f"missing shard {rel}")
            continue
        actual = f.stat().st_size
        if actual != size:
            problems.append(f"{rel}: size {actual} bytes, expected {size} (truncated or grown)")
            continue
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        if h.hexdigest() != digest:
            problems.append(f"{rel}: checksum mismatch (content changed)")
    return problems

