"""Run a function on N gloo ranks in spawned processes and collect what each returns.

One spawn per call: put many checks in one worker function and let the tests assert on
its results, so the ranks' start-up (imports, process groups) is paid once per module.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, outdir: str, kwargs: dict) -> None:
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


def run_ranks(fn, world_size: int, **kwargs) -> list:
    """Run ``fn(rank, **kwargs)`` on ``world_size`` processes; return each rank's result.

    Raises:
        RuntimeError: with the failing rank's traceback.
    """
    with tempfile.TemporaryDirectory() as outdir:
        try:
            mp.start_processes(_entry, args=(fn, world_size, _free_port(), outdir, kwargs),
                               nprocs=world_size, join=True, start_method="spawn")
        except Exception as exc:  # noqa: BLE001
            errors = []
            for r in range(world_size):
                p = Path(outdir) / f"rank{r}.pkl"
                if p.exists():
                    status, payload = pickle.loads(p.read_bytes())
                    if status == "error":
                        errors.append(f"--- rank {r} ---\n{payload}")
            raise RuntimeError("\n".join(errors) or str(exc)) from exc
        results = []
        for r in range(world_size):
            status, payload = pickle.loads((Path(outdir) / f"rank{r}.pkl").read_bytes())
            results.append(payload)
        return results
