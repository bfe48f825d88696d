"""Fixtures of the e2e tests: ``forked_python`` and ``forked_python_in_session``, the
``python -m MODULE`` processes a test (or the launcher it runs) starts are forks of an
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


@pytest.fixture(scope="module")
def forked_python_in_session(tmp_path_factory):
    """For a whole module (its module-scoped fixtures included, when they request it):
    ``sys.executable`` is the shim of a server with the environment of
    :func:`tests.ppo_helpers.start_in_session` (one OMP thread, no ``NEMO_RLHF_*``), whose
    jobs it forks (``NEMO_RLHF_CRASH_AT`` is read when the crash point is reached: a job may
    set it). Returns the shim's path."""
    from tests.ppo_helpers import session_env

    with PythonForkServer(session_env(), tmp_path_factory.mktemp("fork_python_session")) as server, \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "executable", server.shim)
        yield server.shim
