"""A reward call that fails on the scoring rank stops every rank within seconds.

Scores are fetched on model-parallel rank 0 and shared with its TP/PP peers; when the RM
server dies mid-run the scoring rank's call fails, and the peers must not sit in a
collective until the timeout. Run as two real processes started the way ``srun`` starts
them (each its own rank, no torchrun agent to kill the peers): after the server is killed
every rank exits non-zero within 30 s, each with an error naming the RM URL, and no
partial checkpoint is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ppo_helpers import make_demo_data
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("forked_python_in_session")  # the ranks: forks of a preloaded server
WORLD = 2


def _start_server(tmp: Path) -> tuple[subprocess.Popen, str]:
    addr = tmp / "rm_address"
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/rm_server_proc.py"),
                             "--address-file", str(addr)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not addr.exists() and time.time() < deadline:
        time.sleep(0.1)
    return proc, addr.read_text().strip()


def _start_ranks(data: Path, exp: Path, url: str, layout: str) -> list[tuple[subprocess.Popen, Path]]:
    port = free_port()
    args = [sys.executable, "-m", "nemo_rlhf.train_ppo", "--config-name", "ppo_tiny",
            f"data.train_file={data}/ppo_prompts.jsonl", f"data.val_file={data}/eval.jsonl",
            f"data.tokenizer_dir={data}/tokenizer", f"exp_manager.exp_dir={exp}",
            "trainer.max_steps=4", "trainer.val_check_interval=0", "trainer.sample_table_every=0",
            "exp_manager.save_interval=1", "exp_manager.keep_last=5", "exp_manager.resume=none",
            "ppo.num_rollout_samples=8", "ppo.global_batch_size=4", "ppo.micro_batch_size=2",
            "ppo.forward_micro_batch_size=4", "rollout.max_new_tokens=4",
            f"reward.rm_url={url}", "reward.functions=[]", "reward.normalization=none",
            "reward.max_retries=1", "reward.timeout_s=5",
            "reward.restart_wait_s=3",  # a killed RM not restarted: reported 3 s after it went down
            layout]
    exp.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        env.pop("NEMO_RLHF_CRASH_AT", None)
        log = exp / f"rank{rank}.log"
        with open(log, "w") as out:
            procs.append((subprocess.Popen(args, cwd=REPO, env=env, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True), log))
    return procs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("rmfail_data"))


@pytest.mark.parametrize("layout", ["parallel.tensor_model_parallel_size=2",
                                    "parallel.pipeline_model_parallel_size=2"])
def test_rm_death_stops_every_rank_within_seconds_naming_the_url(data, tmp_path, layout):
    exp = tmp_path / "exp"
    server, url = _start_server(tmp_path)
    procs = []
    try:
        procs = _start_ranks(data, exp, url, layout)
        latest = exp / "checkpoints" / "latest"
        deadline = time.time() + 240
        while not latest.exists() and time.time() < deadline:
            assert all(p.poll() is None for p, _ in procs), [log.read_text()[-2000:] for _, log in procs]
            time.sleep(0.05)
        assert latest.exists(), "step 1 never finished"
        server.kill()
        killed_at = time.time()
        exits = {}
        while len(exits) < WORLD and time.time() < killed_at + 90:  # bounded: a hang fails
            for rank, (p, _) in enumerate(procs):
                if rank not in exits and p.poll() is not None:
                    exits[rank] = (p.returncode, time.time() - killed_at)
            time.sleep(0.1)
    finally:
        server.kill()
        server.wait()
        for p, _ in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    logs = [log.read_text() for _, log in procs]
    assert sorted(exits) == list(range(WORLD)), f"ranks still running 90 s after the kill: " \
        f"{sorted(set(range(WORLD)) - set(exits))}\n" + "\n".join(t[-1500:] for t in logs)
    for rank, (code, after) in exits.items():
        assert code != 0, f"rank {rank} exited 0"
        assert after <= 30, f"rank {rank} took {after:.1f} s to stop"
        assert "RewardServiceError" in logs[rank] and url in logs[rank], \
            f"rank {rank} does not name the RM URL:\n{logs[rank][-2500:]}"
    # no partial checkpoint: every published step is complete, no temporary folder left
    names = sorted(p.name for p in (exp / "checkpoints").iterdir())
    assert not [n for n in names if n.startswith(".") or "tmp" in n], names
    steps = [n for n in names if n.startswith("step_")]
    assert steps and all((exp / "checkpoints" / n / "COMPLETE").is_file() for n in steps), names
    assert (exp / "checkpoints" / "latest").read_text().strip() == steps[-1]
