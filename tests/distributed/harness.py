"""Run a function on N gloo ranks in spawned processes and collect what each returns.

One spawn per call: put many checks in one worker function and let the tests assert on
its results, so the ranks' start-up (imports, process groups) is paid once per module.

On a machine without CUDA the ranks are forked from a multiprocessing *forkserver* that
has imported torch, megatron and the package's entry points once (:data:`PRELOAD`), so a
rank starts in well under a second instead of re-importing them (about 5 s of CPU per rank
with ``spawn``; with CUDA they are spawned). The
server is started on the first call and lives for the test session; it runs no torch op
(no OpenMP pool, no CUDA) before it forks, and each rank still starts its own process
group. A rank gets the caller's environment and working directory as they are at the
call, as a spawned one would.

Devices: on a machine without CUDA the ranks run on the host with gloo. With CUDA, a world
of N ranks runs one rank per GPU with NCCL (what ``initialize_distributed`` picks) only
when at least N GPUs are visible; with fewer, the ranks are started with no GPU visible
(``CUDA_VISIBLE_DEVICES=""``) and run on the host with gloo, as on a CPU machine, instead
of sharing a GPU.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.ports import free_port


#: Imported once by the forkserver the ranks are forked from (see the module docstring).
PRELOAD = ("torch", "pytest", "nemo_rlhf.train_ppo", "nemo_rlhf.train_rm", "nemo_rlhf.train_sft",
           "nemo_rlhf.tools.ckpt.cli", "tests.distributed.harness", "tests.ppo_helpers")

#: The start method of the ranks: ``forkserver`` (preloaded), ``spawn`` to compare.
START_METHOD = os.environ.get("NEMO_RLHF_TEST_START_METHOD", "forkserver")


def _context_method() -> str:
    """The ranks' start method: :data:`START_METHOD`, but ``spawn`` where CUDA is available
    (a forkserver that imported the package is not known to leave CUDA usable in what it
    forks; not tried). For ``forkserver``, sets the server's preload list (it takes effect
    at the server's first start)."""
    if START_METHOD == "forkserver" and torch.cuda.is_available():
        return "spawn"
    if START_METHOD == "forkserver":
        import multiprocessing

        multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    return START_METHOD


def _entry(rank: int, fn, world_size: int, port: int, outdir: str, kwargs: dict,
           env: dict) -> None:
    os.environ.clear()  # the caller's environment at the call, not the forkserver's
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(1)
    out = Path(outdir) / f"rank{rank}.pkl"
    try:
        result = fn(rank, **kwargs)
        out.write_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001 - reported to the parent test
        out.write_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise
    finally:
        from nemo_rlhf.distributed import destroy_distributed

        try:
            destroy_distributed()
        except Exception:  # noqa: BLE001
            pass


def ranks_use_gpus(world_size: int) -> bool:
    """Whether ``world_size`` ranks get one GPU each (else they run on the host)."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


def run_ranks(fn, world_size: int, **kwargs) -> list:
    """Run ``fn(rank, **kwargs)`` on ``world_size`` processes; return each rank's result.

    The rendezvous port is picked free and released before the ranks bind it; when another
    process takes it in between (EADDRINUSE at the rendezvous, seen under load), the ranks
    are started again on a new port, up to :data:`PORT_ATTEMPTS` times.

    Raises:
        RuntimeError: with the failing rank's traceback.
    """
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _run_ranks_once(fn, world_size, **kwargs)
        except RuntimeError as exc:
            if "EADDRINUSE" not in str(exc) or attempt == PORT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


PORT_ATTEMPTS = 3


def _run_ranks_once(fn, world_size: int, **kwargs) -> list:
    hide_gpus = torch.cuda.is_available() and not ranks_use_gpus(world_size)
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    with tempfile.TemporaryDirectory() as outdir:
        try:
            if hide_gpus:  # spawned children inherit the environment as it is at start
                os.environ["CUDA_VISIBLE_DEVICES"] = ""
            mp.start_processes(_entry, args=(fn, world_size, free_port(), outdir, kwargs,
                                             dict(os.environ)),
                               nprocs=world_size, join=True, start_method=_context_method())
        except Exception as exc:  # noqa: BLE001
            errors = []
            for r in range(world_size):
                p = Path(outdir) / f"rank{r}.pkl"
                if p.exists():
                    status, payload = pickle.loads(p.read_bytes())
                    if status == "error":
                        errors.append(f"--- rank {r} ---\n{payload}")
            raise RuntimeError("\n".join(errors) or str(exc)) from exc
        finally:
            if hide_gpus:
                if saved is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved
        results = []
        for r in range(world_size):
            status, payload = pickle.loads((Path(outdir) / f"rank{r}.pkl").read_bytes())
            results.append(payload)
        return results
