"""The starting checkpoint carries the model (nemo_rlhf/checkpoint/source.py): roots resolve
to their newest complete step, the checkpoint's shape / tokenizer / template are taken when
``model=`` is not given, and a disagreeing ``model=`` is refused naming both values."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from nemo_rlhf.checkpoint.source import (
    CheckpointModelError,
    adopt_checkpoint_model,
    architecture_mismatches,
    resolve_init_from,
)
from nemo_rlhf.models.config import CONF_DIR

# a Llama-3-8B-shaped checkpoint config, as import-hf writes it (no weights needed here)
LLAMA = {"name": "llama-3-8b-sft", "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
         "num_query_groups": 8, "ffn_hidden_size": 14336, "kv_channels": None, "vocab_size": 128256,
         "make_vocab_size_divisible_by": 128, "max_position_embeddings": 8192, "normalization": "RMSNorm",
         "layernorm_epsilon": 1e-5, "activation": "swiglu", "position_embedding_type": "rope",
         "rotary_base": 500000, "add_bias_linear": False, "add_qkv_bias": False,
         "share_embeddings_and_output_weights": False, "hidden_dropout": 0.0, "attention_dropout": 0.0,
         "init_method_std": 0.02, "value_head_init_std": 0.0}


def _ckpt(root: Path, step: int, complete: bool = True, data: dict | None = None) -> Path:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"model": LLAMA, "data": data or {}}))
    if complete:
        (d / "COMPLETE").write_text("")
    return d


def _job(job: str, *overrides: str):
    """``conf/<job>.yaml`` composed with ``overrides``; (config without hydra, model choice)."""
    import nemo_rlhf.train_ppo  # noqa: F401  (registers the schemas)
    import nemo_rlhf.train_rm  # noqa: F401

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        dcfg = compose(config_name=job, overrides=list(overrides), return_hydra_config=True)
    choice = dcfg.hydra.runtime.choices.get("model")
    with __import__("omegaconf").open_dict(dcfg):
        del dcfg["hydra"]
    return dcfg, choice


def test_a_root_resolves_to_its_newest_complete_step_and_an_experiment_folder_too(tmp_path):
    root = tmp_path / "exp" / "checkpoints"
    _ckpt(root, 5)
    newest = _ckpt(root, 10)
    _ckpt(root, 15, complete=False)  # a save cut off: never chosen
    assert resolve_init_from("k", str(root)) == newest
    assert resolve_init_from("k", str(tmp_path / "exp")) == newest
    assert resolve_init_from("k", str(newest)) == newest
    with pytest.raises(CheckpointModelError, match=r"rm.init_from=.*/nope: does not exist"):
        resolve_init_from("rm.init_from", str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointModelError, match=r"sft.init_from=.*/empty: holds no complete checkpoint"):
        resolve_init_from("sft.init_from", str(tmp_path / "empty"))


def test_without_model_the_checkpoint_gives_shape_tokenizer_and_template(tmp_path):
    root = tmp_path / "llama3"
    step = _ckpt(root, 0, data={"tokenizer_dir": "/elsewhere/tokenizer", "chat_template": "model",
                                "system_prompt": None})
    (root / "tokenizer").mkdir()  # import-hf's layout; the recorded path is not on this host
    overrides = [f"rm.init_from={root}", "data.train_file=x.jsonl"]
    dcfg, choice = _job("rm", *overrides)
    rm_init_std = dcfg.model.value_head_init_std
    notes = adopt_checkpoint_model(dcfg, "rm.init_from", overrides, choice)
    assert dcfg.rm.init_from == str(step)
    m = dcfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.vocab_size,
            m.max_position_embeddings, m.rotary_base) == (32, 4096, 32, 8, 128256, 8192, 500000)
    assert m.value_head_init_std == rm_init_std  # the job's own setting, not the checkpoint's
    assert dcfg.data.tokenizer_dir == str(root / "tokenizer") and dcfg.data.chat_template == "model"
    assert notes[0] == f"rm.init_from={root} -> {step} (its newest complete checkpoint)"
    assert "llama-3-8b-sft (num_layers=32, hidden_size=4096" in notes[1]
    assert f"data.tokenizer_dir={root / 'tokenizer'}" in notes[1]


def test_command_line_model_and_data_keys_still_win(tmp_path):
    step = _ckpt(tmp_path / "c", 0, data={"chat_template": "model"})
    overrides = [f"exp_manager.init_from={step}", "model.max_position_embeddings=4096",
                 "data.chat_template=chatml", "model.num_layers=32"]
    dcfg, choice = _job("ppo", *overrides)
    adopt_checkpoint_model(dcfg, "exp_manager.init_from", overrides, choice)
    assert dcfg.model.max_position_embeddings == 4096 and dcfg.data.chat_template == "chatml"
    assert dcfg.model.num_layers == 32 and dcfg.model.hidden_size == 4096


def test_a_disagreeing_model_is_refused_naming_the_key_and_both_values(tmp_path):
    step = _ckpt(tmp_path / "c", 0)
    overrides = [f"exp_manager.init_from={step}", "model=qwen2_5_7b"]
    dcfg, choice = _job("ppo", *overrides)
    with pytest.raises(CheckpointModelError) as err:
        adopt_checkpoint_model(dcfg, "exp_manager.init_from", overrides, choice)
    msg = str(err.value)
    assert msg.startswith(f"exp_manager.init_from={step} was trained with another model shape: ")
    assert "model.num_layers=28 here but 32 in the checkpoint" in msg
    assert "model.hidden_size=3584 here but 4096 in the checkpoint" in msg
    assert "(set by model=qwen2_5_7b)" in msg and "Drop model=" in msg
    # an architecture key on the command line without model= is checked too
    overrides = [f"exp_manager.init_from={step}", "model.num_layers=16"]
    dcfg, choice = _job("ppo", *overrides)
    with pytest.raises(CheckpointModelError, match=r"model.num_layers=16 here but 32 in the checkpoint "
                                                   r"\(set by the command line\)"):
        adopt_checkpoint_model(dcfg, "exp_manager.init_from", overrides, choice)


def test_the_matching_preset_is_accepted_and_none_shorthands_compare_equal(tmp_path):
    step = _ckpt(tmp_path / "c", 0)
    overrides = [f"exp_manager.init_from={step}", "model=llama3_8b"]
    dcfg, choice = _job("ppo", *overrides)
    assert adopt_checkpoint_model(dcfg, "exp_manager.init_from", overrides, choice) == []
    assert dcfg.model.num_layers == 32
    spelled = {**LLAMA, "kv_channels": 128}
    assert architecture_mismatches(spelled, LLAMA) == []
    assert architecture_mismatches({**LLAMA, "vocab_size": 0}, LLAMA) == []  # 0: from the tokenizer
    assert architecture_mismatches({**LLAMA, "rotary_base": 10000}, LLAMA) == [("rotary_base", 10000, 500000)]


def test_no_init_from_changes_nothing_and_a_missing_path_may_be_tolerated(tmp_path):
    dcfg, choice = _job("ppo")
    before = OmegaConf.to_container(dcfg)
    assert adopt_checkpoint_model(dcfg, "exp_manager.init_from", [], choice) == []
    assert OmegaConf.to_container(dcfg) == before
    overrides = [f"exp_manager.init_from={tmp_path}/not_mounted"]
    dcfg, choice = _job("ppo", *overrides)
    notes = adopt_checkpoint_model(dcfg, "exp_manager.init_from", overrides, choice, missing_ok=True)
    assert "is not on this host" in notes[0] and OmegaConf.to_container(dcfg)["model"] == before["model"]
    with pytest.raises(CheckpointModelError, match="does not exist"):
        adopt_checkpoint_model(dcfg, "exp_manager.init_from", overrides, choice)


def test_the_slurm_launcher_takes_the_model_from_the_checkpoint(tmp_path):
    """No model= on the command line: TP=8 is checked against the checkpoint's 32 heads / 8
    KV groups (the default preset's 4 heads would refuse it); model=tiny is refused."""
    from launchers.slurm import prepare
    from launchers.slurm_jobs import LaunchError

    root = tmp_path / "llama3"
    _ckpt(root, 0)
    (root / "tokenizer").mkdir()
    common = ["cluster.nodes=4", "cluster.gpus_per_node=8", "parallel.tensor_model_parallel_size=8",
              f"exp_manager.init_from={root}", f"exp_manager.exp_dir={tmp_path}/exp",
              "reward.rm_weight=0", "reward.functions=[{name: arithmetic_exact_match}]",
              "ppo.num_rollout_samples=64", "ppo.global_batch_size=32", "ppo.micro_batch_size=2",
              "data.train_file=prompts.jsonl"]
    cluster = [o for o in common if o.startswith("cluster.")]
    job_args = [o for o in common if not o.startswith("cluster.")]
    prepare("ppo", job_args, cluster_name="example", cluster_overrides=cluster)
    with pytest.raises(LaunchError, match=r"model.num_layers=2 here but 32 in the checkpoint"):
        prepare("ppo", [*job_args, "model=tiny"], cluster_name="example", cluster_overrides=cluster)
