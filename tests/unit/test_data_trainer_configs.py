"""conf/sft.yaml, conf/rm.yaml and conf/eval.yaml compose over their typed schemas and
convert to dataclasses; misspelt keys and bad values fail naming the key; batching helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import nemo_rlhf.evaluate  # noqa: F401 - registers eval_schema
import nemo_rlhf.train_rm  # noqa: F401 - registers rm_schema
import nemo_rlhf.train_sft  # noqa: F401 - registers sft_schema
from nemo_rlhf.evaluate import EvalConfig
from nemo_rlhf.trainers.common import SupervisedTrainerConfig, chunks, dp_shard, step_indices
from nemo_rlhf.trainers.rm import RMRunConfig
from nemo_rlhf.trainers.sft import SFTRunConfig

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def _load(name: str, overrides=()):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return OmegaConf.to_object(compose(config_name=name, overrides=list(overrides)))


def test_sft_yaml_composes_into_the_typed_schema_with_the_tiny_model():
    cfg = _load("sft")
    assert isinstance(cfg, SFTRunConfig) and cfg.model.name == "tiny"
    assert cfg.optim.decay_steps == cfg.trainer.max_steps  # interpolated
    assert cfg.data.train_file.endswith("sft.jsonl") and cfg.exp_manager.exp_dir


def test_rm_yaml_composes_and_accepts_init_from():
    cfg = _load("rm", ["rm.init_from=experiments/sft/checkpoints", "parallel.tensor_model_parallel_size=2"])
    assert isinstance(cfg, RMRunConfig) and cfg.rm.init_from == "experiments/sft/checkpoints"
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.data.train_file.endswith("preference.jsonl")


def test_eval_yaml_composes_with_the_three_command_line_keys():
    cfg = _load("eval", ["checkpoint=ck", "data=d.jsonl", "out=r.json"])
    assert isinstance(cfg, EvalConfig) and (cfg.checkpoint, cfg.data, cfg.out) == ("ck", "d.jsonl", "r.json")
    assert cfg.checker == "arithmetic_exact_match"


@pytest.mark.parametrize("name,key", [("sft", "trainer.max_stepz"), ("rm", "rm.init_frm"),
                                      ("sft", "data.chat_templat"), ("eval", "max_new_tokenz")])
def test_a_misspelt_key_fails_naming_it(name, key):
    with pytest.raises(ConfigCompositionException) as err:
        _load(name, [f"{key}=1"])
    assert key.split(".")[-1] in str(err.value.__cause__ or err.value)


def test_bad_values_fail_naming_the_key():
    with pytest.raises(Exception, match="data.overlong_policy"):
        _load("sft", ["data.overlong_policy=cut"])
    with pytest.raises(Exception, match="trainer.precision"):
        _load("rm", ["trainer.precision=64"])


def test_eval_sampling_options_are_validated_naming_the_key():
    base = ["checkpoint=ck", "data=d.jsonl", "out=r.json"]
    cfg = _load("eval", base + ["temperature=0.7", "num_samples=4", "samples_out=s.jsonl",
                                "extra_checkers=[just_the_number]", "chat_template=chatml"])
    assert (cfg.temperature, cfg.num_samples, cfg.extra_checkers) == (0.7, 4, ["just_the_number"])
    with pytest.raises(Exception, match="num_samples=4 with temperature=0"):
        _load("eval", base + ["num_samples=4"])
    with pytest.raises(Exception, match="temperature=-1"):
        _load("eval", base + ["temperature=-1"])
    with pytest.raises(Exception, match="rm.freeze_layers=-1"):
        _load("rm", ["rm.freeze_layers=-1"])


def test_eval_needs_its_mandatory_keys():
    with pytest.raises(Exception, match="checkpoint"):
        _load("eval", ["data=d.jsonl", "out=r.json"])


def test_batch_sizes_are_validated_against_dp_naming_the_keys():
    SupervisedTrainerConfig(global_batch_size=8, micro_batch_size=2).validate(dp=2)
    with pytest.raises(ValueError, match="trainer.global_batch_size=6 .* multiple of 4"):
        SupervisedTrainerConfig(global_batch_size=6, micro_batch_size=1).validate(dp=4)
    with pytest.raises(ValueError, match=r"trainer.micro_batch_size=3 .* valid micro_batch_size values: \[1, 2, 4\]"):
        SupervisedTrainerConfig(global_batch_size=8, micro_batch_size=3).validate(dp=2)


def test_step_indices_are_a_pure_function_of_the_step_and_cover_each_epoch_once():
    n, gbs = 10, 4  # 2 full batches per epoch, 2 examples dropped per epoch
    epoch0 = step_indices(n, gbs, 0, seed=1) + step_indices(n, gbs, 1, seed=1)
    assert len(set(epoch0)) == 8
    assert step_indices(n, gbs, 1, seed=1) == step_indices(n, gbs, 1, seed=1)
    assert step_indices(n, gbs, 2, seed=1) != step_indices(n, gbs, 0, seed=1)  # new epoch order
    with pytest.raises(ValueError, match="smaller than trainer.global_batch_size"):
        step_indices(3, 4, 0, seed=1)


def test_dp_shard_and_chunks_split_without_loss():
    items = list(range(7))
    shards = [dp_shard(items, r, 3) for r in range(3)]
    assert sum(shards, []) == items and max(map(len, shards)) - min(map(len, shards)) <= 1
    assert chunks(items, 3) == [[0, 1, 2], [3, 4, 5], [6]]
