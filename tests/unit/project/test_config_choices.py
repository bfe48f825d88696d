"""Every closed choice of every job schema refuses a bad value when the composed config is
converted (``to_typed``, before anything is built), naming the full key, the value and the
valid values."""

from __future__ import annotations

import pytest

from tests.conf_helpers import typed_job

CHOICES = [  # (job, override, the message names: key=value, and the valid values)
    ("ppo", "kl.type=adaptiv", "kl.type='adaptiv': valid choices are ['adaptive', 'fixed', 'pi']"),
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
    ("ppo", "ppo.rollout_is_mode=clip", "ppo.rollout_is_mode='clip': valid choices are ['truncate', 'mask']"),
    ("ppo", "reference.mode=shared", "reference.mode='shared': valid choices are ['offload', 'colocated', 'adapters_off']"),
    ("ppo", "critic.mode=own", "critic.mode='own': valid choices are ['shared', 'shared_detached', 'separate']"),
    ("ppo", "guards.action=halt", "guards.action='halt': valid choices are ['off', 'warn', 'stop']"),
    ("ppo", "reward.invalid_scores=drop", "reward.invalid_scores='drop': valid choices are ['error', 'skip']"),
    ("rm", "trainer.precision=64", "trainer.precision='64': valid choices are ['32'"),
    ("sft", "data.overlong_policy=cut", "data.overlong_policy='cut': valid choices are ['truncate', 'drop']"),
    ("rm", "data.chat_template=llama", "data.chat_template='llama': valid choices are [None, 'chatml', 'model']"),
    ("sft", "model.normalization=BatchNorm", "model.normalization='BatchNorm': valid choices are ['RMSNorm'"),
    ("rm", "model.activation=relu", "model.activation='relu': valid choices are ['swiglu', 'gelu', 'gelu_tanh']"),
    ("ppo", "model.position_embedding_type=alibi",
     "model.position_embedding_type='alibi': valid choices are ['rope', 'learned_absolute']"),
    ("ppo", "model.recompute_granularity=layer",
     "model.recompute_granularity='layer': valid choices are [None, 'full', 'selective']"),
    ("sft", "model.recompute_method=even", "model.recompute_method='even': valid choices are ['uniform', 'block']"),
    ("rm", "model.recompute_modules=[layernorm]",
     "model.recompute_modules='layernorm': valid choices are ['core_attn', 'mlp']"),
    ("sft", "parallel.backend=mpi", "parallel.backend='mpi': valid choices are ['auto', 'gloo', 'nccl']"),
    ("rm", "optim.decay_style=step", "optim.decay_style='step': valid choices are ['constant', 'linear', 'cosine']"),
    ("eval", "checker=exact", "checker='exact': valid choices are ['arithmetic_exact_match'"),
    ("eval", "extra_checkers=[format]", "extra_checkers[0]='format': valid choices are ["),
    ("eval", "chat_template=chatm", "chat_template='chatm': valid choices are [None, 'chatml', 'model']"),
    ("eval", "precision=16", "precision='16': valid choices are ['32'"),
    ("rm_server", "overlong_policy=cut", "overlong_policy='cut': valid choices are ['error', 'truncate']"),
    ("rm_server", "precision=16", "precision='16': valid choices are ['32'"),
    ("rm_server", "precision=16", "precision='16': valid choices are ['32', 'bf16-mixed', 'fp16-mixed', 'auto'] or null (the checkpoint's)"),
    ("ppo", "rollout.engine=hf", "rollout.engine='hf': valid choices are ['megatron', 'vllm']"),
    ("ppo", "rollout.mode=asynchronous", "rollout.mode='asynchronous': valid choices are ['sync', 'async']"),
    ("rm", "optim.adam_impl=apex", "optim.adam_impl='apex': valid choices are ["),
    ("ppo", "env.tool_call_format=qwen", "env.tool_call_format='qwen': valid choices are ['hermes', 'llama3']"),
    ("ppo", "env.name=calc", "env.name='calc': valid choices are null (single-turn), ['calculator', 'digit_calculator'] (built-in)"),
    ("ppo", "logger.wandb.mode=cloud", "logger.wandb.mode='cloud': valid choices are ['offline', 'online']"),
    ("rm_server", "server.log_level=loud", "server.log_level='loud': valid choices are ['critical', 'error', 'warning'"),
]


@pytest.mark.parametrize("job,override,needle", CHOICES, ids=[c[1] for c in CHOICES])
def test_a_bad_closed_choice_fails_at_config_time_naming_the_key_and_the_valid_values(job, override, needle):
    with pytest.raises(ValueError) as err:
        typed_job(job, [override])
    assert needle in str(err.value)


def test_module_function_reward_paths_are_accepted_without_importing_them():
    cfg = typed_job("ppo", ["reward.functions=[{name: 'no_such_module:fn'}]", "trainer.eval_checker=null"])
    assert cfg.reward.functions[0].name == "no_such_module:fn" and cfg.trainer.eval_checker is None


def test_activation_recompute_is_set_from_the_command_line_and_reaches_megatron():
    from nemo_rlhf.models.config import build_transformer_config

    cfg = typed_job("ppo", ["model.recompute_granularity=full", "model.recompute_method=block",
                            "model.recompute_num_layers=2"])
    tc = build_transformer_config(cfg.model, tp=1, pp=1)
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "block", 2)
    sel = typed_job("sft", ["model.recompute_granularity=selective", "model.recompute_modules=[mlp]"])
    tc = build_transformer_config(sel.model, tp=1, pp=1)
    assert (tc.recompute_granularity, tc.recompute_modules, tc.recompute_num_layers) == ("selective", ["mlp"], None)
    assert build_transformer_config(typed_job("ppo", []).model, tp=1, pp=1).recompute_granularity is None
    # not architecture: a checkpoint trained without recompute resumes with it
    assert cfg.model.fingerprint() == typed_job("ppo", []).model.fingerprint()


def test_more_recomputed_layers_than_a_pipeline_stage_holds_is_refused_naming_the_keys():
    from nemo_rlhf.models.config import build_transformer_config

    cfg = typed_job("ppo", ["model.recompute_granularity=full", "model.recompute_num_layers=2"])
    assert cfg.model.num_layers == 2
    build_transformer_config(cfg.model, tp=1, pp=1)
    with pytest.raises(ValueError, match=r"model.recompute_num_layers=2 is more than the 1 layers .*"
                                         r"pipeline_model_parallel_size=2"):
        build_transformer_config(cfg.model, tp=1, pp=2)
    with pytest.raises(ValueError, match=r"model.recompute_num_layers=0: must be >= 1"):
        typed_job("ppo", ["model.recompute_num_layers=0"])


@pytest.mark.parametrize("build, needle", [
    (lambda: __import__("nemo_rlhf.algorithms.ppo.advantages", fromlist=["x"]).AdvantageConfig(estimator="ppo"),
     "advantage.estimator='ppo': valid choices are ['gae', 'grpo'"),
    (lambda: __import__("nemo_rlhf.reward.normalization", fromlist=["x"]).RewardNormalizationConfig(mode="runing"),
     "RewardNormalizationConfig.mode='runing': valid choices are ['none', 'fixed', 'running']"),
    (lambda: __import__("nemo_rlhf.reward.ensemble", fromlist=["x"]).aggregate_ensemble(
        __import__("torch").zeros(2, 1), __import__("torch").zeros(2), __import__("torch").ones(2), aggregate="median"),
     "reward.ensemble.aggregate='median': valid choices are ["),
])
def test_closed_choices_outside_the_job_schemas_have_the_same_message_shape(build, needle):
    """Every closed choice goes through ``nemo_rlhf.config.check_choice`` (#50): one shape,
    ``<key>=<value!r>: valid choices are [...]``, also where a schema is built by code."""
    with pytest.raises(ValueError) as err:
        build()
    assert needle in str(err.value)
