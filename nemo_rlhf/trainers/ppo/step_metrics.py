"""The PPO step's derived metrics, each over the whole batch (every DP rank's rows).

* :func:`rollout_quality`: the rollout-vs-train log-prob mismatch, the critic's explained
  variance, the n-gram repetition and the longest response;
* :func:`update_metrics`: the update's statistics (first mini-batch's ratio extremes, the
  merged token statistics, the gradient norms);
* :func:`raw_score_mean`: the raw weighted score's mean over DP (scoring ranks).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nemo_rlhf.algorithms import ppo as P
from nemo_rlhf.trainers.ppo.guards import ngram_repetition_rate
from nemo_rlhf.trainers.ppo.scoring import gather_over_scoring_ranks


def response_repetition(batch) -> list[float]:
    """Each response's 3-gram repetition rate (its generated tokens only), ``[B]`` floats."""
    return [ngram_repetition_rate([t for t, m in zip(ids, mk) if m])
            for ids, mk in zip(batch.response_ids.tolist(), batch.response_mask.tolist())]


def rollout_quality(collectives, batch, old_logprobs: torch.Tensor,
                    ev_sums: Optional[torch.Tensor]) -> dict:
    """The rollout-vs-train log-prob mismatch, the critic's explained variance (with
    ``ev_sums``, :func:`~nemo_rlhf.algorithms.ppo.explained_variance_sums`'), the n-gram
    repetition and the longest response (policy tokens), each over every DP rank's rows: one sum and one
    max all-reduce on the batch's device.

    The mismatch, over the policy tokens of ``batch.response_mask`` (a multi-turn row's
    environment tokens are holes in it): ``rollout_train_logprob_diff_mean`` / ``_max``
    (``|logp_rollout - logp_old|`` per token) and ``rollout_train_k3_kl``, the mean per
    token of the k3 estimate of ``KL(pi_rollout || pi_train)``, ``exp(d) - d - 1`` with
    ``d = logp_old - logp_rollout``
    (:func:`~nemo_rlhf.algorithms.ppo.rollout_correction.rollout_train_k3`), each a global
    sum over DP divided by the global token count. All 0 when the old log-probs are the
    rollout's (``ppo.old_logprobs_from_rollout``). ``response_length_max``: the most policy
    tokens of a row (a multi-turn row's environment tokens not counted; its extent,
    ``response_lengths``, counts them).

    Args:
        collectives: the job's :class:`~nemo_rlhf.trainers.collectives.JobCollectives`.
        batch: the ``RolloutBatch`` (``logprobs``, ``response_mask [B, R]``, ...).
        old_logprobs: ``[B, R]`` the training engine's (or the rollout's) old log-probs.
        ev_sums: ``[5]`` float64 or None (no critic: no ``explained_variance``).
    """
    mask = batch.response_mask
    dev, m, dims = mask.device, mask.bool(), collectives.dims
    diff = (batch.logprobs.detach().float() - old_logprobs.detach().float()).abs()
    k3 = P.rollout_train_k3(old_logprobs.detach(), batch.logprobs.detach(), m)
    reps = response_repetition(batch)
    ev = ev_sums if ev_sums is not None else torch.zeros(5, dtype=torch.float64, device=dev)
    sums = torch.cat([torch.stack([torch.where(m, diff, 0.0).sum().double(), m.sum().double(),
                                   torch.tensor(float(sum(reps)), dtype=torch.float64, device=dev),
                                   torch.tensor(float(len(reps)), dtype=torch.float64, device=dev)]),
                      ev.to(dev), k3.sum().double().reshape(1)])
    maxes = torch.stack([torch.where(m, diff, 0.0).max() if diff.numel() else diff.new_zeros(()),
                         m.sum(-1).max().float() if m.numel() else diff.new_zeros(())])
    if dims.dp > 1:
        dist.all_reduce(sums, group=dims.dp_group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=dims.dp_group)
    diff_sum, tokens, rep_sum, rows = (float(x) for x in sums[:4].tolist())
    out = {"rollout_train_logprob_diff_mean": diff_sum / tokens if tokens else 0.0,
           "rollout_train_logprob_diff_max": float(maxes[0]),
           "rollout_train_k3_kl": float(sums[9]) / tokens if tokens else 0.0,
           "repetition": rep_sum / max(rows, 1.0),
           "response_length_max": float(maxes[1])}
    if ev_sums is not None:
        out["explained_variance"] = P.explained_variance_from_sums(sums[4:9])
    return out


def update_metrics(all_stats: list[dict], norms: list[float], critic_norms: list[float]) -> dict:
    """The update's metrics from the mini-batches' DP-reduced token statistics and the
    optimizer steps' gradient norms (the mean of each; ``critic_grad_norm`` with a critic
    of its own)."""
    out = {}
    if all_stats:
        first = P.finalize_token_stats(all_stats[0])
        out["first_minibatch/ratio_max"] = first.get("ratio_max", float("nan"))
        out["first_minibatch/ratio_min"] = first.get("ratio_min", float("nan"))
        merged = P.finalize_token_stats(P.merge_token_stats(all_stats))
        out.update({k: v for k, v in merged.items() if k != "valid_tokens"})
    out["grad_norm"] = float(sum(norms) / len(norms)) if norms else 0.0
    if critic_norms:
        out["critic_grad_norm"] = float(sum(critic_norms) / len(critic_norms))
    return out


def raw_score_mean(dims, raw_scores: torch.Tensor) -> float:
    """Mean of the raw weighted scores ``[B]`` over every DP rank (scoring ranks only; host)."""
    local = torch.tensor([float(raw_scores.sum()), raw_scores.numel()],  # host
                         dtype=torch.float64, device="cpu")
    total = gather_over_scoring_ranks(dims, local).sum(0)
    return float(total[0] / total[1])


__all__ = ["raw_score_mean", "response_repetition", "rollout_quality", "update_metrics"]
