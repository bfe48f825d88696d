"""The PPO step's metrics and hand-offs without a trainer (#50): ``step_metrics``'
repetition, rollout quality, update metrics and raw score mean against hand-computed
values; ``step_data``'s forward results and advantages as the roles read them."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch

from nemo_rlhf.trainers.ppo.step_data import Advantages, ForwardResults
from nemo_rlhf.trainers.ppo.step_metrics import (raw_score_mean, response_repetition, rollout_quality,
                                                 update_metrics)

ONE_RANK = types.SimpleNamespace(dims=types.SimpleNamespace(dp=1))
"""Collectives of a job with one DP rank: the sums are this rank's."""


def _batch(response_ids, response_mask, logprobs):
    mask = torch.tensor(response_mask, dtype=torch.bool)
    return types.SimpleNamespace(response_ids=torch.tensor(response_ids), response_mask=mask,
                                 response_lengths=mask.sum(-1), logprobs=torch.tensor(logprobs))


# row 0: 1 2 3 1 2 3 (6 tokens: 3-grams 123 231 312 123 -> 1 of 4 repeats, 0.25)
# row 1: 5 5 5 5 + 2 masked (3-grams 555 555 -> 0.5); row 2: 7 8 (too short: 0)
IDS = [[1, 2, 3, 1, 2, 3], [5, 5, 5, 5, 5, 5], [7, 8, 7, 8, 7, 8]]
MASK = [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]


def test_response_repetition_counts_only_generated_tokens():
    batch = _batch(IDS, MASK, [[0.0] * 6] * 3)
    assert response_repetition(batch) == [0.25, 0.5, 0.0]


def test_rollout_quality_hand_computed():
    rollout = [[-1.0, -2.0, -1.0, -1.0, -1.0, -1.0],
               [-0.5, -0.5, -0.5, -0.5, -9.0, -9.0],  # the masked -9 never count
               [-3.0, -1.0, -7.0, -7.0, -7.0, -7.0]]
    old = torch.tensor([[-1.5, -2.0, -1.0, -1.0, -1.0, -1.0],
                        [-0.5, -0.5, -0.5, -0.75, 0.0, 0.0],
                        [-1.0, -1.0, 0.0, 0.0, 0.0, 0.0]])
    batch = _batch(IDS, MASK, rollout)
    out = rollout_quality(ONE_RANK, batch, old, None)
    # |diff| on the 12 valid tokens: 0.5, 0.25, 2.0 (rest 0) -> mean 2.75 / 12, max 2.0
    # k3 = exp(d) - d - 1 of d = old - rollout (-0.5, -0.25, 2.0; 0 elsewhere) over the 12
    k3 = (math.exp(-0.5) + 0.5 - 1) + (math.exp(-0.25) + 0.25 - 1) + (math.exp(2.0) - 2.0 - 1)
    assert out == {"rollout_train_logprob_diff_mean": pytest.approx(2.75 / 12),
                   "rollout_train_logprob_diff_max": 2.0, "rollout_train_k3_kl": pytest.approx(k3 / 12),
                   "repetition": pytest.approx(0.75 / 3), "response_length_max": 6.0}
    # returns 1 2 3 4 (+1 masked-out elsewhere), R - V = 0 0 1 -1: var R = 5/3, var D = 2/3
    ev = torch.tensor([10.0, 30.0, 0.0, 2.0, 4.0], dtype=torch.float64)
    assert rollout_quality(ONE_RANK, batch, old, ev)["explained_variance"] == pytest.approx(1 - (2 / 3) / (5 / 3))


def test_rollout_quality_of_an_all_masked_batch_is_zero_not_nan():
    batch = _batch([[1, 2]], [[0, 0]], [[-1.0, -1.0]])
    out = rollout_quality(ONE_RANK, batch, torch.zeros(1, 2), None)
    assert out["rollout_train_logprob_diff_mean"] == 0.0 and out["rollout_train_logprob_diff_max"] == 0.0
    assert out["response_length_max"] == 0.0 and "explained_variance" not in out


def _stats(ratio_max, ratio_min, loss_sum, n):
    return {"ratio_max": torch.tensor(ratio_max), "ratio_min": torch.tensor(ratio_min),
            "policy_loss_sum": torch.tensor(loss_sum), "valid_tokens": torch.tensor(n)}


def test_update_metrics_hand_computed():
    stats = [_stats(1.1, 0.95, 2.0, 4.0), _stats(1.5, 0.7, 4.0, 8.0)]
    out = update_metrics(stats, [1.0, 2.0, 6.0], [0.5, 1.5])
    assert out == {"first_minibatch/ratio_max": pytest.approx(1.1),
                   "first_minibatch/ratio_min": pytest.approx(0.95),
                   "ratio_max": pytest.approx(1.5), "ratio_min": pytest.approx(0.7),
                   "policy_loss": pytest.approx(6.0 / 12.0),  # sums over tokens, not a mean of means
                   "grad_norm": 3.0, "critic_grad_norm": 1.0}


def test_update_metrics_without_steps_or_critic():
    assert update_metrics([], [], []) == {"grad_norm": 0.0}
    out = update_metrics([{"policy_loss_sum": torch.tensor(1.0), "valid_tokens": torch.tensor(2.0)}], [4.0], [])
    assert math.isnan(out["first_minibatch/ratio_max"]) and out["policy_loss"] == 0.5
    assert "critic_grad_norm" not in out and out["grad_norm"] == 4.0


def test_raw_score_mean_on_one_rank():
    dims = types.SimpleNamespace(dp=1)
    assert raw_score_mean(dims, torch.tensor([1.0, 2.0, 6.0])) == 3.0


def test_raw_score_mean_weights_ranks_by_their_rows(monkeypatch):
    """Over DP the mean is total / rows (not a mean of the ranks' means)."""
    from nemo_rlhf.trainers.ppo import step_metrics

    def gather(dims, local):  # this rank's [sum, n] and another's with 3 rows summing to 3
        return torch.stack([local, torch.tensor([3.0, 3.0], dtype=local.dtype)])

    monkeypatch.setattr(step_metrics, "gather_over_scoring_ranks", gather)
    assert raw_score_mean(types.SimpleNamespace(dp=2), torch.tensor([9.0])) == pytest.approx(12.0 / 4)


def test_forward_results_and_advantages_carry_the_step_tensors_by_name():
    assert [f.name for f in dataclasses.fields(ForwardResults)] == [
        "old_logprobs", "ref_logprobs", "kl_logprobs", "values"]
    assert [f.name for f in dataclasses.fields(Advantages)] == ["advantages", "returns", "kl", "loss_mask"]
    t = torch.zeros(2, 3)
    fwd = ForwardResults(old_logprobs=t, ref_logprobs=t + 1, kl_logprobs=t, values=None)  # critic-free
    assert fwd.values is None and torch.equal(fwd.ref_logprobs, torch.ones(2, 3))
    with pytest.raises(TypeError):  # nothing is optional by default: a step passes every field
        ForwardResults(old_logprobs=t, ref_logprobs=t, kl_logprobs=t)
    with pytest.raises(TypeError):
        Advantages(advantages=t, returns=t, kl=t)
