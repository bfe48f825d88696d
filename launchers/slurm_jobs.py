"""The Slurm launcher's configs: the cluster (``conf/cluster/<name>.yaml`` over
:class:`SlurmClusterConfig`), the project's jobs (:data:`JOBS`) and composing a job's own
config with the launcher's overrides (:func:`compose_job`); see :mod:`launchers.slurm`.
"""

from __future__ import annotations

import itertools
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.config_store import ConfigStore

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "slurm"
DEFAULT_CLUSTER = "local"


class LaunchError(RuntimeError):
    """The job cannot be submitted as asked (bad overrides, layout, cluster settings)."""


@dataclass
class SlurmClusterConfig:
    """A Slurm cluster and the allocation of one job on it (config group ``cluster``)."""

    partition: Optional[str] = None
    """``--partition`` (None: the cluster's default partition)."""
    account: Optional[str] = None
    """``--account`` (None: the user's default account)."""
    qos: Optional[str] = None
    """``--qos`` (None: the default)."""
    nodes: int = 1
    """Nodes per job (for a PPO job with rm_dedicated_nodes, trainer nodes + RM nodes)."""
    gpus_per_node: int = 0
    """``--gpus-per-node``; 0: a CPU cluster."""
    ntasks_per_node: Optional[int] = None
    """Ranks per node (None: gpus_per_node, or 1 on a CPU cluster)."""
    cpus_per_task: int = 1
    """``--cpus-per-task`` (also OMP_NUM_THREADS of the ranks)."""
    mem: Optional[str] = None
    """``--mem`` per node, e.g. ``0`` (all of it) or ``200G`` (None: the cluster's default)."""
    time: str = "04:00:00"
    """``--time`` limit of one run of the job (a requeued job gets it again)."""
    exclusive: bool = False
    """``--exclusive`` whole nodes."""
    container_image: Optional[str] = None
    """pyxis/enroot ``srun --container-image`` (None: run on the host)."""
    container_mounts: list[str] = field(default_factory=list)
    """pyxis ``srun --container-mounts`` entries, ``src:dst[:flags]``."""
    signal_seconds: int = 120
    """PPO / RM server: ``--signal=B:USR1@<s>``, USR1 this many seconds before the time limit (0: none)."""
    max_requeues: int = 20
    """Self-requeues a job may do (SLURM_RESTART_COUNT); beyond it the job fails."""
    python: Optional[str] = None
    """Interpreter on the nodes (None: the one running this launcher; ``python`` in a container)."""
    repo_dir: Optional[str] = None
    """This repository as the nodes see it; the job runs there and relative paths start there (None: this checkout)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run in the batch script before the steps (``module load ...``, ``export ...``)."""
    extra_sbatch: list[str] = field(default_factory=list)
    """More ``#SBATCH`` options, e.g. ``--constraint=h100`` or ``--mail-type=FAIL``."""
    srun_args: list[str] = field(default_factory=list)
    """More ``srun`` options for every step, e.g. ``--mpi=pmix``."""
    rm_ntasks: int = 1
    """PPO with an RM server: its ranks (set its TP/PP with ``--rm-arg``)."""
    rm_dedicated_nodes: int = 0
    """PPO with an RM server: 0 shares the first node with the trainer (CPU); k gives it the last k nodes."""
    rm_start_timeout_s: int = 900
    """PPO with an RM server: the job fails if the server wrote no address within this."""
    rollout_dedicated_nodes: int = 0
    """PPO with ``rollout.mode=async``: 0 runs the ``rollout.num_workers`` rollout workers on
    the first node beside the trainer (a CPU cluster); k gives them k nodes of their own (the
    last ones before the RM server's), one worker per GPU: ``rollout.num_workers`` <= k x
    ``gpus_per_node``. A GPU cluster needs k >= 1 (a worker must not share a trainer's GPU)."""
    job_name_prefix: str = "nemo-rlhf"
    """``--job-name`` is ``<prefix>-<job>``."""

    def __post_init__(self) -> None:
        def bad(key: str, value: Any, what: str) -> ValueError:
            return ValueError(f"cluster.{key}={value!r}: {what}")

        for key in ("nodes", "cpus_per_task", "rm_ntasks", "rm_start_timeout_s"):
            if getattr(self, key) < 1:
                raise bad(key, getattr(self, key), "must be >= 1")
        for key in ("gpus_per_node", "signal_seconds", "max_requeues", "rm_dedicated_nodes",
                    "rollout_dedicated_nodes"):
            if getattr(self, key) < 0:
                raise bad(key, getattr(self, key), "must be >= 0")
        if self.ntasks_per_node is not None and self.ntasks_per_node < 1:
            raise bad("ntasks_per_node", self.ntasks_per_node, "must be >= 1 (or null)")
        if self.gpus_per_node and self.ntasks_per_node not in (None, self.gpus_per_node):
            raise bad("ntasks_per_node", self.ntasks_per_node,
                      f"must equal cluster.gpus_per_node={self.gpus_per_node} (one rank per GPU) or be null")
        if not re.fullmatch(r"[\w.-]+", self.job_name_prefix):
            raise bad("job_name_prefix", self.job_name_prefix, "letters, digits, '.', '_' or '-' only")

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node: ntasks_per_node, else one per GPU, else 1."""
        return self.ntasks_per_node or self.gpus_per_node or 1


ConfigStore.instance().store(group="cluster", name="slurm_cluster_schema", node=SlurmClusterConfig)


@dataclass(frozen=True)
class JobKind:
    """One of the project's jobs: its template, config and entry module."""

    template: str
    """File under slurm/."""
    config_name: str
    """Its primary config under conf/."""
    module: str
    """Entry module; importing it registers the config's schema."""
    exp_dir_key: Optional[str]
    """Config key of the experiment folder (None: the RM server has none)."""
    signal: bool
    """Whether the job takes ``--signal=B:USR1@<s>``."""
    requeue: bool
    """Whether the job is requeueable."""


JOBS = {
    "ppo": JobKind("ppo.sbatch", "ppo", "nemo_rlhf.train_ppo", "exp_manager.exp_dir", True, True),
    "sft": JobKind("sft.sbatch", "sft", "nemo_rlhf.train_sft", "exp_manager.exp_dir", True, True),
    "rm": JobKind("rm.sbatch", "rm", "nemo_rlhf.train_rm", "exp_manager.exp_dir", True, True),
    "rm_server": JobKind("rm_server.sbatch", "rm_server", "nemo_rlhf.serve_rm", None, True, False),
}
RM_SERVER_EXP_DIR = "experiments/rm_server"


@dataclass
class PreparedJob:
    """A validated, rendered job, ready for sbatch."""

    job: str
    script: str
    """The sbatch script."""
    exp_dir: Path
    """Experiment folder (absolute); a sweep's tasks use sub-folders of it."""
    task_exp_dirs: list[Path]
    """Each job (array) task's experiment folder."""
    repo_dir: Path
    """The repository on the nodes: the job runs there."""


# --------------------------------------------------------------------------- composing
def _describe(exc: BaseException) -> str:
    """An exception and its causes in one line (Hydra puts the key in the cause)."""
    parts = []
    while exc is not None and len(parts) < 5:
        for line in str(exc).splitlines():
            line = line.strip()
            if line and "$VALUE" not in line and not re.match(r"(reference|object)_type=", line) \
                    and line not in parts:
                parts.append(line)
        exc = exc.__cause__
    return "; ".join(parts)


def _compose(config_name: Optional[str], overrides: Sequence[str], what: str, init_key: Optional[str] = None):
    """Compose and type a config; with ``init_key``, the starting checkpoint's model is
    taken first, as the job itself will (:mod:`nemo_rlhf.checkpoint.source`)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    from nemo_rlhf.checkpoint.source import adopt_checkpoint_model
    from nemo_rlhf.models.config import CONF_DIR

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            dcfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=bool(init_key))
            if init_key:
                choice = dcfg.hydra.runtime.choices.get("model")
                with open_dict(dcfg):
                    del dcfg["hydra"]
                for note in adopt_checkpoint_model(dcfg, init_key, overrides, choice, missing_ok=True):
                    print(f"{what}: {note}", file=sys.stderr)
        node = dcfg.cluster if config_name is None else dcfg
        return OmegaConf.to_object(node)
    except Exception as exc:  # noqa: BLE001 - hydra/omegaconf/schema errors name the key
        raise LaunchError(f"{what}: {_describe(exc)}") from None


def compose_cluster(name: str = DEFAULT_CLUSTER, overrides: Sequence[str] = ()) -> SlurmClusterConfig:
    """``conf/cluster/<name>.yaml`` + ``cluster.<key>=<value>`` overrides, typed.

    Raises:
        LaunchError: unknown cluster, key or value (the message names it).
    """
    return _compose(None, [f"+cluster={name}", *overrides], f"cluster={name}")


def compose_job(job: str, overrides: Sequence[str], config_name: Optional[str] = None):
    """The job's config (``conf/<job>.yaml``, or ``conf/<config_name>.yaml``, + overrides)
    as its typed schema; a training job started from a checkpoint takes its model first
    (:func:`~nemo_rlhf.checkpoint.source.adopt_checkpoint_model`; a checkpoint not on this
    host is not checked).

    Raises:
        LaunchError: unknown key, wrong type, or a rule of the schema (naming the key);
            also ``+key=...`` for a key the schema lacks (Hydra lets ``+`` add it, and the
            typed conversion then drops or keeps it silently); a renamed key of a
            training job (naming the new one).
    """
    import importlib

    from nemo_rlhf.config import check_renamed_keys

    if JOBS[job].exp_dir_key:  # the training jobs (the RM server has no trainer section)
        try:
            check_renamed_keys(overrides)
        except ValueError as exc:
            raise LaunchError(f"{job} overrides: {exc}") from None
    importlib.import_module(JOBS[job].module)  # registers the schema
    from nemo_rlhf.checkpoint.source import INIT_FROM_KEYS

    cfg = _compose(config_name or JOBS[job].config_name, overrides, f"{job} overrides", INIT_FROM_KEYS.get(job))
    _check_added_keys(cfg, overrides, job)
    return cfg


def _check_added_keys(cfg, overrides: Sequence[str], job: str) -> None:
    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.structured(type(cfg))
    missing = object()
    for o in overrides:
        key = o.partition("=")[0]
        if not key.startswith("+"):
            continue
        key = key.lstrip("+")
        parent = OmegaConf.select(schema, key.rpartition(".")[0], default=None) if "." in key else None
        if isinstance(parent, DictConfig) and OmegaConf.get_type(parent) is dict:
            continue  # a new entry of a free-form dict field (data.fields, rm.extra_val_files)
        if OmegaConf.select(schema, key, default=missing) is missing:
            raise LaunchError(f"{job} overrides: {o!r} adds {key}, which is not a key of "
                              f"{type(cfg).__name__} (misspelt?)")


def _override_value(overrides: Sequence[str], key: str) -> Optional[str]:
    value = None
    for o in overrides:
        k, sep, v = o.partition("=")
        if sep and k.lstrip("+~") == key:
            value = v
    return value


def _drop(overrides: Sequence[str], key: str) -> list[str]:
    return [o for o in overrides if o.partition("=")[0].lstrip("+~") != key]


def parse_sweeps(specs: Sequence[str]) -> list[tuple[list[str], str]]:
    """``["kl.target=1,3,6", ...]`` -> one ``(overrides, folder name)`` per sweep point.

    The cartesian product of all specs, in Hydra's sweep syntax. No specs: ``[([], "")]``.

    Raises:
        LaunchError: a spec that is not ``key=<sweep>``, or a key given twice.
    """
    if not specs:
        return [([], "")]
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    axes, keys = [], []
    for spec in specs:
        try:
            o = parser.parse_override(spec)
        except Exception as exc:  # noqa: BLE001
            raise LaunchError(f"--sweep {spec!r}: {_describe(exc)}") from None
        key = o.get_key_element()
        if key in keys:
            raise LaunchError(f"--sweep {spec!r}: {key} is swept twice")
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        keys.append(key)
        axes.append([f"{key}={v}" for v in values])
    points = []
    for combo in itertools.product(*axes):
        name = re.sub(r"[^\w.=,+-]", "_", ",".join(combo))
        points.append((list(combo), name))
    return points
