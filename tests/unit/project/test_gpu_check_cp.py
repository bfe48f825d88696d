"""benchmarks/gpu_check_cp.py: the GPU check's context-parallel and routing-replay steps,
their skip on one GPU and their pass / fail from the benchmarks' JSON (the benchmarks
themselves faked; the real ones run in test_gpu_check.py's dry run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[3]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check")
gpu_check_cp = gpu_check.gpu_check_cp


class FakeCheck:
    """A GPUCheck whose subprocesses write ``payload`` to the benchmark's ``--json`` path."""

    def __init__(self, tmp: Path, cpu: bool, gpus: int, payload: dict, rc: int = 0):
        self.cpu, self.work, self.python, self.report = cpu, tmp, sys.executable, {}
        self.args = SimpleNamespace(timeout_bench=10.0)
        self.torch = SimpleNamespace(cuda=SimpleNamespace(device_count=lambda: gpus))
        self.payload, self.rc, self.steps, self.cmds = payload, rc, [], []

    def run(self, name, cmd, timeout_s):
        self.cmds.append(cmd)
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(self.payload))
        step = gpu_check.Step(name)
        self.steps.append(step)
        return step, self.rc

    def settle(self, step, ok, detail):
        step.status, step.detail = ("ok" if ok else "failed"), detail
        return ok

    def skip(self, name, why):
        self.steps.append(gpu_check.Step(name, status="skipped", detail=why))


def _cp_payload(diff: float) -> dict:
    return {"summary": [{"length": 2048, "cp1_step_peak_mib": 800.0, "cp2_step_peak_mib": 280.0, "ratio": 0.35,
                         "cp1_rss_max_mib": 1.0, "cp2_rss_max_mib": 1.0, "max_rel_metric_diff": diff,
                         "device": "cuda:0"}]}


def test_context_parallel_is_skipped_with_a_reason_on_one_gpu(tmp_path):
    check = FakeCheck(tmp_path, cpu=False, gpus=1, payload={})
    assert gpu_check_cp.context_parallel(check) is True
    assert check.cmds == [] and check.steps[0].status == "skipped"
    assert "1 GPU visible" in check.steps[0].detail and "needs 2" in check.steps[0].detail


def test_context_parallel_passes_within_tolerance_and_reports_the_ratio(tmp_path):
    check = FakeCheck(tmp_path, cpu=False, gpus=2, payload=_cp_payload(5e-5))
    assert gpu_check_cp.context_parallel(check) is True
    cmd = check.cmds[0]
    assert cmd[1].endswith("bench_context_parallel_memory.py")
    assert cmd[cmd.index("--lengths") + 1:cmd.index("--rows")] == ["2048", "8192"]
    assert "(0.35x)" in check.steps[0].detail and check.report["context_parallel"]["summary"][0]["ratio"] == 0.35


def test_context_parallel_fails_past_tolerance_or_on_a_failed_run(tmp_path):
    assert gpu_check_cp.context_parallel(FakeCheck(tmp_path, cpu=False, gpus=2, payload=_cp_payload(2e-4))) is False
    # the host's tolerance is 1e-5
    assert gpu_check_cp.context_parallel(FakeCheck(tmp_path, cpu=True, gpus=0, payload=_cp_payload(5e-5))) is False
    check = FakeCheck(tmp_path, cpu=True, gpus=0, payload=_cp_payload(0.0), rc=1)
    assert gpu_check_cp.context_parallel(check) is False and "exit 1" in check.steps[0].detail


def _replay_payload(x: float) -> dict:
    run = {"rollout_train_logprob_diff_mean": 3e-4, "rollout_train_logprob_diff_max": x, "rollout_train_k3_kl": 8e-8}
    return {"summary": {"without_replay": run, "with_replay": {**run, "rollout_train_logprob_diff_max": 1e-3}}}


def test_routing_replay_passes_on_finite_metrics_and_reports_both(tmp_path):
    check = FakeCheck(tmp_path, cpu=True, gpus=0, payload=_replay_payload(3e-3))
    assert gpu_check_cp.routing_replay(check) is True
    assert "rollout_train_logprob_diff_max: 3.00e-03 / 1.00e-03" in check.steps[0].detail
    assert gpu_check_cp.routing_replay(FakeCheck(tmp_path, cpu=True, gpus=0, payload=_replay_payload(float("nan")))) is False
