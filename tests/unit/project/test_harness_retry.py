"""The multi-rank test harness starts the ranks again on a new port when the rendezvous port
it picked was taken in between (EADDRINUSE), and only then."""

from __future__ import annotations

import pytest

import tests.distributed.harness as harness


def _fails(messages: list[str], calls: list[int]):
    """A stand-in for one start of the ranks: raises the next message, then succeeds."""
    def run_once(fn, world_size, **kw):
        calls.append(world_size)
        if len(calls) <= len(messages):
            raise RuntimeError(messages[len(calls) - 1])
        return ["ok"] * world_size

    return run_once


def test_eaddrinuse_is_retried_and_other_errors_are_not(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(harness, "_run_ranks_once", _fails(["code: -98, name: EADDRINUSE"], calls))
    assert harness.run_ranks(print, world_size=2) == ["ok", "ok"] and calls == [2, 2]

    calls.clear()
    monkeypatch.setattr(harness, "_run_ranks_once", _fails(["--- rank 0 ---\nAssertionError"], calls))
    with pytest.raises(RuntimeError, match="AssertionError"):
        harness.run_ranks(print, world_size=1)
    assert calls == [1]

    calls.clear()
    monkeypatch.setattr(harness, "_run_ranks_once", _fails(["EADDRINUSE"] * harness.PORT_ATTEMPTS, calls))
    with pytest.raises(RuntimeError, match="EADDRINUSE"):
        harness.run_ranks(print, world_size=1)
    assert len(calls) == harness.PORT_ATTEMPTS
