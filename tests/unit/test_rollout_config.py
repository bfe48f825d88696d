"""RolloutConfig validation, the ``rollout`` section of the PPO job, and the log-prob
mismatch metric."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.config import CONF_DIR
from nemo_rlhf.rollout import RolloutConfig, logprob_diff_stats


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
