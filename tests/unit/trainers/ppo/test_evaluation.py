"""``trainer.eval_judge``: a reward function or a second RM server's URL, checked at config
time; the URL form scores through the RM client."""

from __future__ import annotations

import math
import types

import pytest

from nemo_rlhf.trainers.ppo import evaluation
from nemo_rlhf.reward.config import RewardConfig
from nemo_rlhf.trainers.ppo.config import PPOTrainerConfig


def judge(prompts, responses, extras):
    return [0.0] * len(responses)


def test_the_judge_is_checked_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"trainer.eval_judge='nope': valid choices are \[.*'two_digit_addition'\]"):
        PPOTrainerConfig(eval_judge="nope")
    PPOTrainerConfig(eval_judge="http://judge:5555")
    PPOTrainerConfig(eval_judge=f"{__name__}:judge")
    PPOTrainerConfig(eval_judge="two_digit_addition")
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
                                reward=RewardConfig(timeout_s=7.0, max_retries=2, max_wait_s=60.0),
                                exp_manager=types.SimpleNamespace(exp_dir="unused"))
    state = evaluation.HeldOutEvaluation(cfg, has_prompts=False)
    judge = state.judge()
    assert judge(["p", "q"], ["abc", "de"], [{}, {}]) == [3.0, 2.0]
    assert state.judge() is judge  # built once
    assert seen["init"] == ("http://judge:5555", 7.0, 2, 60.0) and seen["calls"] == [(["p", "q"], ["abc", "de"])]


def test_win_rate_counts_ties_as_half():
    now = [{"s": 2.0}, {"s": 1.0}, {"s": 0.0}]
    before = [{"s": 1.0}, {"s": 1.0}, {"s": 1.0}]
    assert evaluation.win_rate(now, before, "s") == pytest.approx(0.5)


def test_win_rate_leaves_out_prompts_whose_score_is_invalid():
    now = [{"s": 2.0}, {"s": float("nan"), "valid": False}, {"s": 0.0}]
    before = [{"s": 1.0}, {"s": 1.0}, {"s": 1.0, "valid": False}]
    assert evaluation.win_rate(now, before, "s") == 1.0  # only the first pair counts
    assert math.isnan(evaluation.win_rate(now[1:], before[1:], "s"))


def _evaluate(state, n, batch, texts, reward, dims, step=0):
    """:func:`evaluation.evaluate_policy` on ``n`` held-out rows ``p0``, ``p1``, ... (no
    trainer: a fixed batch decoded as ``texts``); the ids it decoded are recorded."""
    prompts = [types.SimpleNamespace(prompt=f"p{i}", prompt_ids=[i + 1], extras={}) for i in range(n)]
    failures = []

    def raise_if_failed(failure):
        failures.append(failure)
        if failure is not None:
            raise failure

    decoded = []
    out = evaluation.evaluate_policy(state, prompts, lambda rows: decoded.append([r.prompt_ids for r in rows]) or batch,
                                     lambda b: list(texts), reward, dims, step, True, raise_if_failed)
    assert decoded == [[[i + 1] for i in range(min(n, state.max_samples))]] and failures == [None]
    return out


def test_heldout_metrics_leave_out_invalid_scores_under_skip(tmp_path):
    """``reward.invalid_scores=skip``: a held-out response whose score is NaN is left out of
    ``eval/reward``, the per-source means and the win rate, and counted in
    ``eval/invalid_scores`` (the metrics were NaN before)."""
    import torch

    from nemo_rlhf.reward.functions import CombinedReward, RewardFunctionScorer, WeightedSource
    from tests.single_rank import single_rank

    def scores(prompts, responses, extras):
        return [float("nan") if r == "bad" else float(len(r)) for r in responses]

    texts = ["ab", "bad", "abcd"]
    batch = types.SimpleNamespace(response_ids=torch.ones(3, 2, dtype=torch.long),
                                  response_mask=torch.ones(3, 2, dtype=torch.bool),
                                  response_lengths=torch.tensor([2, 3, 4]))
    reward = CombinedReward([WeightedSource("f", RewardFunctionScorer(scores))], invalid_scores="skip")
    cfg = types.SimpleNamespace(trainer=PPOTrainerConfig(max_eval_samples=3), reward=RewardConfig(),
                                exp_manager=types.SimpleNamespace(exp_dir=str(tmp_path)))
    state = evaluation.HeldOutEvaluation(cfg, has_prompts=True)
    with single_rank() as dims:
        first = _evaluate(state, 3, batch, texts, reward, dims)
        texts[:] = ["abc", "bad", "a"]
        second = _evaluate(state, 3, batch, texts, reward, dims)
    assert first["eval/reward"] == 3.0 and first["eval/f"] == 3.0  # (2 + 4) / 2
    assert first["eval/invalid_scores"] == 1.0
    assert second["eval/reward"] == 2.0  # (3 + 1) / 2
    assert second["eval/win_rate_vs_initial"] == 0.5  # 3 > 2, 1 < 4; the invalid pair left out


def test_reward_auc_is_the_share_of_checker_ordered_pairs_the_reward_orders_alike():
    # right answers scored 3 and 2, wrong ones 1 and 2: pairs (3,1) (3,2) (2,1) agree, (2,2) ties
    rows = [{"score": 3.0, "correct": 1.0}, {"score": 1.0, "correct": 0.0},
            {"score": 2.0, "correct": 1.0}, {"score": 2.0, "correct": 0.0}]
    assert evaluation.reward_auc(rows) == pytest.approx(3.5 / 4)
    assert evaluation.reward_auc(rows, chunk=1) == pytest.approx(3.5 / 4)  # chunking changes nothing
    # graded checker scores: every ordered pair counts; the reward orders all three the other way
    graded = [{"score": 1.0, "correct": 1.0}, {"score": 2.0, "correct": 0.5}, {"score": 3.0, "correct": 0.0}]
    assert evaluation.reward_auc(graded) == 0.0
    # a reward that scores right and wrong alike carries no information
    assert evaluation.reward_auc([{"score": 5.0, "correct": c} for c in (1.0, 0.0, 0.0)]) == 0.5
    # nothing to order: all right, all wrong, one answer
    assert evaluation.reward_auc([{"score": 1.0, "correct": 1.0}, {"score": 0.0, "correct": 1.0}]) is None
    assert evaluation.reward_auc([{"score": 1.0, "correct": 0.0}] * 3) is None
    assert evaluation.reward_auc(rows[:1]) is None


def has_a(prompts, responses, extras):
    return [float("a" in r) for r in responses]


def test_heldout_metrics_report_the_reward_auc_against_the_checker(tmp_path):
    """``eval/reward_auc`` is :func:`reward_auc` over the held-out answers whose score is
    valid, with the checker's scores as labels; without a comparable pair it is not logged."""
    import torch

    from nemo_rlhf.reward.functions import CombinedReward, RewardFunctionScorer, WeightedSource
    from tests.single_rank import single_rank

    def scores(prompts, responses, extras):  # the reward: minus the length, NaN for "bad"
        return [float("nan") if r == "bad" else -float(len(r)) for r in responses]

    texts = ["a", "bbb", "bad", "aa"]
    batch = types.SimpleNamespace(response_ids=torch.ones(4, 2, dtype=torch.long),
                                  response_mask=torch.ones(4, 2, dtype=torch.bool),
                                  response_lengths=torch.tensor([1, 3, 3, 2]))
    reward = CombinedReward([WeightedSource("f", RewardFunctionScorer(scores))], invalid_scores="skip")
    cfg = types.SimpleNamespace(trainer=PPOTrainerConfig(max_eval_samples=4, eval_checker=f"{__name__}:has_a"),
                                reward=RewardConfig(), exp_manager=types.SimpleNamespace(exp_dir=str(tmp_path)))
    state = evaluation.HeldOutEvaluation(cfg, has_prompts=True)
    with single_rank() as dims:
        first = _evaluate(state, 4, batch, texts, reward, dims)
        texts[:] = ["a", "aaa", "bad", "ab"]  # every valid answer right: no pair to order
        second = _evaluate(state, 4, batch, texts, reward, dims)
    # right "a" (-1) and "aa" (-2) outscore wrong "bbb" (-3); the right "bad" (invalid score)
    # is left out (with its NaN the share would be 2/3)
    assert first["eval/accuracy"] == 0.75 and first["eval/reward_auc"] == 1.0
    assert "eval/reward_auc" not in second and second["eval/accuracy"] == 1.0


def test_evaluate_policy_takes_its_parts_and_names_the_checker_key_on_a_bad_path(tmp_path):
    """Without a trainer: no held-out rows give ``{}`` (nothing decoded); a checker path that
    does not resolve fails on the scoring rank, through ``raise_if_failed``, naming
    ``trainer.eval_checker`` and the attribute tried; ``max_eval_samples`` caps the rows."""
    import torch

    from nemo_rlhf.reward.functions import CombinedReward, RewardFunctionScorer, WeightedSource
    from tests.single_rank import single_rank

    reward = CombinedReward([WeightedSource("f", RewardFunctionScorer(lambda p, r, e: [1.0] * len(r)))])
    batch = types.SimpleNamespace(response_ids=torch.ones(2, 2, dtype=torch.long),
                                  response_mask=torch.ones(2, 2, dtype=torch.bool),
                                  response_lengths=torch.tensor([1, 2]))

    def cfg(**trainer):
        return types.SimpleNamespace(trainer=PPOTrainerConfig(**trainer), reward=RewardConfig(),
                                     exp_manager=types.SimpleNamespace(exp_dir=str(tmp_path)))

    state = evaluation.HeldOutEvaluation(cfg(eval_checker=f"{__name__}:no_such_checker"), has_prompts=True)
    with single_rank() as dims:
        assert evaluation.evaluate_policy(state, [], None, None, reward, dims, 0, True, None) == {}
        with pytest.raises(AttributeError, match=rf"^trainer.eval_checker='{__name__}:no_such_checker': "
                                                 rf"module '{__name__}' has no attribute 'no_such_checker'"):
            _evaluate(state, 2, batch, ["a", "b"], reward, dims)
        capped = evaluation.HeldOutEvaluation(cfg(max_eval_samples=2, eval_checker=f"{__name__}:has_a"),
                                              has_prompts=True)
        out = _evaluate(capped, 5, batch, ["a", "b"], reward, dims, step=3)
    assert out["eval/accuracy"] == 0.5 and out["eval/reward"] == 1.0 and out["eval/response_length"] == 1.5
    written = (tmp_path / "eval_samples" / "step_000003.jsonl").read_text().splitlines()
    assert [__import__("json").loads(line)["prompt"] for line in written] == ["p0", "p1"]
