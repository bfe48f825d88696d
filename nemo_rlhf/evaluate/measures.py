"""What an evaluation measures on each response besides the checker's score: the n-gram
repetition rate (:func:`repetition_rates`), the KL to a reference policy
(:func:`forward_response_logprobs`, :func:`sequence_kl`) and the reward model's score
(:func:`rm_scores`), each as the PPO trainer computes it, and the sharing of per-rank
values over the job's ranks."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nemo_rlhf.algorithms.ppo.kl import kl_penalty
from nemo_rlhf.distributed.split import dp_slice
from nemo_rlhf.reward.batching import ScoreItem
from nemo_rlhf.trainers.ppo.guards import ngram_repetition_rate
from nemo_rlhf.trainers.ppo.roles import ForwardPasses, PolicyRole


def repetition_rates(response_ids: list[list[int]], response_mask: list[list[bool]]) -> list[float]:
    """Per-response n-gram repetition rate of the generated tokens (mask True: EOS included,
    pads excluded): :func:`nemo_rlhf.trainers.ppo.guards.ngram_repetition_rate` with its
    default ``n=3``, exactly as the PPO trainer's (:func:`~nemo_rlhf.trainers.ppo.step_metrics.response_repetition`) (``eval/repetition`` is
    their mean).

    Args:
        response_ids: ``[B][R]`` token ids.
        response_mask: ``[B][R]`` bools.

    Returns:
        ``[B]`` rates in ``[0, 1)``.
    """
    return [ngram_repetition_rate([t for t, m in zip(ids, mk) if m])
            for ids, mk in zip(response_ids, response_mask)]


def forward_response_logprobs(model, batch, dims, temperature: float, vocab_size: int,
                              micro_batch_size: int) -> Optional[torch.Tensor]:
    """Log-probs of a rollout's response tokens from a forward-only pass of ``model``: the
    PPO trainer's own pass (:meth:`nemo_rlhf.trainers.ppo.roles.PolicyRole.logprobs`,
    micro-batches of ``micro_batch_size`` rows, the last topped up with copies of its last
    row and dropped again; the logits path).

    Args:
        model: this rank's stage of an actor(-critic) model.
        batch: a :class:`~nemo_rlhf.rollout.RolloutBatch` (``input_ids [B, P+R]``).
        dims: this process's ``ParallelDims``.
        temperature: > 0, the logits' temperature (the rollout's ``logprob_temperature``).
        vocab_size: real vocabulary size.
        micro_batch_size: rows per forward, >= 1.

    Returns:
        ``[B, R]`` float32 on the last pipeline stage (0 where ``response_mask`` is False);
        None on the other stages.
    """
    passes = ForwardPasses(dims, vocab_size, micro_batch_size)
    out = PolicyRole(model, None, passes, dims, temperature, temperature, with_values=False).logprobs(batch)
    if out is None:
        return None
    lp = out["logprobs"]
    return torch.where(batch.response_mask, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence KL estimate of the policy to the reference, in nats.

    ``sum_t mask[b, t] * (logprobs[b, t] - ref_logprobs[b, t])``: the ``k1`` estimator of
    :func:`nemo_rlhf.algorithms.ppo.kl.kl_penalty` summed over the generated tokens (EOS
    included, pads excluded), in fp32. This is the PPO trainer's ``kl_mean`` per sequence
    (its default ``kl.estimator=k1``, ``kl.clamp=null``, ``kl.temperature=sampling``: both
    log-probs at the rollout's ``logprob_temperature``, i.e. 1.0 for greedy decoding);
    ``kl_to_reference`` is the mean of these over the responses.

    Args:
        logprobs: ``[B, R]`` policy log-probs of the generated tokens.
        ref_logprobs: ``[B, R]`` reference log-probs of the same tokens.
        response_mask: ``[B, R]`` bool.

    Returns:
        ``[B]`` float32.
    """
    kl = kl_penalty(logprobs, ref_logprobs, "k1")
    return torch.where(response_mask.bool(), kl, torch.zeros((), dtype=kl.dtype, device=kl.device)).sum(-1)


def rm_scores(scorer, dims, prompts: list[str], responses: list[str], where: str,
              items: Optional[list[dict]] = None) -> list[float]:
    """Raw RM scores of (prompt, response) text pairs, or of ``items``, on every rank.

    Text items exactly as :meth:`RewardModelScorer.score_batch` lays them out (the RM
    checkpoint's chat template and system prompt, response + EOS), scored by
    :meth:`RewardModelScorer.forward_scores` in process: each DP replica scores a
    contiguous slice, the last stages' TP-rank-0 share theirs with every rank.

    Args:
        scorer: a :class:`~nemo_rlhf.reward.rm_scorer.RewardModelScorer` built on every rank.
        prompts, responses: ``[N]`` raw prompts and decoded responses (EOS excluded).
        where: the config key named in errors (``rm_checkpoint``).
        items: ``[N]`` wire items (:func:`~nemo_rlhf.reward.functions.rm_items`: ``{"prompt",
            "response"}``, ``{"prompt_ids", "response_ids"}`` or ``{"messages"}``) scored
            instead of the text pairs (multi-turn episodes read whole); None: the text pairs.

    Returns:
        ``[N]`` floats.

    Raises:
        ValueError: a pair the RM refuses (too long for its ``max_position_embeddings``,
            untokenisable), raised on every rank before any forward.
    """
    try:
        if items is None:
            items = [{"prompt": p, "response": r} for p, r in zip(prompts, responses)]
        seqs = [scorer.encode(ScoreItem(**item), j) for j, item in enumerate(items)]
    except ValueError as exc:
        raise ValueError(f"{where}: the reward model refuses a response: {exc}") from None
    n = len(seqs)
    mine = dp_slice(n, dims.dp_rank, dims.dp)
    lo = mine.start
    local = scorer.forward_scores(seqs[mine])  # every stage of the replica: the same rows
    if dims.world_size == 1:
        return list(local)
    share = (lo, local) if local is not None and dims.tp_rank == 0 else None
    gathered = [None] * dims.world_size
    dist.all_gather_object(gathered, share)
    out: list[Optional[float]] = [None] * n
    for g in gathered:
        if g is not None:
            out[g[0]:g[0] + len(g[1])] = g[1]
    if any(s is None for s in out):
        raise RuntimeError(f"{where}: {sum(s is None for s in out)} of {n} RM scores missing after the gather")
    return out


def share_from_last_stage(values: Optional[list], dims) -> list:
    """``values`` (held by the last pipeline stages) on every rank."""
    if dims.world_size == 1:
        return values
    gathered = [None] * dims.world_size
    dist.all_gather_object(gathered, values if dims.is_last_stage and dims.tp_rank == 0 else None)
    return next(g for g in gathered if g is not None)


def mean_or_nan(xs) -> float:
    """The mean of ``xs``, NaN when there is none."""
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


