"""``nemo_rlhf.evaluate`` with ``env.name`` (#51): the config takes the PPO config's ``env.*``
keys, refuses what episodes do not measure, and the episode summary's means by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from nemo_rlhf.config import to_typed
from nemo_rlhf.evaluate.config import EvalConfig
from nemo_rlhf.evaluate.job import episode_summary

CONF = Path(__file__).resolve().parents[3] / "conf"


def test_the_env_keys_compose_on_the_eval_config():
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = to_typed(compose("eval", overrides=[
            "checkpoint=/x", "data=/d.jsonl", "out=/o.json", "env.name='digit_calculator'", "env.max_turns=2",
            "env.max_total_tokens=64"]), EvalConfig)
    assert cfg.env.enabled and cfg.env.name == "digit_calculator"
    assert (cfg.env.max_turns, cfg.env.max_total_tokens) == (2, 64)
    assert not EvalConfig(checkpoint="/x", data="/d", out="/o", checker="env").env.enabled  # default: single-turn


def test_reference_with_episodes_is_refused_naming_both_keys():
    from nemo_rlhf.envs.config import EnvConfig

    with pytest.raises(ValueError, match=r"reference='/ref' with env.name='digit_calculator'.*drop reference or "
                                         r"env.name"):
        EvalConfig(checkpoint="/x", data="/d", out="/o", checker="env", reference="/ref",
                   env=EnvConfig(name="digit_calculator"))


def test_episode_summary_by_hand():
    eps = [{"turns": 2, "tool_calls": 1, "malformed": 0}, {"turns": 1, "tool_calls": 0, "malformed": 1},
           {"turns": 3, "tool_calls": 2, "malformed": 0}, {"turns": 2, "tool_calls": 1, "malformed": 0}]
    assert episode_summary(eps) == {"turns_mean": 2.0, "tool_calls_mean": 1.0, "tool_call_rate": 0.75,
                                    "malformed_call_rate": 0.25}


def test_an_unknown_rm_input_is_refused_naming_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"rm_input.*'whole'.*conversation.*final_answer"):
        EvalConfig(checkpoint="/x", data="/d", out="/o", checker="env", rm_input="whole")
