"""RolloutConfig validation, the ``rollout`` section of the PPO job, and the log-prob
mismatch metric."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.config import CONF_DIR
from nemo_rlhf.rollout import RolloutConfig, logprob_diff_stats
from nemo_rlhf.rollout.config import VLLMConfig


@pytest.mark.parametrize(
    "kwargs, key, value",
    [
        (dict(top_p=0.0), "rollout.top_p", "0.0"),
        (dict(top_p=-0.5), "rollout.top_p", "-0.5"),
        (dict(top_p=1.5), "rollout.top_p", "1.5"),
        (dict(temperature=0.0), "rollout.temperature", "0.0"),
        (dict(temperature=-1.0), "rollout.temperature", "-1.0"),
        (dict(max_new_tokens=-1), "rollout.max_new_tokens", "-1"),
        (dict(min_new_tokens=5, max_new_tokens=4), "rollout.min_new_tokens", "5"),
        (dict(min_new_tokens=-1), "rollout.min_new_tokens", "-1"),
        (dict(top_k=-3), "rollout.top_k", "-3"),
        (dict(stop_token_ids=[3, -1]), "rollout.stop_token_ids[1]", "-1"),
        (dict(stop_strings=[""]), "rollout.stop_strings[0]", "''"),
        (dict(engine="sglang"), "rollout.engine", "'sglang'"),
        (dict(wait_timeout_s=0.0), "rollout.wait_timeout_s", "0.0"),
        (dict(vllm=VLLMConfig(tensor_parallel_size=0)), "rollout.vllm.tensor_parallel_size", "0"),
        (dict(vllm=VLLMConfig(gpu_memory_utilization=1.5)), "rollout.vllm.gpu_memory_utilization", "1.5"),
        (dict(vllm=VLLMConfig(kv_cache_space_gib=0)), "rollout.vllm.kv_cache_space_gib", "0"),
    ],
)
def test_invalid_rollout_config_names_key_value_and_valid_range(kwargs, key, value):
    with pytest.raises(ValueError) as err:
        RolloutConfig(**kwargs)
    msg = str(err.value)
    assert key in msg and value in msg
    assert "must" in msg or "valid" in msg


def test_min_greater_than_max_message_says_what_is_valid():
    with pytest.raises(ValueError, match=r"valid values are 0 \.\. 4"):
        RolloutConfig(min_new_tokens=5, max_new_tokens=4)


def test_greedy_allows_zero_temperature_and_logprobs_at_temperature_one():
    cfg = RolloutConfig(greedy=True, temperature=0.0)
    assert cfg.logprob_temperature == 1.0
    assert RolloutConfig(temperature=0.7).logprob_temperature == 0.7


def test_validate_catches_fields_changed_after_construction():
    cfg = RolloutConfig()
    cfg.top_p = 2.0
    with pytest.raises(ValueError, match="rollout.top_p"):
        cfg.validate()


def _compose_ppo(*overrides: str):
    from hydra import compose, initialize_config_dir

    import nemo_rlhf.train_ppo  # noqa: F401 - registers ppo_schema
    from nemo_rlhf.config import to_typed
    from nemo_rlhf.trainers.ppo.config import PPOConfig

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return to_typed(compose("ppo_tiny", overrides=list(overrides)), PPOConfig)


def test_rollout_is_no_config_group_any_more_and_choosing_one_fails_naming_rollout():
    # its one option restated the dataclass defaults: the PPO job states what differs
    assert not (CONF_DIR / "rollout").exists()
    with pytest.raises(Exception) as err:
        _compose_ppo("rollout=default")
    assert "full_key: rollout" in str(err.value.__cause__ or err.value)


def test_yaml_value_errors_surface_as_rollout_keys():
    with pytest.raises(ValueError, match="rollout.top_p"):
        _compose_ppo("rollout.top_p=0.0")
    assert _compose_ppo("rollout.top_p=0.9").rollout.top_p == 0.9


def test_logprob_diff_stats_worked_example():
    roll = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]])
    train = torch.tensor([[-1.5, -2.0, -9.0], [-0.25, -0.25, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    stats = logprob_diff_stats(roll, train, mask)
    assert stats["rollout_train_logprob_diff_mean"] == pytest.approx((0.5 + 0.0 + 0.25) / 3)
    assert stats["rollout_train_logprob_diff_max"] == pytest.approx(0.5)
    empty = logprob_diff_stats(roll, train, torch.zeros_like(mask))
    assert empty == {"rollout_train_logprob_diff_mean": 0.0, "rollout_train_logprob_diff_max": 0.0}


def test_an_unknown_engine_lists_the_choices():
    with pytest.raises(ValueError, match=r"^rollout.engine='hf': valid choices are \['megatron', 'vllm'\]$"):
        RolloutConfig(engine="hf")


def test_the_vllm_engine_refuses_layouts_it_cannot_refit_before_importing_vllm():
    from types import SimpleNamespace

    from nemo_rlhf.models.config import ModelConfig
    from nemo_rlhf.rollout.vllm_engine import VLLMRolloutEngine

    cfg = RolloutConfig(engine="vllm", vllm=VLLMConfig(tensor_parallel_size=2))
    model = ModelConfig(vocab_size=100)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=1"):
        VLLMRolloutEngine(cfg, SimpleNamespace(pp=2, tp=2), model, eos_token_id=1, pad_token_id=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide parallel.tensor_model_parallel_size=1"):
        VLLMRolloutEngine(cfg, SimpleNamespace(pp=1, tp=1), model, eos_token_id=1, pad_token_id=0)


def test_without_vllm_the_engine_says_how_to_install_it(monkeypatch):
    import builtins
    from types import SimpleNamespace

    from nemo_rlhf.models.config import ModelConfig
    from nemo_rlhf.rollout.vllm_engine import VLLMRolloutEngine

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    with pytest.raises(ImportError, match="make vllm-env"):
        VLLMRolloutEngine(RolloutConfig(engine="vllm"), SimpleNamespace(pp=1, tp=1),
                          ModelConfig(vocab_size=100), eos_token_id=1, pad_token_id=0)


def test_row_seeds_are_a_function_of_seed_rank_step_and_row():
    from nemo_rlhf.rollout.vllm_engine import row_seed

    assert row_seed(1, 0, 5, 3) == row_seed(1, 0, 5, 3)
    seeds = {row_seed(1, r, s, i) for r in range(2) for s in range(3) for i in range(4)}
    assert len(seeds) == 24 and all(0 <= x < 2**31 for x in seeds)


def test_stop_strings_cut_after_the_first_token_that_completes_one():
    from nemo_rlhf.rollout.vllm_engine import cut_at_stop_strings

    text = {1: "a", 2: "b", 3: "\n", 4: "c"}

    def decode(ids):
        return "".join(text[i] for i in ids)

    assert cut_at_stop_strings([1, 2, 3, 4], ["b\n"], decode, 0) == 3
    assert cut_at_stop_strings([1, 2, 3, 4], ["a"], decode, 0) == 1
    # as the megatron engine: checked from token min_new_tokens on, on the whole response
    assert cut_at_stop_strings([1, 2, 3, 4], ["a"], decode, 2) == 3
    assert cut_at_stop_strings([1, 2, 3, 4], ["zz"], decode, 0) is None
