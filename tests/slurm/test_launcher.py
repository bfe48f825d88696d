"""launchers.slurm without a cluster: cluster configs, validation before submission,
rendering (headers, settings, sweeps -> job arrays), template syntax, and the Hydra
command-line conventions of the trainer it submits."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import launchers.slurm as ls
from launchers.slurm import LaunchError, SlurmClusterConfig, compose_cluster, prepare

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = sorted((REPO / "slurm").glob("*.sbatch"))
NO_RM = "reward.functions=[{name: arithmetic_exact_match}]"


def _bash_n(text: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("path", [*TEMPLATES, REPO / "slurm" / "lib.sh", REPO / "tests" / "slurm" / "cluster.sh",
                                  REPO / ".ci" / "slurm_setup.sh"], ids=lambda p: p.name)
def test_templates_and_shell_helpers_pass_bash_n(path):
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_templates_have_the_requeue_signal_and_append_headers():
    ppo = (REPO / "slurm" / "ppo.sbatch").read_text()
    for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@", "#SBATCH --open-mode=append"):
        assert line in ppo
    for t in TEMPLATES:
        text = t.read_text()
        assert '"$@"' in text and "# >>> settings" in text and "# <<< settings" in text, t.name


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "conf" / "cluster").glob("*.yaml")))
def test_every_cluster_yaml_composes_into_the_typed_schema(name):
    cluster = compose_cluster(name)
    assert isinstance(cluster, SlurmClusterConfig)
    assert cluster.ranks_per_node >= 1


def test_cluster_values_and_the_example_gpu_settings():
    local = compose_cluster("local")
    assert (local.nodes, local.ranks_per_node, local.gpus_per_node) == (1, 2, 0)
    example = compose_cluster("example", ["cluster.nodes=5"])
    assert example.nodes == 5 and example.gpus_per_node == 8 and example.ranks_per_node == 8
    assert example.container_image and example.container_mounts and example.partition and example.account
    with pytest.raises(ValueError, match=r"cluster.ntasks_per_node=4: must equal cluster.gpus_per_node=8"):
        SlurmClusterConfig(gpus_per_node=8, ntasks_per_node=4)


@pytest.mark.parametrize("args, names", [
    (["trainer.max_stepz=3", NO_RM], ["trainer.max_stepz"]),
    (["+trainer.max_stepz=3", NO_RM], ["trainer.max_stepz"]),
    (["+foo=1", NO_RM], ["foo"]),
    (["trainer.max_steps=abc", NO_RM], ["trainer.max_steps", "abc"]),
    (["reference.mode=shared", NO_RM], ["reference.mode"]),
    (["parallel.tensor_model_parallel_size=4", NO_RM],
     ["parallel.tensor_model_parallel_size=4", "cluster.ntasks_per_node=2", "cluster.nodes=1"]),
    (["cluster=example", "parallel.tensor_model_parallel_size=32", NO_RM],
     ["parallel.tensor_model_parallel_size=32", "cluster.gpus_per_node=8", "cluster.nodes=3"]),
    (["cluster=example", "--rm-checkpoint=/ckpt", "parallel.tensor_model_parallel_size=8",
      "parallel.pipeline_model_parallel_size=4"],
     ["parallel.pipeline_model_parallel_size=4", "cluster.nodes=3 - cluster.rm_dedicated_nodes=1"]),
    (["parallel.tensor_model_parallel_size=3", "cluster.ntasks_per_node=4", NO_RM],
     ["parallel.tensor_model_parallel_size=3"]),
    (["ppo.global_batch_size=3", "ppo.num_rollout_samples=6", NO_RM], ["ppo.global_batch_size=3"]),
    (["cluster.nodez=2", NO_RM], ["cluster.nodez"]),
    (["cluster=nosuch", NO_RM], ["nosuch"]),
    (["--rm-checkpoint=/ckpt", "--rm-arg=micro_batch_sise=4"], ["micro_batch_sise"]),
    (["--rm-checkpoint=/ckpt", "--rm-arg=parallel.tensor_model_parallel_size=2"],
     ["parallel.tensor_model_parallel_size=2", "cluster.rm_ntasks=1"]),
    (["--rm-checkpoint=/ckpt", "reward.rm_url=http://x:1"], ["reward.rm_url"]),
    (["--rm-checkpoint=/ckpt", "cluster.rm_dedicated_nodes=1"],
     ["cluster.rm_dedicated_nodes=1 leaves no trainer node of cluster.nodes=1"]),
    (["cluster=example", "rollout.mode=async", "rollout.max_staleness=0", NO_RM],
     ["rollout.mode=async on a GPU cluster", "cluster.rollout_dedicated_nodes >= 1"]),
    (["cluster=example", "cluster.rollout_dedicated_nodes=1", "rollout.mode=async", "rollout.max_staleness=0",
      "rollout.num_workers=9", NO_RM],
     ["rollout.num_workers=9 > cluster.rollout_dedicated_nodes=1 x cluster.gpus_per_node=8"]),
    (["cluster=example", "cluster.rollout_dedicated_nodes=2", "--rm-checkpoint=/ckpt", "rollout.mode=async",
      "rollout.max_staleness=0"], ["leaves no trainer node of cluster.nodes=3"]),
    (["rollout.mode=async", "rollout.max_staleness=0", "parallel.pipeline_model_parallel_size=2", NO_RM],
     ["rollout.mode=async needs parallel.pipeline_model_parallel_size=1"]),
    (["rollout.mode=async", "rollout.max_staleness=1", NO_RM], ["ppo.rollout_is_cap"]),
    (["--sweep", "kl.targte=1,3", NO_RM], ["kl.targte"]),
    (["--sweep", "kl.target=1,x", NO_RM], ["kl.target", "x"]),
    ([], ["reward.functions"]),
    (["--job", "sft", "trainer.global_batch_size=5"], ["trainer.global_batch_size=5"]),
    (["--job", "rm", "rm.init_fromm=x"], ["rm.init_fromm"]),
    (["--job", "rm_server", "server.prot=1"], ["server.prot"]),
])
def test_bad_overrides_fail_before_submission_naming_the_key(args, names, monkeypatch, capsys):
    def no_sbatch(*a, **k):
        raise AssertionError("sbatch must not be called for a bad submission")

    monkeypatch.setattr(ls, "_sbatch", no_sbatch)
    job = args[args.index("--job") + 1] if "--job" in args else "ppo"
    if job != "rm_server":  # the tiny demo's config: the real-model one also wants data paths
        args = ["--config-name", f"{job}_tiny", *args]
    assert ls.main(args) == 1
    err = capsys.readouterr().err
    assert "[launcher] error:" in err
    for name in names:
        assert name in err, f"{name!r} not in: {err}"


def test_dry_run_renders_headers_settings_and_overrides(tmp_path, capsys):
    exp = tmp_path / "exp"
    args = ["--dry-run", "--config-name", "ppo_tiny", "cluster.partition=debug", "cluster.account=acct", "cluster.signal_seconds=90",
            "cluster.container_image=nvcr.io/nvidia/pytorch:25.01-py3", "cluster.container_mounts=[/a:/a,/b:/b]",
            "--rm-checkpoint", "/ckpt", "--rm-arg", "micro_batch_size=8", f"exp_manager.exp_dir={exp}",
            "trainer.max_steps=7", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]"]
    assert ls.main(args) == 0
    script = capsys.readouterr().out
    for line in ("#SBATCH --partition=debug", "#SBATCH --account=acct", "#SBATCH --nodes=1",
                 "#SBATCH --ntasks-per-node=2", "#SBATCH --requeue", "#SBATCH --signal=B:USR1@90",
                 "#SBATCH --open-mode=append", f"#SBATCH --output={exp}/slurm-%x-%j.out",
                 f"EXP_DIR={exp}", "RM_CHECKPOINT=/ckpt", "RM_OVERRIDES=micro_batch_size=8",
                 "CONTAINER_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3", "CONTAINER_MOUNTS=/a:/a,/b:/b",
                 f"PYTHON={sys.executable}", f"REPO_DIR={REPO}"):
        assert line in script, line
    assert "##SBATCH" not in script and script.count("#SBATCH --job-name") == 1
    sets = [line for line in script.splitlines() if line.startswith("set -- ")]
    assert len(sets) == 1
    words = shlex.split(sets[0])[2:]
    assert words == ["--config-name", "ppo_tiny", "trainer.max_steps=7", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "$@"]
    _bash_n(script, tmp_path)


def test_sweep_becomes_a_job_array_with_one_experiment_folder_per_value(tmp_path):
    exp = tmp_path / "sweep"
    job = prepare("ppo", [NO_RM, f"exp_manager.exp_dir={exp}"], sweeps=["kl.target=1,3,6", "optim.lr=1e-4,1e-3"],
                  config_name="ppo_tiny")
    assert "#SBATCH --array=0-5" in job.script
    assert f"#SBATCH --output={exp}/slurm-%x-%A_%a.out" in job.script
    assert [d.name for d in job.task_exp_dirs] == [  # Hydra's sweep parser writes 1e-4 as 0.0001
        "kl.target=1,optim.lr=0.0001", "kl.target=1,optim.lr=0.001", "kl.target=3,optim.lr=0.0001",
        "kl.target=3,optim.lr=0.001", "kl.target=6,optim.lr=0.0001", "kl.target=6,optim.lr=0.001"]
    _bash_n(job.script, tmp_path)
    # what each array task would run: its overrides and its own exp_dir, through the template
    script = tmp_path / "job.sbatch"
    script.write_text(job.script)
    for task in (0, 5):
        probe = (f"source <(sed -n '/^# >>> settings/,/^# <<< settings/p' {script}); "
                 f"source {REPO}/slurm/lib.sh; ARGS=(\"$@\"); SLURM_ARRAY_TASK_ID={task}; "
                 "nemo_setup_exp_dir exp_manager.exp_dir; printf '%s\\n' \"${ARGS[@]}\"")
        res = subprocess.run(["bash", "-c", probe, "probe"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        args = res.stdout.splitlines()
        name = job.task_exp_dirs[task].name
        assert args[-1] == f"exp_manager.exp_dir='{exp}/{name}'"  # quoted: '=' and ',' in the path
        assert args[-3:-1] == name.split(",")
        assert (exp / name).is_dir()


def test_a_field_mapping_is_added_with_plus_and_a_misspelt_plus_key_is_still_refused():
    job = prepare("sft", ["+data.fields={prompt: question}", "trainer.micro_batch_size=8"], config_name="sft_tiny")
    assert "'+data.fields={prompt: question}'" in job.script
    with pytest.raises(LaunchError, match=r"adds data.fieldz.prompt, which is not a key of SFTRunConfig"):
        prepare("sft", ["+data.fieldz.prompt=question", "trainer.micro_batch_size=8"], config_name="sft_tiny")


def test_sweep_key_given_twice_is_refused():
    with pytest.raises(LaunchError, match="kl.target is both swept"):
        prepare("ppo", [NO_RM, "kl.target=2"], sweeps=["kl.target=1,3"], config_name="ppo_tiny")


def test_sft_rm_and_rm_server_jobs_render(tmp_path):
    for job, overrides in (("sft", ["trainer.micro_batch_size=8"]), ("rm", ["trainer.micro_batch_size=8"]),
                           ("rm_server", ["checkpoint=/ckpt", f"server.address_file={tmp_path}/srv/addr"])):
        out = prepare(job, overrides, config_name=None if job == "rm_server" else f"{job}_tiny")
        assert f"#SBATCH --job-name=nemo-rlhf-{job}" in out.script
        # every job saves on the pre-timeout signal (SFT/RM run the loop PPO runs)
        assert "#SBATCH --signal=B:USR1@60" in out.script
        _bash_n(out.script, tmp_path)
    assert prepare("rm_server", ["checkpoint=/ckpt", f"server.address_file={tmp_path}/srv/addr"]).exp_dir == tmp_path / "srv"


# --------------------------------------------------------------------------- Hydra CLI
def _train_ppo(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nemo_rlhf.train_ppo", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_train_ppo_cfg_job_prints_the_resolved_config_with_overrides(tmp_path):
    res = _train_ppo("--cfg", "job", "kl.target=3", "optim.lr=0.002", f"exp_manager.exp_dir={tmp_path}/e", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    cfg = OmegaConf.create(res.stdout)
    assert cfg.kl.target == 3 and cfg.optim.lr == 0.002 and cfg.exp_manager.exp_dir == f"{tmp_path}/e"
    assert cfg.model.num_layers and "hydra" not in cfg
    assert not (tmp_path / "e").exists()  # printing runs nothing


def test_train_ppo_misspelt_key_fails_naming_it(tmp_path):
    res = _train_ppo("kl.targte=3", f"exp_manager.exp_dir={tmp_path}/e", cwd=tmp_path)
    assert res.returncode != 0
    assert "kl.targte" in res.stderr
    assert not (tmp_path / "e").exists()


def test_the_readme_multi_node_example_renders(capsys):
    """The multi-node command of docs/slurm.md (its text, read from the page the README links)
    passes validation and renders with --dry-run: the preset's heads fit TP=8, and the job has
    4 trainer nodes and one for the RM server."""
    page = (REPO / "docs" / "slurm.md").read_text()
    block = page.split("# Multi-node on SLURM", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    cmd = " ".join(line.rstrip("\\").strip() for line in block.strip().splitlines())
    argv = shlex.split(cmd)
    assert argv[:3] == ["python", "-m", "launchers.slurm"]
    assert ls.main(["--dry-run", *argv[3:]]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=5" in script and "model=llama3_8b" in script
