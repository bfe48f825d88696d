"""Every YAML under ``conf/`` composes and converts to its typed schema (each job config
through Hydra and ``to_typed``, each group option in every job that uses it), and none
restates a value it inherits: each default lives once, in its dataclass field."""

from __future__ import annotations

import pytest
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from nemo_rlhf.models.config import CONF_DIR, ModelConfig
from tests.conf_helpers import JOBS, compose_job, schema, typed_job

GROUP_JOBS = {"model": ("ppo", "sft", "rm")}
"""Config groups -> the jobs that use them (``cluster``: the Slurm launcher, below)."""


def _leaves(node, prefix=""):
    """``{dotted key: value}`` of a plain dict (lists are leaves)."""
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        out.update(_leaves(v, f"{key}.") if isinstance(v, dict) else {key: v})
    return out


def test_every_config_file_and_group_is_covered_here():
    assert {p.stem for p in CONF_DIR.glob("*.yaml")} == set(JOBS)
    assert {p.name for p in CONF_DIR.iterdir() if p.is_dir()} == set(GROUP_JOBS) | {"cluster"}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_every_job_config_composes_and_converts_to_its_schema(name):
    assert isinstance(typed_job(name), schema(name))


@pytest.mark.parametrize("group,option,job", [
    (group, p.stem, job) for group, jobs in GROUP_JOBS.items()
    for p in sorted((CONF_DIR / group).glob("*.yaml")) for job in jobs])
def test_every_group_option_composes_in_every_job_that_uses_it(group, option, job):
    cfg = typed_job(job, [f"{group}={option}"])
    expected = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                                   OmegaConf.load(CONF_DIR / group / f"{option}.yaml")))
    assert getattr(cfg, group) == expected


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF_DIR / "cluster").glob("*.yaml")))
def test_every_cluster_preset_composes_through_the_slurm_launcher(option):
    from launchers.slurm import SlurmClusterConfig, compose_cluster

    GlobalHydra.instance().clear()
    assert isinstance(compose_cluster(option), SlurmClusterConfig)


def _overridden(path) -> dict:
    """What a YAML's own values override: its parent job config (a ``defaults`` entry that
    is a job config, with the file's ``override group: option`` entries), else the schema's
    defaults."""
    raw = OmegaConf.load(path)
    if path.parent.name == "model":
        return OmegaConf.to_container(OmegaConf.structured(ModelConfig))
    if path.parent.name == "cluster":
        from launchers.slurm import SlurmClusterConfig

        return OmegaConf.to_container(OmegaConf.structured(SlurmClusterConfig))
    defaults = list(raw.get("defaults", []))
    parents = [d for d in defaults if isinstance(d, str) and d in JOBS]
    if parents:
        groups = [f"{k.split()[1]}={v}" for d in defaults if isinstance(d, DictConfig)
                  for k, v in d.items() if k.startswith("override ")]
        return OmegaConf.to_container(compose_job(parents[0], groups), resolve=True)
    return OmegaConf.to_container(OmegaConf.structured(schema(path.stem)))


@pytest.mark.parametrize("path", sorted(CONF_DIR.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONF_DIR)))
def test_no_yaml_restates_a_value_it_inherits(path):
    own = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    own = {k: v for k, v in own.items() if k not in ("defaults", "hydra")}
    base = _leaves(_overridden(path))
    restated = {k: v for k, v in _leaves(own).items() if k in base and base[k] == v}
    assert not restated, f"{path} restates inherited values (delete them there): {restated}"
