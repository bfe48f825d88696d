"""Where this process sits in the job: read torchrun's or SLURM's environment.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.
Under ``srun`` SLURM sets ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` and the
job's node list; the rendezvous host is the first host of that list and the port is derived
from the job id (as the project's sbatch templates do), unless ``MASTER_ADDR`` /
``MASTER_PORT`` are already exported. Without either, the process is a single rank.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """Rank layout of the current process as the launcher described it."""

    rank: int
    """Global rank, 0 .. world_size-1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node (selects the GPU when CUDA is present)."""
    master_addr: str
    """Rendezvous host."""
    master_port: int
    """Rendezvous TCP port."""
    launcher: str
    """``torchrun``, ``slurm`` or ``single``."""


def expand_first_host(nodelist: str) -> str:
    """First host name of a SLURM node list.

    ``"gpu[003-005,010],cpu1"`` -> ``"gpu003"``; ``"node7"`` -> ``"node7"``. Zero padding of
    the range start is kept, as ``scontrol show hostnames`` does.

    Raises:
        ValueError: if the node list is empty or malformed.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("SLURM node list is empty")
    m = re.match(r"^([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if m is None:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, _, ranges = m.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    if not first:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    return prefix + first


def port_from_job_id(job_id: str | int) -> int:
    """A rendezvous port derived from a SLURM job id, in [20000, 30000)."""
    return 20000 + int(job_id) % 10000


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the rank layout from torchrun's variables, else SLURM's, else single-process.

    Raises:
        ValueError: if the variables are inconsistent (rank outside ``[0, world_size)``).
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        layout = LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
            launcher="torchrun",
        )
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        job_id = env.get("SLURM_JOB_ID", "0")
        layout = LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or expand_first_host(nodelist),
            master_port=int(env.get("MASTER_PORT") or port_from_job_id(job_id)),
            launcher="slurm",
        )
    else:
        layout = LaunchEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"),
                           int(env.get("MASTER_PORT", 0) or 0), "single")
    if not 0 <= layout.rank < layout.world_size:
        raise ValueError(
            f"{layout.launcher} environment gives rank {layout.rank} outside world size "
            f"{layout.world_size}"
        )
    return layout
