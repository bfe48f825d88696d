"""Fixtures of the unit tests: ``entry_point_python``, an interpreter whose ``python -m``
entry-point runs are forks of one that has imported torch, megatron and the three trainers
(``tests/fork_python.py``), for the tests that check what an entry point does with a bad
command line or config (``tests/unit/test_entry_points.py``,
``tests/unit/config/test_renamed_keys.py``)."""

from __future__ import annotations

import os

import pytest

ENTRY_POINTS = ("nemo_rlhf.train_ppo", "nemo_rlhf.train_sft", "nemo_rlhf.train_rm")
"""What the ``entry_point_python`` server imports before it forks a job."""


@pytest.fixture(scope="session")
def entry_point_python(tmp_path_factory):
    """The shim of a :class:`~tests.fork_python.PythonForkServer` (this session's environment
    when first requested; torch and :data:`ENTRY_POINTS` preloaded): ``[shim, "-m", MODULE,
    ...]`` behaves as ``[sys.executable, "-m", MODULE, ...]`` (working directory,
    environment, argv, stdout and stderr, exit code) without re-importing them, about 6 s
    of CPU per run. A run whose start-up environment differs from the server's is run by
    the real interpreter instead (``tests/fork_python.py``). Returns the shim's path."""
    from tests.fork_python import PythonForkServer

    with PythonForkServer(dict(os.environ), tmp_path_factory.mktemp("fork_python_unit"),
                          preload=("torch", *ENTRY_POINTS)) as server:
        yield server.shim
