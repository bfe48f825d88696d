"""Deterministic fault injection for recovery and verification tests.

``NEMO_RLHF_CRASH_AT=<point>:<step>`` makes the process ``SIGKILL`` itself when it reaches
``point`` during step ``step`` (points: ``rollout``, ``update``, ``save_shards`` -- before
this rank writes its shards, the others writing theirs --, ``save_written`` -- after
the shards are written, before publication -- and ``save_published`` -- after the rename,
before ``latest`` is updated).

Both take an optional third field, ``rank<r>`` (e.g. ``save_written:2:rank1``): only global
rank ``r`` acts (a multi-rank run where one rank of several is killed); without it every
rank does.

``NEMO_RLHF_FAULT=hang_<phase>:<step>[:rank<r>]`` makes the rank sleep forever when it
enters ``phase`` (:mod:`nemo_rlhf.distributed.phase`: ``rollout``, ``reward``, ``forward``,
``advantages``, ``update``, ``metrics``, ``save``, ``eval``) of step ``step``: a hung rank,
which the others' collectives must report within ``parallel.timeout_minutes``.

``NEMO_RLHF_FAULT=<fault>:<step>`` plants a silent fault in the save of step ``step``
(:func:`fault_requested`): ``change_after_digest`` changes one saved tensor in memory after
its digest was taken and before it is written (a buffer modified under the save);
``overwrite_shard`` overwrites bytes in the middle of a written shard file before the read-back
(a storage layer returning other data); ``enospc`` fails this rank's part of the write with
``OSError(ENOSPC)`` after the shards, ``enospc_publish`` fails rank 0's metadata write the
same way (a full disk). Unset in normal runs: no-ops.
"""

from __future__ import annotations

import os
from pathlib import Path
import signal

import torch

from nemo_rlhf.distributed.fault_spec import FAULT_ENV, spec_matches as _matches

ENV = "NEMO_RLHF_CRASH_AT"
FAULTS = (  # and hang_<phase> (maybe_hang, in nemo_rlhf.distributed.fault_spec)
    "change_after_digest", "overwrite_shard", "enospc", "enospc_publish")


def maybe_crash(point: str, step: int) -> None:
    """Kill this process with SIGKILL if ``NEMO_RLHF_CRASH_AT`` names this point and step."""
    if _matches(os.environ.get(ENV), point, step):
        os.kill(os.getpid(), signal.SIGKILL)


def fault_requested(fault: str, step: int) -> bool:
    """Whether ``NEMO_RLHF_FAULT`` asks for ``fault`` (one of :data:`FAULTS`) at this step."""
    return _matches(os.environ.get(FAULT_ENV), fault, step)



def plant_change(tensors: list) -> None:
    """Fault ``change_after_digest``: add 1 to the first element of the first floating
    tensor this rank saves (after its digest was taken)."""
    for st in tensors:
        if st.data.is_floating_point() and st.data.numel():
            with torch.no_grad():
                st.data.view(-1)[0] += 1
            return


def plant_overwrite(dist_dir: Path) -> None:
    """Fault ``overwrite_shard``: overwrite 64 bytes at the middle of the largest shard file."""
    files = sorted(Path(dist_dir).glob("*.distcp"), key=lambda f: f.stat().st_size)
    if files:
        with open(files[-1], "r+b") as fh:
            fh.seek(files[-1].stat().st_size // 2)
            fh.write(bytes(range(64)))

