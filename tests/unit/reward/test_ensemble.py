"""The RM ensemble's conservative reward, against hand-computed values."""

import threading

import pytest
import torch

from nemo_rlhf.reward.ensemble import RewardModelEnsemble, aggregate_ensemble
from nemo_rlhf.reward.functions import CombinedReward, WeightedSource

# member 0: mean 1, std 2; member 1: mean -3, std 0.5 (another offset and scale, as two
# Bradley-Terry RMs have). Sample A: z = [1, 1] (they agree); sample B: z = [0, -1].
SCORES = torch.tensor([[3.0, 1.0], [-2.5, -3.5]])
MEANS, STDS = torch.tensor([1.0, -3.0]), torch.tensor([2.0, 0.5])


@pytest.mark.parametrize("aggregate,coef,expected", [
    ("mean", 1.0, [3.0, 0.0]),             # B: mean z -0.5 -> -0.5 * 2 + 1
    ("min", 1.0, [3.0, -1.0]),             # B: min z -1 -> -1 * 2 + 1
    ("mean_minus_std", 1.0, [3.0, -1.0]),  # B: -0.5 - 1 * 0.5 (population std) -> -1.0 * 2 + 1
    ("mean_minus_std", 2.0, [3.0, -2.0]),  # B: -0.5 - 2 * 0.5 -> -1.5 * 2 + 1
    ("mean_minus_std", 0.0, [3.0, 0.0]),   # k = 0 is the mean
])
def test_aggregate_standardises_members_and_answers_in_the_first_ones_units(aggregate, coef, expected):
    reward, spread = aggregate_ensemble(SCORES, MEANS, STDS, aggregate, coef)
    assert reward.dtype == torch.float32 and spread.dtype == torch.float32
    assert reward.tolist() == pytest.approx(expected, abs=1e-6)
    assert spread.tolist() == pytest.approx([0.0, 1.0], abs=1e-6)  # B: 0.5 z-units * std_0


def test_an_offset_between_members_is_not_counted_as_disagreement():
    # the same RM shifted by +100 (a Bradley-Terry RM is defined up to an offset)
    base = torch.tensor([0.5, -1.0, 2.0])
    reward, spread = aggregate_ensemble(torch.stack([base, base + 100]), torch.tensor([0.0, 100.0]),
                                        torch.tensor([1.0, 1.0]), "mean_minus_std", 3.0)
    assert reward.tolist() == pytest.approx(base.tolist(), abs=1e-5)
    assert spread.tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(aggregate="median"), r"reward.ensemble.aggregate='median'.*'mean', 'min', 'mean_minus_std'"),
    (dict(std_coef=-1.0), r"reward.ensemble.std_coef=-1.0: must be >= 0"),
    (dict(stds=torch.tensor([2.0, 0.0])), r"reward_std must be > 0"),
    (dict(means=torch.tensor([1.0])), r"must be \[members, batch\]"),
])
def test_aggregate_refuses_bad_input(kwargs, match):
    args = dict(scores=SCORES, means=MEANS, stds=STDS, aggregate="mean_minus_std", std_coef=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        aggregate_ensemble(**args)


class _Client:
    def __init__(self, scores, barrier=None):
        self.scores, self.barrier, self.calls = scores, barrier, []
        self.allow_nonfinite = False

    def score_texts(self, prompts, responses):
        self.calls.append((list(prompts), list(responses)))
        if self.barrier is not None:
            self.barrier.wait()  # raises BrokenBarrierError unless the members are asked together
        return list(self.scores)


def _stats(means=MEANS, stds=STDS):
    return [{"reward_mean": float(m), "reward_std": float(s)} for m, s in zip(means, stds)]


def test_members_are_asked_concurrently_and_their_spread_is_reported_as_a_metric():
    barrier = threading.Barrier(2, timeout=10)
    clients = [_Client(SCORES[0].tolist(), barrier), _Client(SCORES[1].tolist(), barrier)]
    ens = RewardModelEnsemble(clients, _stats(), ["a", "b"], "min")
    reward = CombinedReward([WeightedSource("rm", ens)])
    out = reward.score(["p1", "p2"], ["r1", "r2"])
    assert [c.calls for c in clients] == [[(["p1", "p2"], ["r1", "r2"])]] * 2
    assert out.scores.tolist() == pytest.approx([3.0, -1.0])
    metrics = out.metrics()
    assert metrics["reward/rm"] == pytest.approx(1.0)
    assert metrics["reward/rm_ensemble_std"] == pytest.approx(0.5)  # mean of [0, 1]


def test_a_member_without_training_statistics_is_refused_naming_it():
    clients = [_Client([0.0]), _Client([0.0])]
    with pytest.raises(ValueError, match=r"the RM at http://b:1 serves no reward_mean / reward_std > 0"):
        RewardModelEnsemble(clients, [_stats()[0], {"reward_mean": 0.0}], ["http://a:1", "http://b:1"])
    with pytest.raises(ValueError, match=r"needs >= 2 members"):
        RewardModelEnsemble(clients[:1], _stats()[:1], ["a"])


def test_an_invalid_member_score_makes_the_sample_invalid_under_skip():
    clients = [_Client([3.0, 1.0]), _Client([float("nan"), -3.5])]
    ens = RewardModelEnsemble(clients, _stats(), ["a", "b"], "mean")
    out = CombinedReward([WeightedSource("rm", ens)], invalid_scores="skip").score(["p", "q"], ["r", "s"])
    assert all(c.allow_nonfinite for c in clients)  # judged by CombinedReward, not raised by the client
    assert out.valid.tolist() == [False, True]
    assert out.metrics()["reward/rm_ensemble_std"] == pytest.approx(1.0)  # the valid sample only


def test_reward_config_refuses_members_without_a_primary_rm_and_bad_rules():
    from nemo_rlhf.reward.config import RewardConfig, RMEnsembleConfig

    with pytest.raises(ValueError, match=r"reward.ensemble lists 1 more RM\(s\) but no primary RM"):
        RewardConfig(ensemble=RMEnsembleConfig(rm_urls=["http://b:1"]))
    with pytest.raises(ValueError, match=r"reward.ensemble.aggregate"):
        RMEnsembleConfig(aggregate="max")
    cfg = RewardConfig(rm_url="http://a:1", ensemble=RMEnsembleConfig(rm_urls=["http://b:1"],
                                                                      rm_address_files=["/x/rm_address_1"]))
    assert cfg.ensemble.members == ["http://b:1", "/x/rm_address_1"]
