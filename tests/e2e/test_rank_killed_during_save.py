"""SIGKILL of one rank of two during a save, then auto-resume.

Two real ranks (DP=2 on gloo) started the way ``srun`` starts them (each its own process,
no torchrun agent to stop the survivor). Only rank 1 is killed in the save of step 2
(``NEMO_RLHF_CRASH_AT=<point>:2:rank1``): before it writes its shards while rank 0 writes
its own (``save_shards``), or after its shards are written and verified, before
publication (``save_written``). Rank 0 must end by itself within seconds, naming the
phase; step 2 is not published and ``latest`` names step 1. The same command started
again resumes from step 1 and finishes; the final weights, optimizer state and per-step
metrics are bit-identical to an uninterrupted two-rank run, and every step's prompts were
consumed once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.ppo_helpers import make_demo_data
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("forked_python_in_session")  # the ranks: forks of a preloaded server
WORLD = 2
STEPS = 3
VOLATILE = ("timing/", "_per_s")


def _run(data: Path, exp: Path, crash: str | None = None, timeout: float = 240) -> list[tuple[int, float, str]]:
    """Both ranks of the job; per rank (exit code, seconds after the first rank's exit, log)."""
    port = free_port()
    args = [sys.executable, "-m", "nemo_rlhf.train_ppo", "--config-name", "ppo_tiny",
            f"data.train_file={data}/ppo_prompts.jsonl", f"data.val_file={data}/eval.jsonl",
            f"data.tokenizer_dir={data}/tokenizer", f"exp_manager.exp_dir={exp}",
            f"trainer.max_steps={STEPS}", "trainer.val_check_interval=0", "trainer.sample_table_every=0",
            "exp_manager.save_interval=1", "exp_manager.keep_last=5", "ppo.num_rollout_samples=8",
            "ppo.global_batch_size=4", "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=4",
            "rollout.max_new_tokens=4", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
            "reward.normalization=running", "kl.type=adaptive", "kl.horizon=100", "optim.lr=1e-3"]
    exp.mkdir(parents=True, exist_ok=True)
    procs = []
    stamp = time.time_ns()
    for rank in range(WORLD):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("NEMO_RLHF_")},
               "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        if crash:
            env["NEMO_RLHF_CRASH_AT"] = crash
        log = exp / f"rank{rank}_{stamp}.log"
        with open(log, "w") as out:
            procs.append((subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True), log))
    exits: dict[int, tuple[int, float]] = {}
    first = None
    deadline = time.time() + timeout
    try:
        while len(exits) < WORLD and time.time() < deadline:
            for rank, (p, _) in enumerate(procs):
                if rank not in exits and p.poll() is not None:
                    first = first or time.time()
                    exits[rank] = (p.returncode, time.time() - first)
            time.sleep(0.05)
    finally:
        for p, _ in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    logs = [log.read_text() for _, log in procs]
    assert len(exits) == WORLD, "ranks still running: " + "\n".join(t[-2000:] for t in logs)
    return [(*exits[r], logs[r]) for r in range(WORLD)]


def _metrics(exp: Path) -> dict[int, dict]:
    out = {}
    for line in (exp / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = {k: v for k, v in row.items() if not any(s in k for s in VOLATILE)}
    return out


def _prompt_ids(exp: Path) -> dict[tuple[int, int], list[int]]:
    out = {}
    for line in (exp / "prompt_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[(row["step"], row["dp_rank"])] = row["prompt_ids"]  # a crashed attempt's is superseded
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("rankkill_data"))


@pytest.fixture(scope="module")
def baseline(data, forked_python_in_session, tmp_path_factory):
    exp = tmp_path_factory.mktemp("rankkill_baseline")
    for code, _, log in _run(data, exp):
        assert code == 0, log[-3000:]
    return exp


@pytest.mark.parametrize("point", ["save_shards", "save_written"])
def test_rank1_killed_in_a_save_then_resume_matches_uninterrupted_run(data, baseline, tmp_path, point):
    from nemo_rlhf.checkpoint.io import load_full_tensors

    exp = tmp_path / "exp"
    (c0, after0, log0), (c1, _, log1) = _run(data, exp, crash=f"{point}:2:rank1")
    assert c1 == -signal.SIGKILL, log1[-3000:]
    assert c0 not in (0, -signal.SIGKILL), log0[-3000:]
    assert after0 < 30, f"rank 0 took {after0:.1f} s to stop after rank 1 died"
    assert "CollectiveError: rank 0 of 2: a collective in phase 'save' (step 2) failed: another rank died" \
        in log0, log0[-3000:]
    ckpts = exp / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_1"
    assert not (ckpts / "step_2").exists()  # the partial save was not published

    resumed = _run(data, exp)  # the same command again: auto-resume
    for code, _, log in resumed:
        assert code == 0, log[-3000:]
    assert f"resumed from {ckpts / 'step_1'} at step 1" in resumed[0][2], resumed[0][2][-3000:]
    names = sorted(p.name for p in ckpts.iterdir())
    assert not [n for n in names if n.startswith(".")], names
    a = load_full_tensors(ckpts / f"step_{STEPS}")
    b = load_full_tensors(baseline / "checkpoints" / f"step_{STEPS}")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{point}: {k} differs from the uninterrupted run"
        else:
            assert a[k] == b[k], f"{point}: {k} differs from the uninterrupted run"
    assert _metrics(exp) == _metrics(baseline)
    ids, ref = _prompt_ids(exp), _prompt_ids(baseline)
    assert ids == ref and sorted({s for s, _ in ids}) == list(range(1, STEPS + 1))
    flat = [i for key in sorted(ids) for i in ids[key]]
    assert len(flat) == len(set(flat))
