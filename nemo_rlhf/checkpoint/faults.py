"""Deterministic fault injection for recovery and verification tests.

``NEMO_RLHF_CRASH_AT=<point>:<step>`` makes the process ``SIGKILL`` itself when it reaches
``point`` during step ``step`` (points: ``rollout``, ``update``, ``save_written`` -- after
the shards are written, before publication -- and ``save_published`` -- after the rename,
before ``latest`` is updated).

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
import signal

ENV = "NEMO_RLHF_CRASH_AT"
FAULT_ENV = "NEMO_RLHF_FAULT"
FAULTS = ("change_after_digest", "overwrite_shard", "enospc", "enospc_publish")


def _matches(spec: str | None, point: str, step: int) -> bool:
    if not spec:
        return False
    want_point, _, want_step = spec.partition(":")
    return want_point == point and int(want_step) == int(step)


def maybe_crash(point: str, step: int) -> None:
    """Kill this process with SIGKILL if ``NEMO_RLHF_CRASH_AT`` names this point and step."""
    if _matches(os.environ.get(ENV), point, step):
        os.kill(os.getpid(), signal.SIGKILL)


def fault_requested(fault: str, step: int) -> bool:
    """Whether ``NEMO_RLHF_FAULT`` asks for ``fault`` (one of :data:`FAULTS`) at this step."""
    return _matches(os.environ.get(FAULT_ENV), fault, step)
