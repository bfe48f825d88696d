"""Bradley-Terry loss, accuracy, margin and reward statistics on hand-computed batches."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rlhf.trainers.rm import bradley_terry_loss, make_rm_loss_fn, pair_metrics


def _log1p_exp(x: float) -> float:  # -log sigmoid(d) = log(1 + exp(-d))
    return math.log1p(math.exp(x))


def test_bradley_terry_loss_and_stats_on_a_hand_computed_batch():
    rc = torch.tensor([2.0, 0.5, -1.0, 1.0])
    rr = torch.tensor([1.0, 1.5, -1.0, -2.0])
    # margins 1, -1, 0 (tie: counts as wrong), 3
    loss, stats = bradley_terry_loss(rc, rr, num_pairs=8)  # this micro-batch is half the global batch
    want = (_log1p_exp(-1) + _log1p_exp(1) + math.log(2) + _log1p_exp(-3)) / 8
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert int(stats["correct"]) == 2
    assert float(stats["margin"]) == pytest.approx(3.0)
    assert float(stats["reward_sum"]) == pytest.approx(2.0 + 0.5 - 1 + 1 + 1 + 1.5 - 1 - 2)
    assert float(stats["reward_sq"]) == pytest.approx(4 + 0.25 + 1 + 1 + 1 + 2.25 + 1 + 4)


def test_loss_over_split_micro_batches_sums_to_the_whole_batch_loss():
    g = torch.Generator().manual_seed(0)
    rc, rr = torch.randn(6, generator=g), torch.randn(6, generator=g)
    whole, _ = bradley_terry_loss(rc, rr, 6)
    parts = sum(bradley_terry_loss(rc[i:i + 2], rr[i:i + 2], 6)[0] for i in (0, 2, 4))
    assert float(parts) == pytest.approx(float(whole), rel=1e-6)


def test_loss_gradient_pushes_chosen_up_and_rejected_down():
    rc = torch.tensor([0.0], requires_grad=True)
    rr = torch.tensor([0.0], requires_grad=True)
    loss, _ = bradley_terry_loss(rc, rr, 1)
    loss.backward()
    assert float(rc.grad) == pytest.approx(-0.5) and float(rr.grad) == pytest.approx(0.5)


def test_rm_loss_fn_reads_rewards_at_the_last_valid_token_chosen_rows_first():
    rewards = torch.tensor([[9.0, 1.0, 2.0, 9.0],    # chosen 0, length 3 -> 2.0
                            [9.0, 9.0, 9.0, 3.0],    # chosen 1, length 4 -> 3.0
                            [0.5, 9.0, 9.0, 9.0],    # rejected 0, length 1 -> 0.5
                            [9.0, 4.0, 9.0, 9.0]])   # rejected 1, length 2 -> 4.0
    mb = {"lengths": torch.tensor([3, 4, 1, 2])}
    loss, stats = make_rm_loss_fn(2)(rewards, mb)
    want = (_log1p_exp(-1.5) + _log1p_exp(1.0)) / 2
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert int(stats["correct"]) == 1 and float(stats["margin"]) == pytest.approx(0.5)


def test_pair_metrics_turn_global_sums_into_means_and_std():
    rewards = [2.0, 0.5, 1.0, 1.5]  # two pairs: chosen 2.0, 0.5; rejected 1.0, 1.5
    sums = {"loss": 0.7, "correct": 1.0, "margin": 0.0, "reward_sum": sum(rewards),
            "reward_sq": sum(r * r for r in rewards)}
    m = pair_metrics(sums, 2, "val/")
    assert m["val/accuracy"] == 0.5 and m["val/margin"] == 0.0 and m["val/loss"] == 0.7
    assert m["val/reward_mean"] == pytest.approx(1.25)
    assert m["val/reward_std"] == pytest.approx(float(torch.tensor(rewards).std(unbiased=False)))
