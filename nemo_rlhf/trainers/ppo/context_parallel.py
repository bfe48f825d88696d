"""What of the PPO job runs under context parallelism (``parallel.context_parallel_size``).

Wired (docs/parallelism.md): a dense model (TP, PP and DP free, LoRA or not), every critic
mode (the value head on the actor's backbone, a separate critic, none), every
``ppo.loss_agg_mode``, padded micro-batches by rows or by a token budget
(``ppo.max_tokens_per_micro_batch``), packed ones (``ppo.sequence_packing``), the logits or
the fused output layer (``ppo.logprob_chunk_size``), the megatron engine's KV-cache rollout and the vLLM engine's
(``rollout.engine=vllm``: CP rank 0's engines refit and generate, the rows broadcast over
CP; :mod:`nemo_rlhf.rollout.vllm_engine`), synchronous or with rollout workers
(``rollout.mode=async`` with the megatron engine on the workers: the CP ranks of a DP rank
take its item, CP rank 0 publishes the weights; :mod:`nemo_rlhf.trainers.ppo.async_rollout`),
single-turn. (Async with vLLM workers is refused: the workers do not see CP, but that
combination has no test.)
Everything else is refused here, before any process group exists, by the key and the value
that works.
"""

from __future__ import annotations


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
    p, r, par = cfg.ppo, cfg.rollout, cfg.parallel
    unwired = (  # (key, value, refused, the value that works)
        ("model.num_moe_experts", cfg.model.num_moe_experts, bool(cfg.model.num_moe_experts), "null"),
        ("rollout.engine", "vllm with rollout.mode=async", r.engine == "vllm" and r.mode == "async",
         "megatron (or rollout.mode=sync)"),
        ("rollout.use_kv_cache", r.use_kv_cache, not r.use_kv_cache, True),
        ("env.name", cfg.env.name, cfg.env.name is not None, "null"),
    )
    for key, value, refused, ok in unwired:
        if refused:
            raise ValueError(
                f"parallel.context_parallel_size={cp} with {key}={_show(value)}: not wired for context "
                f"parallelism yet; set {key}={_show(ok)} (wired: a dense model, every critic mode, "
                f"micro-batches by rows, by a token budget or packed, the megatron KV-cache or the vLLM "
                f"rollout, synchronous or async (megatron workers), single-turn; "
                f"docs/parallelism.md)")


def _show(value) -> str:
    """A value as a Hydra override writes it."""
    return str(value).lower() if isinstance(value, bool) else str(value)


__all__ = ["check_context_parallel"]
