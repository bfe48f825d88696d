"""The digit-vocabulary calculator (``env.name=digit_calculator``, #51): hand-checked turns
(a well-formed call, malformed turns, the final answer), its limits, its registration, and
that its observations and a calc demonstration tokenise in the tiny model's vocabulary."""

from __future__ import annotations

import pytest

from nemo_rlhf.envs import DigitCalculatorEnv, EnvLimits, parse_digit_turn
from nemo_rlhf.envs.config import EnvConfig, get_env_factory
from nemo_rlhf.rollout.trajectory import Trajectory


def _traj(turns: int, tokens_per_turn: int = 3) -> Trajectory:
    tr = Trajectory([1, 2])
    for i in range(turns):
        if i:
            tr.append_env([9])
        tr.append_policy([5] * tokens_per_turn, [-1.0] * tokens_per_turn)
    return tr


@pytest.mark.parametrize("text,parsed", [
    ("37*12=", ("call", "37*12")),
    (" 3+4*5=\n", ("call", "3+4*5")),
    ("2*-3=", ("call", "2*-3")),
    ("444", ("answer", "444")),
    ("-12", ("answer", "-12")),
    ("37*=", ("malformed", None)),
    ("444=", ("call", "444")),  # a bare number with '=' is a (trivial) call
    ("=", ("malformed", None)),
    ("", ("malformed", None)),
    ("37**2=", ("malformed", None)),
    ("37*12=444", ("malformed", None)),
])
def test_parse_digit_turn(text, parsed):
    assert parse_digit_turn(text) == parsed


def test_a_well_formed_episode():
    env = DigitCalculatorEnv(EnvLimits(max_turns=4))
    assert env.reset({"prompt": "37*12=", "answer": "444"}) == "37*12="
    call = env.step(_traj(1), "37*12=")
    assert (call.observation, call.done, call.reward) == ("444=", False, None)  # 37*12 = 444 by hand
    assert call.info["tool_calls"] == 1 and call.info["malformed_calls"] == 0
    final = env.step(_traj(2), "444")
    assert (final.observation, final.done, final.reward) == (None, True, 1.0)
    assert final.info == {"tool_calls": 1, "malformed_calls": 0, "truncated": False}


def test_precedence_and_a_negative_result():
    env = DigitCalculatorEnv(EnvLimits())
    env.reset({"prompt": "x", "answer": "-17"})
    assert env.step(_traj(1), "3-4*5=").observation == "-17="  # * before -: 3 - 20
    assert env.step(_traj(2), "-17").reward == 1.0


def test_a_wrong_final_answer_scores_0_and_no_answer_field_gives_no_reward():
    env = DigitCalculatorEnv(EnvLimits())
    env.reset({"prompt": "37*12=", "answer": "444"})
    assert env.step(_traj(1), "445").reward == 0.0
    env.reset({"prompt": "37*12="})
    r = env.step(_traj(1), "444")
    assert r.done and r.reward is None
    env.reset("37*12=")  # a plain problem: its text is the prompt
    assert env.step(_traj(1), "444").reward is None


@pytest.mark.parametrize("text", ["37*=", "=", "", "37*12=444", "99999999999999999*99999999999999999="])
def test_a_malformed_turn_ends_the_episode(text):
    env = DigitCalculatorEnv(EnvLimits())
    env.reset({"prompt": "37*12=", "answer": "444"})
    r = env.step(_traj(1), text)
    assert r.done and r.observation is None and r.reward == 0.0
    assert r.info["malformed_calls"] == 1 and r.info["tool_calls"] == 0
    assert r.info["reason"] == "malformed" and r.info["truncated"] is False


def test_a_call_counts_are_per_episode():
    env = DigitCalculatorEnv(EnvLimits())
    env.reset({"prompt": "1+1=", "answer": "2"})
    env.step(_traj(1), "1+1=")
    env.step(_traj(2), "2+0=")
    env.reset({"prompt": "1+1=", "answer": "2"})
    assert env.step(_traj(1), "2").info["tool_calls"] == 0


@pytest.mark.parametrize("limits,turns,tokens,reason", [
    ({"max_turns": 1}, 1, 3, "max_turns"),
    ({"max_turns": 2}, 2, 3, "max_turns"),
    ({"max_total_tokens": 5}, 1, 3, "max_total_tokens"),  # 2 prompt + 3 policy tokens
])
def test_a_call_with_no_turn_left_ends_truncated(limits, turns, tokens, reason):
    env = DigitCalculatorEnv(EnvLimits(**limits))
    env.reset({"prompt": "37*12=", "answer": "444"})
    r = env.step(_traj(turns, tokens), "37*12=")
    assert r.done and r.observation is None and r.reward == 0.0
    assert r.info["truncated"] is True and r.info["reason"] == reason and r.info["tool_calls"] == 0


def test_registered_as_a_builtin():
    cfg = EnvConfig(name="digit_calculator", max_turns=3)
    env = get_env_factory(cfg)(cfg)
    assert isinstance(env, DigitCalculatorEnv) and env.limits.max_turns == 3


def test_observations_and_a_demonstration_tokenise_in_the_tiny_vocabulary(tmp_path):
    """The tiny tokenizer encodes the observation alone and a calc demonstration whose
    ``<eos>`` is the EOS id (so the SFT row has the episode's token layout)."""
    from nemo_rlhf.data.tokenizer import Tokenizer
    from nemo_rlhf.tasks.precedence import SPECIAL_TOKENS, build_char_tokenizer_json

    (tmp_path / "tokenizer.json").write_text(build_char_tokenizer_json())
    import json
    (tmp_path / "special_tokens.json").write_text(json.dumps(SPECIAL_TOKENS))
    tok = Tokenizer(tmp_path)
    assert tok.decode(tok.encode("-17=")) == "-17="
    ids = tok.encode("37*12=<eos>444=444")
    assert ids.count(tok.eos_id) == 1 and ids.index(tok.eos_id) == 6
    assert tok.decode(ids[:6]) == "37*12=" and tok.decode(ids[7:]) == "444=444"
