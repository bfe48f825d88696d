"""Build the PPO side's reward from config: the served RM and/or reward functions.

Scores are fetched on the *scoring ranks*: model-parallel rank 0 (TP rank 0, PP rank 0)
of every data-parallel replica. megatron's DP group of such a rank holds exactly the
scoring ranks (the DP group joins the ranks with the same TP and PP coordinates), so a
collective over ``dims.dp_group`` called on the scoring ranks only is a collective over
all of them: :func:`gather_over_scoring_ranks` is the one place that does it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from nemo_rlhf.reward.client import RewardModelClient
from nemo_rlhf.reward.functions import (
    CombinedReward,
    RemoteRewardModel,
    RewardFunctionScorer,
    WeightedSource,
)
from nemo_rlhf.reward.normalization import RewardNormalizer
from nemo_rlhf.trainers.ppo.config import RewardConfig


RM_IDENTITY_KEYS = ("checkpoint_path", "checkpoint_step")
"""The served RM's ``/metadata`` -> ``scorer`` keys that say which RM it is (recorded in
the PPO checkpoint; a resume against another RM resets that source's normalisation)."""


def gather_over_scoring_ranks(dims, local: torch.Tensor) -> torch.Tensor:
    """All-gather a small host tensor over the scoring ranks, in DP-rank order.

    Call on every scoring rank (TP rank 0 and PP rank 0 of each DP replica) together, and
    on no other rank.

    Args:
        dims: :class:`~nemo_rlhf.distributed.ParallelDims` of this (scoring) rank.
        local: ``[k]`` host tensor, e.g. a running normaliser's float64 moments.

    Returns:
        ``[dp, k]`` host tensor of the same dtype; ``local[None]`` when DP is 1.
    """
    if dims.dp == 1:
        return local.reshape(1, -1)
    group = dims.dp_group  # host collective (gloo): the DP group's host twin on NCCL
    parts = [torch.empty_like(local) for _ in range(dims.dp)]  # host
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.stack(parts)


def build_reward(cfg: RewardConfig, dims=None):
    """A ``CombinedReward`` over the RM client (if configured) and the reward functions.

    The RM client waits for the server's ``/health`` (``reward.wait_for_server_s``); the
    RM's normalisation stats come from its ``/metadata`` when ``normalization: fixed``, and
    its identity (``RM_IDENTITY_KEYS``) always does.
    With ``running`` normalisation and DP > 1 (``dims``), the statistics are reduced over
    the scoring ranks (:func:`gather_over_scoring_ranks`): one statistic on every DP
    rank, the same as with DP = 1, and the same on every rank after a resume (rank 0's
    saved state is everyone's). Call it on the scoring ranks only.

    Raises:
        ValueError: no source configured, or ``fixed`` normalisation without RM stats.
        RewardServiceError: the RM server is not reachable before the deadline.
    """
    sources = []
    if cfg.rm_url or cfg.rm_address_file:
        kw = dict(timeout_s=cfg.timeout_s, max_retries=cfg.max_retries, max_wait_s=cfg.max_wait_s)
        client = (RewardModelClient(cfg.rm_url, **kw) if cfg.rm_url else
                  RewardModelClient.from_address_file(cfg.rm_address_file,
                                                      wait_s=cfg.wait_for_server_s, **kw))
        client.wait_until_healthy(cfg.wait_for_server_s)
        scorer_meta = client.metadata().get("scorer") or {}  # the RM checkpoint's description
        identity = {k: scorer_meta.get(k) for k in RM_IDENTITY_KEYS}
        norm = None
        if cfg.normalization == "fixed":
            stats = scorer_meta  # the RM trainer's statistics, stored with its checkpoint
            mean, std = stats.get("reward_mean"), stats.get("reward_std")
            if mean is None or std is None:
                raise ValueError("reward.normalization=fixed but the RM server's /metadata has no "
                                 "reward_mean/reward_std; use 'running' or 'none'")
            norm = RewardNormalizer("fixed", mean=float(mean), std=float(std), clip=cfg.clip)
        elif cfg.normalization == "running":
            norm = RewardNormalizer("running", clip=cfg.clip)
        elif cfg.clip is not None:
            norm = RewardNormalizer("none", clip=cfg.clip)
        sources.append(WeightedSource("rm", RemoteRewardModel(client), cfg.rm_weight, norm, identity))
    for spec in cfg.functions:
        sources.append(WeightedSource(spec.name.split(":")[-1], RewardFunctionScorer(spec.name),
                                      spec.weight))
    if not sources:
        raise ValueError("no reward source: set reward.rm_url / reward.rm_address_file and/or "
                         "reward.functions")
    gather = (functools.partial(gather_over_scoring_ranks, dims)
              if dims is not None and dims.dp > 1 else None)
    return CombinedReward(sources, gather=gather, max_abs_score=cfg.max_abs_score)
