"""The multi-rank test harness starts the ranks again on a new port when the rendezvous port
it picked was taken in between (EADDRINUSE), and only then."""

from __future__ import annotations

import pytest

import tests.distributed.harness as harness


def test_eaddrinuse_is_retried_and_other_errors_are_not(monkeypatch):
    calls = []

    def flaky(fn, world_size, **kw):
        calls.append(world_size)
        if len(calls) == 1:
            raise RuntimeError("DistNetworkError: ... code: -98, name: EADDRINUSE, message: address already in use")
        return ["ok"] * world_size

    monkeypatch.setattr(harness, "_run_ranks_once", flaky)
    assert harness.run_ranks(print, world_size=2) == ["ok", "ok"] and calls == [2, 2]

    def broken(fn, world_size, **kw):
        calls.append(world_size)
        raise RuntimeError("--- rank 0 ---\nAssertionError")

    calls.clear()
    monkeypatch.setattr(harness, "_run_ranks_once", broken)
    with pytest.raises(RuntimeError, match="AssertionError"):
        harness.run_ranks(print, world_size=1)
    assert calls == [1]

    def always_taken(fn, world_size, **kw):
        calls.append(world_size)
        raise RuntimeError("EADDRINUSE")

    calls.clear()
    monkeypatch.setattr(harness, "_run_ranks_once", always_taken)
    with pytest.raises(RuntimeError, match="EADDRINUSE"):
        harness.run_ranks(print, world_size=1)
    assert len(calls) == harness.PORT_ATTEMPTS
