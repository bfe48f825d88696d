"""Context parallelism (CP) on the local layer spec: sequences split across ranks.

Why: megatron-core 0.16.1's CP attention is transformer-engine's
(``TEDotProductAttention``); its local ``DotProductAttention`` asserts
``context_parallel_size == 1``, and this project runs the local spec on every device
(:func:`nemo_rlhf.models.actor_critic._layer_spec`). This module is the smallest CP for
that spec, on gloo and on NCCL alike.

Layout: megatron's load-balanced chunking. A sequence of ``S`` tokens is cut into
``2 * cp`` chunks of ``S / (2 cp)``; CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``
(:func:`cp_positions`), so under a causal mask every rank does the same attention work.
It is the layout megatron's RoPE already slices its frequencies by
(``rope_utils.get_pos_emb_on_this_cp_rank``, read from the CP group in ``parallel_state``),
so rotary positions are global with no change to megatron's code; learned absolute
positions come from the sharded ``position_ids``.

Attention: :class:`AllGatherCPAttention` is the "all-gather CP" of the Llama 3 paper
(Dubey et al. 2024, sec. 3.3.2): each rank all-gathers the keys and values of the whole
sequence over the CP group, puts them in global order and attends its local queries to
them under a mask of global positions. The gather's backward is a reduce-scatter: every
rank's gradient of the gathered keys/values is summed and each rank keeps its own chunks
(:class:`_GatherSequence`; on host tensors, where gloo has no reduce-scatter, an
all-reduce followed by the rank's slice -- the same sums).

Log-probs: the target of position ``t`` is token ``t + 1``; the target of a chunk's last
token lives on the next chunk. Every rank holds the whole ``input_ids`` (integers, tiny
next to the activations), so the targets are shifted globally first and then sharded like
the inputs (:func:`cp_next_token_targets`), as megatron's ``get_batch_on_this_cp_rank``
shards labels. The last global position has no target (masked).

Losses: per-token terms are computed on the local chunk; a token-mean divides by the
global count of valid tokens summed over the CP and DP groups
(:func:`cp_global_token_count`); the parameter gradients are then summed over CP (and DP),
which megatron's DDP does over its data-parallel-with-CP group.

The PPO trainer (padded micro-batches, docs/parallelism.md) uses the response-level
helpers: :func:`cp_response_index` / :func:`shard_response` put the ``[B, R]`` per-response
tensors on a rank's positions, :func:`cp_token_logprobs` gives its log-probs and entropy,
:func:`gather_response` brings per-position outputs back to ``[B, R]`` on every CP rank,
:func:`pad_to_cp_multiple` pads a micro-batch's columns to ``2 cp``.

Simplified: packing, the fused output-layer log-probs, TP/PP with CP and the SFT / RM jobs
are not wired for CP (refused by the key). The memory of the gathered keys/values is
``O(S)`` per rank, as in Llama 3's all-gather CP (the scores are ``[S/cp, S]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule

from nemo_rlhf.models.logprobs import ResponseLogprobs, fused_logprobs_of_positions
from nemo_rlhf.models.vocab_parallel import vocab_parallel_logprobs


def cp_positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions held by CP rank ``cp_rank``: chunks ``cp_rank`` and
    ``2 cp - 1 - cp_rank`` of ``2 cp`` equal chunks (megatron's load-balanced layout).

    Args:
        seq_len: ``S``, divisible by ``2 * cp``.
        cp: the CP size (>= 1); ``cp == 1`` gives ``arange(S)``.
        cp_rank: in ``[0, cp)``.
        device: where the index tensor is made (``dims.device`` when it meets model tensors).

    Returns:
        ``[S / cp]`` int64, increasing.

    Raises:
        ValueError: ``S`` not divisible by ``2 * parallel.context_parallel_size``.
    """
    if cp == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 * parallel.context_parallel_size = "
            f"{2 * cp} (load-balanced CP chunks); pad the sequences to a multiple of {2 * cp}")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c, device=device)])


def _gathered_order(local_len: int, cp: int, device) -> torch.Tensor:
    """Permutation putting an all-gather of every rank's local positions (rank order) in
    global order: ``gathered[perm]`` is position 0, 1, ..., S-1."""
    seq_len = local_len * cp
    held = torch.cat([cp_positions(seq_len, cp, r, device) for r in range(cp)])
    return torch.argsort(held)


def shard_sequence(t: torch.Tensor, dims, dim: int = 1) -> torch.Tensor:
    """This CP rank's positions of ``t`` along ``dim`` (:func:`cp_positions`); ``t`` itself
    at CP 1.

    Args:
        t: any tensor whose ``dim`` is the global sequence (``[B, S]`` ids, masks, targets).
        dims: :class:`~nemo_rlhf.distributed.ParallelDims` (``cp``, ``cp_rank``).
        dim: the sequence dimension.

    Raises:
        ValueError: as :func:`cp_positions`.
    """
    if dims.cp == 1:
        return t
    return t.index_select(dim, cp_positions(t.shape[dim], dims.cp, dims.cp_rank, t.device))


class _GatherSequence(torch.autograd.Function):
    """All-gather ``[s_local, ...]`` over the CP group into ``[cp * s_local, ...]`` (rank
    order); backward: the sum over ranks of the gradient, each rank keeping its slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = group.size()
        out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        n, rank = group.size(), group.rank()
        grad = grad.contiguous()
        if grad.is_cuda:  # NCCL
            out = grad.new_empty((grad.shape[0] // n,) + tuple(grad.shape[1:]))
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        total = grad.clone()  # gloo has no reduce-scatter: all-reduce, keep this rank's slice
        dist.all_reduce(total, group=group)
        return total.narrow(0, rank * (grad.shape[0] // n), grad.shape[0] // n).contiguous(), None


def gather_sequence(x: torch.Tensor, dims, dim: int = 0) -> torch.Tensor:
    """All-gather a CP-sharded tensor into the global sequence order (differentiable:
    backward is a reduce-scatter).

    Args:
        x: this rank's ``[..., S/cp, ...]`` along ``dim`` (its :func:`cp_positions`).
        dims: ``ParallelDims`` (``cp``, ``cp_group``).
        dim: the sequence dimension.

    Returns:
        ``[..., S, ...]`` in global position order; ``x`` at CP 1.
    """
    if dims.cp == 1:
        return x
    return _gather_global(x, dims.cp_group, dim)


def _gather_global(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    cp = group.size()
    moved = x.movedim(dim, 0)
    gathered = _GatherSequence.apply(moved, group)
    perm = _gathered_order(moved.shape[0], cp, x.device)
    return gathered.index_select(0, perm).movedim(0, dim)


class AllGatherCPAttention(MegatronModule):
    """Core attention of the local spec under context parallelism (all-gather K/V).

    Same constructor as megatron's ``DotProductAttention`` (built from a layer spec); same
    arithmetic (scale ``1/sqrt(head_dim)`` unless ``softmax_scale``, fp32 softmax when
    ``config.attention_softmax_in_fp32``, GQA by repeating the key/value groups, dropout in
    the TP RNG tracker), with the keys and values of the whole sequence.

    Forward shapes (megatron's): ``query [s, b, heads/tp, d]``, ``key``/``value``
    ``[s, b, groups/tp, d]`` for this rank's ``s = S/cp`` positions (:func:`cp_positions`);
    ``attention_mask`` bool (True = masked out) ``[b or 1, 1, s, S]`` -- rows this rank's
    queries, columns all keys in global order -- or None (causal by global position; a
    given mask is combined with the causal one). A mask marked
    ``_cp_keys_in_rank_order`` (a packed batch's,
    :func:`nemo_rlhf.models.cp_packing.cp_packed_inputs`) is taken as it is: its columns
    are the keys in the all-gather's rank order and it is already causal within each
    sequence. Returns ``[s, b, heads/tp * d]``.

    Raises:
        ValueError: packed sequences or an attention bias (not supported here).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        from megatron.core import parallel_state as ps

        self.layer_number = max(1, layer_number)
        tp = config.tensor_model_parallel_size
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
        if config.apply_query_key_layer_scaling:
            raise ValueError("AllGatherCPAttention: apply_query_key_layer_scaling is not supported")
        self.cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") \
            else ps.get_context_parallel_group()
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.attention_dropout = torch.nn.Dropout(p)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """See the class docstring."""
        from megatron.core import tensor_parallel

        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("AllGatherCPAttention: packed sequences and attention bias are not "
                             "supported under parallel.context_parallel_size > 1")
        s, b = query.shape[0], query.shape[1]
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        # a packed batch's mask (nemo_rlhf.models.cp_packing): keys in rank order, complete
        as_given = attention_mask is not None and getattr(attention_mask, "_cp_keys_in_rank_order", False)
        gather = (lambda t: _GatherSequence.apply(t, self.cp_group)) if as_given else \
            (lambda t: _gather_global(t, self.cp_group, 0))
        key, value = gather(key), gather(value)           # [S, b, g, d]
        S = key.shape[0]
        if self.heads // self.groups > 1:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        q = query.permute(1, 2, 0, 3)                     # [b, h, s, d]
        k = key.permute(1, 2, 3, 0)                       # [b, h, d, S]
        scores = torch.matmul(q, k) * self.softmax_scale  # [b, h, s, S]
        if as_given:
            masked = attention_mask.bool()
        else:
            q_pos = cp_positions(S, cp, rank, query.device)
            masked = torch.arange(S, device=query.device).unsqueeze(0) > q_pos.unsqueeze(1)  # [s, S]
            masked = masked.view(1, 1, s, S)
            if attention_mask is not None:
                masked = masked | attention_mask.bool()
        if self.config.attention_softmax_in_fp32:
            scores = scores.float()
        scores = scores.masked_fill(masked, -10000.0)    # megatron's masked-fill value
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        if self.training and self.attention_dropout.p > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        ctx = torch.matmul(probs, value.permute(1, 2, 0, 3))  # [b, h, s, d]
        return ctx.permute(2, 0, 1, 3).reshape(s, b, -1)


def cp_next_token_targets(input_ids: torch.Tensor, dims) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token targets of this CP rank's positions, shifted globally before sharding.

    Args:
        input_ids: ``[B, S]`` int64, the whole (unsharded) sequences.
        dims: ``ParallelDims``.

    Returns:
        ``(targets [B, S/cp] int64, has_target [B, S/cp] bool)``: position ``t``'s target
        is ``input_ids[:, t+1]``; the global last position has none (target 0, False).
    """
    B, S = input_ids.shape
    targets = torch.cat([input_ids[:, 1:], input_ids.new_zeros(B, 1)], dim=1)
    has = torch.ones(B, S, dtype=torch.bool, device=input_ids.device)
    has[:, -1] = False
    return shard_sequence(targets, dims), shard_sequence(has, dims)


def cp_global_token_count(mask: torch.Tensor, dims) -> torch.Tensor:
    """The number of True entries of ``mask`` summed over this rank's CP and DP groups
    (the denominator of a token-mean loss under CP).

    Args:
        mask: this rank's local ``[B, S/cp]`` bool/int mask, on ``dims.device``.
        dims: ``ParallelDims``.

    Returns:
        0-d float32 on ``mask``'s device.
    """
    count = mask.bool().sum().to(torch.float32)
    for group, size in ((getattr(dims, "cp_group", None), dims.cp), (dims.dp_group, dims.dp)):
        if size > 1:
            dist.all_reduce(count, group=group)
    return count


def cp_response_index(seq_len: int, prompt_length: int, response_length: int, dims,
                      device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which response token each of this CP rank's positions predicts.

    Position ``t`` predicts token ``t + 1`` (:func:`nemo_rlhf.models.logprobs.response_slice`):
    response token ``j`` (column ``P + j``) is predicted at ``P - 1 + j``.

    Args:
        seq_len: ``S`` of the (padded) ``[B, S]`` micro-batch, divisible by ``2 cp``.
        prompt_length: ``P`` (>= 1).
        response_length: ``R`` of the ``[B, R]`` per-response-token tensors (``<= S - P``;
            columns past ``P + R`` are the micro-batch's CP padding).
        dims: ``ParallelDims`` (``cp``, ``cp_rank``).
        device: ``dims.device``.

    Returns:
        ``(index [S/cp] int64 in [0, R), valid [S/cp] bool)``: this rank's position ``i``
        predicts response token ``index[i]`` where ``valid[i]`` (elsewhere a prompt
        position, the last position or padding; ``index`` is clamped there).

    Raises:
        ValueError: as :func:`cp_positions`.
    """
    j = cp_positions(seq_len, dims.cp, dims.cp_rank, device) - (prompt_length - 1)
    valid = (j >= 0) & (j < response_length)
    return j.clamp(0, max(response_length - 1, 0)), valid


def shard_response(t: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A per-response-token tensor on this CP rank's positions (:func:`cp_response_index`).

    Args:
        t: ``[B, R]`` (log-probs, advantages, masks, ...).
        index / valid: :func:`cp_response_index`'s.

    Returns:
        ``[B, S/cp]`` of ``t``'s dtype: ``t[:, index]`` where ``valid``, 0 (False) elsewhere.
    """
    picked = t.index_select(1, index)
    return torch.where(valid.unsqueeze(0), picked, torch.zeros((), dtype=t.dtype, device=t.device))


def cp_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, dims, temperature: float,
                      vocab_size: Optional[int] = None, compute_entropy: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs and entropy of this CP rank's positions (targets shifted
    globally, :func:`cp_next_token_targets`), from its TP-sharded logits.

    Args:
        logits: ``[B, S/cp, padded_vocab/tp]`` of :func:`nemo_rlhf.models.engine.model_forward` under CP (differentiable),
            or the fused output layer's :class:`~nemo_rlhf.models.logprobs.ResponseLogprobs`
            of this rank's positions (:func:`cp_fused_logprobs`: its values are returned).
        input_ids: ``[B, S]`` int64, the whole sequences.
        dims: ``ParallelDims`` (CP and TP groups).
        temperature: > 0, as :func:`nemo_rlhf.models.vocab_parallel.vocab_parallel_logprobs`.
        vocab_size: the real vocabulary (padded rows out of the softmax).
        compute_entropy: also the entropy (else zeros).

    Returns:
        ``(logprobs [B, S/cp] float32, entropy [B, S/cp] float32)``, unmasked (the global
        last position's target is a placeholder: mask it with :func:`cp_response_index`).
    """
    if isinstance(logits, ResponseLogprobs):  # the fused output layer's (cp_fused_logprobs)
        if temperature not in logits.logprobs:
            raise ValueError(f"cp_token_logprobs: the forward computed temperatures {sorted(logits.logprobs)}, "
                             f"not {temperature}")
        lp = logits.logprobs[temperature]
        return lp, logits.entropy if compute_entropy else torch.zeros_like(lp)
    targets, _ = cp_next_token_targets(input_ids, dims)
    return vocab_parallel_logprobs(logits, targets, dims.tp_group, dims.tp_rank, temperature=temperature,
                                   vocab_size=vocab_size, compute_entropy=compute_entropy)


def gather_response(local: torch.Tensor, prompt_length: int, response_length: int, dims) -> torch.Tensor:
    """Per-position outputs of this CP rank's positions back to the ``[B, R]`` response
    layout on every CP rank (an all-gather, :func:`gather_sequence`).

    Args:
        local: ``[B, S/cp]`` (log-probs or values of :func:`cp_token_logprobs` / the value
            head, one per position).
        prompt_length / response_length: ``P`` and ``R`` (``P + R <= S``).

    Returns:
        ``[B, R]``: column ``j`` is the output at position ``P - 1 + j``.
    """
    full = gather_sequence(local, dims, dim=1)
    return full[:, prompt_length - 1:prompt_length - 1 + response_length]


@dataclass(frozen=True)
class CPLogprobRequest:
    """A :class:`~nemo_rlhf.models.logprobs.LogprobRequest` for this CP rank's positions
    (built by :func:`nemo_rlhf.models.engine.model_forward` under context parallelism):
    the last stage returns the fused output layer's log-probs of its positions
    (:func:`cp_fused_logprobs`) in place of the ``[B, S/cp, V/tp]`` logits."""

    request: object
    """The :class:`~nemo_rlhf.models.logprobs.LogprobRequest` (temperatures, vocabulary,
    chunk size, entropy; its ``prompt_length`` is the micro-batch's)."""
    targets: torch.Tensor
    """``[B, S/cp]`` int64: each local position's next token (:func:`cp_next_token_targets`)."""
    select: torch.Tensor
    """``[n]`` int64 flat indices into ``[B * S/cp]``: the local positions that predict a
    response token (global position ``>= P - 1`` with a target); only these go through the
    output layer."""


def cp_logprob_request(request, input_ids: torch.Tensor, cp: int, cp_rank: int) -> CPLogprobRequest:
    """:class:`CPLogprobRequest` of CP rank ``cp_rank`` for ``[B, S]`` ``input_ids``."""
    dims = _CPDims(cp, cp_rank)
    targets, has = cp_next_token_targets(input_ids, dims)
    pos = cp_positions(input_ids.shape[1], cp, cp_rank, input_ids.device)
    wanted = has & (pos >= request.prompt_length - 1).unsqueeze(0)
    return CPLogprobRequest(request, targets, wanted.reshape(-1).nonzero().squeeze(1))


@dataclass(frozen=True)
class _CPDims:
    cp: int
    cp_rank: int


def cp_fused_logprobs(hidden_states: torch.Tensor, weight: torch.Tensor, cp_request: CPLogprobRequest,
                      tp_group):
    """The fused, chunked output layer's log-probs of this CP rank's positions (the CP
    twin of :func:`nemo_rlhf.models.logprobs.fused_response_logprobs`).

    Args:
        hidden_states: ``[S/cp, B, hidden]`` after the final norm.
        weight: ``[padded_vocab/tp, hidden]`` the output layer's (or tied embedding's).
        cp_request: :class:`CPLogprobRequest`.
        tp_group: the output layer's TP group (the hidden states' gradient is summed over
            it, as a column-parallel linear does).

    Returns:
        :class:`~nemo_rlhf.models.logprobs.ResponseLogprobs` whose tensors are ``[B, S/cp]``
        float32 in this rank's position order (0 where not selected), as
        :func:`cp_token_logprobs` returns them.
    """
    s, B, H = hidden_states.shape
    h = hidden_states.transpose(0, 1).reshape(B * s, H)
    return fused_logprobs_of_positions(h, weight, cp_request.targets.reshape(B * s), (B, s), cp_request.request,
                                       tp_group, cp_request.select)


def pad_to_cp_multiple(t: torch.Tensor, cp: int, value: int = 0) -> torch.Tensor:
    """``t`` ``[B, S]`` right-padded with ``value`` to the next multiple of ``2 cp`` columns
    (megatron's load-balanced chunks); ``t`` itself when ``S`` already is one or ``cp == 1``.
    Pad ``input_ids`` with any id and ``attention_mask`` with 0: the padding is masked."""
    extra = (-t.shape[1]) % (2 * cp) if cp > 1 else 0
    if not extra:
        return t
    return torch.cat([t, t.new_full((t.shape[0], extra), value)], dim=1)


def cp_routes(routes: torch.Tensor, seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """A MoE micro-batch's routing-replay routes (``moe.routing_replay``) cut to this CP
    rank's positions, exactly as its ``input_ids`` are (:func:`cp_positions`).

    Args:
        routes: ``[B, S0, L, k]`` int64 expert ids of the micro-batch's columns
            (:class:`~nemo_rlhf.models.routing_replay.RoutingReplay`), ``S0 <= seq_len``: the
            columns before the CP padding (:func:`pad_to_cp_multiple`).
        seq_len: ``S``, the padded ``input_ids``' columns (a multiple of ``2 cp``).
        cp / cp_rank: the CP size and this rank.

    Returns:
        ``[B, S / cp, L, k]``: the padding columns ``-1`` (the router's own choice; padded
        positions are masked out of the loss and the router's counts).

    Raises:
        ValueError: ``S0 > seq_len``; ``seq_len`` not divisible by ``2 cp``.
    """
    extra = seq_len - routes.shape[1]
    if extra < 0:
        raise ValueError(f"routing replay under parallel.context_parallel_size={cp}: the routes "
                         f"cover {routes.shape[1]} columns, the micro-batch {seq_len}")
    if extra:
        routes = torch.cat([routes, routes.new_full((routes.shape[0], extra, *routes.shape[2:]), -1)], dim=1)
    return routes.index_select(1, cp_positions(seq_len, cp, cp_rank, routes.device))


def refuse_context_parallel(parallel, job: str) -> None:
    """Refuse ``parallel.context_parallel_size`` > 1 in a job it is not wired into (the SFT
    and RM trainers, the RM server, evaluate: their micro-batches do not shard sequences
    yet; the PPO trainer's own check is
    :func:`nemo_rlhf.trainers.ppo.context_parallel.check_context_parallel`).

    Raises:
        ValueError: naming the key, its value, the job and the value that works.
    """
    cp = getattr(parallel, "context_parallel_size", 1)
    if cp > 1:
        raise ValueError(
            f"parallel.context_parallel_size={cp} in the {job}: context parallelism is not "
            f"wired into the {job} yet (model, log-prob and loss level only: "
            f"nemo_rlhf.models.context_parallel, docs/parallelism.md); set "
            f"parallel.context_parallel_size=1")
