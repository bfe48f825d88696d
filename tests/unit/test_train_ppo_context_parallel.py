"""``parallel.context_parallel_size`` composes from the command line into every job's
schema; the PPO config accepts it on what is wired (docs/parallelism.md) and refuses every
other combination naming the key and the value that works; the jobs it is not wired into
refuse it before any process group exists."""

from __future__ import annotations

import pytest

from tests.conf_helpers import typed_job

CP = ["parallel.context_parallel_size=2", "ppo.logprob_chunk_size=0"]


def test_ppo_config_accepts_cp_on_the_wired_path():
    cfg = typed_job("ppo_tiny", CP + ["critic.mode=shared_detached", "ppo.loss_agg_mode=seq-mean-token-sum",
                                      "parallel.tensor_model_parallel_size=2",
                                      "parallel.pipeline_model_parallel_size=2"])
    assert cfg.parallel.context_parallel_size == 2
    assert typed_job("ppo_tiny", CP + ["ppo.advantage_estimator=grpo", "rollout.n_samples_per_prompt=2"])
    assert typed_job("ppo_tiny", CP + ["critic.mode=separate"]).critic.mode == "separate"
    assert typed_job("ppo_tiny", CP + ["model.lora.enabled=true"]).model.lora.enabled
    # tests/vllm_engine/test_vllm_context_parallel.py: equal to CP=1, refit once per replica
    assert typed_job("ppo_tiny", CP + ["rollout.engine=vllm"]).rollout.engine == "vllm"
    # tests/e2e/test_async_rollout.py: equal to CP=1 (rollout workers, max_staleness=1)
    assert typed_job("ppo_tiny", CP + ["rollout.mode=async", "rollout.max_staleness=1",
                                       "ppo.rollout_is_cap=2.0"]).rollout.mode == "async"
    assert typed_job("ppo_tiny", ["parallel.context_parallel_size=2"]).ppo.logprob_chunk_size == 1024
    # tests/distributed/test_ppo_context_parallel_budget.py: equal to CP=1
    assert typed_job("ppo_tiny", CP + ["ppo.loss_agg_mode=seq-mean-token-mean"]).ppo.loss_agg_mode == \
        "seq-mean-token-mean"
    assert typed_job("ppo_tiny", CP + ["ppo.max_tokens_per_micro_batch=64"]).ppo.max_tokens_per_micro_batch == 64
    assert typed_job("ppo_tiny", CP + ["ppo.max_tokens_per_micro_batch=64", "ppo.sequence_packing=true"]
                     ).ppo.sequence_packing
    # tests/distributed/test_ppo_context_parallel_moe.py: a MoE model at CP=2 and CP=2 x EP=2
    moe = CP + ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32"]
    cfg = typed_job("ppo_tiny", moe + ["model.moe_aux_loss_coeff=0.1", "moe.routing_replay=true",
                                       "parallel.expert_model_parallel_size=2"])
    assert cfg.model.num_moe_experts == 4 and cfg.moe.routing_replay
    assert typed_job("ppo_tiny", moe + ["ppo.max_tokens_per_micro_batch=64", "ppo.sequence_packing=true"]
                     ).ppo.sequence_packing


MOE = ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32"]


@pytest.mark.parametrize("overrides, key, value, ok", [
    (["parallel.tensor_model_parallel_size=2"], "parallel.tensor_model_parallel_size", "2", "1"),
    (["parallel.pipeline_model_parallel_size=2"], "parallel.pipeline_model_parallel_size", "2", "1"),
    (["model.moe_z_loss_coeff=0.01"], "model.moe_z_loss_coeff", "0.01", "0.0"),
])
def test_ppo_config_refuses_what_is_not_wired_for_moe_naming_the_key(overrides, key, value, ok):
    what = f"model.num_moe_experts=4 and {key}" if key.startswith("parallel.") else key
    with pytest.raises(ValueError, match=rf"parallel\.context_parallel_size=2 with {what}={value}: not wired "
                                         rf"for context parallelism yet; set {key}={ok} \(wired: a dense model, "
                                         rf"every critic mode.*a MoE model at TP = PP = 1"):
        typed_job("ppo_tiny", CP + MOE + overrides)


ENV = ["env.name=digit_calculator"]


def test_ppo_config_accepts_multiturn_episodes_under_cp():
    # tests/distributed/test_ppo_multiturn_parallel.py: CP=2 equals one rank
    assert typed_job("ppo_tiny", CP + ENV).env.name == "digit_calculator"


@pytest.mark.parametrize("overrides, key, value, ok", [
    (ENV + ["parallel.tensor_model_parallel_size=2"], "parallel.tensor_model_parallel_size", "2", "1"),
    (ENV + ["parallel.pipeline_model_parallel_size=2"], "parallel.pipeline_model_parallel_size", "2", "1"),
    (ENV + MOE, "env.name", "digit_calculator", "null"),
])
def test_ppo_config_refuses_multiturn_episodes_where_not_wired(overrides, key, value, ok):
    what = "model.num_moe_experts=4" if key == "env.name" else "env.name=digit_calculator"
    with pytest.raises(ValueError, match=rf"parallel\.context_parallel_size=2 with {what} and {key}={value}: "
                                         rf"not wired for context parallelism yet; set {key}={ok} "
                                         rf"\(wired: a dense model, every critic mode.*multi-turn episodes"):
        typed_job("ppo_tiny", CP + overrides)


ASYNC = ["rollout.mode=async", "rollout.max_staleness=0"]


@pytest.mark.parametrize("overrides, what, key, value, ok", [
    (["rollout.engine=vllm"] + ASYNC, "rollout.mode=async", "rollout.engine", "vllm", "megatron"),
    (["rollout.engine=vllm"] + MOE, "model.num_moe_experts=4", "rollout.engine", "vllm", "megatron"),
    (["rollout.engine=vllm"] + ENV, "env.name=digit_calculator", "rollout.engine", "vllm", "megatron"),
    (ASYNC + MOE, "model.num_moe_experts=4", "rollout.mode", "async", "sync"),
    (ASYNC + ENV, "env.name=digit_calculator", "rollout.mode", "async", "sync"),
])
def test_ppo_config_refuses_vllm_and_async_beyond_a_dense_single_turn_model(overrides, what, key, value, ok):
    with pytest.raises(ValueError, match=rf"parallel\.context_parallel_size=2 with {what} and {key}={value}: "
                                         rf"not wired for context parallelism yet; set {key}={ok} "
                                         rf"\(wired: a dense model, every critic mode.*vLLM rollout \(sync\)"):
        typed_job("ppo_tiny", CP + overrides)


@pytest.mark.parametrize("overrides, key, value, ok", [
    (["rollout.use_kv_cache=false"], "rollout.use_kv_cache", "false", "true"),
])
def test_ppo_config_refuses_what_is_not_wired_naming_the_key(overrides, key, value, ok):
    base = CP
    with pytest.raises(ValueError, match=rf"parallel\.context_parallel_size=2 with {key}={value}: not wired "
                                         rf"for context parallelism yet; set {key}={ok} \(wired: a dense model, every critic mode"):
        typed_job("ppo_tiny", base + overrides)


@pytest.mark.parametrize("job", ["sft_tiny", "rm_tiny"])
def test_supervised_setup_refuses_cp_naming_the_key(job):
    from nemo_rlhf.trainers.common import setup_run

    cfg = typed_job(job, ["parallel.context_parallel_size=2"])
    with pytest.raises(ValueError, match=r"parallel\.context_parallel_size=2 in the SFT / RM trainer or "
                                         r"evaluate job: context parallelism is not wired"):
        setup_run(cfg.parallel, cfg.model, None, 0)
