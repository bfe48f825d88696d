"""One pipeline stage of a megatron ``GPTModel`` for the static-batching decode loop.

The rollout's hot loop runs the stage's layers (:mod:`nemo_rlhf.models.decode_layers`)
incrementally, without ``GPTModel``'s and ``TransformerBlock``'s per-call wrappers; see
:class:`IncrementalStage`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

from nemo_rlhf.models.actor_critic import ActorCriticModel
from nemo_rlhf.models.decode_layers import KVCacheTransformerLayer, _plain_linear
from nemo_rlhf.models.embedding import MainGradVocabParallelEmbedding


class IncrementalStage:
    """One pipeline stage of a ``GPTModel`` for the static-batching decode loop, without
    the model- and block-level wrappers.

    megatron's ``GPTModel.forward`` -> ``TransformerBlock.forward`` -> layers costs, per
    decode step, a RoPE-table lookup, viewless-tensor wrapping, context managers, the
    embedding and output layers' autograd ``Function`` wrappers and identity collectives
    at TP=1, and a ``[s, b, vocab]`` -> ``[b, s, vocab]`` copy of the logits; at a few
    tokens per step that is several percent of the step (``benchmarks/bench_rollout.py``).
    This runs the same arithmetic directly: embedding (``F.embedding`` (+ learned
    positions), transposed to ``[s, b, h]``), every :class:`KVCacheTransformerLayer`'s
    incremental forward, the final norm, and the output projection of the **last** token
    only (as megatron does for a static context, ``materialize_only_last_token_logits``).
    At TP>1 the embedding and output modules themselves are called (their collectives
    are needed); the rest is the same.

    Build with :meth:`for_model`, which returns None for anything this does not cover
    (the caller then calls the model): layers that do not all take the lean incremental
    path, MTP, MLA, flash-decode, sequence parallelism, token-type embeddings, RoPE
    variants other than megatron's ``RotaryEmbedding``, a subclass with its own ``forward``
    / ``_preprocess`` / ``_postprocess`` (the actor-critic's is fine: it adds nothing in
    inference), or a model in training mode.
    """

    def __init__(self, gpt, rotary_seq_len: int):
        self.gpt = gpt
        cfg = gpt.config
        tp1 = cfg.tensor_model_parallel_size == 1
        self.layers = list(gpt.decoder.layers)
        self.final_norm = gpt.decoder.final_layernorm if gpt.post_process else None
        self.freqs = None
        if gpt.position_embedding_type == "rope":
            # under context parallelism megatron's RoPE call slices its table to the CP
            # rank's positions; the decode runs every position (get_emb: the whole table)
            self.freqs = (gpt.rotary_pos_emb.get_emb(rotary_seq_len) if cfg.context_parallel_size > 1
                          else gpt.rotary_pos_emb(rotary_seq_len))
        self._plain_embedding = False
        if gpt.pre_process:
            emb = gpt.embedding
            self._plain_embedding = (
                # megatron's lookup (ours differs only in the backward, unused in decoding)
                tp1 and type(emb.word_embeddings) in (VocabParallelEmbedding, MainGradVocabParallelEmbedding)
                and not getattr(emb.word_embeddings, "reduce_scatter_embeddings", False)
                and not getattr(emb, "reduce_scatter_embeddings", False))
        self._plain_output = gpt.post_process and _plain_linear(gpt.output_layer, tp1)
        self.value_head: Optional[torch.nn.Module] = None
        """Set to an actor-critic's value head to also compute, each call, the value of the
        last token's state (:attr:`last_values`)."""
        self.last_values: Optional[torch.Tensor] = None
        """``[B]`` float32: the value head on the last token's final hidden state (last
        stage, with :attr:`value_head`)."""

    @classmethod
    def for_model(cls, gpt, rotary_seq_len: int) -> Optional["IncrementalStage"]:
        """An :class:`IncrementalStage` of ``gpt`` (a megatron ``GPTModel`` stage, eval
        mode), or None if some part of it needs megatron's own forward.

        Args:
            gpt: unwrapped ``GPTModel`` (or subclass) of this pipeline stage.
            rotary_seq_len: the RoPE table length megatron would use (the inference
                context's ``max_sequence_length``).
        """
        cfg = getattr(gpt, "config", None)
        if not isinstance(gpt, GPTModel) or gpt.training or cfg is None:
            return None
        # a subclass with its own forward pieces (e.g. the reward model's head) is not this
        cls_ = type(gpt)
        if (cls_.forward not in (GPTModel.forward, ActorCriticModel.forward)
                or cls_._preprocess is not GPTModel._preprocess
                or cls_._postprocess not in (GPTModel._postprocess,
                                             ActorCriticModel._postprocess)):
            return None
        layers = list(gpt.decoder.layers)
        if not layers or not all(isinstance(layer, KVCacheTransformerLayer) and layer._lean
                                 and layer.self_attention._fast_inference for layer in layers):
            return None
        if (getattr(gpt, "mtp_process", False) or getattr(cfg, "mtp_num_layers", None)
                or cfg.multi_latent_attention or getattr(cfg, "flash_decode", False)
                or cfg.sequence_parallel or getattr(cfg, "cpu_offloading", False)
                or getattr(cfg, "fine_grained_activation_offloading", False)):
            return None
        if gpt.position_embedding_type == "rope":
            if type(gpt.rotary_pos_emb) is not RotaryEmbedding:
                return None
        elif gpt.position_embedding_type not in ("learned_absolute", "none"):
            return None
        if gpt.pre_process and getattr(gpt.embedding, "tokentype_embeddings", None) is not None:
            return None
        return cls(gpt, rotary_seq_len)

    def _embed(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
        """``[B, s]`` ids -> ``[s, B, h]``, ``LanguageModelEmbedding`` in eval mode."""
        emb = self.gpt.embedding
        if not self._plain_embedding:
            return emb(input_ids=input_ids_BS, position_ids=position_ids_BS)
        x = F.embedding(input_ids_BS, emb.word_embeddings.weight)
        if emb.add_position_embedding:
            x = x + emb.position_embeddings(position_ids_BS)
        x = x.transpose(0, 1)
        if self.gpt.config.fp32_residual_connection:
            x = x.float()
        return x

    def __call__(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], ctx,
                 input_tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Forward ``s`` new tokens of every row through this stage.

        Args:
            input_ids_BS, position_ids_BS: ``[B, s]`` int64 (used on the first stage).
            attention_mask: bool ``[B or 1, 1, s, offset+s]`` (True = masked out) or None.
            ctx: the ``StaticInferenceContext`` (its offset is advanced by the caller).
            input_tensor: ``[s, B, h]`` from the previous stage (not the first stage).

        Returns:
            Last stage: ``[B, padded_vocab]`` logits of the last of the ``s`` tokens
            (gathered over TP; with :attr:`value_head`, that token's value is left in
            :attr:`last_values`). Other stages: ``[s, B, h]`` hidden states for the next.
        """
        gpt = self.gpt
        h = self._embed(input_ids_BS, position_ids_BS) if gpt.pre_process else input_tensor
        for layer in self.layers:
            h = layer._incremental_forward(h, attention_mask, ctx, self.freqs)
        if not gpt.post_process:
            return h
        h = h[-1]  # [B, h]: only the last token's logits are needed
        if self.final_norm is not None:
            h = self.final_norm(h)
        if self.value_head is not None:  # as ActorCriticModel._postprocess: fp32 head
            self.last_values = self.value_head(h.float()).squeeze(-1)
        weight = (gpt.shared_embedding_or_output_weight()
                  if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight)
        if self._plain_output:
            logits = torch.matmul(h, weight.t())
            if gpt.output_layer.bias is not None:
                logits = logits + gpt.output_layer.bias
            return logits
        logits, _ = gpt.output_layer(h.unsqueeze(0), weight=weight, runtime_gather_output=True)
        return logits[0]
