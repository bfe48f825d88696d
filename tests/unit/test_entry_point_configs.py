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
from nemo_rlhf.data.sampler import ResumableSampler
from nemo_rlhf.evaluate import EvalConfig
from nemo_rlhf.distributed.split import chunks, dp_shard
from nemo_rlhf.trainers.rm import RMRunConfig
from nemo_rlhf.trainers.sft import SFTRunConfig
from nemo_rlhf.trainers.supervised import SupervisedTrainerConfig

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def _load(name: str, overrides=()):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return OmegaConf.to_object(compose(config_name=name, overrides=list(overrides)))


def test_sft_yaml_composes_into_the_typed_schema_with_the_tiny_model():
    cfg = _load("sft_tiny")
    assert isinstance(cfg, SFTRunConfig) and cfg.model.name == "tiny"
    assert cfg.optim.decay_steps == cfg.trainer.max_steps  # interpolated
    assert cfg.data.train_file.endswith("sft.jsonl") and cfg.exp_manager.exp_dir


def test_rm_yaml_composes_and_accepts_init_from():
    cfg = _load("rm_tiny", ["rm.init_from=experiments/sft/checkpoints", "parallel.tensor_model_parallel_size=2"])
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
        _load("sft_tiny", ["data.overlong_policy=cut"])
    with pytest.raises(Exception, match="trainer.precision"):
        _load("rm_tiny", ["trainer.precision=64"])


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
        _load("rm_tiny", ["rm.freeze_layers=-1"])


def test_eval_needs_its_mandatory_keys():
    with pytest.raises(Exception, match="checkpoint"):
        _load("eval", ["data=d.jsonl", "out=r.json"])


def test_batch_sizes_are_validated_against_dp_naming_the_keys():
    SupervisedTrainerConfig(global_batch_size=8, micro_batch_size=2).validate(dp=2)
    with pytest.raises(ValueError, match="trainer.global_batch_size=6 .* multiple of 4"):
        SupervisedTrainerConfig(global_batch_size=6, micro_batch_size=1).validate(dp=4)
    with pytest.raises(ValueError, match=r"trainer.micro_batch_size=3 .* valid micro_batch_size values: \[1, 2, 4\]"):
        SupervisedTrainerConfig(global_batch_size=8, micro_batch_size=3).validate(dp=2)


def test_the_sampler_covers_each_epoch_once_and_resumes_where_it_stopped():
    n, gbs = 10, 4  # batches run across the epoch boundary: nothing is dropped
    s = ResumableSampler(n, seed=1)
    first = s.next_global_batch(gbs) + s.next_global_batch(gbs) + s.next_global_batch(2)
    assert sorted(first) == list(range(n))  # epoch 0, each example once
    again = ResumableSampler(n, seed=1)
    assert again.next_global_batch(gbs) == first[:gbs]  # a function of (seed, position)
    later = ResumableSampler(n, seed=1)
    later.load_state_dict(s.state_dict())  # resumed after 10 examples
    assert later.next_global_batch(n) == s.next_global_batch(n)
    assert later.next_global_batch(n) != first  # epoch 2's own order
    assert s.state_dict() == {"consumed_samples": 20, "epoch": 2}
    with pytest.raises(ValueError, match="the dataset is empty"):
        ResumableSampler(0, seed=1)


def test_dp_shard_and_chunks_split_without_loss():
    items = list(range(7))
    shards = [dp_shard(items, r, 3) for r in range(3)]
    assert sum(shards, []) == items and max(map(len, shards)) - min(map(len, shards)) <= 1
    assert chunks(items, 3) == [[0, 1, 2], [3, 4, 5], [6]]
