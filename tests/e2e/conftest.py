"""Fixtures of the e2e tests: ``forked_python``, the stages of a launcher run as forks of an
interpreter that has imported torch and megatron once (tests/fork_python.py)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.fork_python import PythonForkServer


@pytest.fixture(scope="package")
def _python_fork_server(tmp_path_factory):
    """One server for the e2e tests that use ``forked_python`` (its environment: the first
    such test's; a job whose start-up environment differs runs in a fresh interpreter)."""
    with PythonForkServer(dict(os.environ), tmp_path_factory.mktemp("fork_python")) as server:
        yield server


@pytest.fixture
def forked_python(_python_fork_server, monkeypatch):
    """For this test, ``sys.executable`` is the fork server's shim: a ``[sys.executable, "-m",
    MODULE, ...]`` the code under test starts is a fork of the preloaded server that behaves
    as that process would (cwd, environment, argv, pipes, exit code, signals to its group).
    Returns the shim's path."""
    monkeypatch.setattr(sys, "executable", _python_fork_server.shim)
    return _python_fork_server.shim
