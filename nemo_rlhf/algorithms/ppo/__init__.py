"""PPO-RLHF math as pure fp32 tensor functions (no distributed calls, no trainer config, no
I/O).

Modules: ``core`` (masked statistics), ``kl`` (KL estimators and coefficient controllers),
``rewards`` (per-token rewards), ``gae`` (GAE advantages/returns), ``advantages`` (the
registry of advantage estimators: GAE, GRPO / Dr. GRPO, RLOO, REINFORCE++; group
bookkeeping), ``advantages_reference`` (their plain-loop versions, which the tests check
them against), ``losses`` (policy, value, entropy and KL losses, their aggregation modes
and stats), ``objective`` (those losses assembled into one micro-batch's loss),
``critic_metrics`` (the critic's value error by response position),
``rollout_correction`` (importance weights, truncated or masked at a cap, and row
masking of the rollout-vs-train mismatch; the mismatch's k3 KL and the rows a correction
touches). See each module's docstring for sources and for what is
simplified.
"""

from nemo_rlhf.algorithms.ppo.advantages import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATOR_TRAITS,
    AdvantageConfig,
    EstimatorTraits,
    check_groups_divisible,
    check_slice_keeps_groups,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    estimator_traits,
    get_advantage_estimator,
    group_ids_from_samples,
    grpo_advantages,
    register_advantage_estimator,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from nemo_rlhf.algorithms.ppo.core import (
    ReduceFn,
    last_valid_index,
    masked_mean,
    masked_spread,
    masked_sum,
    masked_var,
    masked_whiten,
)
from nemo_rlhf.algorithms.ppo.critic_metrics import (
    POSITION_BUCKETS,
    position_bucket_names,
    value_error_by_position_from_sums,
    value_error_by_position_sums,
)
from nemo_rlhf.algorithms.ppo.gae import (
    compute_decoupled_gae,
    compute_gae,
    compute_gae_reference,
    length_adaptive_lam,
)
from nemo_rlhf.algorithms.ppo.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    PIKLController,
    build_kl_controller,
    kl_penalty,
    pi_kl_coef,
)
from nemo_rlhf.algorithms.ppo.losses import (
    DEFAULT_KL_LOSS_CLAMP,
    DEFAULT_LOSS_AGG_MODE,
    LOSS_AGG_MODES,
    aggregate_loss,
    entropy_bonus,
    explained_variance,
    explained_variance_from_sums,
    explained_variance_sums,
    finalize_token_stats,
    kl_loss,
    merge_token_stats,
    policy_loss,
    stat_reduce_op,
    value_loss,
)
from nemo_rlhf.algorithms.ppo.objective import PPOObjective, critic_loss, ppo_loss
from nemo_rlhf.algorithms.ppo.token_rewards import (compute_token_rewards, drop_empty_responses,
                                                   turn_reward_tensor)
from nemo_rlhf.algorithms.ppo.rollout_correction import (
    rollout_correction_row_counts,
    rollout_correction_weights,
    rollout_train_k3,
)

__all__ = [
    "rollout_correction_row_counts",
    "rollout_correction_weights",
    "rollout_train_k3",
    "ADVANTAGE_ESTIMATORS",
    "ESTIMATOR_TRAITS",
    "EstimatorTraits",
    "estimator_traits",
    "register_advantage_estimator",
    "DEFAULT_KL_LOSS_CLAMP",
    "DEFAULT_LOSS_AGG_MODE",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "AdvantageConfig",
    "FixedKLController",
    "PPOObjective",
    "ReduceFn",
    "PIKLController",
    "aggregate_loss",
    "build_kl_controller",
    "check_groups_divisible",
    "check_slice_keeps_groups",
    "compute_advantages",
    "compute_decoupled_gae",
    "compute_gae",
    "compute_gae_reference",
    "compute_token_rewards",
    "critic_loss",
    "discounted_returns",
    "drop_empty_responses",
    "entropy_bonus",
    "explained_variance",
    "explained_variance_from_sums",
    "explained_variance_sums",
    "finalize_token_stats",
    "gae_advantages",
    "get_advantage_estimator",
    "group_ids_from_samples",
    "grpo_advantages",
    "kl_loss",
    "kl_penalty",
    "last_valid_index",
    "length_adaptive_lam",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_spread",
    "masked_whiten",
    "merge_token_stats",
    "POSITION_BUCKETS",
    "position_bucket_names",
    "pi_kl_coef",
    "policy_loss",
    "ppo_loss",
    "reinforce_plus_plus_advantages",
    "rloo_advantages",
    "stat_reduce_op",
    "turn_reward_tensor",
    "value_error_by_position_from_sums",
    "value_error_by_position_sums",
    "value_loss",
]
