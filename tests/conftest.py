"""Suite-wide test contract: the device that device-parametrised tests run on.

Tests marked ``@pytest.mark.device`` build their tensors on the ``test_device`` fixture,
which is the device named by the environment variable ``NEMO_RLHF_TEST_DEVICE``
(:data:`DEVICE_ENV`; default ``cpu``). On a GPU machine
``NEMO_RLHF_TEST_DEVICE=cuda pytest -m device`` runs them on the GPU (what
``benchmarks/gpu_check.py`` does); everywhere else they run on the host like any test.

Rules, checked here so that ``-m device`` selects exactly the tests that use a device:

* a test that requests ``test_device`` must carry the ``device`` marker (collection error
  otherwise, naming the test);
* a device the machine does not have (``NEMO_RLHF_TEST_DEVICE=cuda`` without CUDA, a
  malformed name) stops the session at start-up with a usage error: it is never turned
  into skips, which would let a GPU check pass without running anything on the GPU.

Multi-rank tests (``tests/distributed/harness.py``) are not affected: they pick their
device from the world size and the GPUs present (see ``run_ranks``).
"""

from __future__ import annotations

import os

import pytest

DEVICE_ENV = "NEMO_RLHF_TEST_DEVICE"
"""Environment variable naming the device of ``@pytest.mark.device`` tests (``cpu``,
``cuda``, ``cuda:1``, ...)."""

_DEVICE_KEY = pytest.StashKey()


def _configured_device():
    import torch

    name = os.environ.get(DEVICE_ENV, "cpu").strip() or "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise pytest.UsageError(f"{DEVICE_ENV}={name!r} is not a torch device name "
                                f"(cpu, cuda, cuda:N): {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError(f"{DEVICE_ENV}={name!r} but torch {torch.__version__} sees no "
                                    f"CUDA device (CUDA_VISIBLE_DEVICES="
                                    f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        if device.index is None:  # tensors report cuda:N; the fixture names the same device
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise pytest.UsageError(f"{DEVICE_ENV}={name!r} but only {torch.cuda.device_count()} "
                                    f"CUDA device(s) are visible")
    elif device.type != "cpu":
        raise pytest.UsageError(f"{DEVICE_ENV}={name!r}: device type {device.type!r} is not "
                                f"supported by the suite; use cpu or cuda[:N]")
    return device


def pytest_configure(config) -> None:
    config.stash[_DEVICE_KEY] = _configured_device()


def pytest_report_header(config) -> str:
    return f"{DEVICE_ENV}: device-marked tests run on {config.stash[_DEVICE_KEY]}"


def pytest_collection_modifyitems(config, items) -> None:
    unmarked = [item.nodeid for item in items
                if "test_device" in getattr(item, "fixturenames", ())
                and item.get_closest_marker("device") is None]
    if unmarked:
        raise pytest.UsageError(
            "tests that use the test_device fixture must be marked @pytest.mark.device "
            f"(so that `-m device` selects them): {unmarked}")


@pytest.fixture
def test_device(request):
    """The ``torch.device`` of this run's device tests (``NEMO_RLHF_TEST_DEVICE``)."""
    return request.config.stash[_DEVICE_KEY]

