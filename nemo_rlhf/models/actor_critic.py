"""Actor and Critic on one megatron-core GPT backbone (and the reward model's scalar head).

:class:`ActorCriticModel` is megatron's ``GPTModel`` plus a value head (hidden -> 1) on
the last pipeline stage: the Actor's vocab-parallel logits and the Critic's values come
from the same forward over the same weights (InstructGPT's PPO setup with a shared
backbone, as in NeMo-Aligner's "critic on actor" option; Ouyang et al. 2022 sec. 3.5).
:class:`RewardModel` is the same backbone with a scalar head read at the last valid token
and no output layer call.

Shapes: inputs are batch-first ``input_ids [batch, seq]``; on the last stage the forward
returns ``(logits [batch, seq, padded_vocab/tp], values [batch, seq] float32)``; other
stages return megatron's hidden states ``[seq, batch, hidden]`` for the next stage.

The value head's weights are fp32 whatever the model precision and are part of
``sharded_state_dict()`` (replicated across TP, present on the last stage only).
Simplified: sequence parallelism is not wired in (the value head would need the
sequence-parallel gather); virtual pipeline stages are not used. Context parallelism
(``dims.cp`` > 1) builds the all-gather CP attention and megatron's CP RoPE slicing; each
rank's forward then covers its own positions of the sequences
(:mod:`nemo_rlhf.models.context_parallel`), the fused log-prob path's over those positions
(:func:`~nemo_rlhf.models.context_parallel.cp_fused_logprobs`).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_rlhf.distributed.parallel import reseed_model_parallel
from nemo_rlhf.models.config import ModelConfig, build_transformer_config
from nemo_rlhf.models.context_parallel import CPLogprobRequest, cp_fused_logprobs
from nemo_rlhf.models.decode_layers import local_layer_spec
from nemo_rlhf.models.embedding import use_main_grad_lookup
from nemo_rlhf.models.moe import patch_router_gemm_without_te
from nemo_rlhf.models.moe_dispatch import use_padded_dispatcher
from nemo_rlhf.models.logprobs import LogprobRequest, fused_response_logprobs
from nemo_rlhf.models.lora import apply_lora
from nemo_rlhf.models.packing import PackedBatch


def apply_rope_scaling(gpt: GPTModel, model_cfg: ModelConfig) -> None:
    """Scale ``gpt``'s RoPE inverse frequencies in place per ``model.rope_scaling``
    (``llama3``: megatron's ``RotaryEmbedding._apply_scaling``, a port of transformers'
    ``_compute_llama3_parameters``, given all four of the checkpoint's parameters, where
    megatron's own ``rope_scaling`` flag passes the factor alone). Every consumer of the
    rotary embedding (the training forward, the KV-cache decode) reads these frequencies.
    A no-op without scaling or without RoPE."""
    rot = getattr(gpt, "rotary_pos_emb", None)
    if model_cfg.rope_scaling is None or rot is None:
        return
    inv = rot.inv_freq
    rot_dim = 2 * inv.numel()
    base = 1.0 / (model_cfg.rotary_base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=inv.device)
                                             / rot_dim))
    rot.inv_freq = rot._apply_scaling(
        base, factor=model_cfg.rope_scaling_factor, low_freq_factor=model_cfg.rope_low_freq_factor,
        high_freq_factor=model_cfg.rope_high_freq_factor,
        original_max_position_embeddings=model_cfg.rope_original_max_position_embeddings).to(inv.dtype)
    clear = getattr(type(rot).forward, "cache_clear", None)  # frequencies megatron cached by length
    if clear is not None:
        clear()


class ActorCriticModel(GPTModel):
    """megatron ``GPTModel`` with a value head sharing the backbone.

    Args:
        config: megatron ``TransformerConfig``.
        model_cfg: the project's :class:`ModelConfig` (vocab, positions, tying).
        pre_process / post_process: whether this pipeline stage holds the embedding /
            the output layer and value head.
        layer_spec: megatron layer spec (local spec, or TE's when installed).
    """

    head_name = "value_head"

    def __init__(self, config: TransformerConfig, model_cfg: ModelConfig, pre_process: bool,
                 post_process: bool, layer_spec=None):
        super().__init__(
            config=config,
            transformer_layer_spec=layer_spec or get_gpt_layer_local_spec(
                normalization=model_cfg.normalization),
            vocab_size=model_cfg.padded_vocab_size,
            max_sequence_length=model_cfg.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=model_cfg.share_embeddings_and_output_weights,
            position_embedding_type=model_cfg.position_embedding_type,
            rotary_base=model_cfg.rotary_base,
        )
        self.model_cfg = model_cfg
        apply_rope_scaling(self, model_cfg)
        self._with_values = True  # this call's with_values (forward's argument)
        self.detach_value_head = False
        """When True the value head reads the hidden states with the gradient stopped
        (``critic.mode=shared_detached``): the value loss does not reach the backbone."""
        if post_process:
            head = torch.nn.Linear(config.hidden_size, 1, bias=True, dtype=torch.float32)
            with torch.no_grad():
                if model_cfg.value_head_init_std > 0:
                    head.weight.normal_(0.0, model_cfg.value_head_init_std)
                else:
                    head.weight.zero_()
                head.bias.zero_()
            setattr(self, self.head_name, head)

    def _head(self) -> torch.nn.Linear:
        return getattr(self, self.head_name)

    def forward(self, input_ids, *args, with_values: bool = True,
                logprob_request: Optional[LogprobRequest] = None,
                packed: Optional[PackedBatch] = None, **kwargs):
        """megatron ``GPTModel.forward``; on the last stage ``(logits, values)`` when
        ``with_values`` (and the stage has its value head, outside KV-cache decoding),
        else the logits alone (rollout, reference and SFT passes). With a
        ``logprob_request`` the logits are replaced by the response log-probs
        (:class:`~nemo_rlhf.models.logprobs.ResponseLogprobs`, output layer fused and
        chunked; training or forward-only, not KV-cache decoding).

        With ``packed`` (a :class:`~nemo_rlhf.models.packing.PackedBatch`), ``input_ids``,
        the position ids and the attention mask are the packed ones (``[bins, W]``, see
        :func:`nemo_rlhf.models.engine.model_forward`); the last stage puts the final
        hidden states back in the padded layout before its heads, so the outputs have the
        padded micro-batch's ``[rows, S]`` shape, as without packing."""
        self._with_values = with_values
        self._packed = packed
        targets = input_ids if packed is None else packed.padded_input_ids
        self._logprob_request = (logprob_request, targets) if logprob_request is not None else None
        try:
            return super().forward(input_ids, *args, **kwargs)
        finally:
            self._with_values = True
            self._logprob_request = None
            self._packed = None

    def _unpacked(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The last stage's hidden states in the padded layout ``[S, rows, H]`` (a packed
        forward's are ``[W, bins, H]``); unchanged without packing."""
        packed = getattr(self, "_packed", None)
        return hidden_states if packed is None else packed.unpack_hidden(hidden_states)

    def _postprocess(self, hidden_states, *args, **kwargs):
        request = getattr(self, "_logprob_request", None)
        packed = getattr(self, "_packed", None)
        if self.post_process:
            hidden_states = self._unpacked(hidden_states)
        if request is not None and self.post_process and not kwargs.get("inference_context") \
                and self.config.mtp_num_layers is None:
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
                else self.output_layer.weight
            if isinstance(request[0], CPLogprobRequest):  # context parallel: this rank's positions
                logits = cp_fused_logprobs(hidden_states, weight, request[0], self.output_layer.tp_group)
            else:
                logits = fused_response_logprobs(
                    hidden_states, weight, request[1], request[0], self.output_layer.tp_group,
                    select=None if packed is None else packed.response_index)
        else:
            logits = super()._postprocess(hidden_states, *args, **kwargs)
        if (not self.post_process or not self._with_values or kwargs.get("inference_context")
                or not hasattr(self, self.head_name)):  # an actor without its head: logits
            return logits
        h = hidden_states.detach() if self.detach_value_head else hidden_states
        values = self._head()(h.float()).squeeze(-1).transpose(0, 1).contiguous()
        return logits, values


class RewardModel(ActorCriticModel):
    """GPT backbone + scalar reward head (Bradley-Terry RM, Ouyang et al. 2022 sec. 3.5).

    The last stage returns per-token scalar rewards ``[batch, seq]`` float32; the score of a
    sequence is read at its last valid token (:func:`gather_last_token`). The output layer
    exists (so an RM can start from an SFT checkpoint and keep its keys) but is not called.
    """

    head_name = "reward_head"

    def _postprocess(self, hidden_states, *args, **kwargs):
        if not self.post_process:
            return hidden_states
        return self._head()(self._unpacked(hidden_states).float()).squeeze(-1).transpose(0, 1).contiguous()


class CriticModel(RewardModel):
    """A critic with its own backbone (``critic.mode=separate``): GPT backbone + value head.

    The last stage returns per-token values ``[batch, seq]`` float32 (position ``t``: the
    state after token ``t``), like the reward model's per-token scores; the output layer
    exists (keys compatible with actor, SFT and RM checkpoints, so a critic can start from
    any of them) but is not called.
    """

    head_name = "value_head"


def gather_last_token(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Pick ``values[b, lengths[b]-1]`` for right-padded rows.

    Args:
        values: ``[batch, seq]``.
        lengths: ``[batch]`` int, number of valid tokens per row (>= 1).

    Returns:
        ``[batch]`` tensor.

    Raises:
        ValueError: if a length is < 1 or > seq.
    """
    if (lengths < 1).any() or (lengths > values.shape[1]).any():
        raise ValueError(f"lengths must be in [1, {values.shape[1]}], got {lengths.tolist()}")
    idx = (lengths.long() - 1).unsqueeze(1)
    return values.gather(1, idx).squeeze(1)


def build_model(model_cfg: ModelConfig, dims, precision: str = "32", kind: str = "actor_critic",
                seed: Optional[int] = None) -> torch.nn.Module:
    """Build this rank's pipeline stage of an actor-critic or reward model.

    Args:
        model_cfg: architecture; ``vocab_size`` must be set.
        dims: :class:`nemo_rlhf.distributed.ParallelDims` of this process.
        precision: ``trainer.precision`` (``32``, ``bf16-mixed``, ``fp16-mixed``).
        kind: ``actor_critic``, ``reward`` or ``critic`` (:class:`CriticModel`).
        seed: if given, re-seed megatron's TP RNG tracker first, so two builds give the
            same weights (tests; reference copies); with ``model.lora.enabled`` also the
            run's seed of the adapters' ``A`` (:func:`nemo_rlhf.models.lora.adapter_seed`;
            None: ``A`` from the adapter's name alone).

    A MoE model at ``dims.ep`` > 1 holds ``num_moe_experts / ep`` experts per layer (its
    expert-parallel rank's); its token dispatchers are
    :class:`~nemo_rlhf.models.moe_dispatch.PaddedAllGatherTokenDispatcher`.

    With ``model.lora.enabled`` the stage gets LoRA adapters and only they and the head
    stay trainable (:func:`nemo_rlhf.models.lora.apply_lora`).

    Raises:
        ValueError: unknown ``kind``, or a padded vocabulary not divisible by TP.
    """
    classes = {"actor_critic": ActorCriticModel, "reward": RewardModel, "critic": CriticModel}
    if kind not in classes:
        raise ValueError(f"model kind {kind!r}: valid kinds are {sorted(classes)}")
    if model_cfg.padded_vocab_size % dims.tp:
        raise ValueError(
            f"padded vocabulary {model_cfg.padded_vocab_size} is not divisible by "
            f"parallel.tensor_model_parallel_size={dims.tp}: set model.make_vocab_size_divisible_by "
            f"to a multiple of {dims.tp}"
        )
    if seed is not None:
        reseed_model_parallel(seed)
    if model_cfg.num_moe_experts is not None:
        patch_router_gemm_without_te()
    cp = getattr(dims, "cp", 1)
    config = build_transformer_config(model_cfg, dims.tp, dims.pp, precision, ep=dims.ep, cp=cp)
    model = classes[kind](config, model_cfg, pre_process=dims.is_first_stage,
                          post_process=dims.is_last_stage,
                          layer_spec=_layer_spec(model_cfg, context_parallel=cp > 1))
    # MoE: expert-parallel ranks may hold different token counts (nemo_rlhf.models.moe)
    use_padded_dispatcher(model)
    # the word embedding's weight gradient into DDP's main_grad, without a dense
    # [vocab, hidden] gradient (nemo_rlhf.models.embedding)
    use_main_grad_lookup(model)
    if model_cfg.lora.enabled:  # adapters added, all but them and the head frozen
        apply_lora(model, model_cfg.lora, gated_fc1=model_cfg.activation == "swiglu", seed=seed)
    return model.to(dims.device)


def _layer_spec(model_cfg: ModelConfig, context_parallel: bool = False):
    """The layer spec on every device: :func:`nemo_rlhf.models.decode_layers.local_layer_spec`,
    megatron's local spec with a layer and self-attention class that add an incremental
    KV-cache decoding path (same parameters and keys, same training forward).

    Transformer-engine's spec is not used, even where TE is installed (NGC containers ship
    it): its layers fuse the norms into the linear layers (``linear_qkv.layer_norm_weight``
    instead of ``input_layernorm.weight``), so checkpoints, the HF mapping and the decode
    layers, all written for the local keys, would not apply; and under megatron's
    ``causal`` mask type TE does not read the attention mask that every forward here passes
    (left-padded prompts, padded keys, packed sequences). megatron's local attention runs on
    CUDA as on the host."""
    return local_layer_spec(normalization=model_cfg.normalization, qk_layernorm=model_cfg.qk_layernorm,
                            num_experts=model_cfg.num_moe_experts, context_parallel=context_parallel)
