"""Log-probs and values of the response tokens from a forward over ``prompt + response``.

Alignment (one helper, :func:`response_slice`): the forward's position ``t`` is the state
after token ``t``, so response token ``j`` (column ``P+j`` of ``input_ids``) is predicted
by position ``P-1+j``: its log-prob comes from the logits there, and the critic's value
of the state it is chosen in is the value there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nemo_rlhf.models.vocab_parallel import chunked_linear_logprobs, vocab_parallel_logprobs


@dataclass(frozen=True)
class LogprobRequest:
    """Ask the actor's last stage for response log-probs instead of logits (the fused,
    chunked output layer: :func:`nemo_rlhf.models.vocab_parallel.chunked_linear_logprobs`).

    Passed as ``logprob_request=`` to the actor-critic's forward (through
    :func:`nemo_rlhf.models.engine.forward_backward`); the last stage then returns a
    :class:`ResponseLogprobs` where it would return the logits. Only the ``R = seq - P``
    positions that predict response tokens go through the output layer, ``chunk_size``
    tokens at a time: neither the ``[batch, seq, vocab]`` logits nor the prompt positions'
    logits are computed.
    """

    prompt_length: int
    """``P``: response token ``j`` is column ``P+j`` of ``input_ids`` (>= 1)."""
    temperatures: tuple[float, ...]
    """Temperatures to compute log-probs at (the first also gives the entropy)."""
    vocab_size: Optional[int]
    """Real vocabulary (padded rows excluded from the softmax)."""
    compute_entropy: bool = True
    """Compute the entropy at ``temperatures[0]`` (else zeros)."""
    chunk_size: int = 1024
    """Tokens (batch x response positions) per output-layer chunk (>= 1)."""

    def __post_init__(self) -> None:
        if self.prompt_length < 1 or self.chunk_size < 1 or not self.temperatures:
            raise ValueError(f"LogprobRequest: prompt_length={self.prompt_length} and chunk_size="
                             f"{self.chunk_size} must be >= 1, temperatures={self.temperatures} non-empty")


@dataclass
class ResponseLogprobs:
    """What the actor's last stage returns for a :class:`LogprobRequest`, in place of logits.

    ``logprobs[t]``: ``[batch, R]`` float32 at temperature ``t``; ``entropy``: ``[batch, R]``
    float32 (nats) at the request's first temperature. Not masked: :func:`response_logprobs`
    zeroes the padding as it does for logits.
    """

    logprobs: dict[float, torch.Tensor]
    entropy: torch.Tensor


def response_slice(t: torch.Tensor, prompt_length: int, response_length: int) -> torch.Tensor:
    """The positions that predict the response tokens: ``t[:, P-1 : P-1+R]``.

    Args:
        t: ``[B, P+R, ...]`` per-position outputs of a forward (logits, values).
        prompt_length: ``P`` (>= 1).
        response_length: ``R``.

    Returns:
        ``[B, R, ...]`` view.
    """
    return t[:, prompt_length - 1:prompt_length - 1 + response_length]


def response_values(values: torch.Tensor, prompt_length: int, response_length: int) -> torch.Tensor:
    """Values of the states that predict the response tokens.

    Args:
        values: ``[B, P+R]`` from the actor-critic's or the critic's forward.
        prompt_length: ``P``; response token ``j`` (column ``P+j``) is predicted at ``P-1+j``.
        response_length: ``R``.

    Returns:
        ``[B, R]`` float32.
    """
    return response_slice(values, prompt_length, response_length).float()


def response_logprobs(
    logits: torch.Tensor,
    batch,
    dims,
    temperature: float,
    *,
    vocab_size: Optional[int] = None,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of the response tokens from the last stage's logits.

    The training-side twin of the sampler's log-probs: position ``P-1+j`` of the forward
    over ``batch.input_ids`` predicts response token ``j`` (column ``P+j``); the log-probs
    are computed from the TP-sharded logits with
    :func:`nemo_rlhf.models.vocab_parallel.vocab_parallel_logprobs` (no full-vocabulary
    gather), at ``temperature`` (pass ``RolloutConfig.logprob_temperature``).

    Args:
        logits: ``[B, P+R, padded_vocab/tp]`` from ``engine.model_forward(model,
            batch.input_ids, batch.attention_mask)`` on the last stage (the first element
            of the actor-critic's ``(logits, values)``), differentiable; or the
            :class:`ResponseLogprobs` of a forward with a :class:`LogprobRequest` (its
            log-probs at ``temperature`` are returned, masked alike).
        batch: a :class:`~nemo_rlhf.rollout.RolloutBatch`, or ``(input_ids [B, P+R],
            prompt_length P)``.
        dims: :class:`ParallelDims` (TP group and rank).
        temperature: > 0.
        vocab_size: real vocabulary (padded rows excluded from the softmax); default
            ``batch.vocab_size`` for a RolloutBatch. Must match what the sampler used.
        compute_entropy: also compute the entropy (else zeros).

    Returns:
        ``(logprobs [B, R] float32, entropy [B, R] float32)``; for a RolloutBatch both are
        0 where ``response_mask`` is False.

    Raises:
        TypeError: if ``logits`` is a tuple (pass ``output[0]``).
        ValueError: shape mismatch; a :class:`ResponseLogprobs` without ``temperature``.
    """
    if isinstance(logits, (tuple, list)):
        raise TypeError("response_logprobs: pass the logits tensor (output[0] of the actor-critic)")
    if isinstance(logits, ResponseLogprobs):
        return _from_fused(logits, batch, temperature, compute_entropy)
    mask = None
    if isinstance(batch, tuple):
        input_ids, P = batch
    else:  # a RolloutBatch (or anything with its fields)
        input_ids, P = batch.input_ids, batch.prompt_length
        mask = batch.response_mask
        if vocab_size is None and batch.vocab_size > 0:
            vocab_size = batch.vocab_size
    B, S = input_ids.shape
    if logits.shape[:2] != (B, S):
        raise ValueError(
            f"response_logprobs: logits {tuple(logits.shape)} do not match input_ids {(B, S)}"
        )
    if not 1 <= P <= S:
        raise ValueError(f"response_logprobs: prompt_length={P} outside [1, {S}]")
    lp, ent = vocab_parallel_logprobs(
        response_slice(logits, P, S - P), input_ids[:, P:], dims.tp_group, dims.tp_rank,
        temperature=temperature, vocab_size=vocab_size, compute_entropy=compute_entropy)
    if mask is not None:
        lp = torch.where(mask, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
        ent = torch.where(mask, ent, torch.zeros((), dtype=ent.dtype, device=ent.device))
    return lp, ent


def _from_fused(out: ResponseLogprobs, batch, temperature: float, compute_entropy: bool):
    """:func:`response_logprobs` of a fused forward's output: pick, check, mask."""
    if temperature not in out.logprobs:
        raise ValueError(f"response_logprobs: the forward computed temperatures {sorted(out.logprobs)}, "
                         f"not {temperature} (add it to the LogprobRequest)")
    lp, ent = out.logprobs[temperature], out.entropy if compute_entropy else None
    if isinstance(batch, tuple):
        input_ids, P = batch
        mask = None
    else:
        input_ids, P, mask = batch.input_ids, batch.prompt_length, batch.response_mask
    if lp.shape != (input_ids.shape[0], input_ids.shape[1] - P):
        raise ValueError(f"response_logprobs: fused log-probs {tuple(lp.shape)} do not match "
                         f"input_ids {tuple(input_ids.shape)} with prompt_length={P}")
    if ent is None:
        ent = torch.zeros_like(lp)
    if mask is not None:
        lp = torch.where(mask, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
        ent = torch.where(mask, ent, torch.zeros((), dtype=ent.dtype, device=ent.device))
    return lp, ent


def fused_response_logprobs(hidden_states: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                            request: LogprobRequest, tp_group,
                            select: Optional[torch.Tensor] = None) -> ResponseLogprobs:
    """The response log-probs of a last stage's final hidden states, output layer fused in.

    Args:
        hidden_states: ``[seq, batch, hidden]`` megatron layout, after the final norm.
        weight: ``[padded_vocab/tp, hidden]`` the output layer's (or tied embedding's) weight.
        input_ids: ``[batch, seq]`` int64 (the targets are ``input_ids[:, P:]``).
        request: what to compute.
        tp_group: the output layer's tensor-parallel group (its gradient of the hidden
            states is summed over it, as a column-parallel linear does).
        select: optional ``[n]`` int64 flat indices into ``[batch * R]``: only these
            response positions go through the output layer (the valid tokens of a packed
            micro-batch, :attr:`nemo_rlhf.models.packing.PackedBatch.response_index`); the
            others are 0 in the result. None: every response position.

    Returns:
        :class:`ResponseLogprobs` with ``[batch, R]`` float32 tensors.

    Raises:
        ValueError: ``prompt_length`` outside ``[1, seq]``.
    """
    S, B, H = hidden_states.shape
    P = request.prompt_length
    if not 1 <= P <= S:
        raise ValueError(f"LogprobRequest.prompt_length={P} outside [1, {S}]")
    R = S - P
    h = response_slice(hidden_states.transpose(0, 1), P, R).reshape(B * R, H)
    return fused_logprobs_of_positions(h, weight, input_ids[:, P:].reshape(B * R), (B, R), request,
                                       tp_group, select)


def fused_logprobs_of_positions(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                shape: tuple[int, int], request, tp_group,
                                select: Optional[torch.Tensor] = None) -> ResponseLogprobs:
    """The fused, chunked output layer's log-probs (and entropy) of flat positions: the one
    body of :func:`fused_response_logprobs` and the context-parallel
    :func:`nemo_rlhf.models.context_parallel.cp_fused_logprobs`.

    Args:
        h: ``[rows * cols, hidden]`` hidden states of the positions, row-major.
        weight: ``[padded_vocab/tp, hidden]`` the output layer's weight.
        targets: ``[rows * cols]`` int64 next-token ids.
        shape: ``(rows, cols)`` of the result.
        request: the temperatures, vocabulary size, entropy flag and chunk size
            (:class:`LogprobRequest`).
        tp_group: the output layer's TP group (``h``'s gradient is summed over it).
        select: optional ``[n]`` int64 flat indices: only these positions go through the
            output layer; the others are 0 in the result. None: every position.

    Returns:
        :class:`ResponseLogprobs` with ``[rows, cols]`` float32 tensors.
    """
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    rows, cols = shape
    tp_size, tp_rank = tp_group.size(), tp_group.rank()
    if tp_size > 1:
        h = copy_to_tensor_model_parallel_region(h, group=tp_group)
    if select is not None:
        h, targets = h.index_select(0, select), targets.index_select(0, select)

    def full(t: torch.Tensor) -> torch.Tensor:  # [n] selected -> [rows, cols], 0 elsewhere
        if select is None:
            return t.view(rows, cols)
        return t.new_zeros(rows * cols).index_copy(0, select, t).view(rows, cols)

    logprobs, entropy = {}, None
    for i, t in enumerate(request.temperatures):
        lp, ent = chunked_linear_logprobs(
            h, weight, targets, tp_group if tp_size > 1 else None, tp_rank, t, request.vocab_size,
            compute_entropy=request.compute_entropy and i == 0, chunk_size=request.chunk_size)
        logprobs[float(t)] = full(lp)
        if i == 0:
            entropy = full(ent)
    return ResponseLogprobs(logprobs=logprobs, entropy=entropy)
