"""The rollout-vs-train mismatch metrics (#52): rollout_quality's |delta logp| and k3 KL
over policy tokens, and the rollout correction's row shares, each a global sum over DP
divided by a global count (a fake second DP rank adds its sums)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from nemo_rlhf.trainers.ppo.step_metrics import rollout_quality
from nemo_rlhf.trainers.ppo.step_tensors import correction_row_shares


def _batch(rollout, mask):
    mask = torch.tensor(mask, dtype=torch.bool)
    return SimpleNamespace(logprobs=torch.tensor(rollout), response_mask=mask,
                           response_ids=torch.arange(mask.numel()).reshape(mask.shape),
                           response_lengths=mask.sum(-1))


ONE_RANK = SimpleNamespace(dims=SimpleNamespace(dp=1))


def test_mismatch_metrics_over_policy_tokens_by_hand():
    # a multi-turn row: its environment tokens (mask 0) carry garbage rollout log-probs
    batch = _batch([[-1.2, -50.0, -0.5, -50.0], [-0.4, -0.2, -0.3, 0.0]],
                   [[1, 0, 1, 0], [1, 1, 1, 0]])
    old = torch.tensor([[-1.0, 0.0, -1.5, 0.0], [-0.3, -0.3, -0.3, 0.0]])
    m = rollout_quality(ONE_RANK, batch, old, None)
    # d = old - rollout on the 5 policy tokens: 0.2, -1.0 | 0.1, -0.1, 0
    d = [0.2, -1.0, 0.1, -0.1, 0.0]
    assert m["rollout_train_logprob_diff_mean"] == pytest.approx(sum(abs(x) for x in d) / 5, rel=1e-6)
    assert m["rollout_train_logprob_diff_max"] == pytest.approx(1.0)
    assert m["rollout_train_k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 5, rel=1e-5)
    same = rollout_quality(ONE_RANK, batch, batch.logprobs.clone(), None)
    assert same["rollout_train_k3_kl"] == 0.0 and same["rollout_train_logprob_diff_max"] == 0.0


def test_response_length_max_counts_policy_tokens_not_the_holed_rows_extent():
    # row 0: policy 2, env 3, policy 1 -> extent 6, 3 policy tokens; row 1: 4 policy tokens
    mask = [[1, 1, 0, 0, 0, 1], [1, 1, 1, 1, 0, 0]]
    batch = _batch([[0.0] * 6, [0.0] * 6], mask)
    batch.response_lengths = torch.tensor([6, 4])  # the extent (to_padded_batch's)
    m = rollout_quality(ONE_RANK, batch, torch.zeros(2, 6), None)
    assert m["response_length_max"] == 4.0


def test_correction_row_shares_are_global_sums_over_dp_by_hand():
    ppo = SimpleNamespace(rollout_is_cap=2.0, rollout_is_mode="truncate")
    other_rank = {"rows": 3.0, "masked_rows": 0.0, "capped_rows": 2.0}  # DP rank 1's counts
    two_ranks = SimpleNamespace(dp_sum_named=lambda s: {k: v + other_rank[k] for k, v in s.items()})
    mine = {"rows": torch.tensor(1.0), "masked_rows": torch.tensor(1.0), "capped_rows": torch.tensor(0.0)}
    out = correction_row_shares(two_ranks, mine, ppo)
    # 1 of 4 rows masked (the mean of the ranks' shares would say 0.5), 2 of 4 truncated
    assert out == {"rollout_correction/masked_rows_fraction": 0.25,
                   "rollout_correction/is_truncated_rows_fraction": 0.5}
    out = correction_row_shares(two_ranks, mine, SimpleNamespace(rollout_is_cap=2.0, rollout_is_mode="mask"))
    assert set(out) == {"rollout_correction/masked_rows_fraction", "rollout_correction/is_masked_rows_fraction"}
    only_mask = correction_row_shares(two_ranks, mine, SimpleNamespace(rollout_is_cap=None, rollout_is_mode="truncate"))
    assert only_mask == {"rollout_correction/masked_rows_fraction": 0.25}
