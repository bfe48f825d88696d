"""``rollout.mode=async`` end to end, as real processes (the tiny model, CPU, fp32):

* ``max_staleness=0``: one trainer rank and one rollout worker give the same metrics as the
  synchronous run for the same seed (generation moved, nothing else), in bf16-mixed; and
  with multi-turn episodes (``env.name``, two turns each), in fp32;
* ``max_staleness=1`` under ``launchers.local --nproc 2`` at TP=2: the launcher starts the
  worker the trainer's controller asks for; every step after the first trains on samples one
  version old; the weights reach the worker gathered over TP, bit-checked at every sync;
* ``max_staleness=1`` under ``launchers.local --nproc 2`` at CP=2 (one DP rank's two CP
  ranks) gives the one-rank run's metrics within 1e-5 (#52);
* recovery (``max_staleness=1``, TP=1): the worker killed with SIGKILL in step 2 stops the
  trainer within ``rollout.worker_timeout_s``, naming the worker; the resumed trainer is
  then killed in step 3's update; the second resume ends bit-identical to the uninterrupted
  run (weights, optimizer, metrics), every prompt trained on once, the staleness within the
  bound throughout (each checkpoint carries the samples an older version made for the next
  step).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.ppo_helpers import end_session, make_demo_data, read_metrics, read_prompt_ids, start_in_session

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("forked_python_in_session")  # the processes: forks of a preloaded server
STEPS = 4
VOLATILE = ("timing/", "_per_s", "async/trainer_wait_s", "async/worker_idle_s", "async/weight_sync_s",
            "async/generate_s", "async/step_generate_s")
TIMEOUT_S = 240


def _overrides(data: Path, exp: Path, *extra: str) -> list[str]:
    return [f"data.train_file={data}/ppo_prompts.jsonl", f"data.val_file={data}/eval.jsonl",
            f"data.tokenizer_dir={data}/tokenizer", f"exp_manager.exp_dir={exp}",
            f"trainer.max_steps={STEPS}", "trainer.val_check_interval=0", "trainer.sample_table_every=0",
            "exp_manager.save_interval=1", "exp_manager.keep_last=5", "ppo.num_rollout_samples=8",
            "ppo.global_batch_size=4", "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=4",
            "rollout.max_new_tokens=4", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
            "reward.normalization=none", "trainer.precision=32", "optim.lr=1e-3", *extra]


ASYNC1 = ("rollout.mode=async", "rollout.max_staleness=1", "ppo.rollout_is_cap=2.0",
          "rollout.worker_timeout_s=8")


def _start(cmd: list[str], log: Path, crash: str | None = None):
    return start_in_session(cmd, log, REPO, crash)


def _finish(proc, timeout: float = TIMEOUT_S) -> int | None:
    return end_session(proc, timeout)


def _trainer(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "nemo_rlhf.train_ppo", "--config-name", "ppo_tiny", *overrides]


def _worker(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "nemo_rlhf.rollout_worker", "--worker-index", "0", "--config-name", "ppo_tiny",
            *overrides]


def _run_pair(overrides: list[str], exp: Path, trainer_crash=None, worker_crash=None) -> tuple:
    """A trainer and one worker; returns (trainer code, worker code, trainer log text)."""
    log = exp / f"trainer_{time.time_ns()}.log"
    worker = _start(_worker(overrides), exp / "worker.log", worker_crash)
    trainer = _start(_trainer(overrides), log, trainer_crash)
    t_code = _finish(trainer)
    w_code = _finish(worker, timeout=30)
    return t_code, w_code, log.read_text()


def _metrics(exp: Path) -> dict[int, dict]:
    return read_metrics(exp, VOLATILE)


_prompt_ids = read_prompt_ids


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("async_data"))


def test_on_policy_async_equals_sync_for_the_same_seed(data, tmp_path):
    """In bf16-mixed (bf16 weights, float32 norms: the worker's model takes every dtype as
    sent)."""
    sync = tmp_path / "sync"
    bf16 = "trainer.precision=bf16-mixed"
    proc = _start(_trainer(_overrides(data, sync, "trainer.max_steps=3", bf16)), tmp_path / "sync.log")
    assert _finish(proc) == 0, (tmp_path / "sync.log").read_text()[-3000:]
    exp = tmp_path / "async0"
    t_code, w_code, text = _run_pair(_overrides(data, exp, "trainer.max_steps=3", "rollout.mode=async",
                                                "rollout.max_staleness=0", bf16), exp)
    assert t_code == 0 and w_code == 0, text[-3000:] + (exp / "worker.log").read_text()[-2000:]
    a, s = _metrics(exp), _metrics(sync)
    assert sorted(a) == [1, 2, 3]
    for step in a:
        assert a[step]["async/staleness_max"] == 0 and a[step]["async/weight_syncs"] == 1
        only_async = {k for k in a[step] if k.startswith("async/")}
        assert {k: v for k, v in a[step].items() if k not in only_async} == s[step]
    assert _prompt_ids(exp) == _prompt_ids(sync)
    # generated_tokens_per_s: the step's tokens (the sync run's: the same samples) over the
    # worker's generation seconds (one worker, on-policy: async/generate_s is this step's item's),
    # not over the trainer's wait for a ready item (#50)
    raw_a, raw_s = read_metrics(exp, ()), read_metrics(sync, ())
    for step in a:
        tokens = raw_s[step]["generated_tokens_per_s"] * raw_s[step]["timing/rollout_s"]
        assert raw_a[step]["generated_tokens_per_s"] == pytest.approx(tokens / raw_a[step]["async/generate_s"],
                                                                      rel=1e-6), (step, tokens, raw_a[step])


MULTI_TURN = ("env.name=tests.ppo_helpers:two_turn_env", "env.max_total_tokens=64",
              "reward.functions=[{name: env}]", "trainer.max_steps=2")


def test_on_policy_async_multi_turn_equals_sync_for_the_same_seed(data, tmp_path):
    """``env.name`` with ``rollout.mode=async`` (#51): the worker runs the episodes (two
    policy turns each, ``tests.ppo_helpers:two_turn_env``) with the DP rank's seeds, and at
    ``max_staleness=0`` the trainer sees the synchronous run's episodes: every metric
    (``episode/*`` included) within 1e-6."""
    sync = tmp_path / "sync"
    proc = _start(_trainer(_overrides(data, sync, *MULTI_TURN)), tmp_path / "sync.log")
    assert _finish(proc) == 0, (tmp_path / "sync.log").read_text()[-3000:]
    exp = tmp_path / "async0"
    t_code, w_code, text = _run_pair(_overrides(data, exp, *MULTI_TURN, "rollout.mode=async",
                                                "rollout.max_staleness=0"), exp)
    assert t_code == 0 and w_code == 0, text[-3000:] + (exp / "worker.log").read_text()[-2000:]
    a, s = _metrics(exp), _metrics(sync)
    assert sorted(a) == [1, 2]
    for step in a:
        assert a[step]["async/staleness_max"] == 0 and a[step]["async/weight_syncs"] == 1
        assert a[step]["episode/turns_mean"] == 2.0 and a[step]["episode/tool_calls_mean"] == 1.0
        mine = {k: v for k, v in a[step].items() if not k.startswith("async/")}
        assert sorted(mine) == sorted(s[step])
        assert mine == {k: pytest.approx(v, rel=1e-6, abs=1e-6) for k, v in s[step].items()}, step
    assert _prompt_ids(exp) == _prompt_ids(sync)


def test_the_local_launcher_runs_an_async_job_at_tp2(data, tmp_path):
    exp = tmp_path / "launched"
    cmd = [sys.executable, "-m", "launchers.local", "--no-rm", "--nproc", "2", "--config-name", "ppo_tiny", "--",
           *_overrides(data, exp, *ASYNC1, "parallel.tensor_model_parallel_size=2")]
    proc = _start(cmd, tmp_path / "launcher.log")
    code = _finish(proc, timeout=TIMEOUT_S + 60)
    text = (tmp_path / "launcher.log").read_text()
    assert code == 0, text[-4000:]
    assert "starting rollout worker 0" in text and "trainer finished" in text
    assert "rollout worker 0 connected" in (exp / "rollout_worker_0.log").read_text()
    m = _metrics(exp)
    assert [m[s]["async/staleness_max"] for s in sorted(m)] == [0, 1, 1, 1]
    # version 0 made steps 1-2, versions 1 and 2 steps 3-4: three syncs of the full weights
    assert [m[s]["async/weight_syncs"] for s in sorted(m)] == [1, 0, 1, 1]
    assert all(m[s]["async/weight_sync_bytes"] > 0 for s in (1, 3, 4))
    assert m[2]["rollout_correction/mismatch"] > 100 * m[1]["rollout_correction/mismatch"]  # off-policy
    assert m[STEPS]["grad_norm"] > 0


@pytest.fixture(scope="module")
def uninterrupted(data, forked_python_in_session, tmp_path_factory):
    exp = tmp_path_factory.mktemp("async_straight")
    t_code, w_code, text = _run_pair(_overrides(data, exp, *ASYNC1), exp)
    assert t_code == 0 and w_code == 0, text[-3000:]
    return exp


def test_worker_and_trainer_killed_then_resumed_bit_identical(data, uninterrupted, tmp_path):
    from nemo_rlhf.checkpoint.io import load_full_tensors

    exp = tmp_path / "exp"
    ov = _overrides(data, exp, *ASYNC1)
    # 1. the worker dies generating step 3 (version 1, while the trainer trains step 2)
    t0 = time.monotonic()
    t_code, w_code, text = _run_pair(ov, exp, worker_crash="rollout_worker:3")
    assert w_code == -signal.SIGKILL
    assert t_code not in (0, None), text[-3000:]
    assert "rollout worker 0" in text and "sent no heartbeat" in text, text[-3000:]
    assert time.monotonic() - t0 < TIMEOUT_S
    done = sorted(p.name for p in (exp / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert done and done[-1] in ("step_1", "step_2"), done
    # 2. the resumed trainer is killed in step 3's update
    t_code, w_code, text = _run_pair(ov, exp, trainer_crash="update:3")
    assert t_code == -signal.SIGKILL and "resumed from" in text, text[-3000:]
    assert w_code is not None  # the worker saw its controller go and exited
    # 3. resumed again: to the end
    t_code, w_code, text = _run_pair(ov, exp)
    assert t_code == 0 and w_code == 0 and "resumed from" in text, text[-3000:]

    a = load_full_tensors(exp / "checkpoints" / f"step_{STEPS}")
    b = load_full_tensors(uninterrupted / "checkpoints" / f"step_{STEPS}")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"
    got, want = _metrics(exp), _metrics(uninterrupted)
    timing = ("async/weight_sync", "async/buffer_depth")  # when a sync lands between two takes
    assert {s: {k: v for k, v in row.items() if not k.startswith(timing)} for s, row in got.items()} == \
        {s: {k: v for k, v in row.items() if not k.startswith(timing)} for s, row in want.items()}
    assert [got[s]["async/staleness_max"] for s in sorted(got)] == [0, 1, 1, 1]
    ids = _prompt_ids(exp)
    assert ids == _prompt_ids(uninterrupted) and sorted(ids) == list(range(1, STEPS + 1))
    flat = [i for s in sorted(ids) for i in ids[s]]
    assert len(flat) == len(set(flat))  # 4 steps x 8 prompts of 64: none twice


@pytest.mark.timeout(TIMEOUT_S + 240)
def test_resumed_at_another_dp_size_the_buffered_step_is_regenerated(data, uninterrupted, tmp_path):
    """The uninterrupted run's (DP=1) checkpoint after step 2 carries step 3's samples (made by
    version 1) for one DP rank; resumed at DP=2 under ``launchers.local --nproc 2`` they are
    dropped, logged naming the change, and step 3 is regenerated from the checkpoint's weights:
    the run ends (on 7fb6bc5 it waited forever for DP rank 1's item of step 3) (#50)."""
    import json
    import shutil

    exp = tmp_path / "dp2"
    for step in (1, 2):
        shutil.copytree(uninterrupted / "checkpoints" / f"step_{step}", exp / "checkpoints" / f"step_{step}")
    cmd = [sys.executable, "-m", "launchers.local", "--no-rm", "--nproc", "2", "--config-name", "ppo_tiny", "--",
           *_overrides(data, exp, *ASYNC1)]
    proc = _start(cmd, tmp_path / "launcher.log")
    code = _finish(proc, timeout=TIMEOUT_S + 60)
    text = (tmp_path / "launcher.log").read_text()
    assert code == 0, text[-4000:]
    assert "resumed from" in text and "trainer finished" in text, text[-4000:]
    assert "buffered samples (steps [3]) are dropped and regenerated from its weights: DP size 1 -> 2" in text, \
        text[-4000:]
    m = _metrics(exp)
    assert sorted(m) == [3, 4]
    # step 3 from the checkpoint's weights (version 2: fresher than the bound), step 4 one version old
    assert [m[s]["async/staleness_max"] for s in (3, 4)] == [0, 1]
    rows = [json.loads(line) for line in (exp / "prompt_log.jsonl").read_text().splitlines()]
    ids = {s: [i for r in sorted((r for r in rows if r["step"] == s), key=lambda r: r["dp_rank"])
               for i in r["prompt_ids"]] for s in (3, 4)}
    assert ids == {s: _prompt_ids(uninterrupted)[s] for s in (3, 4)}  # the same prompts, split over 2 ranks


@pytest.mark.timeout(TIMEOUT_S + 240)
def test_an_async_job_at_cp2_equals_the_cp1_run(data, uninterrupted, tmp_path):
    """``parallel.context_parallel_size=2`` with ``rollout.mode=async`` (``max_staleness=1``,
    ``launchers.local --nproc 2``: the two trainer ranks are one DP rank's CP ranks): both take
    DP rank 0's item, only CP rank 0 gathers the weights for the worker, and the four steps
    (three weight syncs, off-policy from step 2) give the one-rank (CP=1) run's metrics
    within 1e-5 and train on its prompts (#52)."""
    exp = tmp_path / "cp2"
    cmd = [sys.executable, "-m", "launchers.local", "--no-rm", "--nproc", "2", "--config-name", "ppo_tiny", "--",
           *_overrides(data, exp, *ASYNC1, "parallel.context_parallel_size=2", "exp_manager.save_interval=0")]
    proc = _start(cmd, tmp_path / "launcher.log")
    code = _finish(proc, timeout=TIMEOUT_S + 60)
    text = (tmp_path / "launcher.log").read_text()
    assert code == 0, text[-4000:]
    assert "trainer finished" in text, text[-4000:]
    # when a sync lands between two takes; and the share of computed positions that are
    # padding, which CP's alignment of every row to 2 * CP columns adds to (by design)
    timing = ("async/weight_sync_s", "async/buffer_depth", "padding_fraction")
    got, want = _metrics(exp), _metrics(uninterrupted)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for s in got:
        g = {k: v for k, v in got[s].items() if not k.startswith(timing)}
        w = {k: v for k, v in want[s].items() if not k.startswith(timing)}
        assert sorted(g) == sorted(w), s
        assert g == {k: pytest.approx(v, rel=1e-5, abs=1e-5) for k, v in w.items()}, s
    assert [got[s]["async/staleness_max"] for s in sorted(got)] == [0, 1, 1, 1]
    # version 0 made steps 1-2, versions 1 and 2 steps 3-4: three syncs, each the one-rank run's bytes
    assert [got[s]["async/weight_syncs"] for s in sorted(got)] == [1, 0, 1, 1]
    assert got[STEPS]["grad_norm"] > 0 and got[2]["rollout_correction/mismatch"] > 0
    assert _prompt_ids(exp) == _prompt_ids(uninterrupted)
