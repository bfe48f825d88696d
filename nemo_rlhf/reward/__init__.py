"""Rewards: the served reward model (server, client), reward functions, normalisation.

Names are imported lazily, so ``import nemo_rlhf.reward.server`` in the RM process does
not pull in torch (``functions`` and ``normalization`` need it; the server and client
do not).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # batching.py: the scorer interface and the dynamic batcher
    "ScoreItem": "batching",
    "Scorer": "batching",
    "DynamicBatcher": "batching",
    "ItemRejected": "batching",
    "ItemTooLong": "batching",
    "validate_token_ids": "batching",
    # server.py
    "RMServerConfig": "server",
    "serve": "server",
    "build_app": "server",
    # config.py: the reward group of the PPO config
    "RMEnsembleConfig": "config",
    "RewardConfig": "config",
    "RewardFunctionSpec": "config",
    # client.py
    "RewardModelClient": "client",
    "RewardServiceError": "client",
    # functions.py
    "CombinedReward": "functions",
    "RemoteRewardModel": "functions",
    "RewardFunctionScorer": "functions",
    "RewardOutput": "functions",
    "WeightedSource": "functions",
    "check_reward_function_spec": "functions",
    "get_reward_function": "functions",
    "BUILTIN_REWARD_FUNCTIONS": "functions",
    # normalization.py
    "RewardNormalizationConfig": "normalization",
    "RewardNormalizer": "normalization",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nemo_rlhf.reward' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"nemo_rlhf.reward.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
