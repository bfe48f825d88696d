"""PPO-RLHF math as pure fp32 tensor functions (no distributed calls, no config, no I/O).

Modules: ``core`` (masked statistics), ``kl`` (KL estimators and coefficient controllers),
``rewards`` (per-token rewards), ``gae`` (GAE advantages/returns), ``losses`` (policy,
value, entropy and KL losses, their aggregation modes and stats). See each module's
docstring for sources and for what is simplified.
"""

from nemo_rlhf.algorithms.ppo.core import (
    ReduceFn,
    last_valid_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from nemo_rlhf.algorithms.ppo.gae import compute_gae, compute_gae_reference
from nemo_rlhf.algorithms.ppo.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    kl_penalty,
)
from nemo_rlhf.algorithms.ppo.losses import (
    DEFAULT_LOSS_AGG_MODE,
    LOSS_AGG_MODES,
    aggregate_loss,
    entropy_bonus,
    explained_variance,
    finalize_token_stats,
    kl_loss,
    merge_token_stats,
    policy_loss,
    stat_reduce_op,
    value_loss,
)
from nemo_rlhf.algorithms.ppo.rewards import compute_token_rewards, drop_empty_responses

__all__ = [
    "DEFAULT_LOSS_AGG_MODE",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "ReduceFn",
    "aggregate_loss",
    "build_kl_controller",
    "compute_gae",
    "compute_gae_reference",
    "compute_token_rewards",
    "drop_empty_responses",
    "entropy_bonus",
    "explained_variance",
    "finalize_token_stats",
    "kl_loss",
    "kl_penalty",
    "last_valid_index",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "merge_token_stats",
    "policy_loss",
    "stat_reduce_op",
    "value_loss",
]
