"""``trainer.eval_judge``: a reward function or a second RM server's URL, checked at config
time; the URL form scores through the RM client."""

from __future__ import annotations

import types

import pytest

from nemo_rlhf.reward.functions import register_reward_function
from nemo_rlhf.trainers.ppo import evaluation
from nemo_rlhf.trainers.ppo.config import PPOTrainerConfig, RewardConfig


@register_reward_function("test_evaluation_judge")
def _judge(prompts, responses, extras):
    return [0.0] * len(responses)


def test_the_judge_is_checked_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"trainer.eval_judge='nope': valid choices are \[.*'test_evaluation_judge'"):
        PPOTrainerConfig(eval_judge="nope")
    PPOTrainerConfig(eval_judge="http://judge:5555")
    PPOTrainerConfig(eval_judge="test_evaluation_judge")
    PPOTrainerConfig(eval_judge="mypkg.judges:not_imported_yet")


def test_a_judge_url_scores_through_the_rm_client(monkeypatch):
    seen = {}

    class FakeClient:
        def __init__(self, url, timeout_s, max_retries, max_wait_s):
            seen["init"] = (url, timeout_s, max_retries, max_wait_s)

        def score_texts(self, prompts, responses):
            seen.setdefault("calls", []).append((list(prompts), list(responses)))
            return [float(len(r)) for r in responses]

    monkeypatch.setattr(evaluation, "RewardModelClient", FakeClient)
    cfg = types.SimpleNamespace(trainer=PPOTrainerConfig(eval_judge="http://judge:5555"),
                                reward=RewardConfig(timeout_s=7.0, max_retries=2, max_wait_s=60.0))
    state = evaluation.HeldOutEvaluation(cfg, has_prompts=False)
    judge = state.judge()
    assert judge(["p", "q"], ["abc", "de"], [{}, {}]) == [3.0, 2.0]
    assert state.judge() is judge  # built once
    assert seen["init"] == ("http://judge:5555", 7.0, 2, 60.0) and seen["calls"] == [(["p", "q"], ["abc", "de"])]


def test_win_rate_counts_ties_as_half():
    now = [{"s": 2.0}, {"s": 1.0}, {"s": 0.0}]
    before = [{"s": 1.0}, {"s": 1.0}, {"s": 1.0}]
    assert evaluation.win_rate(now, before, "s") == pytest.approx(0.5)
