"""Build the PPO side's reward from config: the served RM and/or reward functions."""

from __future__ import annotations

from nemo_rlhf.trainers.ppo.config import RewardConfig


def build_reward(cfg: RewardConfig, dims=None):
    """A ``CombinedReward`` over the RM client (if configured) and the reward functions.

    The RM client waits for the server's ``/health`` (``reward.wait_for_server_s``); the
    RM's normalisation stats come from its ``/metadata`` when ``normalization: fixed``.

    Raises:
        ValueError: no source configured, or ``fixed`` normalisation without RM stats.
        RewardServiceError: the RM server is not reachable before the deadline.
    """
    from nemo_rlhf.reward.client import RewardModelClient
    from nemo_rlhf.reward.functions import (
        CombinedReward,
        RemoteRewardModel,
        RewardFunctionScorer,
        WeightedSource,
    )
    from nemo_rlhf.reward.normalization import RewardNormalizer

    sources = []
    if cfg.rm_url or cfg.rm_address_file:
        kw = dict(timeout_s=cfg.timeout_s, max_retries=cfg.max_retries)
        client = (RewardModelClient(cfg.rm_url, **kw) if cfg.rm_url else
                  RewardModelClient.from_address_file(cfg.rm_address_file,
                                                      wait_s=cfg.wait_for_server_s, **kw))
        client.wait_until_healthy(cfg.wait_for_server_s)
        norm = None
        if cfg.normalization == "fixed":
            meta = client.metadata()
            stats = meta.get("scorer") or {}  # the RM scorer's metadata: checkpoint stats
            mean, std = stats.get("reward_mean"), stats.get("reward_std")
            if mean is None or std is None:
                raise ValueError("reward.normalization=fixed but the RM server's /metadata has no "
                                 "reward_mean/reward_std; use 'running' or 'none'")
            norm = RewardNormalizer("fixed", mean=float(mean), std=float(std), clip=cfg.clip)
        elif cfg.normalization == "running":
            norm = RewardNormalizer("running", clip=cfg.clip)
        elif cfg.clip is not None:
            norm = RewardNormalizer("none", clip=cfg.clip)
        sources.append(WeightedSource("rm", RemoteRewardModel(client), cfg.rm_weight, norm))
    for spec in cfg.functions:
        sources.append(WeightedSource(spec.name.split(":")[-1], RewardFunctionScorer(spec.name),
                                      spec.weight))
    if not sources:
        raise ValueError("no reward source: set reward.rm_url / reward.rm_address_file and/or "
                         "reward.functions")
    return CombinedReward(sources)
