"""Deterministic crash injection for recovery tests.

``NEMO_RLHF_CRASH_AT=<point>:<step>`` makes the process ``SIGKILL`` itself when it reaches
``point`` during step ``step`` (points: ``rollout``, ``update``, ``save_written`` -- after
the shards are written, before publication -- and ``save_published`` -- after the rename,
before ``latest`` is updated). Unset in normal runs: a no-op.
"""

from __future__ import annotations

import os
import signal

ENV = "NEMO_RLHF_CRASH_AT"


def maybe_crash(point: str, step: int) -> None:
    """Kill this process with SIGKILL if ``NEMO_RLHF_CRASH_AT`` names this point and step."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want_point, _, want_step = spec.partition(":")
    if want_point == point and int(want_step) == int(step):
        os.kill(os.getpid(), signal.SIGKILL)
