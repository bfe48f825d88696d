"""Log-probs and entropy of chosen tokens from vocab-parallel (TP-sharded) logits.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. The log-prob
of a token and the entropy of the distribution are computed in fp32 without gathering the
full vocabulary on any rank: the max and the sum of exponentials are all-reduced across
the TP group (max, then sum), and the target logit is picked by the rank that owns it
(sum all-reduce). This is the same decomposition as megatron-core's
``_VocabParallelCrossEntropy``, extended with the entropy and its gradient.

Memory: the forward keeps one fp32 ``[batch, seq, vocab/tp]`` buffer (the shifted,
temperature-scaled logits) for the backward; the backward needs two more. The naive path
(gather + ``log_softmax`` + autograd) holds several full-vocabulary copies; see
``benchmarks/bench_vocab_parallel_logprobs.py`` for the measured ratio.

Temperature is applied exactly as the sampler applies it: ``logits / temperature`` before
the softmax. Padded vocabulary rows (ids >= ``vocab_size``) are excluded from the softmax.
:func:`chunked_linear_logprobs` fuses the output layer in: it takes the hidden states and
the output weight and never holds more than a chunk of tokens' logits (forward and
backward), so the ``[tokens, vocab]`` logits of a micro-batch never exist at once.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nemo_rlhf.distributed.split import chunk_slices

_NEG = -1e30  # finite "minus infinity": keeps p * logp = 0 instead of NaN on masked rows


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _mask_padded_rows(z: torch.Tensor, vocab_start: int, vocab_size) -> None:
    """Give this shard's padded vocabulary rows (ids >= ``vocab_size``) a finite minus
    infinity, in place."""
    if vocab_size is not None and vocab_start + z.shape[-1] > vocab_size:
        z[..., max(vocab_size - vocab_start, 0):] = _NEG


def _target_index(target: torch.Tensor, vocab_start: int, v_local: int):
    """``(local, in_range)``: each target's index in this shard (0 where another rank owns
    it) and whether this rank owns it."""
    local = target - vocab_start
    in_range = (local >= 0) & (local < v_local)
    return torch.where(in_range, local, torch.zeros_like(local)), in_range


def _softmax_stats(z: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_size, tp_group,
                   compute_entropy: bool):
    """Log-probs of ``target`` and the entropy from one rank's temperature-scaled fp32
    logits ``z`` ``[..., v_local]``, which are modified in place: padded rows (ids >=
    ``vocab_size``) masked, then shifted by the global (TP) max.

    Returns ``(lse, logprobs, entropy, local, in_range)``: ``lse`` the log-sum-exp of the
    *shifted* logits, ``local`` / ``in_range`` the target's index in this shard and whether
    this rank owns it. Three (four with the entropy) all-reduces of ``[...]`` scalars.
    """
    _mask_padded_rows(z, vocab_start, vocab_size)
    zmax = z.max(dim=-1).values
    _all_reduce(zmax, dist.ReduceOp.MAX, tp_group)
    z.sub_(zmax.unsqueeze(-1))
    e = torch.exp(z)
    sumexp = e.sum(dim=-1)
    _all_reduce(sumexp, dist.ReduceOp.SUM, tp_group)
    lse = torch.log(sumexp)  # of the shifted logits
    local, in_range = _target_index(target, vocab_start, z.shape[-1])
    z_t = torch.where(in_range, z.gather(-1, local.unsqueeze(-1)).squeeze(-1),
                      torch.zeros((), dtype=z.dtype, device=z.device))
    _all_reduce(z_t, dist.ReduceOp.SUM, tp_group)
    logprobs = z_t - lse
    if compute_entropy:
        e.div_(sumexp.unsqueeze(-1))  # softmax, in place
        sum_pz = e.mul_(z).sum(dim=-1)  # in place: e is not needed after this
        _all_reduce(sum_pz, dist.ReduceOp.SUM, tp_group)
        entropy = lse - sum_pz
    else:
        entropy = torch.zeros_like(logprobs)
    return lse, logprobs, entropy, local, in_range, zmax


def _grad_logits(logp: torch.Tensor, entropy, local, in_range, grad_logprobs, grad_entropy,
                 compute_entropy: bool, temperature: float) -> torch.Tensor:
    """d loss / d logits (fp32, ``[..., v_local]``) from this shard's log-softmax ``logp``
    (overwritten: the result reuses its memory) and the upstream gradients.

    dlogp_t/dz_k = 1[k=t] - p_k;  dH/dz_k = -p_k (log p_k + H);  z = logits / temperature.
    """
    p = torch.exp(logp)
    g_lp = grad_logprobs.float() if grad_logprobs is not None else torch.zeros_like(entropy)
    if compute_entropy and grad_entropy is not None:
        grad = logp.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.float().unsqueeze(-1))
        grad.add_(g_lp.unsqueeze(-1)).mul_(p).neg_()
    else:
        grad = p.mul_(g_lp.unsqueeze(-1)).neg_()
    del p
    onehot_grad = torch.where(in_range, g_lp, torch.zeros((), dtype=g_lp.dtype, device=g_lp.device))
    grad.scatter_add_(-1, local.unsqueeze(-1), onehot_grad.unsqueeze(-1))
    return grad.div_(temperature)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature, vocab_start, vocab_size, tp_group,
                compute_entropy):
        z = logits.float() / temperature  # new fp32 buffer: [b, s, v_local]
        lse, logprobs, entropy, local, in_range, _ = _softmax_stats(
            z, target, vocab_start, vocab_size, tp_group, compute_entropy)
        ctx.save_for_backward(z, lse, entropy, local, in_range)
        ctx.temperature = temperature
        ctx.input_dtype = logits.dtype
        ctx.compute_entropy = compute_entropy
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        z, lse, entropy, local, in_range = ctx.saved_tensors
        grad = _grad_logits(z - lse.unsqueeze(-1), entropy, local, in_range, grad_logprobs,
                            grad_entropy, ctx.compute_entropy, ctx.temperature)
        return grad.to(ctx.input_dtype), None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    tp_group=None,
    tp_rank: int = 0,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``target_ids`` and the entropy, from this rank's vocabulary shard.

    Args:
        logits: ``[batch, seq, vocab_padded / tp]`` any float dtype (cast to fp32).
        target_ids: ``[batch, seq]`` int64 global token ids.
        tp_group: the tensor-parallel process group (None or size 1: no communication).
        tp_rank: this rank's index in ``tp_group`` (selects the vocabulary slice).
        temperature: logits are divided by it before the softmax (as the sampler does).
        vocab_size: real vocabulary size; ids >= it (padding rows) get zero probability.
        compute_entropy: also return the entropy (else zeros, and a cheaper backward).

    Returns:
        ``(logprobs, entropy)``, each ``[batch, seq]`` float32, differentiable w.r.t.
        ``logits``; entropy in nats.

    Raises:
        ValueError: if ``temperature <= 0`` or the shapes disagree.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target_ids {tuple(target_ids.shape)} disagree"
        )
    vocab_start = tp_rank * logits.shape[-1]
    return _VocabParallelLogprobEntropy.apply(
        logits, target_ids.long(), float(temperature), vocab_start, vocab_size, tp_group,
        compute_entropy,
    )


class _ChunkedLinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, temperature, vocab_start, vocab_size, tp_group,
                compute_entropy, chunk_size):
        n = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        logprobs, entropy, lse_full = (torch.empty(n, **f32) for _ in range(3))  # on hidden.device
        for s, e in ((c.start, c.stop) for c in chunk_slices(n, chunk_size)):
            z = torch.nn.functional.linear(hidden[s:e], weight).float().div_(temperature)
            lse, lp, ent, _, _, zmax = _softmax_stats(z, target[s:e], vocab_start, vocab_size,
                                                      tp_group, compute_entropy)
            logprobs[s:e], entropy[s:e], lse_full[s:e] = lp, ent, lse + zmax
            del z
        ctx.save_for_backward(hidden, weight, target, lse_full, entropy)
        ctx.args = (temperature, vocab_start, vocab_size, compute_entropy, chunk_size)
        # megatron DDP's persistent fp32 gradient buffer of the weight (None outside DDP)
        ctx.main_grad = getattr(weight, "main_grad", None)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, target, lse_full, entropy = ctx.saved_tensors
        temperature, vocab_start, vocab_size, compute_entropy, chunk_size = ctx.args
        grad_hidden = torch.empty_like(hidden)
        # the weight's gradient goes straight into DDP's main_grad when there is one (no
        # [vocab, hidden] buffer held through the rest of the backward, and for a tied
        # embedding no second one to sum with the embedding's gradient); else a local fp32 sum
        into = ctx.main_grad if ctx.needs_input_grad[1] else None
        grad_weight = None
        if ctx.needs_input_grad[1] and into is None:
            grad_weight = into = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        v_local = weight.shape[0]
        for s, e in ((c.start, c.stop) for c in chunk_slices(hidden.shape[0], chunk_size)):
            z = torch.nn.functional.linear(hidden[s:e], weight).float().div_(temperature)
            _mask_padded_rows(z, vocab_start, vocab_size)
            local, in_range = _target_index(target[s:e], vocab_start, v_local)
            g = _grad_logits(z.sub_(lse_full[s:e].unsqueeze(-1)), entropy[s:e], local, in_range,
                             None if grad_logprobs is None else grad_logprobs[s:e],
                             None if grad_entropy is None else grad_entropy[s:e],
                             compute_entropy, temperature).to(hidden.dtype)
            grad_hidden[s:e] = g @ weight
            if into is not None:
                if g.dtype == into.dtype:
                    into.addmm_(g.t(), hidden[s:e])  # in place: no [vocab, hidden] temporary
                else:
                    into.add_(g.t() @ hidden[s:e])
            del z, g
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def chunked_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_ids: torch.Tensor,
    tp_group=None,
    tp_rank: int = 0,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    compute_entropy: bool = True,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy through the output layer, ``chunk_size`` tokens at a time.

    The fused form of ``vocab_parallel_logprobs(linear(hidden, weight), ...)``: the logits
    of at most ``chunk_size`` tokens exist at once (``[chunk_size, vocab/tp]`` fp32, a few
    buffers of that size), in the forward and again in the backward, which recomputes them
    from ``hidden`` and ``weight`` instead of keeping them (the idea of Liger-Kernel's fused
    linear cross-entropy, Hsu et al. 2024; here vocab-parallel, with the entropy, fp32 math).
    The logits are computed in ``hidden``'s dtype (as the output layer computes them), then
    cast to fp32; the gradient of ``hidden`` comes back in its dtype. The weight's gradient:
    when ``weight`` carries megatron DDP's ``main_grad`` buffer (a DDP-wrapped model), it is
    accumulated there, chunk by chunk, and autograd gets None for it -- as megatron's
    gradient-accumulation fusion writes a linear's weight gradient into ``main_grad``, but
    without its ``grad_added_to_main_grad`` flag, so the other gradients of a tied
    embedding still reach ``main_grad`` through DDP's hook. That needs DDP's grad hooks not
    to wait for this weight (``overlap_grad_reduce=False``, as
    :func:`nemo_rlhf.models.engine.wrap_ddp` configures it). Without ``main_grad`` the
    gradient is summed over the chunks in fp32 and returned in the weight's dtype.

    With TP > 1 each rank holds ``weight``'s vocabulary shard and the gradient of ``hidden``
    returned here is this shard's part: the caller sums it over the TP group (megatron's
    ``copy_to_tensor_model_parallel_region`` in front of ``hidden``), as a column-parallel
    linear does.

    Args:
        hidden: ``[tokens, hidden]`` final hidden states (after the final norm).
        weight: ``[vocab_padded / tp, hidden]`` this rank's output-layer weight (no bias).
        target_ids: ``[tokens]`` int64 global token ids.
        tp_group / tp_rank / temperature / vocab_size / compute_entropy: as
            :func:`vocab_parallel_logprobs`.
        chunk_size: tokens per chunk (>= 1).

    Returns:
        ``(logprobs, entropy)``, each ``[tokens]`` float32, differentiable w.r.t. ``hidden``
        and ``weight``; entropy in nats (zeros without ``compute_entropy``).

    Raises:
        ValueError: ``temperature <= 0``, ``chunk_size < 1`` or disagreeing shapes.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] \
            or target_ids.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and target_ids "
                         f"{tuple(target_ids.shape)} disagree: need [tokens, h], [v, h], [tokens]")
    return _ChunkedLinearLogprobEntropy.apply(
        hidden, weight, target_ids.long(), float(temperature), tp_rank * weight.shape[0], vocab_size,
        tp_group, compute_entropy, int(chunk_size))


def gather_vocab_parallel(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """All-gather vocab shards into ``[..., vocab_padded]`` (tests and HF export only)."""
    if tp_group is None or not dist.is_initialized() or dist.get_world_size(tp_group) == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)
