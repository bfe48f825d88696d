"""The fault hooks' environment grammar, shared by :mod:`nemo_rlhf.checkpoint.faults` and
:mod:`nemo_rlhf.distributed.phase`: ``<point>:<step>[:rank<r>]``.

The optional ``rank<r>`` makes only global rank ``r`` act (one rank of several); without
it every rank does. ``NEMO_RLHF_FAULT=hang_<phase>:<step>[:rank<r>]`` (:func:`maybe_hang`)
makes the rank sleep forever on entering that phase of that step. Unset: no-ops.
"""

from __future__ import annotations

import logging
import os
import time

FAULT_ENV = "NEMO_RLHF_FAULT"


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def spec_matches(spec: str | None, point: str, step: int) -> bool:
    """Whether ``spec`` (``<point>:<step>[:rank<r>]``) names this point, step and rank.

    Raises:
        ValueError: a third field that is not ``rank<r>``.
    """
    if not spec:
        return False
    want_point, _, rest = spec.partition(":")
    want_step, _, want_rank = rest.partition(":")
    if want_point != point or int(want_step) != int(step):
        return False
    if want_rank:
        if not want_rank.startswith("rank") or not want_rank[4:].isdigit():
            raise ValueError(f"{spec!r}: the optional third field is rank<r>, e.g. {point}:{step}:rank1")
        return int(want_rank[4:]) == _rank()
    return True


def maybe_hang(phase: str, step: int) -> None:
    """Sleep forever if ``NEMO_RLHF_FAULT=hang_<phase>:<step>[:rank<r>]`` names this phase,
    step and rank (a rank that hangs; the process stays alive, its peers wait on it)."""
    if spec_matches(os.environ.get(FAULT_ENV), f"hang_{phase}", step):
        logging.getLogger("nemo_rlhf").warning(
            "rank %d hangs in phase %r of step %d (injected: %s)", _rank(), phase, step, FAULT_ENV)
        while True:
            time.sleep(3600)
