"""Crash recovery of the PPO main job, run as real subprocesses.

``kill -9`` at several points (rollout, update, after the shards are written, between the
rename and ``latest``), resume, and compare with an uninterrupted run: same final weights
and optimizer state (bit-identical on CPU), same per-step metrics, every step's prompts
consumed exactly once. Plus SIGUSR1 -> checkpoint + requeue exit code, fingerprint
mismatch, and a corrupt shard falling back to the previous checkpoint.
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

from nemo_rlhf.train_ppo import REQUEUE_EXIT_CODE
from tests.ppo_helpers import make_demo_data

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
pytestmark = pytest.mark.usefixtures("forked_python_in_session")  # the jobs: forks of a preloaded server
VOLATILE = ("timing/", "_per_s")


def _cmd(data: Path, exp: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nemo_rlhf.train_ppo", "--config-name", "ppo_tiny",
            f"data.train_file={data}/ppo_prompts.jsonl", f"data.val_file={data}/eval.jsonl",
            f"data.tokenizer_dir={data}/tokenizer", f"exp_manager.exp_dir={exp}",
            f"trainer.max_steps={STEPS}", "trainer.val_check_interval=0",
            "trainer.sample_table_every=0", "exp_manager.save_interval=1",
            "exp_manager.keep_last=5", "ppo.num_rollout_samples=8", "ppo.global_batch_size=4",
            "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=4", "rollout.max_new_tokens=4",
            "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
            "reward.normalization=none", "kl.type=adaptive", "kl.horizon=100", "optim.lr=1e-3",
            *extra]


class _Result:
    def __init__(self, returncode: int, output: str):
        self.returncode, self.stdout, self.stderr = returncode, output, output


def _run(data, exp, *extra, crash=None, timeout=240) -> _Result:
    """Run the job in its own session; output goes to a file (a SIGKILLed trainer may leave
    forked checkpoint writers holding a pipe open), and the session is killed afterwards."""
    env = {k: v for k, v in os.environ.items() if k != "NEMO_RLHF_CRASH_AT"}
    env["OMP_NUM_THREADS"] = "1"  # every run alike; two run side by side (:data:`PARALLEL`)
    if crash:
        env["NEMO_RLHF_CRASH_AT"] = crash
    Path(exp).mkdir(parents=True, exist_ok=True)
    log = Path(exp) / f"run_{time.time_ns()}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_cmd(data, exp, *extra), cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return _Result(code, log.read_text())


def _metrics(exp: Path) -> dict[int, dict]:
    out = {}
    for line in (exp / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = {k: v for k, v in row.items()
                            if not any(s in k for s in VOLATILE)}
    return out


def _prompt_ids(exp: Path) -> dict[int, list[int]]:
    out = {}
    for line in (exp / "prompt_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["prompt_ids"]  # a crashed attempt's line is superseded
    return out


def _tensors(ckpt: Path) -> dict:
    from nemo_rlhf.checkpoint.io import load_full_tensors

    return load_full_tensors(ckpt)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("recovery_data"))


@pytest.fixture(scope="module")
def baseline(data, forked_python_in_session, tmp_path_factory):
    exp = tmp_path_factory.mktemp("baseline")
    res = _run(data, exp)
    assert res.returncode == 0, res.stderr[-3000:]
    return exp


CRASHES = ("rollout:2", "update:3", "save_written:2", "save_published:2")
PARALLEL = 2
"""Independent runs (each single-threaded, mostly importing torch) run this many at a time:
the suite runs serially on 2 cores, so the second one is otherwise idle."""


def _side_by_side(chains: dict) -> dict:
    """Runs each of ``chains`` (name -> a function running its jobs one after another),
    :data:`PARALLEL` at a time; returns name -> its result, or the exception it raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = {name: pool.submit(chain) for name, chain in chains.items()}
    return {name: f.exception() or f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def kill9_runs(data, forked_python_in_session, tmp_path_factory):
    """Per crash point of :data:`CRASHES`: its folder, the run killed there and the resumed
    run (the chains side by side)."""
    def chain(crash: str):
        exp = tmp_path_factory.mktemp("kill9") / "exp"
        killed = _run(data, exp, crash=crash)
        return exp, killed, (_run(data, exp) if killed.returncode == -signal.SIGKILL else None)

    return _side_by_side({crash: (lambda c=crash: chain(c)) for crash in CRASHES})


@pytest.mark.parametrize("crash", CRASHES)
def test_kill9_then_resume_matches_uninterrupted_run(kill9_runs, baseline, crash):
    got = kill9_runs[crash]
    if isinstance(got, BaseException):
        raise got
    exp, killed, resumed = got
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr + resumed.stdout
    # no half checkpoint survives, every published one is complete
    names = sorted(p.name for p in (exp / "checkpoints").iterdir())
    assert names[-1] == "step_3" or "latest" in names
    assert not [n for n in names if n.startswith(".")], names
    _assert_same_run(exp, baseline, crash)


def _assert_same_run(exp: Path, baseline: Path, label: str) -> None:
    """The resumed run ``exp`` equals the uninterrupted ``baseline``: the final checkpoint's
    tensors bit for bit, the per-step metrics, and each step's prompts, each consumed once."""
    final, ref = exp / "checkpoints" / f"step_{STEPS}", baseline / "checkpoints" / f"step_{STEPS}"
    a, b = _tensors(final), _tensors(ref)
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), f"{label}: {k} differs from the uninterrupted run"
        else:
            assert a[k] == b[k], f"{label}: {k} differs from the uninterrupted run"
    assert _metrics(exp) == _metrics(baseline)
    ids, ref_ids = _prompt_ids(exp), _prompt_ids(baseline)
    assert ids == ref_ids and sorted(ids) == list(range(1, STEPS + 1))
    flat = [i for s in sorted(ids) for i in ids[s]]
    assert len(flat) == len(set(flat))  # 3 steps x 8 prompts < 64: no prompt twice


LORA = ("model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8",
        "exp_manager.init_value_head=true")


def test_lora_killed_in_its_update_resumes_bit_identical(data, baseline, tmp_path):
    """LoRA on a frozen base (the baseline's step-1 checkpoint): killed in step 2's update,
    resumed from the adapters-only step-1 checkpoint, equal to the uninterrupted LoRA run bit
    for bit (adapters, value head, their Adam state, metrics, prompts)."""
    base = f"exp_manager.init_from={baseline}/checkpoints/step_1"
    straight, exp = tmp_path / "straight", tmp_path / "exp"

    def killed_then_resumed():
        killed = _run(data, exp, *LORA, base, crash="update:2")
        return killed, (_run(data, exp, *LORA, base) if killed.returncode == -signal.SIGKILL else None)

    got = _side_by_side({"straight": lambda: _run(data, straight, *LORA, base),
                         "killed": killed_then_resumed})
    for x in got.values():
        if isinstance(x, BaseException):
            raise x
    res, (killed, resumed) = got["straight"], got["killed"]
    assert res.returncode == 0, res.stderr[-3000:]
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    saved = _tensors(exp / "checkpoints" / f"step_{STEPS}")
    weights = [k for k in saved if not k.startswith("optimizer.") and isinstance(saved[k], torch.Tensor)]
    assert weights and all("_lora." in k or "value_head" in k for k in weights), weights  # adapters only
    _assert_same_run(exp, straight, "lora update:2")


def test_kl_coefficient_sampler_and_reward_state_are_in_the_checkpoint(baseline):
    state = json.loads((baseline / "checkpoints" / f"step_{STEPS}" / "trainer_state.json").read_text())
    assert state["step"] == STEPS
    assert state["sampler"]["consumed_samples"] == STEPS * 8
    beta = state["kl_controller"]["value"]
    assert beta != 0.05  # the adaptive controller moved it, and the moved value is saved
    assert (baseline / "checkpoints" / f"step_{STEPS}" / "rng" / "rank_0.pt").is_file()


def test_sigusr1_saves_the_step_and_exits_with_requeue_code(data, tmp_path):
    exp = tmp_path / "exp"
    proc = subprocess.Popen(_cmd(data, exp, "trainer.max_steps=50", "exp_manager.save_interval=0"),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        log = exp / "prompt_log.jsonl"
        if log.exists() and len(log.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == REQUEUE_EXIT_CODE, out[-3000:]
    latest = (exp / "checkpoints" / "latest").read_text().strip()
    step = int(latest.split("_")[1])
    assert step >= 2 and (exp / "checkpoints" / latest / "COMPLETE").is_file()
    assert json.loads((exp / "checkpoints" / latest / "trainer_state.json").read_text())["step"] == step


def test_fingerprint_mismatch_is_refused_naming_what_differs(data, baseline, tmp_path):
    import shutil

    exp = tmp_path / "exp"
    shutil.copytree(baseline / "checkpoints", exp / "checkpoints")
    res = _run(data, exp, "model.num_layers=4", f"trainer.max_steps={STEPS + 1}")
    assert res.returncode != 0
    assert "model.num_layers: saved 2, now 4" in res.stderr
    # different prompts: refused, then loaded with the explicit flag
    other = tmp_path / "prompts.jsonl"
    other.write_text("".join((data / "ppo_prompts.jsonl").read_text().splitlines(True)[:-1]))
    res = _run(data, exp, f"data.train_file={other}", f"trainer.max_steps={STEPS + 1}")
    assert res.returncode != 0 and "train_prompts: saved" in res.stderr
    forced = _run(data, exp, f"data.train_file={other}", f"trainer.max_steps={STEPS + 1}",
                  "exp_manager.ignore_fingerprint=true")
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert "loading" in forced.stderr and "despite fingerprint differences" in forced.stderr
    assert (exp / "checkpoints" / f"step_{STEPS + 1}" / "COMPLETE").is_file()


def test_corrupt_shard_falls_back_to_previous_checkpoint_with_warning(data, baseline, tmp_path):
    import shutil

    exp = tmp_path / "exp"
    shutil.copytree(baseline / "checkpoints", exp / "checkpoints")
    newest = exp / "checkpoints" / f"step_{STEPS}" / "dist"
    shard = max((p for p in newest.rglob("*") if p.is_file() and p.suffix == ".distcp"),
                key=lambda p: p.stat().st_size)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    res = _run(data, exp, f"trainer.max_steps={STEPS + 1}")
    assert res.returncode == 0, res.stderr[-2000:]
    text = res.stderr + res.stdout
    assert f"checkpoint {exp / 'checkpoints' / f'step_{STEPS}'} is corrupt" in text
    assert f"resumed from {exp / 'checkpoints' / f'step_{STEPS - 1}'}" in text
