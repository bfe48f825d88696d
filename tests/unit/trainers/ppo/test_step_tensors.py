"""step_advantages' KL metrics: the betas logged are the ones applied (#50)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_rlhf.trainers.ppo.step_data import ForwardResults
from nemo_rlhf.trainers.ppo.step_tensors import step_advantages
from tests.conf_helpers import typed_job

ONE_RANK = SimpleNamespace(dp_sum_named=lambda sums: sums, whiten_reduce=lambda s, sq, n: (s, sq, n))


def _step(overrides, controller_beta: float) -> dict:
    """One rollout of 2 samples x 3 response tokens; actor 0.5 nats above the reference on
    each token (k1 = 0.5, 1.5 nats a sequence); scores 1 and 3."""
    cfg = typed_job("ppo_tiny", overrides)
    mask = torch.ones(2, 3, dtype=torch.bool)
    batch = SimpleNamespace(response_mask=mask, ended=torch.ones(2, dtype=torch.bool),
                            truncated=torch.zeros(2, dtype=torch.bool))
    logp = torch.full((2, 3), -1.0)
    fwd = ForwardResults(old_logprobs=logp, ref_logprobs=logp - 0.5, kl_logprobs=logp,
                         values=torch.zeros(2, 3))
    _, metrics = step_advantages(cfg, cfg.advantage_config(), controller_beta, ONE_RANK, batch,
                                 torch.tensor([1.0, 3.0]), fwd)
    return metrics


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
