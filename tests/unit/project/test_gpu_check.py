"""benchmarks/gpu_check.py: the dry run (--cpu) end to end, the no-GPU exit, and its pieces."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), **extra)


def test_without_cuda_and_without_cpu_flag_it_says_so_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "r.json")],
                          env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "needs a CUDA GPU" in proc.stderr and "--cpu" in proc.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_cpu_dry_run_passes_and_writes_the_report(tmp_path):
    out = tmp_path / "report" / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--out", str(out), "--work-dir", str(tmp_path / "w")],
        env=_env(), capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu" and report["ok"] is True
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status == {"setup": "skipped", "device_tests_cpu": "ok", "data": "ok", "rm_tiny": "ok",
                      "ppo_tiny": "ok", "ppo_tiny_distopt": "skipped", "ppo_smollm2": "skipped",
                      "rollout_benchmark": "ok", "vllm_benchmark": "skipped", "context_parallel": "ok",
                      "routing_replay": "ok"}
    assert report["device_tests"]["passed"] > 0 and report["device_tests"]["failures"] == []
    assert report["environment"]["device"] == "cpu" and report["environment"]["torch"]
    assert report["peak"]["source"].startswith("measured host") and report["peak"]["tflops"] > 0

    run = report["ppo"]["tiny"]
    assert run["exit_code"] == 0 and run["steps"] == 2 and run["nonfinite_core"] == []
    last = run["per_step"][-1]
    assert last["shapes"]["batch"] == 16 and last["shapes"]["seq_len"] == (
        last["shapes"]["prompt_len"] + last["shapes"]["response_len"])
    assert last["flops"]["train"] > 0 and last["phases"]["train"]["s"] > 0
    summary = run["summary"]
    assert summary["steps_used"] == [2]
    assert math.isfinite(summary["train_mfu"]) and summary["train_mfu"] > 0
    assert summary["train_mfu"] == pytest.approx(
        last["flops"]["train"] / last["phases"]["train"]["s"] / 1e12 / report["peak"]["tflops"])
    assert summary["rollout_tokens_per_s"] > 0
    assert summary["reference_swap_in_s"] > 0 and summary["reference_swap_out_s"] > 0
    # no CUDA: no memory figures from the probe, and none from the trainer's metrics
    assert summary["memory_gib"]["train"] == {"probe_peak_allocated_gib": None,
                                              "probe_peak_reserved_gib": None}

    bench = report["rollout_benchmark"]
    assert bench["device"] == "cpu" and bench["rows"][0]["kv_tokens_per_s"] > 0
    assert bench["rows"][0]["hf_tokens_per_s"] > 0
    cp = report["context_parallel"]["summary"]  # gloo ranks on the host
    assert [r["length"] for r in cp] == [256] and cp[0]["device"] == "cpu"
    assert cp[0]["max_rel_metric_diff"] <= 1e-5 and 0 < cp[0]["ratio"] < 1
    replay = report["routing_replay"]["summary"]
    assert set(replay) == {"without_replay", "with_replay"}
    assert replay["without_replay"]["rollout_train_logprob_diff_max"] > 0
    assert "all steps passed" in proc.stdout and "train TFLOP/s" in proc.stdout


def test_peak_table_matches_device_names_and_override_wins():
    args = SimpleNamespace(peak_tflops=None)
    for name, tflops in (("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                         ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                         ("NVIDIA L40S", 362.0)):
        assert gpu_check._peak(args, None, False, {"device": name})["tflops"] == tflops, name
    unknown = gpu_check._peak(args, None, False, {"device": "NVIDIA T4"})
    assert unknown["tflops"] is None and "--peak-tflops" in unknown["source"]
    given = gpu_check._peak(SimpleNamespace(peak_tflops=500.0), None, False, {"device": "NVIDIA H200"})
    assert given == {"tflops": 500.0, "source": "--peak-tflops"}


def test_missing_requirements_are_absent_or_too_old():
    reqs = ["pytest>=1", "pytest==0.0.1", "surely-not-installed-package==1.0", "packaging>=999",
            "PyYAML>=1"]
    # a name is judged once (its first line); pytest>=1 holds, so pytest==0.0.1 is not listed
    assert gpu_check.missing_requirements(reqs) == ["surely-not-installed-package==1.0",
                                                    "packaging>=999"]


def test_requirements_never_include_torch_and_cover_the_pyproject_dependencies():
    reqs = gpu_check._requirements()
    names = [r.split("=")[0].split(">")[0].split("<")[0].strip().lower() for r in reqs]
    assert "torch" not in names
    for name in ("megatron-core", "hydra-core", "omegaconf", "antlr4-python3-runtime", "fastapi",
                 "uvicorn", "pydantic", "pydantic-core", "tensorboard", "httpx"):
        assert name in names, name


def test_junit_summary_counts_and_names_failures(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="1" skipped="0">'
        '<testcase classname="tests.unit.test_x" name="test_ok"/>'
        '<testcase classname="tests.unit.test_x" name="test_ok2"/>'
        '<testcase classname="tests.unit.test_x" name="test_bad">'
        '<failure message="AssertionError: devices differ&#10;more">tb</failure></testcase>'
        '<testcase classname="tests.unit.test_x" name="test_err"><error message="boom">tb</error>'
        '</testcase></testsuite></testsuites>')
    got = gpu_check._junit_summary(xml)
    assert (got["passed"], got["failed"], got["errors"], got["skipped"]) == (2, 1, 1, 0)
    assert got["failures"] == [
        {"test": "tests.unit.test_x::test_bad", "message": "AssertionError: devices differ"},
        {"test": "tests.unit.test_x::test_err", "message": "boom"}]
    assert gpu_check._junit_summary(tmp_path / "absent.xml")["passed"] == 0


def _step(step, train_flops, train_s, tokens, rollout_s, memory=None, metrics_memory=None):
    phases = {"train": {"s": train_s, **(memory or {})}, "rollout": {"s": rollout_s},
              "reference_swap_in": {"s": 0.2}, "reference_swap_out": {"s": 0.1},
              "reference_forward": {"s": 0.3}}
    return {"step": step, "flops": {"train": train_flops}, "phases": phases,
            "shapes": {"generated_tokens": tokens}, "reference_host_bytes": 4e9,
            "timing": {"timing/reference_logprobs_s": 0.7},
            "memory_metrics": metrics_memory or {}}


def test_summary_takes_medians_after_the_first_step_and_divides_by_the_peak():
    run = {"per_step": [
        _step(1, 1e15, 100.0, 10, 10.0),  # warm-up step: left out
        _step(2, 1e15, 2.0, 1000, 2.0, {"peak_allocated_gib": 3.0, "peak_reserved_gib": 4.0}),
        _step(3, 1e15, 4.0, 1000, 1.0, {"peak_allocated_gib": 5.0, "peak_reserved_gib": 6.0},
              {"memory/train_peak_allocated_gib": 5.5, "memory/train_peak_reserved_gib": 6.5}),
    ]}
    s = gpu_check.summarise_run(run, peak_tflops=1000.0)
    assert s["steps_used"] == [2, 3]
    assert s["train_tflops_per_s"] == pytest.approx((500 + 250) / 2)  # 1e15 / 2 s, 1e15 / 4 s
    assert s["train_mfu"] == pytest.approx(0.375)
    assert s["rollout_tokens_per_s"] == pytest.approx(750.0)  # median of 500 and 1000
    assert s["reference_swap_in_s"] == pytest.approx(0.2)
    assert s["reference_swap_in_gb_per_s"] == pytest.approx(20.0)  # 4 GB in 0.2 s
    assert s["reference_swap_out_gb_per_s"] == pytest.approx(20.0)  # 2 GB in 0.1 s
    assert s["memory_gib"]["train"] == {"probe_peak_allocated_gib": 5.0, "probe_peak_reserved_gib": 6.0,
                                        "metrics_peak_allocated_gib": 5.5,
                                        "metrics_peak_reserved_gib": 6.5}
    assert gpu_check.summarise_run(run, peak_tflops=None)["train_mfu"] is None


def _load_probe():
    spec = importlib.util.spec_from_file_location("gpu_check_trainer",
                                                  REPO / "benchmarks" / "gpu_check_trainer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _FakeReference:
    mode = "offload"

    def __init__(self, log):
        self.log = log

    def host_bytes(self):
        return 1000

    def swapped_in(self):
        from contextlib import contextmanager

        @contextmanager
        def cm():
            self.log.append("swap_in")
            yield "ref-model"
            self.log.append("swap_out")

        return cm()


class _FakeActor:
    """The actor role's forward (:meth:`PolicyRole.logprobs`): ``model`` None is the actor."""

    def __init__(self, log):
        self.log = log

    def logprobs(self, batch, model=None, *, with_values=False, **kwargs):
        self.log.append(f"forward:{model or 'actor'}:{with_values}")
        return {}


class _FakeTrainer:
    """The call structure of PPOTrainer.train_step: rollout, old forward, reference forward
    inside the swap (both by the actor role), update."""

    def __init__(self):
        import torch

        self.log, self.step = [], 0
        self.dims = SimpleNamespace(device=torch.device("cpu"), rank=0)
        self.reference = _FakeReference(self.log)
        self.actor = _FakeActor(self.log)
        self.torch = torch

    def rollout(self, idx):
        torch = self.torch
        B, P, R = len(idx), 5, 3
        self.log.append("rollout")
        return SimpleNamespace(input_ids=torch.zeros(B, P + R), prompt_length=P,
                               response_ids=torch.zeros(B, R),
                               response_mask=torch.tensor([[1, 1, 0]] * B, dtype=torch.bool))

    def update(self, batch, fwd, adv):
        self.log.append("update")
        return {"policy_loss": 0.0}

    def train_step(self):
        batch = self.rollout([1] * 4)
        self.actor.logprobs(batch, with_values=True)
        with self.reference.swapped_in() as ref:
            self.actor.logprobs(batch, ref, with_values=False)
        return {**self.update(batch, None, None), "memory/train_peak_allocated_gib": 1.5}


def test_probe_times_each_phase_and_computes_the_step_flops(tmp_path):
    from nemo_rlhf.metrics.flops import ppo_step_flops
    from nemo_rlhf.models.config import load_model_preset

    probe_mod = _load_probe()
    trainer = _FakeTrainer()
    cfg = SimpleNamespace(model=load_model_preset("tiny", vocab_size=17),
                          ppo=SimpleNamespace(ppo_epochs=2))
    path = tmp_path / "probe.jsonl"
    probe = probe_mod.PhaseProbe(trainer, cfg, path).install()
    metrics = trainer.train_step()
    assert metrics["policy_loss"] == 0.0  # the step's own result passes through
    assert trainer.log == ["rollout", "forward:actor:True", "swap_in", "forward:ref-model:False",
                           "swap_out", "update"]
    trainer.rollout([1])  # outside a step: runs, not recorded
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert record == probe.records[0]
    assert record["step"] == 1 and record["probe_unwrapped"] == []
    assert set(record["phases"]) == {"rollout", "old_logprobs_values", "reference_swap_in",
                                     "reference_forward", "reference_swap_out", "train"}
    assert all(p["s"] >= 0 and "peak_allocated_gib" not in p for p in record["phases"].values())
    assert record["shapes"] == {"batch": 4, "prompt_len": 5, "response_len": 3,
                                "generated_tokens": 8, "seq_len": 8, "ppo_epochs": 2}
    assert record["flops"] == ppo_step_flops(cfg.model, batch=4, prompt_len=5, response_len=3,
                                             ppo_epochs=2).to_dict()
    assert record["metrics_memory"] == {"memory/train_peak_allocated_gib": 1.5}
    assert record["reference_mode"] == "offload" and record["reference_host_bytes"] == 1000


def test_probe_leaves_out_a_phase_the_trainer_no_longer_has(tmp_path):
    probe_mod = _load_probe()
    trainer = _FakeTrainer()
    trainer.actor.logprobs = None  # e.g. renamed by a refactor
    cfg = SimpleNamespace(model=None, ppo=SimpleNamespace(ppo_epochs=1))
    probe = probe_mod.PhaseProbe(trainer, cfg, None).install()
    assert probe.unwrapped == ["actor.logprobs"]
