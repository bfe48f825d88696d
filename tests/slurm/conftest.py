"""A real one-node Slurm cluster for the tests in this folder.

The ``slurm`` fixture (session scope) installs slurm-wlm + munge when they are missing
(``.ci/slurm_setup.sh``; CI runs it before the tests), starts munged, slurmctld and slurmd
as root with config, state, logs and pid files under a temporary folder
(``tests/slurm/cluster.sh start``), and stops them by pid at the end. Tests that need it
are skipped, with the reason, only when Slurm is missing and cannot be installed (not
root, no apt-get, no package mirror) or the tests do not run as root (the daemons do); a
cluster that does not start is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = Path(__file__).with_name("cluster.sh")
SETUP_SH = REPO / ".ci" / "slurm_setup.sh"
CPUS = 2
"""CPUs of the test node: the tiny jobs run 2 trainer ranks (+ the RM server overlapping)."""


def _have_slurm() -> bool:
    return all(shutil.which(b) for b in ("sbatch", "slurmctld", "slurmd", "munged"))


class Cluster:
    """The running test cluster: its folder, the environment that points at it, helpers."""

    def __init__(self, root: Path):
        self.root = root
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        res = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def launch(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """``python -m launchers.slurm <args>`` against this cluster."""
        return subprocess.run([sys.executable, "-m", "launchers.slurm", *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def submit(self, *args: str) -> str:
        res = self.launch(*args)
        assert res.returncode == 0, f"launchers.slurm {args} failed:\n{res.stderr[-3000:]}"
        job_id = res.stdout.strip().splitlines()[-1]
        assert job_id.isdigit(), res.stdout
        return job_id

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, Reason, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, until, timeout: float, what: str = "", log: Path | None = None,
             poll_s: float = 1.0, final=("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")) -> dict:
        """Poll the job until ``until(info)`` holds; fail with its state and log as soon as
        it is in a ``final`` state, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if until(info):
                return info
            if info.get("JobState") in final:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        tail = ""
        if log is not None:
            for f in sorted(log.parent.glob(log.name)):
                tail += f"\n--- {f}\n" + "".join(f.read_text(errors="replace").splitlines(True)[-60:])
        raise AssertionError(f"job {job_id}: waited {timeout:.0f}s {what}; now JobState={info.get('JobState')} "
                             f"Reason={info.get('Reason')} ExitCode={info.get('ExitCode')} "
                             f"Restarts={info.get('Restarts')}{tail}\n{self.daemon_logs()}")

    def daemon_logs(self, lines: int = 15) -> str:
        out = ""
        for f in sorted((self.root / "log").glob("*.log")):
            out += f"--- {f.name}\n" + "".join(f.read_text(errors="replace").splitlines(True)[-lines:])
        return out


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The running one-node cluster (see the module docstring)."""
    if not _have_slurm():
        res = subprocess.run(["bash", str(SETUP_SH)], capture_output=True, text=True, timeout=900)
        if res.returncode != 0 or not _have_slurm():
            pytest.skip("Slurm (slurm-wlm, munge) is not installed and could not be installed by "
                        f".ci/slurm_setup.sh: {(res.stderr or res.stdout).strip()[-500:]}")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs munged, slurmctld and slurmd as root; this is not root")
    root = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "SLURM_TEST_CPUS": str(CPUS)}
    started = subprocess.run(["bash", str(CLUSTER_SH), "start", str(root)], env=env,
                             capture_output=True, text=True, timeout=180)
    cluster = Cluster(root)
    try:
        assert started.returncode == 0, (f"the test cluster did not start:\n{started.stderr}\n"
                                         f"{cluster.daemon_logs()}")
        yield cluster
    finally:
        subprocess.run(["bash", str(CLUSTER_SH), "stop", str(root)], capture_output=True, timeout=120)
