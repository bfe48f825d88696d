"""The calc tool task (#51): its problems, checker and demonstrations, ``Task.env`` /
``Task.env_overrides`` and what the recipe passes to PPO for them."""

from __future__ import annotations

import json

import pytest

from nemo_rlhf.envs import DigitCalculatorEnv
from nemo_rlhf.envs.config import EnvConfig
from nemo_rlhf.rollout.trajectory import Trajectory
from nemo_rlhf.tasks.calc import NO_TOOL, TASK, calc_answer, calc_answer_right, calc_problems
from nemo_rlhf.tasks.task import Task, demonstration_rows, env_overrides


def test_problems_are_disjoint_and_right():
    train, heldout = calc_problems()
    assert len(train) + len(heldout) == 90 * 98 and len(heldout) == 200
    key = lambda p: (p["a"], p["b"])  # noqa: E731
    assert not {key(p) for p in train} & {key(p) for p in heldout}
    assert all(p["answer"] == str(p["a"] * p["b"]) and 10 <= p["a"] <= 99 and 2 <= p["b"] <= 99
               for p in train + heldout)


@pytest.mark.parametrize("response,answer", [
    ("444", "444"), (" 444\n", "444"), ("37*12=<eos>444=444", "444"), ("37*12=444=444", "444"),
    ("37*12=", None), ("", None), ("44 4", None), ("444=", None), ("4a", None),
])
def test_calc_answer(response, answer):
    assert calc_answer(response) == answer


def test_checker():
    ex = {"answer": "444"}
    assert calc_answer_right("37*12=", "444", ex) and calc_answer_right("37*12=", "37*12=<eos>444=444", ex)
    assert not calc_answer_right("37*12=", "445", ex) and not calc_answer_right("37*12=", "37*12=", ex)


def test_demonstrations_are_right_and_hold_the_call():
    rows = [TASK.prompt_row({"a": 37, "b": 12, "answer": "444"}, "x")]
    assert demonstration_rows(TASK, rows) == [{"prompt": "37*12=", "segments": [
        {"kind": "policy", "text": "37*12="}, {"kind": "env", "text": "444="}, {"kind": "policy", "text": "444"}]}]
    assert demonstration_rows(NO_TOOL, rows) == [{"prompt": "37*12=", "response": "444"}]


def test_the_demonstration_is_a_right_episode_of_the_digit_calculator():
    """The demonstration's turns, played against the environment: the call is answered with
    the observation the demonstration holds, and its final turn earns reward 1."""
    prompt, extras = "37*12=", {"a": 37, "b": 12, "answer": "444"}
    (k0, call), (k1, obs), (k2, final) = [(s["kind"], s["text"]) for s in TASK.demonstrate(prompt, extras)]
    assert (k0, k1, k2) == ("policy", "env", "policy")
    env = DigitCalculatorEnv(EnvConfig(name=TASK.env).limits())
    env.reset({"prompt": prompt, **extras})
    tr = Trajectory([1, 2])
    tr.append_policy([5] * len(call), [-1.0] * len(call))
    r = env.step(tr, call)
    assert not r.done and r.observation == obs  # the env segment is the observation, as appended
    tr.append_env([9] * len(r.observation))
    tr.append_policy([5] * len(final), [-1.0] * len(final))
    end = env.step(tr, final)
    assert end.done and end.reward == 1.0 and calc_answer_right(prompt, final, extras)


def test_env_overrides_the_recipe_passes():
    assert env_overrides(TASK) == ["env.name='digit_calculator'", "env.max_turns=2", "env.max_total_tokens=64"]
    assert env_overrides(NO_TOOL) == []
    EnvConfig(name=TASK.env, max_turns=2, max_total_tokens=64)  # valid values


def _task(**kw) -> Task:
    return Task(**{"name": "t", "train": [{"x": 1}], "heldout": [{"x": 2}], "prompt_template": "{x}=",
                   "check": lambda p, r, e: True, **kw})


@pytest.mark.parametrize("kw,message", [
    ({"env": ""}, "Task.env=''"),
    ({"env": 3}, "Task.env=3"),
    ({"env": "digit_calculator", "env_overrides": ("max_turns=2",)}, "Task.env_overrides[0]='max_turns=2'"),
    ({"env": "digit_calculator", "env_overrides": ("env.name=x",)}, "other than env.name"),
    ({"env_overrides": ("env.max_turns=2",)}, "without Task.env"),
])
def test_bad_env_fields_are_refused(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
        _task(**kw)


def test_calc_prompts_demonstrations_fit_the_tiny_budget():
    """Every held-out demonstration's call turn (+ EOS) and answer turn (+ EOS) fit
    ``Task.max_new_tokens`` (one token per character in the tiny vocabulary)."""
    for p in TASK.heldout:
        row = TASK.prompt_row(p, "heldout")
        call = TASK.demonstrate(row["prompt"], p)[0]["text"]
        assert len(call) + 1 <= TASK.max_new_tokens and len(p["answer"]) + 1 <= TASK.max_new_tokens
        assert json.dumps(row)  # JSON-able
