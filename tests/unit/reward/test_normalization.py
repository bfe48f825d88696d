"""RewardNormalizer: fixed and running normalisation, clipping, state round trip."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.reward.normalization import RewardNormalizationConfig, RewardNormalizer


def test_none_passes_scores_through_and_clip_clips():
    x = torch.tensor([-5.0, -0.5, 0.0, 0.5, 5.0])
    assert torch.equal(RewardNormalizer("none")(x), x)
    assert RewardNormalizer("none", clip=1.0)(x).tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0]


def test_fixed_uses_checkpoint_stats_from_metadata_then_clips():
    meta = {"status": "ready", "scorer": {"model_name": "rm", "reward_mean": 2.0, "reward_std": 4.0}}
    norm = RewardNormalizer.from_metadata(meta, mode="fixed")
    assert norm(torch.tensor([2.0, 6.0, -2.0, 42.0])).tolist() == [0.0, 1.0, -1.0, 10.0]
    clipped = RewardNormalizer.from_metadata(meta["scorer"], mode="fixed", clip=3.0)
    assert clipped([2.0, 6.0, -2.0, 42.0]).tolist() == [0.0, 1.0, -1.0, 3.0]
    assert norm(torch.tensor([6.0])).dtype == torch.float32


def test_running_matches_mean_and_std_of_everything_seen():
    torch.manual_seed(0)
    batches = [torch.randn(n) * 3 + 7 for n in (5, 1, 12, 8)]
    norm = RewardNormalizer("running")
    for b in batches:
        out = norm(b)
    seen = torch.cat(batches).double()
    mean, std = seen.mean().item(), seen.std(unbiased=False).item()
    assert norm.count == seen.numel()
    assert norm.mean == pytest.approx(mean, rel=1e-12) and norm.std == pytest.approx(std, rel=1e-12)
    assert torch.allclose(out, ((batches[-1].double() - mean) / std).float(), atol=1e-6)


def test_running_update_false_leaves_stats_and_requires_stats():
    norm = RewardNormalizer("running")
    with pytest.raises(RuntimeError, match="no statistics yet"):
        norm([1.0], update=False)
    norm([1.0, 3.0])
    state = norm.state_dict()
    assert norm([100.0], update=False).tolist() == [98.0]  # (100 - mean 2) / std 1
    assert norm.state_dict() == state


def test_running_gather_merges_all_ranks_like_one_big_batch():
    rank_batches = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0]), torch.tensor([4.0, -4.0])]

    def fake_all_gather(local):  # what an all-gather over 3 DP ranks would return, here for rank 0
        others = []
        for b in rank_batches:
            d = b.double()
            others.append(torch.tensor([float(b.numel()), d.mean().item(), ((d - d.mean()) ** 2).sum().item()]))
        assert torch.equal(local, others[0])
        return torch.stack(others)

    norm = RewardNormalizer("running")
    norm.update(rank_batches[0], gather=fake_all_gather)
    single = RewardNormalizer("running")
    single.update(torch.cat(rank_batches))
    assert norm.count == single.count == 6
    assert norm.mean == pytest.approx(single.mean) and norm.std == pytest.approx(single.std)


def test_state_round_trip_survives_a_resume():
    a = RewardNormalizer("running", clip=2.0)
    a(torch.tensor([1.0, 2.0, 3.0, 10.0]))
    b = RewardNormalizer("running", clip=2.0)
    b.load_state_dict(a.state_dict())
    nxt = torch.tensor([4.0, -3.0])
    assert torch.equal(a(nxt), b(nxt)) and a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="state has mode='running' but this normaliser has mode='none'"):
        RewardNormalizer("none").load_state_dict(a.state_dict())
    with pytest.raises(KeyError, match="missing key 'm2'"):
        b.load_state_dict({"mode": "running", "count": 1, "mean": 0.0})


def test_errors_name_the_key():
    with pytest.raises(ValueError, match=r"^RewardNormalizationConfig.mode='zscore': valid choices are \['none', 'fixed', 'running'\]$"):
        RewardNormalizer("zscore")
    with pytest.raises(ValueError, match=r"clip=0 is invalid; valid: None or a number > 0"):
        RewardNormalizer("none", clip=0)
    with pytest.raises(ValueError, match=r"std \(reward_std\) > 0; got 0.0"):
        RewardNormalizer("fixed", mean=0.0, std=0.0)
    with pytest.raises(ValueError, match="only for mode='fixed'"):
        RewardNormalizer("running", mean=1.0, std=1.0)
    with pytest.raises(KeyError, match=r"needs reward_std in the reward model metadata; keys present: \['model_name', 'reward_mean'\]"):
        RewardNormalizer.from_metadata({"model_name": "rm", "reward_mean": 1.0})
    with pytest.raises(ValueError, match="needs the reward model metadata"):
        RewardNormalizer.from_config(RewardNormalizationConfig(mode="fixed"))
    with pytest.raises(ValueError, match=r"non-finite reward\(s\) at positions \[1\]"):
        RewardNormalizer("none")([0.0, float("nan")])
