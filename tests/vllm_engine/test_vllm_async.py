"""``rollout.mode=async`` with ``rollout.engine=vllm``: a rollout worker whose vLLM engine is
refit in memory from the weights the trainer sends, at ``max_staleness=0``, gives the
synchronous vLLM run's metrics step for step (same seeds: vLLM's per-row seeds come from
the DP rank and the step, which the worker takes from each item). Real processes: the
trainer and the worker, each ``python -m`` forked from a server of this environment's
interpreter that has imported torch, the trainer and the worker once
(``tests/fork_python.py``, :func:`forked_python`), not a fresh interpreter each (about
12 s of CPU per process here); vLLM is imported by each process itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ppo_helpers import end_session, make_demo_data, read_metrics, session_env, start_in_session

REPO = Path(__file__).resolve().parents[2]
# vLLM's CPU attention has no kernel for head dim 16 (the tiny preset's 64 / 4 heads)
TINY = ("model.num_attention_heads=2", "model.num_query_groups=2")
ENGINE_OWN = ("timing/", "_per_s", "rollout/refit", "vllm/")


def _overrides(data: Path, exp: Path, *extra: str) -> list[str]:
    return ["--config-name", "ppo_tiny", f"data.train_file={data}/ppo_prompts.jsonl",
            f"data.val_file={data}/eval.jsonl", f"data.tokenizer_dir={data}/tokenizer", f"exp_manager.exp_dir={exp}",
            "trainer.max_steps=3", "trainer.val_check_interval=0", "trainer.sample_table_every=0",
            "ppo.num_rollout_samples=8", "ppo.global_batch_size=4", "ppo.micro_batch_size=2",
            "ppo.forward_micro_batch_size=4", "rollout.max_new_tokens=4",
            "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "reward.normalization=none",
            "trainer.precision=32", "rollout.engine=vllm", "exp_manager.save_interval=0", *TINY, *extra]


def _run(cmd: list[str], log: Path):
    return start_in_session(cmd, log, REPO)


def _wait(proc, timeout: float = 600) -> int | None:
    return end_session(proc, timeout)


def _metrics(exp: Path) -> dict[int, dict]:
    return read_metrics(exp, ENGINE_OWN)


@pytest.fixture
def forked_python(tmp_path):
    """The shim of a :class:`~tests.fork_python.PythonForkServer` with
    :func:`~tests.ppo_helpers.start_in_session`'s environment (a job whose start-up
    environment differs runs in the real interpreter): ``[shim, "-m", MODULE, ...]`` in
    place of ``[sys.executable, "-m", MODULE, ...]``."""
    from tests.fork_python import PythonForkServer

    with PythonForkServer(session_env(), tmp_path / "fork_python",
                          preload=("torch", "nemo_rlhf.train_ppo", "nemo_rlhf.rollout_worker")) as server:
        yield server.shim


def test_a_vllm_worker_on_policy_gives_the_synchronous_vllm_runs_metrics(tmp_path, forked_python):
    python = forked_python
    data = make_demo_data(tmp_path / "data")
    sync = tmp_path / "sync"
    code = _wait(_run([python, "-m", "nemo_rlhf.train_ppo", *_overrides(data, sync)], tmp_path / "sync.log"))
    assert code == 0, (tmp_path / "sync.log").read_text()[-3000:]
    exp = tmp_path / "async"
    ov = _overrides(data, exp, "rollout.mode=async", "rollout.max_staleness=0", "rollout.worker_timeout_s=60")
    worker = _run([python, "-m", "nemo_rlhf.rollout_worker", "--worker-index", "0", *ov], tmp_path / "w.log")
    trainer = _run([python, "-m", "nemo_rlhf.train_ppo", *ov], tmp_path / "t.log")
    t_code, w_code = _wait(trainer), _wait(worker, 60)
    assert t_code == 0, (tmp_path / "t.log").read_text()[-3000:]
    assert w_code == 0, (tmp_path / "w.log").read_text()[-3000:]
    assert "Reloading and processing weights" in (tmp_path / "w.log").read_text()  # the worker's vLLM refit
    a, s = _metrics(exp), _metrics(sync)
    assert sorted(a) == [1, 2, 3]
    for step in a:
        assert a[step]["async/weight_syncs"] == 1 and a[step]["async/staleness_max"] == 0
        assert {k: v for k, v in a[step].items() if not k.startswith("async/")} == s[step], step
