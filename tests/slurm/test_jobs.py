"""The sbatch templates on a real one-node Slurm cluster (tests/slurm/conftest.py).

A tiny RM trained by ``slurm/rm.sbatch``; the tiny PPO job (2 ranks, TP=2) with that RM served
as its own job step -> checkpoints, TensorBoard events, the resolved config and command
line in the experiment folder; the same job sent USR1 mid-run -> it saves, requeues
itself, resumes from that checkpoint and ends where the uninterrupted job ended, step
for step; a sweep as a job array (reward functions only, no RM); the standalone RM
server job; ``bash -n`` and ``sbatch --test-only`` on rendered scripts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.ppo_helpers import make_demo_data

STEPS = 20
VOLATILE = ("timing/", "_per_s", "time/", "perf/")


def _ppo_overrides(data: Path, exp: Path) -> list[str]:
    return [f"data.train_file={data}/ppo_prompts.jsonl", f"data.val_file={data}/eval.jsonl",
            f"data.tokenizer_dir={data}/tokenizer", f"exp_manager.exp_dir={exp}",
            f"trainer.max_steps={STEPS}", "trainer.val_check_interval=0", "trainer.sample_table_every=0",
            "exp_manager.save_interval=0", "exp_manager.keep_last=5", "ppo.num_rollout_samples=8",
            "ppo.global_batch_size=4", "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=4",
            "rollout.max_new_tokens=4", "reward.normalization=none",
            "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
            # TP=2: one scoring rank, so the RM server's dynamic batches are the same in both
            # runs (with DP=2 two clients' requests share batches by arrival time, and the
            # padded shapes move the RM's scores in their last bits)
            "parallel.tensor_model_parallel_size=2"]


def _done(info: dict) -> bool:
    return info.get("JobState") == "COMPLETED"


def _log(exp: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(exp.glob("slurm-*.out")))


def _metrics(exp: Path) -> dict[int, dict]:
    out = {}
    for line in (exp / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = {k: v for k, v in row.items() if not any(s in k for s in VOLATILE)}
    return out


def _prompt_ids(exp: Path) -> dict[tuple[int, int], list[int]]:
    """(step, dp_rank) -> prompt ids (each DP rank logs its share of the step)."""
    out = {}
    for line in (exp / "prompt_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"], row["dp_rank"]] = row["prompt_ids"]
    return out


def _state(exp: Path, step: int) -> dict:
    return json.loads((exp / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("slurm_data"))


@pytest.fixture(scope="module")
def rm_checkpoint(slurm, data, tmp_path_factory):
    """A tiny RM trained for 2 steps by slurm/rm.sbatch (2 ranks)."""
    exp = tmp_path_factory.mktemp("rm_job")
    job = slurm.submit("--job", "rm", "--config-name", "rm_tiny", f"data.train_file={data}/preference.jsonl",
                       f"data.val_file={data}/preference_val.jsonl", f"data.tokenizer_dir={data}/tokenizer",
                       f"exp_manager.exp_dir={exp}", "trainer.max_steps=2", "trainer.val_check_interval=0",
                       "trainer.global_batch_size=8", "trainer.micro_batch_size=4")
    slurm.wait(job, _done, 240, "for the RM job to complete", exp / "slurm-*.out")
    assert (exp / "checkpoints" / "step_2" / "COMPLETE").is_file()
    return exp / "checkpoints"


@pytest.fixture(scope="module")
def uninterrupted(slurm, data, rm_checkpoint, tmp_path_factory):
    """The tiny PPO job with the RM server step, run to the end without interruption."""
    exp = tmp_path_factory.mktemp("ppo_job")
    job = slurm.submit("--config-name", "ppo_tiny", "--rm-checkpoint", str(rm_checkpoint), *_ppo_overrides(data, exp))
    info = slurm.wait(job, _done, 300, "for the PPO job to complete", exp / "slurm-*.out")
    return exp, info


def test_rendered_scripts_pass_bash_n_and_sbatch_test_only(slurm, tmp_path):
    from launchers.slurm import prepare

    no_rm = "reward.functions=[{name: arithmetic_exact_match}]"
    cases = {"ppo": prepare("ppo", [no_rm], config_name="ppo_tiny"),
             "ppo_rm": prepare("ppo", ["reward.functions=[]"], rm_checkpoint=str(tmp_path), config_name="ppo_tiny"),
             "ppo_async": prepare("ppo", [no_rm, "rollout.mode=async", "rollout.max_staleness=0"],
                                  config_name="ppo_tiny"),
             "ppo_sweep": prepare("ppo", [no_rm, f"exp_manager.exp_dir={tmp_path}/sweep"], config_name="ppo_tiny",
                                  sweeps=["kl.target=1,3,6"]),
             "sft": prepare("sft", ["trainer.micro_batch_size=8"], config_name="sft_tiny"),
             "rm": prepare("rm", ["trainer.micro_batch_size=8"], config_name="rm_tiny"),
             "rm_server": prepare("rm_server", ["checkpoint=/ckpt"])}
    for name, job in cases.items():
        path = tmp_path / f"{name}.sbatch"
        path.write_text(job.script)
        slurm.run("bash", "-n", str(path))
        res = slurm.run("sbatch", "--test-only", str(path))
        assert "to start at" in res.stderr, f"{name}: {res.stderr}"  # sbatch: Job N to start at ...
    # and through the launcher's own --test-only
    res = slurm.launch("--test-only", "--config-name", "ppo_tiny", "--sweep", "kl.target=1,3", no_rm, f"exp_manager.exp_dir={tmp_path}/s2")
    assert res.returncode == 0 and "to start at" in res.stdout, res.stderr[-2000:]


def test_ppo_job_with_rm_server_step_completes_with_checkpoints_and_events(uninterrupted, rm_checkpoint):
    exp, info = uninterrupted
    assert info["Restarts"] == "0" and info["ExitCode"] == "0:0"
    ckpts = exp / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{STEPS}"
    assert (ckpts / f"step_{STEPS}" / "COMPLETE").is_file()
    assert _state(exp, STEPS)["step"] == STEPS
    assert list((exp / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(_metrics(exp)) == list(range(1, STEPS + 1))
    log = _log(exp)
    assert "trainer: 1 node(s) x 2 rank(s)" in log and log.count("starting fresh") == 2  # one per rank
    assert "main step finished" in log
    # the RM server ran as its own step, was used, and was stopped cleanly
    server = (exp / "rm_server.log").read_text()
    assert "reward model server ready at http://" in server and str(rm_checkpoint) in server
    assert "POST http://" in log and "/score" in log
    assert not (exp / "rm_address").exists()  # removed by the server on its graceful stop
    # the experiment folder records the resolved config and the command line
    cfg = (exp / "config.yaml").read_text()
    assert f"max_steps: {STEPS}" in cfg and f"rm_address_file: {exp}/rm_address" in cfg
    argv = json.loads((exp / "command_lines.txt").read_text().splitlines()[-1])["argv"]
    assert f"trainer.max_steps={STEPS}" in argv and f"reward.rm_address_file={exp}/rm_address" in argv
    assert list((exp / "slurm").glob("ppo-*.sbatch"))  # the submitted script is kept


def test_usr1_saves_requeues_and_resumes_to_the_uninterrupted_result(slurm, data, rm_checkpoint,
                                                                     uninterrupted, tmp_path):
    base, _ = uninterrupted
    exp = tmp_path / "exp"
    job = slurm.submit("--config-name", "ppo_tiny", "--rm-checkpoint", str(rm_checkpoint), *_ppo_overrides(data, exp))
    prompt_log = exp / "prompt_log.jsonl"
    slurm.wait(job, lambda i: prompt_log.is_file() and len(prompt_log.read_text().splitlines()) >= 2,
               240, "for the first PPO step", exp / "slurm-*.out", poll_s=0.1)
    slurm.run("scancel", "--signal=USR1", "--batch", job)

    # saved, exited with 42, requeued: pending (Slurm holds a requeued job back ~2 min,
    # Reason=BeginTime; StartTime=now lets it run at once, else the wait below covers it)
    info = slurm.wait(job, lambda i: i.get("Restarts") == "1" and i.get("JobState") in ("PENDING", "RUNNING", "COMPLETED"),
                      120, "for the requeue", exp / "slurm-*.out", final=("FAILED", "TIMEOUT", "NODE_FAIL"))
    if info["JobState"] == "PENDING":
        # release the hold only once the node has finished cleaning up the first run:
        # releasing while it is still COMPLETING makes slurmd refuse the launch ("Job
        # already killed, do not launch batch job") and the job fails
        deadline = time.time() + 90
        while time.time() < deadline:
            if slurm.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() == "idle":
                break
            time.sleep(0.5)
        time.sleep(2)
        slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
    final = slurm.wait(job, _done, 300, "for the requeued job to complete", exp / "slurm-*.out")
    assert final["Restarts"] == "1"

    log = _log(exp)
    assert "SIGUSR1: forwarding it to the trainer step" in log
    assert "main step saved and asked to be requeued (exit code 42)" in log
    assert "PPO job on" in log and "(restart 1)" in log  # --open-mode=append: both runs in one log
    saved = sorted(int(p.name.split("_")[1]) for p in (exp / "checkpoints").glob("step_*"))
    assert len(saved) == 2 and saved[0] < STEPS and saved[1] == STEPS, saved
    assert f"resumed from {exp / 'checkpoints' / f'step_{saved[0]}'} at step {saved[0]}" in log

    # same end as the uninterrupted job: final step, sampler position, prompts, metrics
    state, ref = _state(exp, STEPS), _state(base, STEPS)
    assert state["step"] == ref["step"] == STEPS
    assert state["sampler"] == ref["sampler"]
    assert _prompt_ids(exp) == _prompt_ids(base)
    got, want = _metrics(exp), _metrics(base)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:  # bit-identical on CPU, the RM's scores included
        assert got[step] == want[step], f"step {step}"
    assert len(list((exp / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per run
    assert len((exp / "command_lines.txt").read_text().splitlines()) == 2  # one per run


def test_standalone_rm_server_job_serves_until_usr1(slurm, rm_checkpoint, tmp_path):
    import httpx

    address_file = tmp_path / "srv" / "rm_address"
    job = slurm.submit("--job", "rm_server", "--rm-checkpoint", str(rm_checkpoint),
                       f"server.address_file={address_file}")
    slurm.wait(job, lambda i: address_file.is_file() and address_file.read_text().startswith("http"),
               180, "for the RM server's address", tmp_path / "srv" / "slurm-*.out")
    url = address_file.read_text().strip()
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url}/health never answered 200"
        time.sleep(0.5)
    slurm.run("scancel", "--signal=USR1", "--batch", job)
    info = slurm.wait(job, _done, 120, "for the RM server job to stop", tmp_path / "srv" / "slurm-*.out")
    assert info["ExitCode"] == "0:0"
    assert "RM server stopped after SIGUSR1" in _log(tmp_path / "srv")
    assert not address_file.exists()


def test_sweep_job_array_runs_each_value_in_its_own_folder(slurm, data, tmp_path):
    exp = tmp_path / "sweep"
    overrides = [o for o in _ppo_overrides(data, exp)
                 if not o.startswith(("trainer.max_steps=", "parallel."))]
    # one rank per task: both array tasks fit on the 2 CPUs at once
    job = slurm.submit("cluster.ntasks_per_node=1", "--config-name", "ppo_tiny", "--sweep", "kl.target=1,3", *overrides, "trainer.max_steps=2")
    for task in ("0", "1"):
        slurm.wait(f"{job}_{task}", _done, 240, f"for array task {task}", exp / "slurm-*.out")
    for value in (1, 3):
        task_dir = exp / f"kl.target={value}"
        assert (task_dir / "checkpoints" / "step_2" / "COMPLETE").is_file()
        cfg = (task_dir / "config.yaml").read_text()
        assert f"target: {float(value)}" in cfg and f"exp_dir: {task_dir}" in cfg
        assert list((task_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert not (exp / "checkpoints").exists()  # nothing ran in the sweep's base folder


def test_async_ppo_job_runs_its_rollout_worker_as_a_step(slurm, data, tmp_path):
    """rollout.mode=async: the rollout worker runs as its own step beside the trainer (one
    rank), connects to the trainer's controller, and both end cleanly."""
    exp = tmp_path / "async"
    overrides = [o for o in _ppo_overrides(data, exp) if not o.startswith(("trainer.max_steps=", "parallel."))]
    job = slurm.submit("cluster.ntasks_per_node=1", "--config-name", "ppo_tiny", *overrides, "trainer.max_steps=3",
                       "rollout.mode=async", "rollout.max_staleness=1", "ppo.rollout_is_cap=2.0")
    info = slurm.wait(job, _done, 300, "for the async PPO job to complete", exp / "slurm-*.out")
    assert info["ExitCode"] == "0:0"
    log = _log(exp)
    assert "starting 1 rollout worker(s) (--nodes=1" in log and "stopping the rollout workers" in log
    assert "rollout worker 0 connected" in (exp / "rollout_workers.log").read_text()
    m = _metrics(exp)
    assert [m[s]["async/staleness_max"] for s in sorted(m)] == [0, 1, 1]


def test_the_readmes_multi_node_commands_pass_sbatch_test_only(slurm, tmp_path):
    """Every launchers.slurm command of the README and its pages (the README walkthrough's RM
    job and PPO on 2 trainer nodes + an RM node, docs/slurm.md's PPO on 4 + 1) with
    conf/cluster/example.yaml, asked of the scheduler with --test-only against the test
    cluster's never-started partition of 8-GPU nodes (tests/slurm/cluster.sh); /shared
    holds an 8B-shaped checkpoint's config only."""
    from tests.e2e.test_walkthrough import SHARED, _fake_8b
    from tests.unit.project.test_readme_commands import readme_commands

    _fake_8b(tmp_path, "llama3_8b")
    cmds = [c for c in readme_commands() if c[:3] == ["python", "-m", "launchers.slurm"]]
    assert len(cmds) == 3
    for cmd in cmds:
        nodes = int(next(w for w in cmd if w.startswith("cluster.nodes=")).split("=")[1])
        res = slurm.launch("--test-only", *[w.replace(SHARED, str(tmp_path)) for w in cmd[3:]])
        assert res.returncode == 0, res.stderr[-3000:]
        where = "on nodes gpu-1 in partition batch" if nodes == 1 else f"on nodes gpu-[1-{nodes}] in partition batch"
        assert "to start at" in res.stdout and where in res.stdout, (where, res.stdout, res.stderr[-2000:])
