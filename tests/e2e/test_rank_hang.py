"""A rank that hangs in a collective: the others report it within ``parallel.timeout_minutes``.

Two real ranks started the way ``srun`` starts them (each its own process, no torchrun
agent), a real PPO run on gloo with ``parallel.timeout_minutes=0.2`` (12 s). Rank 1 hangs
on entering the update of step 2 (``NEMO_RLHF_FAULT=hang_update:2:rank1``); rank 0 is
then inside the update's collectives. It must exit non-zero within the timeout plus a
margin, its error naming itself, the phase, the step and the key; rank 1 is left hung (the
launcher, e.g. ``srun --kill-on-bad-exit``, ends it) and its log names the injected hang.
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
TIMEOUT_MIN = 0.2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("hang_data"))


def test_a_rank_hanging_in_the_update_is_reported_by_the_other_naming_rank_and_phase(data, tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    port = free_port()
    args = [sys.executable, "-m", "nemo_rlhf.train_ppo", "--config-name", "ppo_tiny",
            f"data.train_file={data}/ppo_prompts.jsonl", f"data.val_file={data}/eval.jsonl",
            f"data.tokenizer_dir={data}/tokenizer", f"exp_manager.exp_dir={exp}",
            "trainer.max_steps=3", "trainer.val_check_interval=0", "trainer.sample_table_every=0",
            "exp_manager.save_interval=0", "exp_manager.resume=none", "ppo.num_rollout_samples=8",
            "ppo.global_batch_size=4", "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=4",
            "rollout.max_new_tokens=4", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
            "reward.normalization=none", f"parallel.timeout_minutes={TIMEOUT_MIN}"]
    procs = []
    try:
        for rank in range(WORLD):
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("NEMO_RLHF_")},
                   "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                   "NEMO_RLHF_FAULT": "hang_update:2:rank1"}
            log = exp / f"rank{rank}.log"
            with open(log, "w") as out:
                procs.append((subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                               start_new_session=True), log))
        (p0, log0), (p1, log1) = procs
        deadline = time.time() + 240
        while "hangs in phase 'update' of step 2" not in log1.read_text() and time.time() < deadline:
            assert p0.poll() is None and p1.poll() is None, (log0.read_text()[-3000:], log1.read_text()[-3000:])
            time.sleep(0.05)
        hung_at = time.time()
        assert time.time() < deadline, "rank 1 never reached the injected hang"
        code = p0.wait(timeout=TIMEOUT_MIN * 60 + 60)  # bounded: a hang of rank 0 fails the test
        took = time.time() - hung_at
        rank1_still_hung = p1.poll() is None
    finally:
        for p, _ in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    text = log0.read_text()
    assert code != 0
    assert TIMEOUT_MIN * 60 - 1 <= took <= TIMEOUT_MIN * 60 + 30, took
    assert ("CollectiveError: rank 0 of 2: a collective in phase 'update' (step 2) did not complete "
            f"within parallel.timeout_minutes={TIMEOUT_MIN:g} (12 s): another rank hung or died") in text, \
        text[-3000:]
    assert rank1_still_hung


def test_timeout_minutes_takes_fractions_and_refuses_non_positive_naming_the_key():
    from nemo_rlhf.distributed.parallel import ParallelConfig

    assert ParallelConfig(timeout_minutes=0.1).timeout_minutes == 0.1
    for bad in (0, -1.0, "soon"):
        with pytest.raises(ValueError, match=r"parallel.timeout_minutes=.*must be a number of minutes > 0"):
            ParallelConfig(timeout_minutes=bad)
