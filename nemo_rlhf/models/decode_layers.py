"""megatron layers with an incremental KV-cache decoding path (the rollout's hot loop).

The whole-stage runner of the decode loop that uses them is
:class:`nemo_rlhf.rollout.incremental_stage.IncrementalStage`.

Why: in megatron-core 0.16 the static-batching inference path
(``Attention._adjust_key_value_for_inference`` + the local spec's ``DotProductAttention``)
stores **un-rotated** keys in ``StaticInferenceContext.key_value_memory_dict`` and, at
every decoding step and in every layer, re-applies RoPE to the whole cached prefix
(cos/sin/cat/mul over ``[s, b, groups, head_dim]``) and ``repeat_interleave``-s the cached
keys and values to the number of query heads (GQA) before ``baddbmm``/softmax/``bmm``.
Profiled on CPU (``benchmarks/bench_rollout.py``, 4 layers, batch 8) that was ~30% (RoPE)
+ ~9% (GQA copies) of a decode step. megatron's own cure, ``flash_decode``, needs the
flash-attn CUDA kernel. The rest of a decode step is mostly per-op Python in megatron's
layer (bias-dropout-add, autograd ``Function`` wrappers around every linear, viewless
tensors), which at a few tokens per step costs as much as the matmuls.

What: :func:`local_layer_spec` is megatron's local GPT layer spec with two classes swapped
in -- same submodules, same parameters and state-dict keys, same training forward:

* :class:`KVCacheSelfAttention` (megatron ``SelfAttention``): for a static-batching
  inference context in eval mode, RoPE is applied to the **new** queries and keys only
  (positions ``offset .. offset+s-1``, the cos/sin computed once per step and shared by all
  layers, with megatron's arithmetic so the rotated keys are bit-identical to a full
  forward's) and keys are cached **rotated** (as megatron does for flash-decode), in the
  same context (``key_value_memory_dict``, ``sequence_len_offset``, ``batch_size_offset``,
  ``max_batch_size``, ``max_sequence_length``) under the key ``(layer_number, "bhsd")`` in
  the layout ``[max_batch, groups, max_seq, head_dim]``, so a step reads a strided view
  with no copy. No keys or values are repeated for GQA: a prefill (``s > 1``) runs
  ``torch.nn.functional.scaled_dot_product_attention`` with ``enable_gqa``; a one-token
  decode step folds each group's query heads into the query axis (``[b, groups,
  heads/groups, head_dim]`` against the group's cached keys) and runs SDPA on that (on 2
  CPU threads, 97 cached keys: 16-22 us vs 48-53 us for matmul -> softmax -> matmul at
  batch 8 with 2 groups x 2 heads, 46-51 vs 71-89 us with SmolLM2's 3 x 3; about 1-5% of a
  whole decode step). Same scale as ``DotProductAttention`` and the same boolean mask
  convention (True = masked out).
* The QKV projection's output of a decode step is rotated in one go (the queries and the
  key of each group are adjacent in megatron's fused layout) when RoPE covers the whole
  head and is not interleaved.
* A gated MLP's fused ``linear_fc1`` (TP=1, no bias) runs as two matmuls over the gate
  and up halves of its weight (views): when the weights stream from memory (decode steps)
  two half-width matmuls measured a few percent faster than one, and the activation then
  works in place on contiguous tensors.
* :class:`KVCacheTransformerLayer` (megatron ``TransformerLayer``): in that same inference
  mode, norm -> attention -> residual -> norm -> MLP -> residual written out directly
  (eval: no dropout), and at TP=1 the linears as ``matmul(x, W^T) (+ bias)`` -- the
  arithmetic megatron's ``ColumnParallelLinear``/``RowParallelLinear`` perform at TP=1 --
  without their autograd wrappers. At TP>1 the megatron linear modules are called (their
  all-reduces are needed).

Everything else -- training, forwards without an inference context, dynamic batching,
flash-decode, packed sequences, cross-attention, MLA, sliding windows, non-vanilla
softmax, output gates, fp8, offloading, CUDA graphs -- runs megatron's own code unchanged
(decided per module at construction and per call; a context whose cache one path filled
is refused by the other). q/k layernorm, partial or interleaved RoPE and TP>1 keep the
incremental cache but take the per-tensor route (megatron's ``get_query_key_value_tensors``
and ``apply_rotary_pos_emb`` on the new tokens, SDPA). A query row a mask hides completely
would come out as zeros (prefill) or NaN (decode) instead of megatron's uniform average;
``models.engine.causal_padding_mask`` never produces such rows (a padded query attends
to itself) and a decode query always sees its own key.

A mixture-of-experts MLP (megatron ``MoELayer``, ``model.num_moe_experts``) is per-token, so
the decode layer calls the layer's own ``mlp`` module on the new tokens as it is (router,
token dispatcher, experts: megatron's code, including its collectives at TP > 1); only the
dense MLP is written out.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer

from nemo_rlhf.models.context_parallel import AllGatherCPAttention
from nemo_rlhf.models.lora import has_lora

CACHE_TAG = "bhsd"
"""Second element of this module's ``key_value_memory_dict`` keys: ``(layer_number, tag)``."""

_ROPE_ATTR = "_nemo_rlhf_rope_cos_sin"


def _is_static_eval(module: torch.nn.Module, ctx) -> bool:
    return ctx is not None and not module.training and ctx.is_static_batching()


def _plain_linear(mod: torch.nn.Module, tp1: bool) -> bool:
    """Whether ``mod`` is a megatron local column/row-parallel linear that, at TP=1, is
    exactly ``matmul(x, W^T) (+ bias)``."""
    return (tp1 and type(mod) in (ColumnParallelLinear, RowParallelLinear)
            and not getattr(mod, "is_expert", False)
            and not getattr(mod, "sequence_parallel", False)
            and not getattr(mod, "explicit_expert_comm", False))


def _linear(mod: torch.nn.Module, x: torch.Tensor, plain: bool):
    """``(output, bias or None)`` of a megatron linear, as its forward returns them.

    Args:
        mod: megatron ``ColumnParallelLinear`` / ``RowParallelLinear``.
        x: ``[s, b, in]``.
        plain: :func:`_plain_linear` of ``mod`` (then no autograd wrapper, no collectives).
    """
    if not plain or has_lora(mod):  # the module call runs the adapter's hook
        return mod(x)
    out = torch.matmul(x, mod.weight.t())
    bias = mod.bias
    if bias is None:
        return out, None
    if mod.skip_bias_add:
        return out, bias
    return out + bias, None


def _rope_cos_sin(ctx, freqs: torch.Tensor, s0: int, s1: int, dtype: torch.dtype, mscale: float):
    """cos/sin of ``freqs[s0:s1]`` (``[s, 1, 1, rot_dim]``) as megatron's unfused RoPE
    computes them, cached on ``ctx`` for the current step (every layer reuses them)."""
    key = (id(freqs), s0, s1, dtype, mscale)
    cached = getattr(ctx, _ROPE_ATTR, None)
    if cached is not None and cached[0] == key and cached[1] is freqs:
        return cached[2], cached[3]
    f = freqs[s0:s1]
    cos = (torch.cos(f) * mscale).to(dtype)
    sin = (torch.sin(f) * mscale).to(dtype)
    setattr(ctx, _ROPE_ATTR, (key, freqs, cos, sin))
    return cos, sin


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE over the whole last dim, megatron's arithmetic:
    ``t * cos + rotate_half(t) * sin`` with ``rotate_half(x) = cat(-x2, x1)``."""
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return (t * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


class KVCacheSelfAttention(SelfAttention):
    """megatron ``SelfAttention`` with an incremental static-batching inference path.

    Constructor arguments are those of ``SelfAttention`` (built from a layer spec, see
    :func:`local_layer_spec`). The training forward is the parent's.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.config
        self._fast_inference = (
            # the CP attention too: the incremental path never calls the core attention
            # (a CP model's rollout decodes the whole sequence on every CP rank)
            isinstance(self.core_attention, (DotProductAttention, AllGatherCPAttention))
            and not getattr(cfg, "flash_decode", False)
            and not getattr(cfg, "multi_latent_attention", False)
            and getattr(cfg, "softmax_type", "vanilla") == "vanilla"
            and getattr(cfg, "window_size", None) is None
            and not getattr(cfg, "attention_output_gate", False)
            and not getattr(cfg, "no_rope_freq", None)
            and not getattr(cfg, "apply_query_key_layer_scaling", False)
            and not getattr(cfg, "sequence_parallel", False)
            and (getattr(cfg, "context_parallel_size", 1) == 1
                 or isinstance(self.core_attention, AllGatherCPAttention))
            and not getattr(cfg, "fp8", None)
            and not getattr(cfg, "fp4", None)
        )
        tp1 = cfg.tensor_model_parallel_size == 1
        self._plain_qkv = _plain_linear(self.linear_qkv, tp1)
        self._plain_proj = _plain_linear(self.linear_proj, tp1)
        self._identity_qk_norm = all(
            m is None or isinstance(m, IdentityOp)
            for m in (getattr(self, "q_layernorm", None), getattr(self, "k_layernorm", None)))
        self._fused_rope_ok = not cfg.rotary_interleaved and not cfg.multi_latent_attention
        from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config

        self._mscale = float(_yarn_get_concentration_factor_from_config(cfg))
        self._cache_key = (self.layer_number, CACHE_TAG)

    def uses_incremental_path(self, call_kwargs: dict) -> bool:
        """Whether a forward with these keyword arguments (as megatron passes them to the
        attention or to the layer; absent = None) takes the incremental path."""
        return (self._fast_inference
                and _is_static_eval(self, call_kwargs.get("inference_context"))
                and all(call_kwargs.get(k) is None for k in (
                    "key_value_states", "packed_seq_params", "attention_bias",
                    "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin")))

    def forward(self, hidden_states, attention_mask, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        """megatron's signature; see the module docstring for which path runs.

        Args:
            hidden_states: ``[s, b, hidden]``.
            attention_mask: bool, True = masked out; ``[b or 1, 1, s, offset+s]`` or None
                (None: causal when ``s > 1``, nothing to mask when ``s == 1``).
            inference_context: megatron inference context (the incremental path needs a
                ``StaticInferenceContext`` in eval mode).
            rotary_pos_emb: RoPE frequencies ``[max_seq, 1, 1, rot_dim]`` (or a ``(q, k)``
                pair) as ``GPTModel`` passes them, or None (no RoPE).

        Returns:
            ``(output [s, b, hidden], bias or None)`` as ``linear_proj`` returns them.
        """
        if inference_params is not None and inference_context is None:
            inference_context = inference_params
        ctx = inference_context
        if self.uses_incremental_path(dict(
                inference_context=ctx, key_value_states=key_value_states,
                packed_seq_params=packed_seq_params, attention_bias=attention_bias,
                rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin)):
            return self.incremental_forward(hidden_states, attention_mask, ctx, rotary_pos_emb)
        if ctx is not None and self._cache_key in getattr(ctx, "key_value_memory_dict", {}):
            raise RuntimeError(
                "KVCacheSelfAttention: this inference context's cache was filled by the "
                "incremental path; a call with other arguments cannot continue it")
        return super().forward(
            hidden_states, attention_mask, key_value_states=key_value_states,
            inference_context=ctx, rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
            packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset)

    def _caches(self, ctx, groups: int, head_dim: int, like: torch.Tensor):
        memory = ctx.key_value_memory_dict
        caches = memory.get(self._cache_key)
        if caches is None:
            if self.layer_number in memory:
                raise RuntimeError(
                    "KVCacheSelfAttention: this inference context's cache was filled by "
                    "megatron's own attention path; it cannot be continued incrementally")
            shape = (ctx.max_batch_size, groups, ctx.max_sequence_length, head_dim)
            caches = (torch.empty(shape, dtype=like.dtype, device=like.device),
                      torch.empty(shape, dtype=like.dtype, device=like.device))
            memory[self._cache_key] = caches
        return caches

    def incremental_forward(self, hidden_states: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], ctx,
                            rotary_pos_emb) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Attention over the cached prefix plus ``s`` new tokens; appends their keys and
        values to the cache (the caller advances ``ctx.sequence_len_offset``).

        Args:
            hidden_states: ``[s, b, hidden]`` (the layernormed input of the new tokens).
            attention_mask: bool ``[b or 1, 1, s, offset+s]``, True = masked out, or None.
            ctx: ``StaticInferenceContext``; rows ``batch_size_offset .. +b``, positions
                ``sequence_len_offset .. +s``.
            rotary_pos_emb: ``[>= offset+s, 1, 1, rot_dim]`` frequencies, a ``(q, k)`` pair,
                or None.

        Returns:
            ``(output [s, b, hidden], bias or None)`` of ``linear_proj``.
        """
        s, b = hidden_states.shape[0], hidden_states.shape[1]
        s0 = ctx.sequence_len_offset
        s1 = s0 + s
        b0 = ctx.batch_size_offset
        b1 = b0 + b
        heads = self.num_attention_heads_per_partition
        groups = self.num_query_groups_per_partition
        r = heads // groups
        hn = self.hidden_size_per_attention_head
        if s1 > ctx.max_sequence_length or b1 > ctx.max_batch_size:
            raise RuntimeError(
                f"KVCacheSelfAttention: positions [{s0}, {s1}) x rows [{b0}, {b1}) exceed the "
                f"inference context ({ctx.max_sequence_length} x {ctx.max_batch_size})")
        k_cache, v_cache = self._caches(ctx, groups, hn, hidden_states)

        q_emb = k_emb = rotary_pos_emb
        if isinstance(rotary_pos_emb, tuple):
            q_emb, k_emb = rotary_pos_emb
        fused = (s == 1 and self._plain_qkv and self._identity_qk_norm and self._fused_rope_ok
                 and q_emb is k_emb and (q_emb is None or q_emb.shape[-1] == hn))
        if fused:
            # One decode token: rotate the queries and the key of every group in one go on
            # the fused QKV output [1, b, groups, r + 2, hn] (r query heads, key, value).
            mixed, _ = _linear(self.linear_qkv, hidden_states, True)
            mixed = mixed.view(b, groups, r + 2, hn)
            qk = mixed[:, :, :r + 1]
            if q_emb is not None:
                cos, sin = _rope_cos_sin(ctx, q_emb, s0, s1, qk.dtype, self._mscale)
                qk = _rotate(qk, cos.view(1, 1, 1, hn), sin.view(1, 1, 1, hn))
            k_cache[b0:b1, :, s0] = qk[:, :, r]
            v_cache[b0:b1, :, s0] = mixed[:, :, r + 1]
            query = qk[:, :, :r]  # [b, groups, r, hn]: a group's heads as query positions
        else:
            query, key, value = self.get_query_key_value_tensors(hidden_states, None)
            # query [s, b, heads, hn]; key, value [s, b, groups, hn]
            if q_emb is not None:
                from megatron.core.models.common.embeddings.rope_utils import (
                    apply_rotary_pos_emb,
                )

                query = apply_rotary_pos_emb(query, q_emb[s0:s1], config=self.config,
                                             mscale=self._mscale, cp_group=self.pg_collection.cp)
                key = apply_rotary_pos_emb(key, k_emb[s0:s1], config=self.config,
                                           mscale=self._mscale, cp_group=self.pg_collection.cp)
            k_cache[b0:b1, :, s0:s1] = key.permute(1, 2, 0, 3)
            v_cache[b0:b1, :, s0:s1] = value.permute(1, 2, 0, 3)
            query = query.permute(1, 2, 0, 3)  # [b, heads, s, hn]
        keys = k_cache[b0:b1, :, :s1]  # [b, groups, s1, hn], strided views
        values = v_cache[b0:b1, :, :s1]

        scale = self.core_attention.softmax_scale
        if fused:
            # A group's r query heads as r query positions against its cached keys: one
            # SDPA call over (b, groups) on strided cache views, no GQA copies.
            # attention_mask: [b or 1, 1, 1, s1], True = masked out (SDPA: True = attend).
            context = F.scaled_dot_product_attention(
                query, keys, values, scale=scale,
                attn_mask=None if attention_mask is None else ~attention_mask)
            # [b, groups, r, hn] -> [1, b, heads * hn]
            return _linear(self.linear_proj, context.reshape(1, b, heads * hn),
                           self._plain_proj)

        mask, causal = None, False
        if attention_mask is not None:
            mask = ~attention_mask  # SDPA: True = may attend
        elif s > 1:
            if s0 == 0:
                causal = True
            else:
                mask = (torch.arange(s1, device=hidden_states.device).unsqueeze(0)
                        <= torch.arange(s0, s1, device=hidden_states.device).unsqueeze(1))
        context = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=heads != groups)
        # [b, heads, s, hn] -> [s, b, heads * hn]
        context = context.permute(2, 0, 1, 3).reshape(s, b, heads * hn)
        return _linear(self.linear_proj, context, self._plain_proj)


class KVCacheTransformerLayer(TransformerLayer):
    """megatron ``TransformerLayer`` whose static-batching inference forward (eval mode,
    :class:`KVCacheSelfAttention`, dense or MoE MLP) is written out without megatron's per-op
    machinery (a MoE MLP is megatron's module, called on the new tokens). Constructor
    arguments are those of ``TransformerLayer``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.config
        tp1 = cfg.tensor_model_parallel_size == 1
        self._lean = (
            isinstance(self.self_attention, KVCacheSelfAttention)
            and self.self_attention._fast_inference
            and isinstance(self.cross_attention, IdentityOp)
            and isinstance(self.pre_cross_attn_layernorm, IdentityOp)
            and (type(self.mlp) is MLP or isinstance(self.mlp, MoELayer))
            # (megatron's selective recompute flags are not checked: the incremental path
            # runs only under an inference context, without autograd, where recomputing
            # a module in the backward has nothing to change)
            and not getattr(cfg, "inference_fuse_tp_communication", False)
            and not getattr(cfg, "use_te_activation_func", False)
            and not getattr(cfg, "bias_activation_fusion", False)
            and getattr(cfg, "activation_func_clamp_value", None) is None
            and not getattr(cfg, "cpu_offloading", False)
            and not getattr(cfg, "fine_grained_activation_offloading", False)
            and not getattr(cfg, "fp8", None)
            and not getattr(cfg, "fp4", None)
        )
        self._moe = isinstance(self.mlp, MoELayer)
        if self._lean and not self._moe:
            self._plain_fc1 = _plain_linear(self.mlp.linear_fc1, tp1)
            self._plain_fc2 = _plain_linear(self.mlp.linear_fc2, tp1)

    def forward(self, *args, **kwargs):
        """megatron's signature (``hidden_states [s, b, hidden]`` and keywords); returns
        ``(hidden_states [s, b, hidden], context)``."""
        ctx = kwargs.get("inference_context")
        if (self._lean and not args and kwargs.get("context") is None
                and kwargs.get("padding_mask") is None
                and self.self_attention.uses_incremental_path(kwargs)):
            return self._incremental_forward(kwargs["hidden_states"],
                                             kwargs.get("attention_mask"), ctx,
                                             kwargs.get("rotary_pos_emb")), None
        return super().forward(*args, **kwargs)

    def _incremental_forward(self, hidden_states, attention_mask, ctx, rotary_pos_emb):
        """``[s, b, hidden] -> [s, b, hidden]``: the eval-mode layer (dropout is identity),
        residual adds in megatron's order (``residual + (x + bias)``)."""
        x = self.input_layernorm(hidden_states)
        out, bias = self.self_attention.incremental_forward(x, attention_mask, ctx,
                                                            rotary_pos_emb)
        if bias is not None:
            out = out + bias
        hidden_states = out.add_(hidden_states)  # out is this layer's own fresh tensor
        x = self.pre_mlp_layernorm(hidden_states)
        out, bias = self.mlp(x) if self._moe else self._mlp(x)
        if bias is not None:
            out = out + bias
        return out.add_(hidden_states)

    def _mlp(self, x: torch.Tensor):
        """megatron ``MLP.forward`` without fusions (``bias_activation_fusion=False``)."""
        mlp, cfg = self.mlp, self.config
        fc1 = mlp.linear_fc1
        if cfg.gated_linear_unit and self._plain_fc1 and fc1.bias is None and not has_lora(fc1):
            # Two half-width matmuls (gate rows, up rows: views of the fused weight): when
            # the weights stream from memory (decode) they measured a few percent faster
            # on CPU than one, and the activation then runs on contiguous tensors, in place.
            half = fc1.weight.shape[0] // 2
            x_glu = torch.matmul(x, fc1.weight[:half].t())
            x_linear = torch.matmul(x, fc1.weight[half:].t())
            if cfg.glu_linear_offset:
                x_linear = x_linear + cfg.glu_linear_offset
            if cfg.activation_func is F.silu:
                y = F.silu(x_glu, inplace=True).mul_(x_linear)
            else:
                y = cfg.activation_func(x_glu) * x_linear
            return _linear(mlp.linear_fc2, y, self._plain_fc2)
        y, bias = _linear(fc1, x, self._plain_fc1)
        if bias is not None:
            y = y + bias
        if cfg.gated_linear_unit:
            x_glu, x_linear = torch.chunk(y, 2, dim=-1)
            if cfg.glu_linear_offset:
                x_linear = x_linear + cfg.glu_linear_offset
            y = cfg.activation_func(x_glu) * x_linear
        else:
            y = mlp.activation_func(y)
        return _linear(mlp.linear_fc2, y, self._plain_fc2)


class _OneRankGroup:
    """Stands in for a process group of one rank (``size() == 1``): megatron's size check
    and its TP reductions of the router's token counts, which skip a one-rank group."""

    @staticmethod
    def size() -> int:
        return 1


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class TensorParallelMoELayer(MoELayer):
    """megatron's ``MoELayer``, trainable at TP > 1 without sequence parallelism.

    megatron-core 0.16.1's ``MoELayer.forward`` raises in training mode when the attention's
    TP group has more than one rank and ``sequence_parallel`` is off ("performance may
    degrade"). Without sequence parallelism every TP rank holds the same tokens; the
    ``allgather`` dispatcher gathers them over the TP x EP group, so each token arrives
    ``T`` times (``T`` = the expert tensor-parallel size, TP here), each rank runs its TP
    shard of the experts on all of them, and the combine's reduce-scatter sums the shards'
    partial outputs and hands each rank its own copy's rows. The forward is exact (TP=2's
    logits are TP=1's); in the backward every copy's loss reaches the shared expert shards,
    so the expert weights' gradients come out ``T`` times too large (the inputs' and the
    router's are right: each copy's gradient flows only from its own rank's loss). This
    layer skips megatron's check (``attn_tp_group`` is read nowhere else in megatron's
    MoE layer) and, in exactly that case, scales the gradient entering the experts' backward
    by ``1 / T`` and the gradients leaving it (to the tokens and the routing probabilities)
    by ``T``: the expert weights get the true gradient, everything else what it got (exact
    for ``T`` a power of 2). The router losses (``model.moe_aux_loss_coeff`` /
    ``moe_z_loss_coeff``) are reduced over the router's TP group in megatron, which assumes
    each TP rank holds a sequence-parallel shard of the tokens and divides by ``T``; here
    every rank holds them all, so in that same case the router sees a one-rank group and
    each rank computes the whole loss (its gradient is not summed over TP: the router and the
    hidden states are replicated). Otherwise it is megatron's layer, with the same parameters and
    checkpoint names. Costs ``T x`` the expert activations that sequence parallelism would
    save. ``tests/distributed/test_expert_parallel.py`` checks two PPO steps at TP = 2
    against TP = 1 and resumes an EP = 2 checkpoint at TP = 2.
    """

    _copies = 1  # how often each token reaches the experts in the current forward

    def forward(self, hidden_states, *args, **kwargs):
        """megatron's ``MoELayer.forward`` (same arguments and result)."""
        if not (self.training and not self.config.sequence_parallel and self.attn_tp_group.size() > 1):
            return super().forward(hidden_states, *args, **kwargs)
        group, self.attn_tp_group = self.attn_tp_group, _OneRankGroup()
        router_group, self.router.tp_cp_group = self.router.tp_cp_group, _OneRankGroup()
        self._copies = self.token_dispatcher.tp_size
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self.attn_tp_group = group
            self.router.tp_cp_group = router_group
            self._copies = 1

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """megatron's, with the expert gradients' ``1 / copies`` (the class docstring)."""
        copies = self._copies
        if copies == 1:
            return super().routed_experts_compute(hidden_states, probs)
        hidden_states = _ScaleGrad.apply(hidden_states, float(copies))
        probs = _ScaleGrad.apply(probs, float(copies))
        output, mlp_bias = super().routed_experts_compute(hidden_states, probs)
        return _ScaleGrad.apply(output, 1.0 / copies), mlp_bias


def local_layer_spec(normalization: Optional[str] = None, qk_layernorm: bool = False,
                     num_experts: Optional[int] = None, context_parallel: bool = False):
    """megatron's local GPT layer spec with :class:`KVCacheTransformerLayer` and
    :class:`KVCacheSelfAttention` swapped in.

    Same submodules, parameters and state-dict keys as
    ``get_gpt_layer_local_spec(normalization=..., qk_layernorm=..., num_experts=...)``; only
    the two classes differ (with ``qk_layernorm`` the decode takes the per-tensor route, which
    applies the query / key norms as megatron's ``get_query_key_value_tensors`` does). With
    ``num_experts`` the MLP is megatron's ``MoELayer`` with ``SequentialMLP`` experts (no
    grouped GEMM: that needs CUDA kernels), as
    :class:`TensorParallelMoELayer` (trainable at TP > 1). With ``context_parallel`` the
    core attention is :class:`nemo_rlhf.models.context_parallel.AllGatherCPAttention`
    (megatron's local ``DotProductAttention`` refuses CP > 1).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm,
                                    num_experts=num_experts, moe_grouped_gemm=False)
    if spec.module is TransformerLayer:
        spec.module = KVCacheTransformerLayer
    attn = spec.submodules.self_attention
    if attn.module is SelfAttention:
        attn.module = KVCacheSelfAttention
    if context_parallel:
        attn.submodules.core_attention = AllGatherCPAttention
    if num_experts is not None and spec.submodules.mlp.module is MoELayer:
        spec.submodules.mlp.module = TensorParallelMoELayer  # trains at TP > 1 (its docstring)
    return spec
