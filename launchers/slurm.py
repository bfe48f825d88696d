"""Submit the project's jobs to Slurm, validated first.

    python -m launchers.slurm [--dry-run | --test-only] [--job ppo|sft|rm|rm_server]
        [--rm-checkpoint CKPT] [--rm-arg KEY=VALUE]... [--sweep KEY=V1,V2,...]...
        [cluster=<name>] [cluster.<key>=<value>]... <job overrides>

Steps (:func:`prepare`, then :func:`submit`):

1. compose the cluster, ``conf/cluster/<name>.yaml`` over :class:`SlurmClusterConfig`
   (``cluster=local`` unless given; ``cluster.nodes=4``-style overrides on top);
2. compose the job's own config (``conf/ppo.yaml``, ``sft.yaml``, ``rm.yaml`` or
   ``rm_server.yaml``) with the overrides and convert it to its typed schema
   (``OmegaConf.to_object``), once per sweep point: an unknown key, a value of the wrong
   type or a rule of the schema fails here, naming the key; then the layout: TP x PP
   against the job's ranks (``cluster.gpus_per_node`` x ``cluster.nodes`` on GPU
   clusters, ``cluster.ntasks_per_node`` x ``cluster.nodes`` on CPU ones), divisibility
   against the model and the batch sizes against the data-parallel size; with
   ``--rm-checkpoint`` also the RM server's overrides (``--rm-arg``) and its layout;
3. render ``slurm/<job>.sbatch``: its ``#SBATCH`` lines are replaced by the cluster's, its
   settings block by the concrete values (interpreter, experiment folder, RM options,
   container) and the overrides (``set -- ... "$@"``). ``--sweep`` makes a job array, one
   task per point of the sweep (the cartesian product of all ``--sweep`` options; Hydra's
   sweep syntax: ``1,3,6``, ``range(1,4)``, ``choice(a,b)``), each task with its own
   experiment folder ``<exp_dir>/<key>=<value>[,...]``;
4. ``--dry-run`` prints the script; ``--test-only`` asks ``sbatch --test-only`` about it;
   otherwise it is written to ``<exp_dir>/slurm/<job>-<time>.sbatch`` (the experiment's
   record) and submitted with ``sbatch --parsable``; the job id is printed.

Exit code: 0 submitted (or printed), 1 a validation or submission error (the message
names the key), 2 bad launcher options.

Simplified on purpose: one cluster per submission (no heterogeneous jobs); the RM server
of a PPO job runs inside the same allocation (its own step), see ``slurm/ppo.sbatch``;
paths are taken to be the same on the submit host and the nodes (shared file system, or
container mounts that keep them).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.config_store import ConfigStore

__all__ = ["JOBS", "LaunchError", "PreparedJob", "SlurmClusterConfig", "main", "prepare", "submit"]

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
    job_name_prefix: str = "nemo-rlhf"
    """``--job-name`` is ``<prefix>-<job>``."""

    def __post_init__(self) -> None:
        def bad(key: str, value: Any, what: str) -> ValueError:
            return ValueError(f"cluster.{key}={value!r}: {what}")

        for key in ("nodes", "cpus_per_task", "rm_ntasks", "rm_start_timeout_s"):
            if getattr(self, key) < 1:
                raise bad(key, getattr(self, key), "must be >= 1")
        for key in ("gpus_per_node", "signal_seconds", "max_requeues", "rm_dedicated_nodes"):
            if getattr(self, key) < 0:
                raise bad(key, getattr(self, key), "must be >= 0")
        if self.ntasks_per_node is not None and self.ntasks_per_node < 1:
            raise bad("ntasks_per_node", self.ntasks_per_node, "must be >= 1 (or null)")
        if self.gpus_per_node and self.ntasks_per_node not in (None, self.gpus_per_node):
            raise bad("ntasks_per_node", self.ntasks_per_node,
                      f"must equal cluster.gpus_per_node={self.gpus_per_node} (one rank per GPU) or be null")
        if self.rm_dedicated_nodes >= self.nodes:
            raise bad("rm_dedicated_nodes", self.rm_dedicated_nodes,
                      f"leaves no trainer node of cluster.nodes={self.nodes}")
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
    "sft": JobKind("sft.sbatch", "sft", "nemo_rlhf.train_sft", "exp_manager.exp_dir", False, True),
    "rm": JobKind("rm.sbatch", "rm", "nemo_rlhf.train_rm", "exp_manager.exp_dir", False, True),
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


def _compose(config_name: Optional[str], overrides: Sequence[str], what: str):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from nemo_rlhf.models.config import CONF_DIR

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            dcfg = compose(config_name=config_name, overrides=list(overrides))
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


def compose_job(job: str, overrides: Sequence[str]):
    """The job's config (``conf/<job>.yaml`` + overrides) as its typed schema.

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
    cfg = _compose(JOBS[job].config_name, overrides, f"{job} overrides")
    _check_added_keys(cfg, overrides, job)
    return cfg


def _check_added_keys(cfg, overrides: Sequence[str], job: str) -> None:
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(type(cfg))
    missing = object()
    for o in overrides:
        key = o.partition("=")[0]
        if not key.startswith("+"):
            continue
        key = key.lstrip("+")
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


# --------------------------------------------------------------------------- validation
def _trainer_ranks(cluster: SlurmClusterConfig, rm_dedicated: int) -> tuple[int, str]:
    nodes = cluster.nodes - rm_dedicated
    per = (f"cluster.gpus_per_node={cluster.gpus_per_node}" if cluster.gpus_per_node
           else f"cluster.ntasks_per_node={cluster.ranks_per_node}")
    node_text = (f"(cluster.nodes={cluster.nodes} - cluster.rm_dedicated_nodes={rm_dedicated})"
                 if rm_dedicated else f"cluster.nodes={cluster.nodes}")
    return nodes * cluster.ranks_per_node, f"{per} x {node_text}"


def check_layout(parallel, ranks: int, ranks_text: str, model=None) -> int:
    """TP x PP against the job's ranks, then divisibility; returns the DP size.

    Raises:
        LaunchError: naming parallel.* / cluster.* (or model.*) keys and what would work.
    """
    from nemo_rlhf.distributed.parallel import validate_parallel_layout

    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if tp * pp > ranks:
        raise LaunchError(
            f"parallel.tensor_model_parallel_size={tp} x parallel.pipeline_model_parallel_size={pp} "
            f"= {tp * pp} ranks per model copy, but the job has {ranks} ranks ({ranks_text}); "
            f"lower TP/PP or raise the cluster's nodes / ranks per node")
    facts = {}
    if model is not None:
        facts = dict(num_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
                     num_query_groups=model.num_query_groups)
    try:
        return validate_parallel_layout(parallel, ranks, **facts)
    except ValueError as exc:
        raise LaunchError(f"{exc} (job ranks: {ranks} = {ranks_text})") from None


def _validate_job(job: str, cfg, cluster: SlurmClusterConfig, rm_dedicated: int) -> None:
    ranks, text = _trainer_ranks(cluster, rm_dedicated)
    dp = check_layout(cfg.parallel, ranks, text, getattr(cfg, "model", None))
    try:
        if job == "ppo":
            from nemo_rlhf.trainers.ppo.config import validate_batch_sizes

            validate_batch_sizes(cfg.ppo, dp, cfg.rollout.n_samples_per_prompt)
        elif job in ("sft", "rm"):
            cfg.trainer.validate(dp)
    except ValueError as exc:
        raise LaunchError(f"{exc} (data-parallel size {dp} on {ranks} ranks = {text})") from None


def _validate_rm_server(rm_checkpoint: str, rm_overrides: Sequence[str], cluster: SlurmClusterConfig) -> None:
    cfg = compose_job("rm_server", [f"checkpoint={rm_checkpoint}", *rm_overrides])
    for key in ("server.address_file", "server.port", "server.host"):
        if _override_value(rm_overrides, key) is not None:
            raise LaunchError(f"--rm-arg {key}=...: the PPO job sets {key} of its RM server itself; drop it")
    check_layout(cfg.parallel, cluster.rm_ntasks, f"cluster.rm_ntasks={cluster.rm_ntasks}")
    if not Path(rm_checkpoint).exists():
        print(f"[launcher] warning: --rm-checkpoint {rm_checkpoint} does not exist here "
              f"(fine if it exists on the nodes)", file=sys.stderr)


# --------------------------------------------------------------------------- rendering
def _sbatch_lines(kind: JobKind, job: str, cluster: SlurmClusterConfig, exp_dir: Path, n_tasks: int) -> list[str]:
    """The job's #SBATCH lines; ``n_tasks`` > 0 makes it a job array of that many tasks."""
    opts = [f"--job-name={cluster.job_name_prefix}-{job}", f"--nodes={cluster.nodes}",
            f"--ntasks-per-node={cluster.ranks_per_node}", f"--cpus-per-task={cluster.cpus_per_task}"]
    if cluster.gpus_per_node:
        opts.append(f"--gpus-per-node={cluster.gpus_per_node}")
    if cluster.mem is not None:
        opts.append(f"--mem={cluster.mem}")
    opts.append(f"--time={cluster.time}")
    for key in ("partition", "account", "qos"):
        if getattr(cluster, key):
            opts.append(f"--{key}={getattr(cluster, key)}")
    if cluster.exclusive:
        opts.append("--exclusive")
    opts.append("--requeue" if kind.requeue else "--no-requeue")
    if kind.signal and cluster.signal_seconds:
        opts.append(f"--signal=B:USR1@{cluster.signal_seconds}")
    opts.append("--open-mode=append")
    if n_tasks:
        opts.append(f"--array=0-{n_tasks - 1}")
        opts.append(f"--output={exp_dir}/slurm-%x-%A_%a.out")
    else:
        opts.append(f"--output={exp_dir}/slurm-%x-%j.out")
    for line in cluster.extra_sbatch:
        line = line.strip()
        opts.append(line[len("#SBATCH"):].strip() if line.startswith("#SBATCH") else line)
    return [f"#SBATCH {o}" for o in opts]


def _bash_array(items: Sequence[str]) -> str:
    return "(" + " ".join(shlex.quote(i) for i in items) + ")"


def render(template: str, sbatch_lines: Sequence[str], settings: dict[str, str], overrides: Sequence[str],
           setup: Sequence[str] = ()) -> str:
    """Fill a slurm/ template: its #SBATCH lines become ``sbatch_lines``; in its settings
    block, each ``: "${NAME:=...}"`` (or ``NAME=()`` array) line named in ``settings``
    becomes ``NAME=<value>`` (values are already shell words); then ``set -- <overrides>
    "$@"`` and the ``setup`` lines close the block.

    Raises:
        LaunchError: a setting the template does not have (a template/launcher mismatch).
    """
    out, header_done, in_settings, used = [], False, False, set()
    for line in template.splitlines():
        if re.match(r"^##?SBATCH\b", line):
            if not header_done:
                out.extend(sbatch_lines)
                header_done = True
            continue
        if line.startswith("# >>> settings"):
            in_settings = True
            out.append("# >>> settings (rendered by launchers.slurm)")
            continue
        if line.startswith("# <<< settings"):
            in_settings = False
            if overrides:
                out.append("set -- " + " ".join(shlex.quote(o) for o in overrides) + ' "$@"')
            out.extend(setup)
            out.append(line)
            continue
        if in_settings:
            m = (re.match(r'^: "\$\{(\w+):=.*?\}"(\s+#.*)?$', line)
                 or re.match(r"^\[\[ -v (\w+) \]\] \|\| \w+=\(\)(\s+#.*)?$", line))
            if m and m.group(1) in settings:
                text = f"{m.group(1)}={settings[m.group(1)]}"
                if m.group(2):  # keep the comment, at its column when there is room
                    column = len(line) - len(m.group(2).lstrip())
                    text = f"{text}  " if len(text) + 2 > column else text.ljust(column)
                    text += m.group(2).lstrip()
                out.append(text)
                used.add(m.group(1))
                continue
        out.append(line)
    missing = set(settings) - used
    if missing or not header_done:
        raise LaunchError(f"template has no setting(s) {sorted(missing)} or no #SBATCH lines")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- the job
def _check_options(job: str, overrides: list[str], rm_checkpoint: Optional[str],
                   rm_overrides: Sequence[str], points: list[tuple[list[str], str]]) -> list[str]:
    """Launcher options that contradict each other or the overrides; returns the overrides
    (for ``rm_server``, with ``checkpoint=`` from ``--rm-checkpoint``)."""
    if rm_checkpoint is not None and job not in ("ppo", "rm_server"):
        raise LaunchError(f"--rm-checkpoint is for --job ppo or rm_server, not {job}")
    if rm_overrides and not (job == "ppo" and rm_checkpoint):
        raise LaunchError("--rm-arg needs --job ppo with --rm-checkpoint (for --job rm_server pass overrides directly)")
    if job == "rm_server" and rm_checkpoint is not None:
        if _override_value(overrides, "checkpoint") is not None:
            raise LaunchError("give the RM checkpoint once: --rm-checkpoint or checkpoint=...")
        overrides = [f"checkpoint={rm_checkpoint}", *overrides]
    if job == "ppo" and rm_checkpoint is not None:
        for key in ("reward.rm_address_file", "reward.rm_url"):
            if _override_value(overrides, key) is not None:
                raise LaunchError(f"{key} would bypass the RM server this job starts for --rm-checkpoint "
                                  f"(the job passes reward.rm_address_file itself); drop the override")
    for key in {o.partition("=")[0] for o in points[0][0]}:
        if _override_value(overrides, key) is not None:
            raise LaunchError(f"{key} is both swept (--sweep) and overridden; give it once")
        if key in (JOBS[job].exp_dir_key, "checkpoint", "server.address_file"):
            raise LaunchError(f"--sweep {key}: each sweep task gets its own folder; sweep other keys")
    return overrides


def _exp_dir(job: str, overrides: list[str], repo_dir: Path) -> tuple[Path, list[str]]:
    """The experiment folder (absolute; relative ones start at repo_dir) and the overrides
    without ``exp_manager.exp_dir`` (the job gets it as EXP_DIR). The RM server has none:
    the folder of ``server.address_file``, else :data:`RM_SERVER_EXP_DIR`."""
    key = JOBS[job].exp_dir_key
    if key:
        exp_dir = str(compose_job(job, overrides).exp_manager.exp_dir)
        overrides = _drop(overrides, key)
    else:
        address = _override_value(overrides, "server.address_file")
        exp_dir = str(Path(address).parent) if address else RM_SERVER_EXP_DIR
    return Path(os.path.normpath(Path(repo_dir, exp_dir))), overrides


def _settings(job: str, cluster: SlurmClusterConfig, repo_dir: Path, exp_dir: Path,
              rm_checkpoint: Optional[str], rm_overrides: Sequence[str], rm_dedicated: int,
              points: list[tuple[list[str], str]]) -> dict[str, str]:
    """Values of the template's settings block, as shell words."""
    sweep = bool(points[0][0])
    settings = {
        "REPO_DIR": shlex.quote(str(repo_dir)),
        "PYTHON": shlex.quote(cluster.python or sys.executable),
        "EXP_DIR": shlex.quote(str(exp_dir)),
        "RANKS_PER_NODE": str(cluster.ranks_per_node),
        "CONTAINER_IMAGE": shlex.quote(cluster.container_image or ""),
        "CONTAINER_MOUNTS": shlex.quote(",".join(cluster.container_mounts)),
        "SRUN_ARGS": shlex.quote(shlex.join(cluster.srun_args)),
        "MAX_REQUEUES": str(cluster.max_requeues if JOBS[job].requeue else 0),
        "SWEEP_TASKS": _bash_array([shlex.join(p) for p, _ in points] if sweep else []),
        "SWEEP_NAMES": _bash_array([n for _, n in points] if sweep else []),
    }
    if job == "ppo":
        settings.update({
            "RM_CHECKPOINT": shlex.quote(rm_checkpoint or ""),
            "RM_NTASKS": str(cluster.rm_ntasks),
            "RM_DEDICATED_NODES": str(rm_dedicated),
            "RM_OVERRIDES": shlex.quote(shlex.join(rm_overrides)),
            "RM_START_TIMEOUT_S": str(cluster.rm_start_timeout_s),
        })
    return settings


def prepare(job: str = "ppo", overrides: Sequence[str] = (), cluster_name: str = DEFAULT_CLUSTER,
            cluster_overrides: Sequence[str] = (), rm_checkpoint: Optional[str] = None,
            rm_overrides: Sequence[str] = (), sweeps: Sequence[str] = ()) -> PreparedJob:
    """Validate everything and render the sbatch script (see the module docstring).

    Raises:
        LaunchError: naming the offending key.
    """
    if job not in JOBS:
        raise LaunchError(f"--job {job!r}: valid jobs are {sorted(JOBS)}")
    cluster = compose_cluster(cluster_name, cluster_overrides)
    repo_dir = Path(cluster.repo_dir or REPO)
    points = parse_sweeps(sweeps)
    overrides = _check_options(job, list(overrides), rm_checkpoint, rm_overrides, points)
    with_rm = job == "ppo" and rm_checkpoint is not None
    if with_rm:
        _validate_rm_server(rm_checkpoint, rm_overrides, cluster)
    rm_dedicated = cluster.rm_dedicated_nodes if with_rm else 0
    for point, _ in points:
        cfg = compose_job(job, [*overrides, *point])
        if job == "ppo" and not with_rm:
            r = cfg.reward
            if not (r.functions or r.rm_url or r.rm_address_file):
                raise LaunchError("no reward source: give --rm-checkpoint (an RM server step), or set "
                                  "reward.functions / reward.rm_url / reward.rm_address_file")
        _validate_job(job, cfg, cluster, rm_dedicated)

    exp_dir, overrides = _exp_dir(job, overrides, repo_dir)
    settings = _settings(job, cluster, repo_dir, exp_dir, rm_checkpoint, rm_overrides, rm_dedicated, points)
    template = (SLURM_DIR / JOBS[job].template).read_text()
    n_tasks = len(points) if sweeps else 0  # 0: not a job array
    script = render(template, _sbatch_lines(JOBS[job], job, cluster, exp_dir, n_tasks),
                    settings, overrides, cluster.setup)
    tasks = [exp_dir / name for _, name in points] if sweeps else [exp_dir]
    return PreparedJob(job, script, exp_dir, tasks, repo_dir)


def submit(prepared: PreparedJob, test_only: bool = False) -> str:
    """Write the script into the experiment folder and ``sbatch`` it; return the job id
    (``test_only``: ``sbatch --test-only`` on a copy in a temporary folder; returns its
    answer).

    Raises:
        LaunchError: sbatch missing or refusing the job (its message included).
    """
    import tempfile

    if test_only:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"{prepared.job}.sbatch"
            path.write_text(prepared.script)
            res = _sbatch(["--test-only", str(path)])
        return res.stderr.strip() or res.stdout.strip()
    prepared.exp_dir.mkdir(parents=True, exist_ok=True)  # the --output folder must exist
    for d in prepared.task_exp_dirs:
        d.mkdir(parents=True, exist_ok=True)
    folder = prepared.exp_dir / "slurm"
    folder.mkdir(exist_ok=True)
    path = folder / f"{prepared.job}-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 1000000:06d}.sbatch"
    path.write_text(prepared.script)
    res = _sbatch(["--parsable", str(path)])
    job_id = res.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise LaunchError(f"sbatch gave no job id: {res.stdout!r} {res.stderr!r}")
    return job_id


def _sbatch(args: list[str]) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(["sbatch", *args], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise LaunchError("sbatch is not installed here (submit from a Slurm login node)") from None
    if res.returncode != 0:
        raise LaunchError(f"sbatch {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


# --------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launchers.slurm",
        description="Validate a job's Hydra overrides and submit it to Slurm "
                    "(positional: cluster=<name>, cluster.<key>=<value>, job overrides).")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the sbatch script, submit nothing")
    mode.add_argument("--test-only", action="store_true", help="sbatch --test-only (the scheduler's opinion), submit nothing")
    p.add_argument("--job", choices=sorted(JOBS), default="ppo")
    p.add_argument("--rm-checkpoint", help="PPO: serve this RM checkpoint as a job step; rm_server: the checkpoint")
    p.add_argument("--rm-arg", dest="rm_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="RM server Hydra override (repeatable), e.g. parallel.tensor_model_parallel_size=2")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="job array over these values (repeatable: cartesian product)")
    p.add_argument("overrides", nargs="*", help="cluster=<name>, cluster.<key>=<value>, job overrides")
    return p


def split_cluster_overrides(args: Sequence[str]) -> tuple[str, list[str], list[str]]:
    """``cluster=<name>`` / ``cluster.<key>=...`` apart from the job's overrides."""
    name, cluster, job = DEFAULT_CLUSTER, [], []
    for a in args:
        key = a.partition("=")[0]
        if key == "cluster":
            name = a.partition("=")[2]
        elif key.startswith("cluster."):
            cluster.append(a)
        else:
            job.append(a)
    return name, cluster, job


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry; returns the exit code (see the module docstring)."""
    args = _parser().parse_intermixed_args(argv)
    name, cluster_overrides, overrides = split_cluster_overrides(args.overrides)
    try:
        prepared = prepare(args.job, overrides, name, cluster_overrides, args.rm_checkpoint,
                           args.rm_overrides, args.sweep)
        if args.dry_run:
            sys.stdout.write(prepared.script)
            return 0
        if args.test_only:
            print(submit(prepared, test_only=True))
            return 0
        job_id = submit(prepared)
    except LaunchError as exc:
        print(f"[launcher] error: {exc}", file=sys.stderr)
        return 1
    print(job_id)
    print(f"[launcher] submitted {args.job} job {job_id}; experiment {prepared.exp_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
