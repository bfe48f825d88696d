"""Experiment trackers beside TensorBoard: Weights & Biases and MLflow (config section ``logger``).

Both are optional (``pip install 'nemo_rlhf[trackers]'``) and off by default; a job with a
tracker enabled and its library missing stops at start-up naming the key and the extra.

* ``logger.wandb.enabled=true``: ``wandb.init`` in ``logger.wandb.mode`` (``offline`` by
  default: compute nodes often have no internet; ``wandb sync <exp_dir>/wandb/offline-run-*``
  uploads later; ``online`` needs ``WANDB_API_KEY``). Files go to ``<exp_dir>/wandb``.
* ``logger.mlflow.enabled=true``: an MLflow run under ``logger.mlflow.experiment``, at
  ``logger.mlflow.tracking_uri`` (a server ``http://...``, ``sqlite:///...``, or by default
  the local file store ``file:<exp_dir>/mlruns``; ``mlflow ui --backend-store-uri`` reads it).

Every scalar :class:`~nemo_rlhf.metrics.logger.MetricsLogger` writes to TensorBoard goes to
the trackers too, under the same name (``train/kl_mean``, ``eval/accuracy``...) and step; the
resolved config is the run's config (W&B) or its flattened params (MLflow). A requeued or
resumed job continues the same tracker run: the run ids are kept in
``<exp_dir>/trackers.json`` (written by the reporting rank on the first start).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from nemo_rlhf.config import check_choice

log = logging.getLogger(__name__)

WANDB_MODES = ("offline", "online")
EXTRA = "pip install 'nemo_rlhf[trackers]'"


def _check_installed(enabled: bool, module: str, key: str) -> None:
    """Refuse an enabled tracker without its library when the config is built (every rank,
    before any process group), not when the reporting rank opens it."""
    import importlib.util

    if enabled and importlib.util.find_spec(module) is None:
        raise ValueError(f"{key}=true needs the {module!r} library ({EXTRA})")


@dataclass
class WandbConfig:
    """``logger.wandb``: a Weights & Biases run."""

    enabled: bool = False
    project: str = "nemo_rlhf"
    entity: Optional[str] = None
    """Team or user; None: the API key's default."""
    name: Optional[str] = None
    """Run name; None: the experiment folder's name."""
    mode: str = "offline"
    """``offline`` (files only, ``wandb sync`` later) or ``online``."""
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_choice("logger.wandb.mode", self.mode, WANDB_MODES)
        _check_installed(self.enabled, "wandb", "logger.wandb.enabled")


@dataclass
class MLflowConfig:
    """``logger.mlflow``: an MLflow run."""

    enabled: bool = False
    tracking_uri: Optional[str] = None
    """``http(s)://`` server, ``sqlite:///path``, ``file:/path``; None: ``file:<exp_dir>/mlruns``."""
    experiment: str = "nemo_rlhf"
    run_name: Optional[str] = None
    """None: the experiment folder's name."""

    def __post_init__(self) -> None:
        _check_installed(self.enabled, "mlflow", "logger.mlflow.enabled")


@dataclass
class LoggerConfig:
    """Trackers beside TensorBoard and ``metrics.jsonl`` (config section ``logger``)."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _import(module: str, key: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(f"{key}=true needs the {module!r} library ({EXTRA})") from None


class _Ids:
    """``<exp_dir>/trackers.json``: the tracker run ids a resumed job continues."""

    def __init__(self, exp_dir: Path):
        self.path = Path(exp_dir) / "trackers.json"
        self.ids = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def get(self, name: str) -> Optional[str]:
        return self.ids.get(name)

    def put(self, name: str, value: str) -> None:
        self.ids[name] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.ids, indent=2))
        os.replace(tmp, self.path)


class WandbTracker:
    """A W&B run (:class:`WandbConfig`), resumed by id when ``trackers.json`` has one."""

    def __init__(self, cfg: WandbConfig, exp_dir: Path, run_config: dict, ids: _Ids):
        wandb = _import("wandb", "logger.wandb.enabled")
        run_id = ids.get("wandb") or uuid.uuid4().hex[:8]  # W&B's own id form: 8 of [a-z0-9]
        (Path(exp_dir) / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or Path(exp_dir).name,
                              mode=cfg.mode, dir=str(exp_dir), id=run_id, resume="allow",
                              tags=list(cfg.tags) or None, config=run_config)
        ids.put("wandb", run_id)
        log.info("wandb run %s (%s mode) in %s", run_id, cfg.mode, Path(exp_dir) / "wandb")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowTracker:
    """An MLflow run (:class:`MLflowConfig`), resumed by id when ``trackers.json`` has one."""

    def __init__(self, cfg: MLflowConfig, exp_dir: Path, run_config: dict, ids: _Ids):
        mlflow = _import("mlflow", "logger.mlflow.enabled")
        uri = cfg.tracking_uri or (Path(exp_dir).resolve() / "mlruns").as_uri()
        if uri.startswith("file:"):
            # MLflow >= 3.7 refuses its file store unless asked: it is the only backend
            # that needs no database library, and the one a compute node can always write
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.tracking.MlflowClient(uri)
        run_id = ids.get("mlflow")
        if run_id is None:
            exp = self.client.get_experiment_by_name(cfg.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.experiment)
            run_id = self.client.create_run(exp_id, run_name=cfg.run_name or Path(exp_dir).name).info.run_id
            params = _flatten(run_config)
            items = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow's batch limit
                self.client.log_batch(run_id, params=items[i:i + 100])
            ids.put("mlflow", run_id)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id, self._mlflow = run_id, mlflow
        log.info("mlflow run %s at %s", run_id, uri)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        now = int(time.time() * 1000)
        items = [self._mlflow.entities.Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(cfg: Optional[LoggerConfig], exp_dir: Path, run_config: Optional[dict]) -> list:
    """The enabled trackers (call on the reporting rank only).

    Raises:
        RuntimeError: a tracker enabled whose library is not installed (naming the key and
            the extra to install).
    """
    if cfg is None:
        return []
    ids = _Ids(exp_dir)
    out = []
    if cfg.wandb.enabled:
        out.append(WandbTracker(cfg.wandb, exp_dir, run_config or {}, ids))
    if cfg.mlflow.enabled:
        out.append(MLflowTracker(cfg.mlflow, exp_dir, run_config or {}, ids))
    return out
