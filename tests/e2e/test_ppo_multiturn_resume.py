"""A multi-turn PPO run (#51: ``env.name``, the two-turn environment, sampled episodes)
killed with SIGKILL mid-episode-batch and resumed is bit-identical to an uninterrupted run.

The kill is ``NEMO_RLHF_CRASH_AT=rollout:2``: step 2's episodes are rolled out (both turns,
the environment stepped), then the process dies before they are scored or trained on; the
resumed run starts from step 1's checkpoint and must roll out the same episodes again
(the sampler's generator is seeded by ``(rollout.seed, dp_rank, call)``, not carried in
the process). Real subprocesses, as ``test_recovery.py``; the uninterrupted run and the
killed-then-resumed chain run side by side.
"""

from __future__ import annotations

import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.ppo_helpers import (end_session, make_demo_data, read_metrics, read_prompt_ids,
                               start_in_session)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("forked_python_in_session")  # the ranks: forks of a preloaded server
STEPS = 2


def _run(data: Path, exp: Path, crash: str | None = None) -> tuple[int | None, str]:
    cmd = [sys.executable, "-m", "nemo_rlhf.train_ppo", "--config-name", "ppo_tiny",
           f"data.train_file={data}/ppo_prompts.jsonl", f"data.val_file={data}/eval.jsonl",
           f"data.tokenizer_dir={data}/tokenizer", f"exp_manager.exp_dir={exp}",
           f"trainer.max_steps={STEPS}", "trainer.val_check_interval=0",
           "trainer.sample_table_every=0", "exp_manager.save_interval=1", "exp_manager.keep_last=5",
           "ppo.num_rollout_samples=8", "ppo.global_batch_size=4", "ppo.micro_batch_size=2",
           "ppo.forward_micro_batch_size=4", "rollout.max_new_tokens=4",
           "env.name=tests.ppo_helpers:two_turn_env", "env.max_total_tokens=64",
           "reward.functions=[{name: env}]", "reward.normalization=none", "kl.type=adaptive",
           "kl.horizon=100", "optim.lr=1e-3"]
    log = exp / f"run_{'killed' if crash else 'clean'}_{len(list(exp.glob('run_*.log')))}.log"
    proc = start_in_session(cmd, log, REPO, crash=crash)
    code = end_session(proc, timeout=240)
    return code, log.read_text()


@pytest.fixture(scope="module")
def runs(forked_python_in_session, tmp_path_factory):
    data = make_demo_data(tmp_path_factory.mktemp("mt_resume_data"))
    base, exp = tmp_path_factory.mktemp("mt_baseline"), tmp_path_factory.mktemp("mt_killed")

    def killed_then_resumed():
        killed = _run(data, exp, crash=f"rollout:{STEPS}")
        metrics_at_kill = read_metrics(exp) if (exp / "metrics.jsonl").exists() else {}
        return killed, metrics_at_kill, _run(data, exp)

    with ThreadPoolExecutor(2) as pool:
        chain = pool.submit(killed_then_resumed)
        clean = pool.submit(_run, data, base)
        (killed, at_kill, resumed), clean = chain.result(), clean.result()
    return base, exp, clean, killed, at_kill, resumed


def test_killed_mid_episode_batch_then_resumed_is_bit_identical(runs):
    from nemo_rlhf.checkpoint.io import load_full_tensors

    base, exp, clean, killed, at_kill, resumed = runs
    assert clean[0] == 0, clean[1][-3000:]
    assert killed[0] == -signal.SIGKILL, killed[1][-3000:]
    assert sorted(at_kill) == list(range(1, STEPS))  # died inside step 2, after its rollout
    assert resumed[0] == 0, resumed[1][-3000:]
    assert "resumed from" in resumed[1]
    got, want = read_metrics(exp), read_metrics(base)
    assert sorted(want) == list(range(1, STEPS + 1))
    assert want[STEPS]["episode/turns_mean"] == 2.0  # the runs are multi-turn
    assert got == want  # every metric of every step (the timers left out), exactly
    a = load_full_tensors(exp / "checkpoints" / f"step_{STEPS}")
    b = load_full_tensors(base / "checkpoints" / f"step_{STEPS}")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"
        else:
            assert a[k] == b[k], f"{k} differs from the uninterrupted run"
    assert read_prompt_ids(exp) == read_prompt_ids(base)  # each step's prompts, the killed one's again
