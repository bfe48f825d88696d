"""step_advantages' KL metrics: the betas logged are the ones applied (#50)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_rlhf.trainers.ppo.step_data import ForwardResults
from nemo_rlhf.trainers.ppo.step_tensors import step_advantages
from tests.conf_helpers import typed_job

ONE_RANK = SimpleNamespace(dp_sum_named=lambda sums: sums, whiten_reduce=lambda s, sq, n: (s, sq, n),
                           dp_max=lambda t: t)


def _step(overrides, controller_beta: float, scores=(1.0, 3.0), ended=(True, True),
          collectives=ONE_RANK, with_advantages: bool = False):
    """One rollout of 2 samples x 3 response tokens; actor 0.5 nats above the reference on
    each token (k1 = 0.5, 1.5 nats a sequence); scores 1 and 3 unless given."""
    cfg = typed_job("ppo_tiny", overrides)
    mask = torch.ones(2, 3, dtype=torch.bool)
    batch = SimpleNamespace(response_mask=mask, ended=torch.tensor(ended),
                            truncated=torch.zeros(2, dtype=torch.bool))
    logp = torch.full((2, 3), -1.0)
    fwd = ForwardResults(old_logprobs=logp, ref_logprobs=logp - 0.5, kl_logprobs=logp,
                         values=torch.zeros(2, 3))
    adv, metrics = step_advantages(cfg, cfg.advantage_config(), controller_beta, collectives,
                                   batch, torch.tensor(scores), fwd)
    return (adv, metrics) if with_advantages else metrics


def test_without_the_kl_in_the_reward_kl_coef_logs_the_beta_applied_there_zero():
    m = _step(["kl.in_reward=false", "kl.type=fixed", "kl.loss_coef=0.1"], controller_beta=0.26)
    assert m["kl_coef"] == 0.0  # not the controller's 0.26: the token rewards carry no KL
    assert m["kl_loss_coef"] == 0.1  # the weight the loss's KL term gets
    assert m["token_reward_sum_mean"] == pytest.approx(2.0)  # the scores' mean: no KL in them
    assert m["kl_mean"] == pytest.approx(1.5)


def test_with_the_kl_in_the_reward_kl_coef_is_the_controllers_beta():
    m = _step([], controller_beta=0.26)
    assert m["kl_coef"] == 0.26 and "kl_loss_coef" not in m  # no KL loss term: not logged
    assert m["token_reward_sum_mean"] == pytest.approx(2.0 - 0.26 * 1.5)


# The critic at length (#52): ppo.lam_critic / lam_policy / lam_policy_alpha reach the
# advantages and returns, and the critic's value error by position is logged. Same rollout
# as above with beta = 0: token rewards are the score s on the last of 3 tokens, V = 0,
# gamma = 1, so GAE's A_t = lam^(2 - t) * s and the returns equal the advantages.
#   ppo.lam = 0.95 (default): R = s * [0.9025, 0.95, 1]; returns_mean = 2 * 2.8525 / 3
#   lam_critic = 1: R = [s, s, s]; returns_mean = 2
#   lam_policy_alpha = 1: lam = 1 - 1 / (1 * 3) = 2/3 per row, A = s * [4/9, 2/3, 1];
#     advantages_mean = (1 + 3) * (19 / 9) / 6 = 76 / 54
#   value error |V - R| = R: columns 0-1 and 2 (bucket 2-3)

def test_default_lambdas_give_one_lambda_gae_and_value_error_by_position():
    m = _step([], controller_beta=0.0)
    assert m["returns_mean"] == pytest.approx(2 * 2.8525 / 3)
    assert m["advantages_mean"] == pytest.approx(2 * 2.8525 / 3)
    assert m["critic/value_error_pos_0-1"] == pytest.approx((1 + 3) * (0.9025 + 0.95) / 4)
    assert m["critic/value_error_pos_2-3"] == pytest.approx(2.0)
    assert not [k for k in m if k.startswith("critic/") and k not in
                ("critic/value_error_pos_0-1", "critic/value_error_pos_2-3")]


def test_lam_critic_sets_the_returns_and_lam_policy_alpha_the_advantages():
    m = _step(["ppo.lam_critic=1.0", "ppo.lam_policy_alpha=1.0"], controller_beta=0.0)
    assert m["returns_mean"] == pytest.approx(2.0)
    assert m["advantages_mean"] == pytest.approx(76 / 54)
    assert m["critic/value_error_pos_0-1"] == pytest.approx(2.0)  # the targets, lam_critic's
    m = _step(["ppo.lam_policy=0.0"], controller_beta=0.0)  # one-step TD advantages
    assert m["advantages_mean"] == pytest.approx(4 / 6)
    assert m["returns_mean"] == pytest.approx(2 * 2.8525 / 3)


@pytest.mark.parametrize("overrides, needle", [
    (["ppo.gamma=1.5"], r"ppo.gamma=1.5: must be in \[0, 1\]"),
    (["ppo.lam=-0.1"], r"ppo.lam=-0.1: must be in \[0, 1\]"),
    (["ppo.lam_critic=1.5"], r"ppo.lam_critic=1.5: must be in \[0, 1\] \(null: ppo.lam=0.95\)"),
    (["ppo.lam_policy=-0.5"], r"ppo.lam_policy=-0.5: must be in \[0, 1\]"),
    (["ppo.lam_policy_alpha=0"], r"ppo.lam_policy_alpha=0"),
    (["ppo.lam_policy=0.9", "ppo.lam_policy_alpha=0.05"], "set one of them to null"),
    (["ppo.advantage_estimator=grpo", "rollout.n_samples_per_prompt=2", "ppo.lam_critic=1.0"],
     "ppo.lam_critic=1.0 with ppo.advantage_estimator=grpo, which does not read it"),
])
def test_bad_lambda_settings_are_refused_naming_the_key(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        typed_job("ppo_tiny", overrides)


# A rollout whose sequences all got the same task reward is not whitened (ppo.whiten_constant_
# rewards=false, the default). Beta 0, V = 0, gamma 1, lam 0.95, both scores 1: the raw GAE
# advantage of each row is [0.9025, 0.95, 1] (the discounting alone); whitened, the 6 tokens
# would have mean 0.950833 and unbiased std sqrt(2 * (0.048333^2 + 0.000833^2 + 0.049167^2) / 5)
# = 0.043608: [-1.108357, -0.019110, 1.127466] a row.
RAW_ROW = [0.9025, 0.95, 1.0]
WHITE_ROW = [-1.108357, -0.019110, 1.127466]


def test_a_rollout_whose_rewards_all_agree_keeps_its_raw_advantages():
    adv, m = _step([], 0.0, scores=(1.0, 1.0), with_advantages=True)
    assert m["advantages_whitened"] == 0.0
    torch.testing.assert_close(adv.advantages, torch.tensor([RAW_ROW, RAW_ROW]))
    adv, m = _step(["ppo.whiten_constant_rewards=true"], 0.0, scores=(1.0, 1.0), with_advantages=True)
    assert m["advantages_whitened"] == 1.0
    torch.testing.assert_close(adv.advantages, torch.tensor([WHITE_ROW, WHITE_ROW]), atol=1e-5, rtol=0)


def test_a_rollout_whose_rewards_vary_is_whitened():
    adv, m = _step([], 0.0, scores=(1.0, 3.0), with_advantages=True)
    assert m["advantages_whitened"] == 1.0
    a = adv.advantages
    assert float(a.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(a.flatten().std()) == pytest.approx(1.0, abs=1e-4)  # unbiased, as masked_whiten


def test_the_missing_eos_penalty_counts_as_task_reward_and_the_kl_does_not():
    # equal scores, but row 1 did not end: its task reward is 1 - 1 = 0, so the rewards vary
    m = _step(["ppo.missing_eos_penalty=-1.0"], 0.0, scores=(1.0, 1.0), ended=(True, False))
    assert m["advantages_whitened"] == 1.0
    # a KL penalty in the token rewards (beta 0.26) does not make equal scores vary
    m = _step([], 0.26, scores=(1.0, 1.0))
    assert m["advantages_whitened"] == 0.0


def test_rows_left_out_do_not_count_and_other_dp_ranks_do():
    # a NaN score leaves row 1 out (reward.invalid_scores=skip): one kept reward, no spread
    m = _step([], 0.0, scores=(2.0, float("nan")))
    assert m["advantages_whitened"] == 0.0
    # this rank's scores agree (1, 1), another DP rank holds a 3: the MAX all-reduce of
    # [max, -min] sees [3, -1], so the rollout varies and is whitened
    other_rank_3 = SimpleNamespace(**{**vars(ONE_RANK), "dp_max": lambda t: torch.maximum(t, torch.tensor([3.0, -3.0]))})
    m = _step([], 0.0, scores=(1.0, 1.0), collectives=other_rank_3)
    assert m["advantages_whitened"] == 1.0


def test_critic_free_and_unwhitened_runs_log_no_whitening_flag():
    assert "advantages_whitened" not in _step(["ppo.normalize_advantages=false"], 0.0, scores=(1.0, 1.0))
