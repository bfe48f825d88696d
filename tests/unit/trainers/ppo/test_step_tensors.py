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
