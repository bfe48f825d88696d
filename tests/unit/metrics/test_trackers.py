"""W&B and MLflow beside TensorBoard: every scalar under its TensorBoard name and step, the
resolved config as the run's config / params, one tracker run continued across a resume,
a clear error when the library is missing."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import pytest

from nemo_rlhf.metrics.logger import MetricsLogger
from nemo_rlhf.metrics.trackers import LoggerConfig, MLflowConfig, WandbConfig, _check_installed

RUN_CONFIG = {"trainer": {"seed": 3, "max_steps": 2}, "kl": {"target": 6.0}}


def _log_two_steps(exp_dir, cfg, start=0):
    logger = MetricsLogger(exp_dir, enabled=True, total_steps=start + 2, start_step=start,
                           trackers=cfg, run_config=RUN_CONFIG)
    for step in (start + 1, start + 2):
        logger.log_metrics({"kl_mean": 0.5 * step, "eval/accuracy": 0.1 * step, "bad": float("nan"),
                            "note": "text"}, step)
    logger.close()


def test_mlflow_gets_every_scalar_the_config_and_one_run_across_a_resume(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    cfg = LoggerConfig(mlflow=MLflowConfig(enabled=True, experiment="exp"))
    _log_two_steps(tmp_path, cfg)
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    _log_two_steps(tmp_path, cfg, start=2)  # a requeued job: the same run continues
    assert json.loads((tmp_path / "trackers.json").read_text())["mlflow"] == run_id
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").as_uri())
    kl = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/kl_mean")]
    assert sorted(kl) == [(1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0)]
    acc = sorted((m.step, round(m.value, 6)) for m in client.get_metric_history(run_id, "eval/accuracy"))
    assert acc == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    run = client.get_run(run_id)
    assert run.data.params["trainer.seed"] == "3" and run.data.params["kl.target"] == "6.0"
    assert "train/bad" not in run.data.metrics  # non-finite values are left out, as in TensorBoard
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert [e.name for e in client.search_experiments()].count("exp") == 1


class _FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, metrics, step):
        self.calls.append(("log", dict(metrics), step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_init_arguments_payloads_and_the_resumed_id(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(("init", kw)) or _FakeRun(calls)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = LoggerConfig(wandb=WandbConfig(enabled=True, project="p", tags=["a"]))
    _log_two_steps(tmp_path, cfg)
    _log_two_steps(tmp_path, cfg, start=2)
    inits = [c[1] for c in calls if c[0] == "init"]
    run_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]
    assert [i["id"] for i in inits] == [run_id, run_id] and len(run_id) == 8  # resumed, not redrawn
    assert inits[0]["mode"] == "offline" and inits[0]["resume"] == "allow" and inits[0]["dir"] == str(tmp_path)
    assert inits[0]["config"] == RUN_CONFIG and inits[0]["name"] == tmp_path.name and inits[0]["tags"] == ["a"]
    logs = [c for c in calls if c[0] == "log"]
    assert logs[0] == ("log", {"train/kl_mean": 0.5, "eval/accuracy": 0.1}, 1)
    assert [c[2] for c in logs] == [1, 2, 3, 4]
    assert [c[0] for c in calls].count("finish") == 2


def test_wandb_offline_writes_its_run_files_under_the_experiment(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_two_steps(tmp_path, LoggerConfig(wandb=WandbConfig(enabled=True)))
    run_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_a_tracker_without_its_library_is_refused_naming_the_key_and_the_extra():
    with pytest.raises(ValueError, match=r"logger.wandb.enabled=true needs the 'no_such_lib_x' library "
                                         r"\(pip install 'nemo_rlhf\[trackers\]'\)"):
        _check_installed(True, "no_such_lib_x", "logger.wandb.enabled")
    _check_installed(False, "no_such_lib_x", "logger.wandb.enabled")
    with pytest.raises(ValueError, match=r"logger.wandb.mode='cloud': valid choices are \['offline', 'online'\]"):
        WandbConfig(mode="cloud")


@pytest.mark.parametrize("job", ["ppo_tiny", "sft_tiny", "rm_tiny"])
def test_every_job_takes_the_logger_keys_on_the_command_line(job):
    pytest.importorskip("mlflow")
    from tests.conf_helpers import typed_job

    cfg = typed_job(job, ["logger.mlflow.enabled=true", "logger.mlflow.experiment=e1",
                            "logger.wandb.mode=online"])
    assert cfg.logger.mlflow.enabled and cfg.logger.mlflow.experiment == "e1"
    assert cfg.logger.wandb.mode == "online" and not cfg.logger.wandb.enabled
