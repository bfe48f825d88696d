"""Submit the project's jobs to Slurm, validated first.

    python -m launchers.slurm [--dry-run | --test-only] [--job ppo|sft|rm|rm_server]
        [--config-name NAME] [--rm-checkpoint CKPT] [--rm-arg KEY=VALUE]... [--sweep KEY=V1,V2,...]...
        [cluster=<name>] [cluster.<key>=<value>]... <job overrides>

Steps (:func:`prepare`, then :func:`submit`):

1. compose the cluster, ``conf/cluster/<name>.yaml`` over :class:`SlurmClusterConfig`
   (``cluster=local`` unless given; ``cluster.nodes=4``-style overrides on top);
2. compose the job's own config (``conf/ppo.yaml``, ``sft.yaml``, ``rm.yaml`` or
   ``rm_server.yaml``; ``--config-name ppo_tiny`` another file of ``conf/``, passed on to
   the job) with the overrides, take the model of the starting checkpoint
   (``*.init_from``, as the job will: :mod:`nemo_rlhf.checkpoint.source`) and convert it
   to its typed schema (``OmegaConf.to_object``), once per sweep point: an unknown key, a value of the wrong
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
of a PPO job, and its rollout workers with ``rollout.mode=async``, run inside the same
allocation (their own steps), see ``slurm/ppo.sbatch``;
paths are taken to be the same on the submit host and the nodes (shared file system, or
container mounts that keep them).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from launchers.slurm_jobs import (
    DEFAULT_CLUSTER,
    JOBS,
    REPO,
    RM_SERVER_EXP_DIR,
    SLURM_DIR,
    LaunchError,
    PreparedJob,
    SlurmClusterConfig,
    _drop,
    _override_value,
    compose_cluster,
    compose_job,
    parse_sweeps,
)
from launchers.slurm_render import _bash_array, _sbatch_lines, render

__all__ = ["JOBS", "LaunchError", "PreparedJob", "SlurmClusterConfig", "compose_cluster",
           "compose_job", "main", "prepare", "submit"]


# --------------------------------------------------------------------------- validation
def _trainer_ranks(cluster: SlurmClusterConfig, rm_dedicated: int, rollout_dedicated: int = 0) -> tuple[int, str]:
    nodes = cluster.nodes - rm_dedicated - rollout_dedicated
    per = (f"cluster.gpus_per_node={cluster.gpus_per_node}" if cluster.gpus_per_node
           else f"cluster.ntasks_per_node={cluster.ranks_per_node}")
    minus = "".join(f" - cluster.{k}={v}" for k, v in (("rm_dedicated_nodes", rm_dedicated),
                                                        ("rollout_dedicated_nodes", rollout_dedicated)) if v)
    node_text = f"(cluster.nodes={cluster.nodes}{minus})" if minus else f"cluster.nodes={cluster.nodes}"
    return nodes * cluster.ranks_per_node, f"{per} x {node_text}"


def rollout_workers(cfg, cluster: SlurmClusterConfig, rm_dedicated: int) -> tuple[int, int]:
    """``(workers, dedicated nodes)`` of a PPO job: ``(0, 0)`` in ``rollout.mode=sync``.

    Raises:
        LaunchError: a placement that cannot work, naming the keys and what would.
    """
    r = cfg.rollout
    if r.mode != "async":
        return 0, 0
    k = cluster.rollout_dedicated_nodes
    if cfg.parallel.pipeline_model_parallel_size > 1:
        raise LaunchError(f"rollout.mode=async needs parallel.pipeline_model_parallel_size=1 (got "
                          f"{cfg.parallel.pipeline_model_parallel_size}): the workers' weights are gathered over TP only")
    if getattr(cfg.parallel, "expert_model_parallel_size", 1) > 1:
        raise LaunchError(f"rollout.mode=async needs parallel.expert_model_parallel_size=1 (got "
                          f"{cfg.parallel.expert_model_parallel_size}): the workers' weights are gathered over TP only")
    if cluster.gpus_per_node and k == 0:
        raise LaunchError(f"rollout.mode=async on a GPU cluster (cluster.gpus_per_node={cluster.gpus_per_node}): "
                          f"set cluster.rollout_dedicated_nodes >= 1, the nodes of the rollout.num_workers="
                          f"{r.num_workers} workers (one per GPU)")
    if cluster.gpus_per_node and r.num_workers > k * cluster.gpus_per_node:
        raise LaunchError(f"rollout.num_workers={r.num_workers} > cluster.rollout_dedicated_nodes={k} x "
                          f"cluster.gpus_per_node={cluster.gpus_per_node}: one worker per GPU; raise the nodes "
                          f"or lower rollout.num_workers")
    if k + rm_dedicated >= cluster.nodes:
        raise LaunchError(f"cluster.rollout_dedicated_nodes={k} (+ cluster.rm_dedicated_nodes={rm_dedicated}) "
                          f"leaves no trainer node of cluster.nodes={cluster.nodes}")
    return r.num_workers, k


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
                     num_query_groups=model.num_query_groups,
                     num_moe_experts=getattr(model, "num_moe_experts", None))
    try:
        return validate_parallel_layout(parallel, ranks, **facts)
    except ValueError as exc:
        raise LaunchError(f"{exc} (job ranks: {ranks} = {ranks_text})") from None


def _validate_job(job: str, cfg, cluster: SlurmClusterConfig, rm_dedicated: int,
                  rollout_dedicated: int = 0) -> None:
    ranks, text = _trainer_ranks(cluster, rm_dedicated, rollout_dedicated)
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


def _exp_dir(job: str, overrides: list[str], repo_dir: Path,
             config_name: Optional[str] = None) -> tuple[Path, list[str]]:
    """The experiment folder (absolute; relative ones start at repo_dir) and the overrides
    without ``exp_manager.exp_dir`` (the job gets it as EXP_DIR). The RM server has none:
    the folder of ``server.address_file``, else :data:`RM_SERVER_EXP_DIR`."""
    key = JOBS[job].exp_dir_key
    if key:
        exp_dir = str(compose_job(job, overrides, config_name).exp_manager.exp_dir)
        overrides = _drop(overrides, key)
    else:
        address = _override_value(overrides, "server.address_file")
        exp_dir = str(Path(address).parent) if address else RM_SERVER_EXP_DIR
    return Path(os.path.normpath(Path(repo_dir, exp_dir))), overrides


def _settings(job: str, cluster: SlurmClusterConfig, repo_dir: Path, exp_dir: Path,
              rm_checkpoint: Optional[str], rm_overrides: Sequence[str], rm_dedicated: int,
              points: list[tuple[list[str], str]], rollout: tuple[int, int] = (0, 0)) -> dict[str, str]:
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
            "ROLLOUT_WORKERS": str(rollout[0]),
            "ROLLOUT_DEDICATED_NODES": str(rollout[1]),
        })
    return settings


def prepare(job: str = "ppo", overrides: Sequence[str] = (), cluster_name: str = DEFAULT_CLUSTER,
            cluster_overrides: Sequence[str] = (), rm_checkpoint: Optional[str] = None,
            rm_overrides: Sequence[str] = (), sweeps: Sequence[str] = (),
            config_name: Optional[str] = None) -> PreparedJob:
    """Validate everything and render the sbatch script (see the module docstring).
    ``config_name``: the job's config file in ``conf/`` (default: the job's own, e.g.
    ``ppo``; ``ppo_tiny`` is the tiny demo's), passed to the job as ``--config-name``.

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
    rm_dedicated = cluster.rm_dedicated_nodes if with_rm else 0  # only a PPO job's RM server uses it
    if rm_dedicated >= cluster.nodes:
        raise LaunchError(f"cluster.rm_dedicated_nodes={rm_dedicated} leaves no trainer node of "
                          f"cluster.nodes={cluster.nodes} (the RM server's nodes come on top of the trainer's)")
    from nemo_rlhf.models.config import CONF_DIR

    if config_name is not None and (job == "rm_server" or not (CONF_DIR / f"{config_name}.yaml").is_file()):
        raise LaunchError(f"--config-name {config_name}: not a training job config in {CONF_DIR} "
                          f"(valid: {sorted(p.stem for p in CONF_DIR.glob(f'{job}*.yaml'))})")
    placements = set()
    for point, _ in points:
        cfg = compose_job(job, [*overrides, *point], config_name)
        rollout = (0, 0)
        if job == "ppo":
            r = cfg.reward
            if not with_rm and not (r.functions or r.rm_url or r.rm_address_file):
                raise LaunchError("no reward source: give --rm-checkpoint (an RM server step), or set "
                                  "reward.functions / reward.rm_url / reward.rm_address_file")
            rollout = rollout_workers(cfg, cluster, rm_dedicated)
        placements.add(rollout)
        _validate_job(job, cfg, cluster, rm_dedicated, rollout[1])
    if len(placements) > 1:
        raise LaunchError("--sweep points need different rollout workers (rollout.mode / rollout.num_workers): "
                          "sweep them in separate submissions")
    rollout = placements.pop()

    exp_dir, overrides = _exp_dir(job, overrides, repo_dir, config_name)
    settings = _settings(job, cluster, repo_dir, exp_dir, rm_checkpoint, rm_overrides, rm_dedicated, points,
                         rollout)
    template = (SLURM_DIR / JOBS[job].template).read_text()
    n_tasks = len(points) if sweeps else 0  # 0: not a job array
    words = ["--config-name", config_name, *overrides] if config_name else overrides
    script = render(template, _sbatch_lines(JOBS[job], job, cluster, exp_dir, n_tasks),
                    settings, words, cluster.setup)
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
    p.add_argument("--config-name", help="the job's config in conf/ (default: the job's own: ppo, sft, "
                                          "rm); e.g. ppo_tiny, the tiny demo's")
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
                           args.rm_overrides, args.sweep, args.config_name)
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
