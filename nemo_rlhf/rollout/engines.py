"""One rollout interface for both engines (``rollout.engine``).

The PPO trainer builds an engine once (:func:`build_rollout_engine`) and then only calls
:meth:`RolloutEngine.generate` with the actor and a weights version; it never branches on
the engine. Both return a :class:`~nemo_rlhf.rollout.generate.RolloutBatch` in the same
layout (prompts left-padded to ``P``, responses right-padded from column ``P``) on
``dims.device``, with the same token ids on every rank of one model-parallel group.

* ``megatron`` (:class:`MegatronRolloutEngine`): the training model itself decodes
  (:func:`~nemo_rlhf.rollout.generate.generate`); the weights are always current.
* ``vllm`` (:class:`~nemo_rlhf.rollout.vllm_engine.VLLMRolloutEngine`): an in-process vLLM
  engine per DP group, refit in memory from the actor's weights when ``weights_version``
  changed.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

from nemo_rlhf.models.engine import unwrap
from nemo_rlhf.rollout.config import RolloutConfig
from nemo_rlhf.rollout.generate import RolloutBatch, generate


class RolloutEngine(Protocol):
    """What the trainer needs of a rollout engine."""

    name: str

    def generate(self, model, prompts: Sequence[Sequence[int]], cfg: RolloutConfig, *,
                 call_index: int, weights_version: int) -> RolloutBatch:
        """Responses to this DP rank's ``prompts`` by the actor ``model``'s current policy.

        Args:
            model: this rank's actor stage (DDP-wrapped or not); left in train mode.
            prompts: ``B`` token-id lists, the same on every rank of one TP x PP group.
            cfg: sampling and stopping rules (``cfg.greedy`` for evaluation).
            call_index: mixes into the sampling seeds with ``(rollout.seed, dp_rank)``: the
                same index gives the same tokens (a resumed run samples as an
                uninterrupted one).
            weights_version: changes whenever the actor's weights changed (an engine with
                its own copy refits when it differs from the last refit's).
        """
        ...

    def metrics(self) -> dict[str, float]:
        """The engine's own numbers since it was built (logged with the step's metrics)."""
        ...

    def close(self) -> None:
        """Free the engine's resources (idempotent)."""
        ...


class MegatronRolloutEngine:
    """Decoding with the training model (megatron static KV cache, our decode layers).

    Args:
        dims: :class:`~nemo_rlhf.distributed.ParallelDims`.
        eos_token_id, pad_token_id, vocab_size, max_sequence_length, decode_fn: as
            :func:`~nemo_rlhf.rollout.generate.generate`.
        record_routes: every decode also records the MoE routes
            (:attr:`~nemo_rlhf.rollout.generate.RolloutBatch.routes`, ``moe.routing_replay``).
    """

    name = "megatron"

    def __init__(self, dims, *, eos_token_id: int, pad_token_id: int, vocab_size: int,
                 max_sequence_length: int, decode_fn: Optional[Callable[[list[int]], str]] = None,
                 with_values: bool = False, record_routes: bool = False):
        self.dims = dims
        self.kwargs = dict(eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                           vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                           decode_fn=decode_fn, with_values=with_values, record_routes=record_routes)

    def generate(self, model, prompts, cfg: RolloutConfig, *, call_index: int,
                 weights_version: int) -> RolloutBatch:
        m = unwrap(model)
        try:
            return generate(m, self.dims, prompts, cfg, call_index=call_index, **self.kwargs)
        finally:
            m.train()

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def build_rollout_engine(cfg: RolloutConfig, dims, model_cfg, *, eos_token_id: int,
                         pad_token_id: int, decode_fn=None, params_dtype=None,
                         with_values: bool = False, record_routes: bool = False) -> RolloutEngine:
    """The engine ``cfg.engine`` names, built on every rank (collective for ``vllm``).

    Args:
        cfg: the ``rollout`` section.
        dims: this process's parallel layout.
        model_cfg: :class:`~nemo_rlhf.models.config.ModelConfig` of the actor.
        params_dtype: dtype of the actor's weights (vLLM computes in it); None = float32.
        with_values: the rollout also returns the actor-critic's values
            (``RolloutBatch.values``, megatron engine only).
        record_routes: the rollout also records the MoE routes (``RolloutBatch.routes``,
            ``moe.routing_replay``; megatron engine only).

    Raises:
        ValueError: an unknown engine (naming ``rollout.engine`` and the choices), a
            layout the vLLM engine does not support (see its docstring), or
            ``with_values`` with an engine other than megatron or without the KV cache;
            ``record_routes`` with an engine other than megatron.
        ImportError: ``rollout.engine=vllm`` without the ``vllm`` package (says how to
            install it).
    """
    common = dict(eos_token_id=eos_token_id, pad_token_id=pad_token_id, decode_fn=decode_fn)
    if with_values and not cfg.use_kv_cache:
        raise ValueError("rollout.use_kv_cache=false: the rollout's values (ppo.old_logprobs_from_rollout "
                         "with the value head on the actor's backbone) come from the KV-cache decode: set "
                         "rollout.use_kv_cache=true or ppo.old_logprobs_from_rollout=false")
    if cfg.engine == "megatron":
        return MegatronRolloutEngine(dims, vocab_size=model_cfg.vocab_size,
                                     max_sequence_length=model_cfg.max_position_embeddings,
                                     with_values=with_values, record_routes=record_routes, **common)
    if record_routes:
        raise ValueError(f"rollout.engine={cfg.engine}: moe.routing_replay records the routes in the "
                         f"megatron engine's decode only: set rollout.engine=megatron or moe.routing_replay=false")
    if with_values:
        raise ValueError(f"rollout.engine={cfg.engine}: the rollout's values (ppo.old_logprobs_from_rollout "
                         f"with the value head on the actor's backbone) come from the megatron engine's "
                         f"decode only: set rollout.engine=megatron, critic.mode=separate, or a critic-free "
                         f"ppo.advantage_estimator")
    if cfg.engine == "vllm":
        from nemo_rlhf.rollout.vllm_engine import VLLMRolloutEngine  # lazy: vllm is optional and slow to import

        return VLLMRolloutEngine(cfg, dims, model_cfg, params_dtype=params_dtype, **common)
    cfg.validate()  # raises naming rollout.engine and the choices
    raise AssertionError(cfg.engine)
