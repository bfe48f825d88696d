"""Log-probs and values of the response tokens from a forward over ``prompt + response``.

Alignment (one helper, :func:`response_slice`): the forward's position ``t`` is the state
after token ``t``, so response token ``j`` (column ``P+j`` of ``input_ids``) is predicted
by position ``P-1+j``: its log-prob comes from the logits there, and the critic's value
of the state it is chosen in is the value there.
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_rlhf.models.vocab_parallel import vocab_parallel_logprobs


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
            of the actor-critic's ``(logits, values)``), differentiable.
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
        ValueError: shape mismatch.
    """
    if isinstance(logits, (tuple, list)):
        raise TypeError("response_logprobs: pass the logits tensor (output[0] of the actor-critic)")
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
