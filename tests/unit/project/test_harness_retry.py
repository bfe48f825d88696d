"""The multi-rank test harness starts the ranks again on a new port when the rendezvous port
it picked was taken in between (EADDRINUSE), and only then; its ranks (forked from a
forkserver on CPU) see the caller's environment and folder at each call."""

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


def _where(rank: int) -> tuple:
    import os

    return os.environ.get("HARNESS_PROBE"), os.getcwd(), os.environ["RANK"]


def test_a_rank_sees_the_callers_environment_and_folder_at_the_call(monkeypatch, tmp_path):
    """The ranks are forked from a forkserver started at the first call (on CPU): they must
    still see the environment and working directory as they are at each call, as spawned
    ranks would."""
    monkeypatch.delenv("HARNESS_PROBE", raising=False)
    assert harness.run_ranks(_where, world_size=1)[0][0] is None  # the server is running now
    monkeypatch.setenv("HARNESS_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    assert harness.run_ranks(_where, world_size=2) == [
        ("set after the server started", str(tmp_path), "0"), ("set after the server started", str(tmp_path), "1")]
