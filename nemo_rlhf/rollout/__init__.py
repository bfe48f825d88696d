"""Rollout generation: KV-cached sampling on the megatron actor under TP/PP/DP.

``config`` holds :class:`RolloutConfig` (config section ``rollout``), ``sampling`` the pure
next-token functions, ``generate`` the decoding loop, :class:`RolloutBatch` (the layout the
trainer consumes) and :func:`logprob_diff_stats`; ``incremental_stage`` runs a model stage
in the decode loop; ``engines`` the one interface the trainer uses (``rollout.engine``:
``megatron`` or ``vllm``, the latter in ``vllm_engine``, imported only when chosen);
``trajectory`` the multi-turn episode (token ids appended turn by turn, its loss mask, the
append-only check) and ``episodes`` the megatron engine's multi-turn episodes with an
environment (:func:`~nemo_rlhf.rollout.episodes.run_episodes`, KV cache kept across turns;
not yet called by the trainer, docs/multi-turn.md), ``vllm_episodes`` the same on the vLLM
engine (:func:`~nemo_rlhf.rollout.vllm_episodes.run_episodes_vllm`, prefix caching). The training-side log-probs of the same tokens are
:func:`nemo_rlhf.models.logprobs.response_logprobs`.
"""

from nemo_rlhf.rollout.config import RolloutConfig
from nemo_rlhf.rollout.generate import (
    RolloutBatch,
    generate,
    left_pad,
    logprob_diff_stats,
    sampler_seed,
)
from nemo_rlhf.rollout.sampling import choose_tokens, top_k_top_p_filter

__all__ = [
    "RolloutBatch", "RolloutConfig", "choose_tokens", "generate", "left_pad",
    "logprob_diff_stats", "sampler_seed", "top_k_top_p_filter",
]
