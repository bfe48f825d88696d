"""The PPO job's config: with LoRA, ``reference.mode`` null resolves to ``adapters_off``
(``offload`` without); the combinations that cannot work (LoRA ones, some async and KL
settings) are refused naming the keys; vLLM rollouts of a mixture-of-experts model are
accepted."""

from __future__ import annotations

import pytest

from nemo_rlhf.trainers.ppo.config import REFERENCE_MODES
from tests.conf_helpers import typed_job


def test_the_reference_mode_follows_lora_unless_given():
    assert "adapters_off" in REFERENCE_MODES
    assert typed_job("ppo", []).reference.mode == "offload"
    assert typed_job("ppo", ["model.lora.enabled=true"]).reference.mode == "adapters_off"
    assert typed_job("ppo", ["model.lora.enabled=true", "reference.mode=colocated"]).reference.mode == "colocated"


@pytest.mark.parametrize("overrides, needle", [
    (["reference.mode=adapters_off"], "reference.mode=adapters_off needs model.lora.enabled=true"),
    (["model.lora.enabled=true", "critic.mode=separate", "critic.init_from=/some/rm"],
     "model.lora.enabled=true with critic.mode=separate and critic.init_from=/some/rm"),
    (["model.lora.enabled=true", "model.lora.target_modules=[linear_q]"],
     "model.lora.target_modules='linear_q': valid choices are"),
])
def test_lora_combinations_that_cannot_work_are_refused_naming_the_keys(overrides, needle):
    with pytest.raises(ValueError) as err:
        typed_job("ppo", overrides)
    assert needle in str(err.value)


def test_vllm_rollouts_of_a_mixture_of_experts_model_are_accepted():
    """Refused until the refit's MoE work-around (rollout/vllm_engine.py's
    _forget_moe_kernels); tests/vllm_engine checks a Qwen3-MoE against the training forward."""
    cfg = typed_job("ppo", ["rollout.engine=vllm", "model.num_moe_experts=4", "model.moe_router_topk=2"])
    assert (cfg.rollout.engine, cfg.model.num_moe_experts) == ("vllm", 4)


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.mode=asynchronous"], "rollout.mode='asynchronous': valid choices are ['sync', 'async']"),
    (["rollout.mode=async", "rollout.max_staleness=-1"], "rollout.max_staleness=-1: must be an integer >= 0"),
    (["rollout.mode=async", "rollout.num_workers=0"], "rollout.num_workers=0: must be an integer >= 1"),
    (["rollout.mode=async", "rollout.worker_timeout_s=0"], "rollout.worker_timeout_s=0.0: must be > 0"),
    (["rollout.mode=async", "rollout.max_staleness=1"],
     "rollout.mode=async with rollout.max_staleness=1 trains on samples of older policies, which need "
     "importance weights: set ppo.rollout_is_cap"),
    # the row mask alone rejects rows but leaves the kept ones at weight 1
    (["rollout.mode=async", "rollout.max_staleness=2", "ppo.rollout_mask_threshold=1.0"],
     "set ppo.rollout_is_cap (e.g. 2.0; ppo.rollout_is_mode=truncate or mask), with or without "
     "ppo.rollout_mask_threshold=1.0 (the row mask only rejects rows)"),
    (["ppo.rollout_is_mode=clip", "ppo.rollout_is_cap=2.0"],
     "ppo.rollout_is_mode='clip': valid choices are ['truncate', 'mask']"),
    (["ppo.rollout_is_mode=mask"], "ppo.rollout_is_mode=mask drops the tokens whose importance weight "
     "exceeds ppo.rollout_is_cap, which is null: set ppo.rollout_is_cap"),
    (["rollout.mode=async", "rollout.max_staleness=0", "ppo.old_logprobs_from_rollout=true"],
     "rollout.mode=async with ppo.old_logprobs_from_rollout=true"),
])
def test_async_settings_that_cannot_work_are_refused_naming_the_keys(overrides, needle):
    with pytest.raises(ValueError) as err:
        typed_job("ppo", overrides)
    assert needle in str(err.value)


@pytest.mark.parametrize("overrides, needle", [
    (["kl.type=pid"], "kl.type='pid': valid choices are ['adaptive', 'fixed', 'pi']"),
    (["kl.type=pi", "kl.pi_kp=-1"], "kl.pi_kp=-1.0: must be >= 0 with kl.type=pi"),
    (["kl.type=pi", "kl.pi_error_clip=0"], "kl.pi_error_clip=0.0: must be > 0 with kl.type=pi"),
    (["kl.type=pi", "kl.init_kl_coef=0"], "kl.init_kl_coef=0.0: must be > 0 with kl.type=pi"),
    (["kl.type=pi", "kl.pi_min_coef=-0.5"], "kl.pi_min_coef=-0.5: must be >= 0 with kl.type=pi"),
    (["kl.type=pi", "kl.pi_max_factor=1"], "kl.pi_max_factor=1.0: must be > 1 with kl.type=pi"),
    (["kl.type=pi", "kl.pi_max_coef=0.01"], "kl.init_kl_coef=0.05: must be <= kl.pi_max_coef=0.01 with kl.type=pi"),
    (["kl.type=pi", "kl.pi_max_coef=-1"], "kl.pi_max_coef=-1.0: must be > 0 with kl.type=pi"),
])
def test_bad_kl_controller_settings_are_refused_naming_the_key(overrides, needle):
    with pytest.raises(ValueError) as err:
        typed_job("ppo", overrides)
    assert needle in str(err.value)


@pytest.mark.parametrize("kind", ["adaptive", "pi"])
def test_a_kl_controller_without_the_kl_in_the_reward_is_refused_naming_the_keys(kind):
    """kl.in_reward=false: the controller's beta would move with nothing using it (#50)."""
    with pytest.raises(ValueError) as err:
        typed_job("ppo", ["kl.in_reward=false", "kl.loss_coef=0.04", f"kl.type={kind}"])
    assert str(err.value).startswith(
        f"kl.type='{kind}' with kl.in_reward=false: a KL controller moves the reward's beta, which "
        f"kl.in_reward=false does not use; valid choices with kl.in_reward=false are ['fixed'] "
        f"(the loss's KL term has the fixed weight kl.loss_coef=0.04)")
    # the schema's default kind is a controller: a KL-in-the-loss config names kl.type=fixed
    with pytest.raises(ValueError, match="kl.type='adaptive' with kl.in_reward=false"):
        typed_job("ppo", ["kl.in_reward=false"])
    assert typed_job("ppo", ["kl.in_reward=false", "kl.type=fixed", "kl.loss_coef=0.04"]).kl.loss_coef == 0.04


def test_the_pi_fields_take_their_one_default_and_ranges_from_the_controller():
    """One default per knob (#50): each ``kl.pi_<name>`` field's default is
    ``PI_DEFAULTS[name]`` and there is one field per setting; the config's range check is
    the controller's (``PI_RANGES``), named by the config key, non-finite values included."""
    import dataclasses

    from nemo_rlhf.algorithms.ppo.kl import PI_DEFAULTS, PI_RANGES
    from nemo_rlhf.trainers.ppo.config import KLConfig

    defaults = {f.name[len("pi_"):]: f.default for f in dataclasses.fields(KLConfig) if f.name.startswith("pi_")}
    assert defaults == PI_DEFAULTS
    assert KLConfig().pi_settings() == PI_DEFAULTS
    assert set(PI_DEFAULTS) < set(PI_RANGES)
    with pytest.raises(ValueError, match=r"^kl.pi_ki=nan: must be finite with kl.type=pi$"):
        typed_job("ppo", ["kl.type=pi", "kl.pi_ki=nan"])
    with pytest.raises(ValueError, match=r"^kl.target=0.0: must be > 0 with kl.type=pi$"):
        typed_job("ppo", ["kl.type=pi", "kl.target=0"])


def test_the_reward_group_is_the_reward_packages_schema():
    """``RewardConfig`` lives beside the reward code (#50); the PPO job still exposes it as
    its ``reward`` group, checked at config time."""
    import dataclasses

    from nemo_rlhf.reward.config import RewardConfig, RMEnsembleConfig, RewardFunctionSpec
    from nemo_rlhf.trainers.ppo.config import PPOConfig

    assert {f.name: f.default_factory for f in dataclasses.fields(PPOConfig)}["reward"] is RewardConfig
    cfg = typed_job("ppo", ["reward.functions=[{name: 'no_such_module:fn', weight: 0.5}]",
                            "reward.ensemble.std_coef=2"])
    assert isinstance(cfg.reward, RewardConfig) and isinstance(cfg.reward.ensemble, RMEnsembleConfig)
    assert cfg.reward.functions == [RewardFunctionSpec(name="no_such_module:fn", weight=0.5)]
    with pytest.raises(ValueError, match=r"^reward.normalization='z': valid choices are"):
        typed_job("ppo", ["reward.normalization=z"])


def test_the_pi_floor_defaults_to_a_small_absolute_value_not_the_initial_beta():
    """One default (kl.PI_DEFAULTS' min_coef, the field's value): beta can fall below its
    start, by the controller the trainer builds from the config (#50)."""
    from nemo_rlhf.algorithms.ppo.kl import PI_DEFAULTS, build_kl_controller

    kl = typed_job("ppo", ["kl.type=pi", "kl.init_kl_coef=0.05"]).kl
    assert kl.pi_min_coef == PI_DEFAULTS["min_coef"] == 1e-3
    ctl = build_kl_controller(kl.type, kl.init_kl_coef, kl.target, kl.horizon, kl.pi_settings())
    ctl.update(0.0, n_steps=32)  # KL 0: e = -2 (clipped), step = 0.3 * -2: beta * exp(-0.6)
    assert ctl.value == pytest.approx(0.05 * 0.548811636, rel=1e-8) and ctl.value < kl.init_kl_coef


def test_async_with_the_decoupled_correction_or_on_policy_is_taken():
    cfg = typed_job("ppo", ["rollout.mode=async", "rollout.max_staleness=2", "ppo.rollout_is_cap=2.0",
                            "ppo.rollout_mask_threshold=1.0"])
    assert cfg.rollout.mode == "async" and cfg.rollout.max_staleness == 2
    assert cfg.ppo.rollout_is_mode == "truncate"  # the default: today's truncated weights
    cfg = typed_job("ppo", ["rollout.mode=async", "rollout.max_staleness=1", "ppo.rollout_is_cap=2.0",
                            "ppo.rollout_is_mode=mask"])
    assert (cfg.ppo.rollout_is_cap, cfg.ppo.rollout_is_mode) == (2.0, "mask")
    assert typed_job("ppo", ["rollout.mode=async", "rollout.max_staleness=0"]).rollout.num_workers == 1


def test_the_worker_index_comes_from_the_flag_then_the_environment():
    from nemo_rlhf.rollout_worker import worker_index

    assert worker_index(["a=1", "--worker-index", "3", "b=2"], {}) == (3, ["a=1", "b=2"])
    assert worker_index(["--worker-index=2"], {"SLURM_PROCID": "5"}) == (2, [])
    assert worker_index(["x=1"], {"SLURM_PROCID": "5"}) == (5, ["x=1"])
    assert worker_index([], {"NEMO_RLHF_ROLLOUT_WORKER": "1", "SLURM_PROCID": "5"})[0] == 1
    with pytest.raises(SystemExit, match="needs --worker-index"):
        worker_index(["--worker-index", "x"], {})


def test_the_launchers_address_file_name_is_the_controllers():
    from launchers.local import ROLLOUT_ADDRESS_FILE
    from nemo_rlhf.rollout.transport import ADDRESS_FILE

    assert ROLLOUT_ADDRESS_FILE == ADDRESS_FILE


def test_the_pi_settings_reach_the_controller_the_trainer_builds():
    from nemo_rlhf.algorithms.ppo import PIKLController, build_kl_controller

    kl = typed_job("ppo", ["kl.type=pi", "kl.pi_kp=2.5", "kl.pi_ki=0.1", "kl.pi_min_coef=0.001",
                           "kl.init_kl_coef=0.03", "kl.pi_max_factor=3"]).kl
    ctl = build_kl_controller(kl.type, kl.init_kl_coef, kl.target, kl.horizon, kl.pi_settings())
    assert isinstance(ctl, PIKLController)
    assert (ctl.kp, ctl.ki, ctl.error_clip, ctl.max_factor, ctl.min_coef, ctl.value) == (2.5, 0.1, 2.0, 3.0,
                                                                                           0.001, 0.03)
    # the other kinds ignore the pi keys: the adaptive default is what it was
    assert typed_job("ppo", ["kl.pi_kp=-1"]).kl.type == "adaptive"


def test_async_refuses_pipeline_and_expert_parallel_trainers_naming_the_key():
    from types import SimpleNamespace

    from nemo_rlhf.trainers.ppo.async_rollout import check_async_layout

    rollout = typed_job("ppo", ["rollout.mode=async", "rollout.max_staleness=0"]).rollout
    check_async_layout(rollout, SimpleNamespace(pp=1, ep=1))
    with pytest.raises(ValueError, match="parallel.pipeline_model_parallel_size=1 \\(got 2\\)"):
        check_async_layout(rollout, SimpleNamespace(pp=2, ep=1))
    with pytest.raises(ValueError, match="parallel.expert_model_parallel_size=1 \\(got 2\\)"):
        check_async_layout(rollout, SimpleNamespace(pp=1, ep=2))
    check_async_layout(typed_job("ppo", []).rollout, SimpleNamespace(pp=2, ep=2))  # sync: anything


@pytest.mark.parametrize("overrides, needle", [
    # the single-turn checks of the rollout's log-probs hold for episodes too (#51)
    (["env.name=calculator", "ppo.old_logprobs_from_rollout=true", "critic.mode=separate",
      "rollout.temperature=0.7", "kl.temperature=unscaled"], "set kl.temperature=sampling"),
    (["env.name=calculator", "ppo.old_logprobs_from_rollout=true", "critic.mode=separate",
      "rollout.engine=vllm", "rollout.top_p=0.9"], "set rollout.top_k=0 and rollout.top_p=1.0"),
    (["env.name=calculator", "rollout.min_new_tokens=2", "rollout.engine=vllm"],
     "with rollout.min_new_tokens=2 and rollout.engine=vllm: the vLLM engine's episodes do not apply a "
     "per-turn minimum yet (the megatron engine's do); set rollout.min_new_tokens=0 or rollout.engine=megatron"),
    (["env.name=calc"], "env.name='calc': valid choices are null (single-turn), ['calculator', 'digit_calculator'] (built-in) "
     "or a 'package.module:function' factory path"),
    (["env.tool_call_format=json"], "env.tool_call_format='json': valid choices are ['hermes', 'llama3']"),
    (["env.max_turns=0"], "env.max_turns=0: must be an integer >= 1"),
    (["env.max_tool_time_s=0"], "env.max_tool_time_s=0.0: must be a finite number of seconds > 0"),
    (["env.observation_template=obs"], "env.observation_template='obs': must contain '{observation}'"),
    (["reward.functions=[{name: env}]"], "reward.functions names 'env' (the environment's episode reward) "
     "with env.name=null"),
    (["env.name=calculator", "trainer.eval_checker=env"], "trainer.eval_checker=env: the held-out evaluation "
     "is single-turn"),
])
def test_env_settings_that_cannot_work_are_refused_naming_the_keys(overrides, needle):
    with pytest.raises(ValueError) as err:
        typed_job("ppo", overrides)
    assert needle in str(err.value)


def test_env_defaults_are_single_turn_and_the_limits_are_envlimits():
    from nemo_rlhf.envs import EnvLimits

    cfg = typed_job("ppo")
    assert cfg.env.name is None and not cfg.env.enabled
    assert cfg.env.limits() == EnvLimits()
    cfg = typed_job("ppo", ["env.name=calculator", "env.max_turns=3", "reward.functions=[{name: env}]"])
    assert cfg.env.enabled and cfg.env.limits().max_turns == 3


@pytest.mark.parametrize("overrides, needle", [
    (["moe.routing_replay=true"], "moe.routing_replay=true with a dense model (model.num_moe_experts=null)"),
    (["moe.routing_replay=true", "model.num_moe_experts=4", "rollout.engine=vllm"],
     "moe.routing_replay=true with rollout.engine=vllm: only the megatron engine records the routes"),
    (["moe.routing_replay=true", "model.num_moe_experts=4", "rollout.mode=async", "rollout.max_staleness=0"],
     "moe.routing_replay=true with rollout.mode=async: the routes do not cross the rollout transport"),
    (["moe.routing_replay=true", "model.num_moe_experts=4", "env.name=calculator",
      "reward.functions=[{name: env}]"],
     "moe.routing_replay=true with env.name=calculator: multi-turn episodes record no routes"),
    (["moe.routing_replay=true", "model.num_moe_experts=4", "rollout.use_kv_cache=false"],
     "moe.routing_replay=true with rollout.use_kv_cache=false: the routes are recorded by the KV-cache"),
    (["moe.routing_replay=true", "model.num_moe_experts=4", "ppo.sequence_packing=true",
      "ppo.max_tokens_per_micro_batch=64"],
     "moe.routing_replay=true with ppo.sequence_packing=true: packed micro-batches carry no routes"),
    (["moe.routing_replay=true", "model.num_moe_experts=4", "model.recompute_granularity=full"],
     "moe.routing_replay=true with model.recompute_granularity=full: the backward's recompute"),
])
def test_routing_replay_is_refused_naming_the_key(overrides, needle):
    with pytest.raises(ValueError) as err:
        typed_job("ppo", overrides)
    assert needle in str(err.value)


def test_routing_replay_is_accepted_on_a_moe_model_with_the_megatron_engine():
    """Wired into the PPO trainer (#52): accepted with fixed-row and token-budget
    micro-batches, selective recompute and expert parallelism's keys untouched."""
    for extra in ([], ["ppo.max_tokens_per_micro_batch=64"], ["model.recompute_granularity=selective"]):
        cfg = typed_job("ppo", ["moe.routing_replay=true", "model.num_moe_experts=4", *extra])
        assert cfg.moe.routing_replay is True


def test_routing_replay_is_off_by_default():
    assert typed_job("ppo", ["model.num_moe_experts=4"]).moe.routing_replay is False


def test_env_takes_the_old_logprobs_from_either_engines_episodes():
    """``ppo.old_logprobs_from_rollout`` with ``env.name`` (#51): the episodes' behaviour
    log-probs (megatron or vLLM engine) with a critic that computes its own values, or none;
    with a value head on the actor's backbone (the megatron decode's values; the vLLM engine
    refuses it when it is built, as single-turn)."""
    for engine in ("megatron", "vllm"):
        for extra in (["critic.mode=separate"], ["ppo.advantage_estimator=reinforce_plus_plus"],
                      ["ppo.advantage_estimator=grpo", "rollout.n_samples_per_prompt=2"],
                      ["critic.mode=shared"], ["critic.mode=shared_detached"]):
            cfg = typed_job("ppo", ["env.name=calculator", "ppo.old_logprobs_from_rollout=true",
                                    f"rollout.engine={engine}", *extra])
            assert cfg.env.enabled and cfg.ppo.old_logprobs_from_rollout and cfg.rollout.engine == engine


def test_env_takes_a_per_turn_min_new_tokens_on_the_megatron_engine():
    for mode in (["rollout.mode=sync"], ["rollout.mode=async", "ppo.rollout_is_cap=2.0"]):
        cfg = typed_job("ppo", ["env.name=calculator", "rollout.min_new_tokens=2", *mode])
        assert cfg.env.enabled and cfg.rollout.min_new_tokens == 2


def test_env_runs_on_either_engine_in_sync_and_async_mode():
    cfg = typed_job("ppo", ["env.name=calculator", "rollout.engine=vllm"])
    assert cfg.env.enabled and cfg.rollout.engine == "vllm"
    for engine in ("megatron", "vllm"):  # the rollout workers run the episodes (#51)
        cfg = typed_job("ppo", ["env.name=calculator", f"rollout.engine={engine}", "rollout.mode=async",
                                "ppo.rollout_is_cap=2.0"])
        assert cfg.env.enabled and cfg.rollout.mode == "async" and cfg.rollout.engine == engine


def test_a_reward_function_that_is_also_an_extra_checker_is_refused_naming_both_keys():
    with pytest.raises(ValueError, match=r"trainer.eval_extra_checkers\[1\]='just_the_number' is also in "
                                         r"reward.functions: .* eval/just_the_number already"):
        typed_job("ppo", ["reward.functions=[{name: just_the_number}]",
                          "trainer.eval_extra_checkers=[arithmetic_exact_match,just_the_number]"])
    cfg = typed_job("ppo", ["reward.functions=[{name: arithmetic_exact_match}]",
                            "trainer.eval_extra_checkers=[just_the_number]"])
    assert cfg.trainer.eval_extra_checkers == ["just_the_number"]
