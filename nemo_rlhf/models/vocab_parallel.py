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
Simplified: no chunking over the sequence (the caller's micro-batch bounds the memory).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_NEG = -1e30  # finite "minus infinity": keeps p * logp = 0 instead of NaN on masked rows


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature, vocab_start, vocab_size, tp_group,
                compute_entropy):
        z = logits.float() / temperature  # new fp32 buffer: [b, s, v_local]
        v_local = z.shape[-1]
        if vocab_size is not None and vocab_start + v_local > vocab_size:
            z[..., max(vocab_size - vocab_start, 0):] = _NEG
        zmax = z.max(dim=-1).values
        _all_reduce(zmax, dist.ReduceOp.MAX, tp_group)
        z.sub_(zmax.unsqueeze(-1))
        e = torch.exp(z)
        sumexp = e.sum(dim=-1)
        _all_reduce(sumexp, dist.ReduceOp.SUM, tp_group)
        lse = torch.log(sumexp)  # of the shifted logits
        local = target - vocab_start
        in_range = (local >= 0) & (local < v_local)
        local = torch.where(in_range, local, torch.zeros_like(local))
        z_t = torch.where(in_range, z.gather(-1, local.unsqueeze(-1)).squeeze(-1),
                          torch.zeros((), dtype=z.dtype, device=z.device))
        _all_reduce(z_t, dist.ReduceOp.SUM, tp_group)
        logprobs = z_t - lse
        if compute_entropy:
            e.div_(sumexp.unsqueeze(-1))  # softmax, in place
            sum_pz = (e * z).sum(dim=-1)
            _all_reduce(sum_pz, dist.ReduceOp.SUM, tp_group)
            entropy = lse - sum_pz
        else:
            entropy = torch.zeros_like(logprobs)
        del e
        ctx.save_for_backward(z, lse, entropy, local, in_range)
        ctx.temperature = temperature
        ctx.input_dtype = logits.dtype
        ctx.compute_entropy = compute_entropy
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        z, lse, entropy, local, in_range = ctx.saved_tensors
        logp = z - lse.unsqueeze(-1)
        p = torch.exp(logp)
        g_lp = grad_logprobs.float() if grad_logprobs is not None else torch.zeros_like(lse)
        if ctx.compute_entropy and grad_entropy is not None:
            # dH/dz_k = -p_k (log p_k + H);  dlogp_t/dz_k = 1[k=t] - p_k
            grad = logp.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.float().unsqueeze(-1))
            grad.add_(g_lp.unsqueeze(-1)).mul_(p).neg_()
        else:
            grad = p.mul_(g_lp.unsqueeze(-1)).neg_()
        del p
        onehot_grad = torch.where(in_range, g_lp, torch.zeros((), dtype=g_lp.dtype, device=g_lp.device))
        grad.scatter_add_(-1, local.unsqueeze(-1), onehot_grad.unsqueeze(-1))
        grad.div_(ctx.temperature)
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


def gather_vocab_parallel(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """All-gather vocab shards into ``[..., vocab_padded]`` (tests and HF export only)."""
    if tp_group is None or not dist.is_initialized() or dist.get_world_size(tp_group) == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)
