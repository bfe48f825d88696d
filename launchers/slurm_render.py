"""Rendering a job's sbatch script from its template under ``slurm/``: the ``#SBATCH``
lines from the cluster, the settings block, the overrides; see :mod:`launchers.slurm`.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Sequence

from launchers.slurm_jobs import JobKind, LaunchError, SlurmClusterConfig


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
