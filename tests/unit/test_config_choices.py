"""Every closed choice of every job schema refuses a bad value when the composed config is
converted (``to_typed``, before anything is built), naming the full key, the value and the
valid values."""

from __future__ import annotations

import pytest

from tests.conf_helpers import typed_job

CHOICES = [  # (job, override, the message names: key=value, and the valid values)
    ("ppo", "kl.type=adaptiv", "kl.type='adaptiv': valid choices are ['adaptive', 'fixed']"),
    ("ppo", "kl.estimator=k4", "kl.estimator='k4': valid choices are ['k1', 'k2', 'k3']"),
    ("ppo", "kl.loss_estimator=k0", "kl.loss_estimator='k0': valid choices are ['k1', 'k2', 'k3']"),
    ("ppo", "kl.temperature=hot", "kl.temperature='hot': valid choices are ['sampling', 'unscaled']"),
    ("ppo", "reward.normalization=runing",
     "reward.normalization='runing': valid choices are ['none', 'fixed', 'running']"),
    ("ppo", "reward.functions=[{name: arithmetic_exact_matc}]",
     "reward.functions[0].name='arithmetic_exact_matc': valid choices are ['arithmetic_exact_match'"),
    ("ppo", "trainer.eval_checker=two_digit", "trainer.eval_checker='two_digit': valid choices are ["),
    ("ppo", "trainer.eval_extra_checkers=[just_a_number]",
     "trainer.eval_extra_checkers[0]='just_a_number': valid choices are ["),
    ("ppo", "trainer.precision=bf16", "trainer.precision='bf16': valid choices are ['32', 'bf16-mixed'"),
    ("ppo", "ppo.advantage_estimator=ppo", "ppo.advantage_estimator='ppo': valid choices are ['gae', 'grpo'"),
    ("ppo", "ppo.loss_agg_mode=mean", "ppo.loss_agg_mode='mean': valid choices are ['token-mean'"),
    ("ppo", "reference.mode=shared", "reference.mode='shared': valid choices are ['offload', 'colocated']"),
    ("ppo", "critic.mode=own", "critic.mode='own': valid choices are ['shared', 'shared_detached', 'separate']"),
    ("ppo", "guards.action=halt", "guards.action='halt': valid choices are ['off', 'warn', 'stop']"),
    ("rm", "trainer.precision=64", "trainer.precision='64': valid choices are ['32'"),
    ("sft", "data.overlong_policy=cut", "data.overlong_policy='cut': valid choices are ['truncate', 'drop']"),
    ("rm", "data.chat_template=llama", "data.chat_template='llama': valid choices are [None, 'chatml', 'model']"),
    ("sft", "model.normalization=BatchNorm", "model.normalization='BatchNorm': valid choices are ['RMSNorm'"),
    ("rm", "model.activation=relu", "model.activation='relu': valid choices are ['swiglu', 'gelu', 'gelu_tanh']"),
    ("ppo", "model.position_embedding_type=alibi",
     "model.position_embedding_type='alibi': valid choices are ['rope', 'learned_absolute']"),
    ("sft", "parallel.backend=mpi", "parallel.backend='mpi': valid choices are 'auto', 'gloo', 'nccl'"),
    ("rm", "optim.decay_style=step", "optim.decay_style='step': valid choices are ['constant', 'linear', 'cosine']"),
    ("eval", "checker=exact", "checker='exact': valid choices are ['arithmetic_exact_match'"),
    ("eval", "extra_checkers=[format]", "extra_checkers[0]='format': valid choices are ["),
    ("eval", "chat_template=chatm", "chat_template='chatm': valid choices are [None, 'chatml', 'model']"),
    ("eval", "precision=16", "precision='16': valid choices are ['32'"),
    ("rm_server", "overlong_policy=cut", "overlong_policy='cut': valid choices are ['error', 'truncate']"),
    ("rm_server", "precision=16", "precision='16': valid choices are ['32'"),
    ("rm_server", "server.log_level=loud", "log_level='loud' is invalid; valid: critical, error, warning"),
]


@pytest.mark.parametrize("job,override,needle", CHOICES, ids=[c[1] for c in CHOICES])
def test_a_bad_closed_choice_fails_at_config_time_naming_the_key_and_the_valid_values(job, override, needle):
    with pytest.raises(ValueError) as err:
        typed_job(job, [override])
    assert needle in str(err.value)


def test_module_function_reward_paths_are_accepted_without_importing_them():
    cfg = typed_job("ppo", ["reward.functions=[{name: 'no_such_module:fn'}]", "trainer.eval_checker=null"])
    assert cfg.reward.functions[0].name == "no_such_module:fn" and cfg.trainer.eval_checker is None
