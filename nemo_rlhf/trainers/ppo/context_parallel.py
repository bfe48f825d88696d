"""What of the PPO job runs under context parallelism (``parallel.context_parallel_size``).

Wired (docs/parallelism.md): a dense model (TP, PP and DP free, LoRA or not), every critic
mode (the value head on the actor's backbone, a separate critic, none), every
``ppo.loss_agg_mode``, padded micro-batches by rows or by a token budget
(``ppo.max_tokens_per_micro_batch``), packed ones (``ppo.sequence_packing``), the logits or
the fused output layer (``ppo.logprob_chunk_size``), the megatron engine's KV-cache rollout, single-turn.
The vLLM engine (``rollout.engine=vllm``: CP rank 0's engines refit and generate, the rows
broadcast over CP; :mod:`nemo_rlhf.rollout.vllm_engine`) and rollout workers
(``rollout.mode=async`` with the megatron engine on the workers: the CP ranks of a DP rank
take its item, CP rank 0 publishes the weights; :mod:`nemo_rlhf.trainers.ppo.async_rollout`)
for a dense single-turn model. (Async with vLLM workers is refused: the workers do not see
CP, but that combination has no test.)
Multi-turn episodes (``env.name``) of a dense model at TP = PP = 1.
A mixture-of-experts model (``model.num_moe_experts``) at TP = PP = 1, expert parallelism
free (EP within the CP group: megatron carves the expert groups from DP x CP), with the
load-balancing loss (``model.moe_aux_loss_coeff``) and routing replay
(``moe.routing_replay``), without the router z-loss.
Everything else is refused here, before any process group exists, by the key and the value
that works.
"""

from __future__ import annotations

_WIRED = ("a dense model, every critic mode, micro-batches by rows, by a token budget or packed, "
          "the megatron KV-cache rollout, single-turn; for a dense single-turn model also the vLLM "
          "rollout (sync) and rollout workers (rollout.mode=async, megatron engine); a MoE model at "
          "TP = PP = 1, expert parallelism, routing replay and the aux loss free, no z-loss; "
          "multi-turn episodes (env.name) of a dense model at TP = PP = 1")


def check_context_parallel(cfg) -> None:
    """Refuse the PPO settings that are not wired for ``parallel.context_parallel_size`` > 1.

    Args:
        cfg: the :class:`~nemo_rlhf.trainers.ppo.config.PPOConfig`.

    Raises:
        ValueError: naming ``parallel.context_parallel_size``, the first unwired key, its
            value and the value that works.
    """
    cp = cfg.parallel.context_parallel_size
    if cp == 1:
        return
    r, par, m = cfg.rollout, cfg.parallel, cfg.model
    moe, env = bool(m.num_moe_experts), cfg.env.name is not None
    # MoE and multi-turn episodes are wired at TP = PP = 1 (and not together)
    only = f"model.num_moe_experts={m.num_moe_experts}" if moe else f"env.name={cfg.env.name}"
    # the vLLM engine and the rollout workers are wired for a dense single-turn model, vLLM sync
    dense_single = f"{only} and " if moe or env else ""
    vllm_with = dense_single or ("rollout.mode=async and " if r.mode == "async" else "")
    unwired = (  # (key, value, refused, the value that works, what it is refused with)
        ("parallel.tensor_model_parallel_size", par.tensor_model_parallel_size,
         (moe or env) and par.tensor_model_parallel_size > 1, 1, f"{only} and "),
        ("parallel.pipeline_model_parallel_size", par.pipeline_model_parallel_size,
         (moe or env) and par.pipeline_model_parallel_size > 1, 1, f"{only} and "),
        ("model.moe_z_loss_coeff", m.moe_z_loss_coeff, moe and bool(m.moe_z_loss_coeff), 0.0, ""),
        ("rollout.engine", r.engine, r.engine == "vllm" and bool(vllm_with), "megatron", vllm_with),
        ("rollout.mode", r.mode, r.mode == "async" and bool(dense_single), "sync", dense_single),
        ("rollout.use_kv_cache", r.use_kv_cache, not r.use_kv_cache, True, ""),
        ("env.name", cfg.env.name, moe and env, "null", f"{only} and "),
    )
    for key, value, refused, ok, with_ in unwired:
        if refused:
            raise ValueError(
                f"parallel.context_parallel_size={cp} with {with_}{key}={_show(value)}: not wired for context "
                f"parallelism yet; set {key}={_show(ok)} (wired: {_WIRED}; docs/parallelism.md)")


def _show(value) -> str:
    """A value as a Hydra override writes it."""
    return str(value).lower() if isinstance(value, bool) else str(value)


__all__ = ["check_context_parallel"]
