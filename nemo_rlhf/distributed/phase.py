"""The phase of the step this rank is in, and what a collective that fails says.

The trainer marks its phases (:func:`in_phase` on its methods, or :func:`current_phase`):
``rollout``, ``reward``, ``forward`` (old / reference log-probs and values), ``advantages``,
``update``, ``metrics``, ``save``, ``eval``. When a collective inside one times out (a peer
hung: gloo raises after ``parallel.timeout_minutes``, NCCL's wait does under
``TORCH_NCCL_BLOCKING_WAIT=1``) or loses its peer (a rank died: gloo raises at once), the
backend's error is re-raised as :class:`CollectiveError` naming this rank, the phase, the
step and the timeout::

    rank 0 of 2: a collective in phase 'update' (step 3) did not complete within
    parallel.timeout_minutes=0.1 (6 s): another rank hung or died (...)

A hung rank is the one whose log does not show the message (its own last phase is in its
log when it was injected). :func:`collective_errors` does the same for collectives
outside any phase (the loop's signal flag, the guard's broadcast), naming the last phase.

Not covered: NCCL's watchdog, when it tears a process down after the timeout (the default
without ``TORCH_NCCL_BLOCKING_WAIT``), prints its own message; no Python code runs then.
The fault hook ``NEMO_RLHF_FAULT=hang_<phase>:<step>[:rank<r>]``
(:func:`nemo_rlhf.distributed.fault_spec.maybe_hang`) hangs a rank on entering a phase.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Optional

from nemo_rlhf.distributed.fault_spec import maybe_hang

PHASES = ("rollout", "reward", "forward", "advantages", "update", "metrics", "save", "eval")

_state: dict = {"current": None, "last": None, "timeout_minutes": None}

TIMEOUT_MARKS = ("Timed out waiting", "Application timeout caused pair closure",
                 "Watchdog caught collective operation timeout", "collective operation timeout")
"""Substrings of gloo's / NCCL's timeout errors."""
PEER_LOST_MARKS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""Substrings of gloo's errors when a peer process is gone (only with ``gloo`` in the
message or a ``torch.distributed`` error type: an HTTP client says the same words)."""


class CollectiveError(RuntimeError):
    """A collective timed out or lost a peer; the message names the rank, phase and step."""


def set_timeout_minutes(minutes: float) -> None:
    """Record ``parallel.timeout_minutes`` (:func:`initialize_distributed`) for the messages."""
    _state["timeout_minutes"] = float(minutes)


def phase() -> Optional[tuple[str, int]]:
    """``(phase, step)`` this rank is in, or None outside the tracked phases."""
    return _state["current"]


@contextmanager
def current_phase(name: str, step: int):
    """Mark ``name`` (one of :data:`PHASES`) of step ``step`` as this rank's phase; a
    collective error inside is re-raised as :class:`CollectiveError`."""
    if name not in PHASES:
        raise ValueError(f"phase {name!r}: valid phases are {list(PHASES)}")
    outer = _state["current"]
    _state["current"] = _state["last"] = (name, int(step))
    try:
        maybe_hang(name, int(step))
        yield
    except Exception as exc:
        err = translate(exc, name, int(step))
        if err is None:
            raise
        raise err from exc
    finally:
        _state["current"] = outer


def in_phase(name: str, step_offset: int = 1) -> Callable:
    """Decorator of a trainer method: runs it in phase ``name`` of step
    ``self.step + step_offset`` (1 during a step, before the loop counts it; 0 for the
    save and evaluation after it)."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            with current_phase(name, self.step + step_offset):
                return fn(self, *args, **kwargs)
        return wrapper

    return decorate


@contextmanager
def collective_errors():
    """Around a whole job: a collective error outside the tracked phases is re-raised as
    :class:`CollectiveError` naming the last phase."""
    try:
        yield
    except Exception as exc:
        last = _state["last"]
        err = translate(exc, None if last is None else last[0], None if last is None else last[1],
                        outside=True)
        if err is None:
            raise
        raise err from exc


def _kind(exc: BaseException) -> Optional[str]:
    if isinstance(exc, CollectiveError) or not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if any(m in text for m in TIMEOUT_MARKS):
        return "timeout"
    try:
        import torch.distributed as dist

        dist_error = isinstance(exc, getattr(dist, "DistError", ()))
    except ImportError:  # pragma: no cover
        dist_error = False
    if any(m in text for m in PEER_LOST_MARKS) and ("gloo" in text or dist_error):
        return "peer"
    return None


def translate(exc: BaseException, name: Optional[str], step: Optional[int],
              outside: bool = False) -> Optional[CollectiveError]:
    """The :class:`CollectiveError` for a backend's collective error ``exc``, or None when
    ``exc`` is something else."""
    kind = _kind(exc)
    if kind is None:
        return None
    import torch.distributed as dist

    if dist.is_initialized():
        who = f"rank {dist.get_rank()} of {dist.get_world_size()}"
    else:
        who = "this rank"
    where = (f"phase {name!r} (step {step})" if name is not None else "set-up")
    where = f"a collective after {where}, outside the tracked phases," if outside else \
        f"a collective in {where}"
    first = (str(exc).strip().splitlines() or [repr(exc)])[0][:300]
    minutes = _state["timeout_minutes"]
    if kind == "timeout":
        limit = (f"parallel.timeout_minutes={minutes:g} ({minutes * 60:g} s)" if minutes is not None
                 else "the process group timeout")
        return CollectiveError(f"{who}: {where} did not complete within {limit}: another rank hung "
                               f"or died (the one whose log lacks this message) [{first}]")
    return CollectiveError(f"{who}: {where} failed: another rank died or closed its connection "
                           f"(its log or exit status says why) [{first}]")


__all__ = ["CollectiveError", "PHASES", "collective_errors", "current_phase", "in_phase", "phase",
           "set_timeout_minutes", "translate"]
