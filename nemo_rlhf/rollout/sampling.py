"""Next-token choice from full-vocabulary logits: pure tensor functions, no communication.

Order of operations (as in Hugging Face's logits processors): the padded vocabulary rows
(ids >= ``vocab_size``) are cut off; the recorded log-prob is taken from
``log_softmax(logits / T)`` over the real vocabulary (``T`` = ``temperature`` when sampling,
1.0 when greedy) -- i.e. BEFORE min-new-tokens suppression and top-k/top-p filtering, so it
is the policy's own log-prob that the trainer recomputes; then EOS/stop ids are suppressed
while ``step < min_new_tokens``; then top-k, then top-p; then a token is drawn.

Sampling is by inverse CDF: one uniform per row from the caller's ``torch.Generator``,
searched in the cumulative sum of the filtered probabilities in vocabulary order. A fixed
number of draws per step (one per row, finished rows included) keeps the random stream
aligned across batch layouts, and a tiny perturbation of the logits (TP=2 vs TP=1 rounding)
only changes the token if a uniform lands within that perturbation of a bucket edge.
"""

from __future__ import annotations

from typing import Optional

import torch

NEG_INF = float("-inf")


def top_k_top_p_filter(scores_BV: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set the scores of tokens outside the top-k / nucleus to ``-inf`` (in place).

    Args:
        scores_BV: ``[batch, vocab]`` float (temperature-scaled logits).
        top_k: keep the ``top_k`` largest scores per row (ties at the k-th value are kept);
            0 = off.
        top_p: keep the smallest set of most likely tokens whose probability mass reaches
            ``top_p`` (the most likely token is always kept); 1.0 = off.

    Returns:
        ``scores_BV`` (the same tensor, modified).
    """
    vocab = scores_BV.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores_BV, top_k, dim=-1).values[:, -1:]
        scores_BV.masked_fill_(scores_BV < kth, NEG_INF)
    if top_p < 1.0:
        sorted_s, order = torch.sort(scores_BV, dim=-1, descending=True)
        probs = torch.softmax(sorted_s, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove_sorted = mass_before >= top_p
        remove_sorted[:, 0] = False
        remove = torch.empty_like(remove_sorted).scatter_(-1, order, remove_sorted)
        scores_BV.masked_fill_(remove, NEG_INF)
    return scores_BV


def choose_tokens(
    logits_BV: torch.Tensor,
    *,
    vocab_size: int,
    greedy: bool,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    suppress_ids: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and its log-prob.

    Args:
        logits_BV: ``[batch, padded_vocab]`` any float dtype (full vocabulary, gathered).
        vocab_size: real vocabulary size; columns >= it are never chosen.
        greedy: argmax instead of sampling.
        temperature, top_k, top_p: sampling controls (unused when greedy).
        suppress_ids: ``[n]`` int64 ids that may not be chosen (min-new-tokens: EOS and
            stop ids), or None.
        generator: the sampler's generator (required unless greedy).

    Returns:
        ``(tokens [batch] int64, logprobs [batch] float32)`` where ``logprobs`` is
        ``log_softmax(logits / T)[token]`` over the real vocabulary, ``T = temperature``
        when sampling and 1.0 when greedy, before suppression and filtering.
    """
    z_BV = logits_BV[:, :vocab_size].float()
    t = 1.0 if greedy else float(temperature)
    if t != 1.0:
        z_BV = z_BV / t
    lse_B = torch.logsumexp(z_BV, dim=-1)
    if greedy:
        scores_BV = z_BV
        if suppress_ids is not None and suppress_ids.numel():
            scores_BV = z_BV.clone()
            scores_BV[:, suppress_ids] = NEG_INF
        tokens_B = scores_BV.argmax(dim=-1)
    else:
        if generator is None:
            raise ValueError("choose_tokens: sampling needs a torch.Generator")
        # one uniform per row, drawn first: the stream does not depend on the filtering
        u_B = torch.rand(z_BV.shape[0], generator=generator, dtype=torch.float64)
        scores_BV = z_BV.clone()
        if suppress_ids is not None and suppress_ids.numel():
            scores_BV[:, suppress_ids] = NEG_INF
        top_k_top_p_filter(scores_BV, top_k, top_p)
        probs_BV = torch.softmax(scores_BV, dim=-1, dtype=torch.float64)
        cdf_BV = probs_BV.cumsum_(dim=-1)
        target_B1 = (u_B * cdf_BV[:, -1]).unsqueeze(-1)
        tokens_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(-1)
        tokens_B.clamp_(max=z_BV.shape[-1] - 1)
    logprobs_B = z_BV.gather(-1, tokens_B.unsqueeze(-1)).squeeze(-1) - lse_B
    return tokens_B, logprobs_B
