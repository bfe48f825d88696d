"""The demo tasks' checkers (hand examples) and their short names
(:data:`~nemo_rlhf.reward.functions.BUILTIN_REWARD_FUNCTIONS`)."""

from __future__ import annotations

import pytest

from nemo_rlhf.envs.builtin import env_reward
from nemo_rlhf.reward.functions import BUILTIN_REWARD_FUNCTIONS, check_reward_function_spec, get_reward_function
from nemo_rlhf.tasks.addition import addition_answer, just_the_number, two_digit_addition
from nemo_rlhf.tasks.precedence import arithmetic_exact_match


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("21", "21", 1.0),
        (" 21\n", "21", 1.0),
        ("21.", "21", 1.0),
        ("21\n4+5=9", "21", 1.0),
        ("36", "21", 0.0),
        ("", "21", 0.0),
        ("-3", "-3", 1.0),
        ("-3", "3", 0.0),
        ("3", "-3", 0.0),
        ("210", "21", 0.0),
        ("21.5", "21", 0.0),
        ("is 21", "21", 0.0),
        ("twenty-one", "21", 0.0),
    ],
)
def test_arithmetic_exact_match_hand_examples(response, answer, expected):
    assert arithmetic_exact_match(["3+3*6="], [response], [{"prompt": "3+3*6=", "answer": answer}]) == [expected]


def test_arithmetic_exact_match_batch_and_missing_answer():
    assert arithmetic_exact_match(["1+1=", "2*3="], ["2", "5"], [{"answer": 2}, {"answer": "6"}]) == [1.0, 0.0]
    with pytest.raises(KeyError, match=r"extras\[1\] has no 'answer'"):
        arithmetic_exact_match(["a", "b"], ["1", "2"], [{"answer": "1"}, {"question": "b"}])
    with pytest.raises(ValueError, match=r"extras\[0\]\['answer'\]='x' is not an integer"):
        arithmetic_exact_match(["a"], ["1"], [{"answer": "x"}])
    with pytest.raises(ValueError, match="same length"):
        arithmetic_exact_match(["a"], ["1", "2"], [{"answer": "1"}])


def test_two_digit_addition_reads_answer_from_extras_or_prompt():
    prompt = "What is 26+28? Answer with just the number."
    responses = ["54", "The answer is 54.", "26 + 28 = 54", "55", "", "26+28 is 26+28, which is", "54 or 55",
                 "55 or 54", "28"]
    assert two_digit_addition([prompt] * 9, responses, [{}] * 9) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert two_digit_addition([prompt], ["54"], [{"answer": "54"}]) == [1.0]
    with pytest.raises(ValueError, match=r"extras\[0\] has no 'answer' and prompts\[0\] has no 'a\+b'"):
        two_digit_addition(["Say hi"], ["hi"], [{}])


def test_just_the_number_is_format_not_correctness():
    responses = ["54", " 55.\n", "The answer is 54.", "26+28=54", "", "5 4", "-3"]
    assert just_the_number(["p"] * 7, responses, [{}] * 7) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert addition_answer("26 + 28 = 54") == 54 and addition_answer("26+28") is None


def test_the_short_names_resolve_to_the_tasks_checkers():
    expected = {"arithmetic_exact_match": arithmetic_exact_match,
                "two_digit_addition": two_digit_addition, "just_the_number": just_the_number,
                "env": env_reward}  # (env: the episode reward of multi-turn rollouts, #51)
    assert sorted(BUILTIN_REWARD_FUNCTIONS) == sorted(expected)
    for name, fn in expected.items():
        assert get_reward_function(name) is fn
        assert get_reward_function(BUILTIN_REWARD_FUNCTIONS[name]) is fn  # the path it stands for
        check_reward_function_spec("trainer.eval_checker", name)
    assert get_reward_function("nemo_rlhf.tasks.addition:two_digit_addition") is two_digit_addition
