"""Typed config of the PPO main job (``conf/ppo.yaml``), NeMo-Aligner key names where they exist.

Fixed rules are checked in ``__post_init__``; rules that need the world size (batch sizes
vs DP size) in :func:`validate_batch_sizes`, called before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from nemo_rlhf.algorithms.ppo.advantages import (ADVANTAGE_ESTIMATORS, AdvantageConfig, check_gae_settings,
                                                  estimator_parameters, estimator_traits)
from nemo_rlhf.algorithms.ppo.losses import DEFAULT_KL_LOSS_CLAMP, DEFAULT_LOSS_AGG_MODE
from nemo_rlhf.algorithms.ppo.objective import PPOObjective
from nemo_rlhf.algorithms.ppo.kl import KL_CONTROLLERS, KL_ESTIMATORS, PI_DEFAULTS, check_pi_settings
from nemo_rlhf.algorithms.ppo.losses import LOSS_AGG_MODES
from nemo_rlhf.algorithms.ppo.rollout_correction import IS_MODES
from nemo_rlhf.config import check_choice
from nemo_rlhf.data.datasets import DataConfig
from nemo_rlhf.distributed.parallel import ParallelConfig
from nemo_rlhf.envs.config import EnvConfig
from nemo_rlhf.models.config import ModelConfig
from nemo_rlhf.reward.config import RewardConfig
from nemo_rlhf.reward.functions import check_reward_function_spec
from nemo_rlhf.rollout.config import RolloutConfig
from nemo_rlhf.trainers.config import ExpManagerConfig, TrainerConfig
from nemo_rlhf.trainers.mixed_precision import OptimizerConfig
from nemo_rlhf.trainers.ppo.context_parallel import check_context_parallel
from nemo_rlhf.metrics.trackers import LoggerConfig

KL_TEMPERATURES = ("sampling", "unscaled")
REFERENCE_MODES = ("offload", "colocated", "adapters_off")
GUARD_ACTIONS = ("off", "warn", "stop")


@dataclass
class PPOTrainerConfig(TrainerConfig):
    """Loop control of the PPO job (group ``trainer``): the shared keys plus PPO's own."""

    sample_table_every: int = 5
    """Print a table of sample prompts/responses/rewards every N steps (0: never)."""
    critic_warmup_steps: int = 0
    """First N steps train the critic only, on the rollouts of the policy, which does not move
    (VC-PPO's value pretraining, arXiv:2503.01491; with ``ppo.lam_critic=1.0`` its Monte-Carlo
    targets): policy loss off; ``critic.mode=shared``/``shared_detached``: only the value
    head's parameters stepped (the backbone's gradient is dropped: no update, Adam state or
    decay); ``separate``: the whole critic trains and the actor takes no step."""
    max_consecutive_nonfinite: int = 3
    """Stop after this many consecutive skipped (NaN/Inf) updates."""
    deterministic: bool = False
    """Deterministic mode: a run repeated with the same seed on the same machine, software
    and layout is bit-identical. Sets ``torch.use_deterministic_algorithms(True,
    warn_only=False)`` (an op without a deterministic implementation raises, naming it),
    megatron's ``deterministic_mode``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``,
    ``NCCL_ALGO=Ring``, ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` before anything is built
    (:mod:`nemo_rlhf.distributed.determinism`). Costs and what it does not cover:
    docs/reproducibility.md."""
    max_eval_samples: int = 200
    """Cap on evaluated held-out prompts."""
    eval_checker: Optional[str] = None
    """Task checker for ``eval/accuracy`` (``module:function`` or a short name of
    :data:`~nemo_rlhf.reward.functions.BUILTIN_REWARD_FUNCTIONS`; null: off; the demo
    tasks' checkers are in :mod:`nemo_rlhf.tasks`)."""
    eval_extra_checkers: list[str] = field(default_factory=list)
    """More checkers averaged on the held-out set, each logged as ``eval/<name>``
    (e.g. ``just_the_number``, answer-format compliance)."""
    eval_judge: Optional[str] = None
    """An independent judge of the held-out responses: a second RM server's URL
    (``http://host:port``) or a reward function (``module:function`` or a built-in short name).
    Logged as ``eval/judge_score`` and ``eval/judge_win_rate_vs_initial``; None: only the
    self-judged ``eval/win_rate_vs_initial`` (by the reward being optimised)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eval_checker is not None:
            check_reward_function_spec("trainer.eval_checker", self.eval_checker)
        if self.eval_judge is not None and not str(self.eval_judge).startswith(("http://", "https://")):
            check_reward_function_spec("trainer.eval_judge", self.eval_judge)
        for i, name in enumerate(self.eval_extra_checkers):
            check_reward_function_spec(f"trainer.eval_extra_checkers[{i}]", name)


@dataclass
class PPOAlgoConfig:
    """PPO hyper-parameters (group ``ppo``; NeMo-Aligner's ``model.ppo`` names)."""

    num_rollout_samples: int = 32
    """Samples (responses) rolled out per PPO step, across all DP ranks: with
    ``rollout.n_samples_per_prompt = n``, ``num_rollout_samples / n`` prompts each
    sampled ``n`` times."""
    global_batch_size: int = 16
    """Samples per optimizer step (a mini-batch), across all DP ranks."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one rank."""
    forward_micro_batch_size: int = 8
    """Samples per forward-only pass (old log-probs, values, reference)."""
    ppo_epochs: int = 2
    """Passes over the rollout per step."""
    clip_eps: float = PPOObjective.clip_eps
    """Policy clip range epsilon (``PPOObjective.clip_eps``)."""
    clip_eps_low: Optional[float] = None
    """Asymmetric lower clip (None: clip_eps)."""
    clip_eps_high: Optional[float] = None
    """Asymmetric upper clip (None: clip_eps)."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (None: off)."""
    value_clip: Optional[float] = PPOObjective.value_clip
    """Value clip range around the old values (None: off)."""
    value_loss_coef: float = PPOObjective.value_loss_coef
    """vf_coef in loss = policy + value_loss_coef * value - entropy_coef * entropy (small: with the
    shared backbone of ``critic.mode=shared`` it keeps the critic's gradient from dominating)."""
    entropy_coef: float = PPOObjective.entropy_coef
    """Entropy coefficient (``PPOObjective.entropy_coef``)."""
    gamma: float = AdvantageConfig.gamma
    """Discount gamma (``AdvantageConfig.gamma``: ``gae``, ``reinforce_plus_plus``)."""
    lam: float = AdvantageConfig.lam
    """GAE lambda (``AdvantageConfig.lam``): of the advantages and of the critic's targets,
    unless ``lam_critic`` / ``lam_policy`` / ``lam_policy_alpha`` set them apart."""
    lam_critic: Optional[float] = AdvantageConfig.lam_critic
    """``gae``: lambda of the returns, the critic's value targets, in ``[0, 1]`` (null:
    ``ppo.lam``). VC-PPO (Yuan et al. 2025, arXiv:2503.01491) decouples it from the policy's
    and uses 1.0: Monte-Carlo targets, the final reward undecayed at every token of a long
    response (``AdvantageConfig.lam_critic``)."""
    lam_policy: Optional[float] = AdvantageConfig.lam_policy
    """``gae``: lambda of the policy's advantages, in ``[0, 1]`` (null: ``ppo.lam``; VC-PPO:
    0.95) (``AdvantageConfig.lam_policy``)."""
    lam_policy_alpha: Optional[float] = AdvantageConfig.lam_policy_alpha
    """``gae``: VAPO's length-adaptive policy lambda (Yue et al. 2025, arXiv:2504.05118): each
    sequence's advantages use ``1 - 1 / (alpha * l)``, ``l`` its policy-token count, clamped
    to ``[0, 1]``; > 0 (VAPO: 0.05); null: off. Replaces ``ppo.lam_policy`` (setting both is
    refused) (``AdvantageConfig.lam_policy_alpha``)."""
    normalize_advantages: bool = True
    """Whiten ``gae`` advantages over valid tokens (statistics all-reduced over DP); the
    critic-free estimators normalise by their own rule and are not whitened again. A
    rollout whose kept sequences all got the same task reward is not whitened unless
    ``ppo.whiten_constant_rewards`` (metric ``advantages_whitened``)."""
    whiten_constant_rewards: bool = False
    """With ``ppo.normalize_advantages``: whiten also a rollout in which every kept sequence
    got the same task reward (its score, plus ``ppo.missing_eos_penalty`` and per-turn
    environment rewards; the KL penalty is not part of it), over all DP ranks. Default
    false: such a step's GAE advantages are left raw, the value head's errors and the
    discounted KL penalty, because whitening would give them unit variance and push the
    policy by a signal no reward is behind (one run on the SmolLM2 calculator, every one
    of its 64 first episodes right: whitened, the tool call broke; unwhitened, it held;
    docs/tasks.md). The step logs ``advantages_whitened`` (1 whitened, 0 left raw)."""
    advantage_estimator: str = AdvantageConfig.estimator
    """``gae`` (with the critic), or critic-free: ``grpo`` (group-normalised outcome, Shao
    et al. 2024), ``rloo`` (leave-one-out baseline, Ahmadian et al. 2024),
    ``reinforce_plus_plus`` (batch-whitened returns, Hu 2025). Critic-free: no values are
    computed and the value head is not trained. ``grpo``/``rloo`` need
    ``rollout.n_samples_per_prompt >= 2``. Also any name registered with
    :func:`~nemo_rlhf.algorithms.ppo.advantages.register_advantage_estimator`: what it needs
    is read from its :class:`~nemo_rlhf.algorithms.ppo.advantages.EstimatorTraits`."""
    norm_by_std: bool = AdvantageConfig.norm_by_std
    """``grpo``: divide by the group's std (GRPO); false: Dr. GRPO (Liu et al. 2025)."""
    loss_agg_mode: str = DEFAULT_LOSS_AGG_MODE
    """How token losses become one loss, always over global (all micro-batches, all DP
    ranks) counts: ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
    ``seq-mean-token-sum-norm`` (horizon: ``rollout.max_new_tokens``); see
    :func:`nemo_rlhf.algorithms.ppo.losses.aggregate_loss`."""
    missing_eos_penalty: Optional[float] = None
    """Added to the score of truncated responses (None: off)."""
    shuffle: bool = True
    """Shuffle the rollout before splitting it into mini-batches."""
    rollout_is_cap: Optional[float] = None
    """Importance weights of the rollout-vs-train mismatch (and, with ``rollout.mode=async``,
    of the samples' older behaviour policy): each token's policy loss is weighted by
    ``rho = exp(old_logprob - rollout_logprob)``, the training engine's old (proximal)
    log-prob over the rollout engine's, limited at this cap as ``rollout_is_mode`` says
    (>= 1, e.g. 2.0; None: off); :mod:`nemo_rlhf.algorithms.ppo.rollout_correction`.
    Metrics ``rollout_correction/*``."""
    rollout_is_mode: str = "truncate"
    """How ``rollout_is_cap`` limits the weight: ``truncate`` -- ``min(rho, cap)``, truncated
    importance sampling (Yao et al. 2025; verl's ``rollout_is`` truncate mode); ``mask`` --
    ``rho`` where ``rho <= cap``, else the token is dropped from the policy loss (AReaL's
    decoupled objective, ``behav_imp_weight_cap``). Needs ``rollout_is_cap``."""
    rollout_mask_threshold: Optional[float] = None
    """Drop from the policy loss every row with a token whose ``|old_logprob -
    rollout_logprob|`` exceeds this many nats (> 0; None: off)."""
    max_tokens_per_micro_batch: int = 0
    """Form micro-batches by a token budget instead of a row count: the rows of a mini-batch
    (and of the forward-only passes) sorted by length and packed into micro-batches of at
    most this many padded tokens (rows x longest row), each with the padding its rows do
    not need cut away (:mod:`nemo_rlhf.trainers.ppo.micro_batches`); ``micro_batch_size``
    and ``forward_micro_batch_size`` are then not used. 0: fixed row counts over the
    rollout's full width. Under pipeline parallelism the stages send each activation's
    shape ahead of it."""
    old_logprobs_from_rollout: bool = False
    """Take the old log-probs (and, with the value head on the actor's backbone, the old
    values) from the rollout instead of a forward-only pass over it: the megatron engine's
    sampling log-probs (at ``rollout.logprob_temperature``, before top-k/top-p) and its
    value head on each decode step's hidden states. Saves one of the step's three
    forwards (old, reference, RM). The ratio on the first mini-batch is then ~1 instead of
    exactly 1 (the decode and the training forward differ in the last bits;
    ``rollout_correction/mismatch`` no longer measures it). Needs ``kl.temperature`` to
    give the rollout's temperature; with a shared critic, ``rollout.engine=megatron`` and
    ``rollout.use_kv_cache=true``. Refused with ``rollout_is_cap`` /
    ``rollout_mask_threshold``, which would then compare the rollout's log-probs with
    themselves."""
    sequence_packing: bool = False
    """With ``max_tokens_per_micro_batch``: concatenate the sequences (their valid tokens)
    into packed rows of ``packed_row_length`` tokens, attention kept within each sequence
    (block-diagonal causal mask, positions per sequence), so neither the transformer
    layers nor the output layer compute on padding (:mod:`nemo_rlhf.models.packing`); the
    budget then counts packed rows x their fill. Log-probs, values and gradients equal the
    padded forward's (fp32, up to summation order) at any TP / PP layout."""
    packed_row_length: int = 0
    """Tokens per packed row with ``sequence_packing`` (0: the mini-batch's longest
    sequence; a longer row packs more sequences together but its attention, a dense
    masked ``row x row`` product, costs more per token)."""
    logprob_chunk_size: int = 1024
    """Tokens (batch x response positions) per chunk of the fused output layer + log-probs
    (old, reference and training log-probs): only the response positions go through the
    output layer, at most this many at once, forward and backward, so the micro-batch's
    ``[tokens, vocab]`` logits never exist whole
    (:func:`nemo_rlhf.models.vocab_parallel.chunked_linear_logprobs`). 0: the logits path
    (the whole sequence's logits materialised)."""

    def __post_init__(self) -> None:
        for key in ("num_rollout_samples", "global_batch_size", "micro_batch_size",
                    "forward_micro_batch_size", "ppo_epochs"):
            if getattr(self, key) < 1:
                raise ValueError(f"ppo.{key}={getattr(self, key)}: must be >= 1")
        if self.rollout_is_cap is not None and not self.rollout_is_cap >= 1.0:
            raise ValueError(f"ppo.rollout_is_cap={self.rollout_is_cap}: must be >= 1 (null: off)")
        check_choice("ppo.rollout_is_mode", self.rollout_is_mode, IS_MODES)
        if self.rollout_is_mode == "mask" and self.rollout_is_cap is None:
            raise ValueError("ppo.rollout_is_mode=mask drops the tokens whose importance weight "
                             "exceeds ppo.rollout_is_cap, which is null: set ppo.rollout_is_cap "
                             "(e.g. 2.0) or ppo.rollout_is_mode=truncate")
        if self.rollout_mask_threshold is not None and not self.rollout_mask_threshold > 0.0:
            raise ValueError(f"ppo.rollout_mask_threshold={self.rollout_mask_threshold}: must be > 0 "
                             f"nats (null: off)")
        if self.old_logprobs_from_rollout and (self.rollout_is_cap is not None
                                               or self.rollout_mask_threshold is not None):
            # the correction compares the training engine's old log-probs with the rollout's;
            # taken from the rollout, they are the same numbers: every weight 1, nothing masked
            raise ValueError(
                f"ppo.old_logprobs_from_rollout=true makes ppo.rollout_is_cap={self.rollout_is_cap} / "
                f"ppo.rollout_mask_threshold={self.rollout_mask_threshold} a no-op (the old log-probs "
                f"would be compared with themselves): set ppo.old_logprobs_from_rollout=false to "
                f"correct the rollout-vs-train mismatch, or both corrections to null")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"ppo.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}: must be "
                             f">= 0 (0: micro-batches of ppo.micro_batch_size rows)")
        if self.sequence_packing and self.max_tokens_per_micro_batch == 0:
            raise ValueError("ppo.sequence_packing=true needs a token budget: set "
                             "ppo.max_tokens_per_micro_batch > 0 (tokens per packed micro-batch)")
        if self.packed_row_length < 0:
            raise ValueError(f"ppo.packed_row_length={self.packed_row_length}: must be >= 0 "
                             f"(0: the longest sequence of the mini-batch)")
        if self.logprob_chunk_size < 0:
            raise ValueError(f"ppo.logprob_chunk_size={self.logprob_chunk_size}: must be >= 0 "
                             f"(0: materialise the logits)")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"ppo.clip_eps={self.clip_eps}: must be in (0, 1)")
        check_gae_settings("ppo", gamma=self.gamma, lam=self.lam, lam_critic=self.lam_critic,
                           lam_policy=self.lam_policy, lam_policy_alpha=self.lam_policy_alpha)
        check_choice("ppo.advantage_estimator", self.advantage_estimator, sorted(ADVANTAGE_ESTIMATORS))
        check_choice("ppo.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)


@dataclass
class KLConfig:
    """KL penalty in the reward (group ``kl``)."""

    type: str = "adaptive"
    """``fixed``, ``adaptive`` (Ziegler et al. 2019: reacts over ``horizon`` samples) or
    ``pi`` (a proportional-integral rule on ``log(KL / target)``, one update per PPO step,
    for short runs: ``nemo_rlhf.algorithms.ppo.kl.pi_kl_coef``). The controllers move the
    reward's beta: with ``in_reward=false`` only ``fixed`` is accepted."""
    init_kl_coef: float = 0.05
    """Initial beta."""
    target: float = 6.0
    """Adaptive: target KL per sequence (nats, summed over the response)."""
    horizon: int = 10000
    """Adaptive: horizon in samples."""
    pi_kp: float = PI_DEFAULTS["kp"]
    """Pi: proportional gain on the step's change of ``log(KL / target)``."""
    pi_ki: float = PI_DEFAULTS["ki"]
    """Pi: integral gain (beta is multiplied by ``(KL / target) ** pi_ki`` each step)."""
    pi_error_clip: float = PI_DEFAULTS["error_clip"]
    """Pi: bound of ``|log(KL / target)|`` (2.0: KL from 0.14x to 7.4x the target is seen)."""
    pi_max_factor: float = PI_DEFAULTS["max_factor"]
    """Pi: the most beta changes in one step, as a factor (4.0: at most x4 or /4)."""
    pi_min_coef: float = PI_DEFAULTS["min_coef"]
    """Pi: the lowest beta, >= 0 (1e-3: small, so beta can fall below ``init_kl_coef``, and > 0,
    so the multiplicative rule can raise it again; ``nemo_rlhf.algorithms.ppo.kl.pi_kl_coef``
    says what it bounds). Set it to ``init_kl_coef`` for a beta that only rises from its start
    (``conf/ppo_smollm2.yaml`` does: its tables were measured so)."""
    pi_max_coef: float = PI_DEFAULTS["max_coef"]
    """Pi: the highest beta, >= ``pi_min_coef`` and ``init_kl_coef`` (10: one nat of KL then costs
    ten times a reward of scale 1; a ceiling bounds how many steps beta needs to come back down
    after a run whose KL the penalty could not hold; ``nemo_rlhf.algorithms.ppo.kl.pi_kl_coef``)."""
    estimator: str = "k1"
    """``k1``, ``k2`` or ``k3``."""
    clamp: Optional[float] = None
    """Clamp the per-token KL to [-clamp, clamp]: the reward's KL (None: off there) and the
    KL loss term's (None: ``DEFAULT_KL_LOSS_CLAMP``, 10 nats, as verl)."""
    temperature: str = "sampling"
    """Temperature of both log-probs in the KL: ``sampling`` (default, as TRL: the rollout's
    logprob_temperature, the distribution the actor samples from and PPO trains) or
    ``unscaled`` (1.0: the InstructGPT objective's KL(pi || pi_ref))."""
    in_reward: bool = True
    """Subtract ``beta * KL_t`` from the token rewards (InstructGPT). False: no KL in the
    reward (then set ``kl.loss_coef`` for a KL term in the loss, as GRPO recipes do), and
    ``kl.type`` must be ``fixed``: no controller, the metric ``kl_coef`` reads 0 and
    ``kl_loss_coef`` the loss's weight."""
    loss_coef: float = 0.0
    """Weight of a KL(actor || reference) term added to the PPO loss (0: off); aggregated
    like the other losses (``ppo.loss_agg_mode``); may be combined with ``in_reward``."""
    loss_estimator: str = "k3"
    """Estimator of the loss's KL term: ``k1``, ``k2`` or ``k3`` (Schulman 2020; k3 is
    non-negative and unbiased, GRPO's choice)."""

    def __post_init__(self) -> None:
        check_choice("kl.type", self.type, sorted(KL_CONTROLLERS))
        check_choice("kl.estimator", self.estimator, sorted(KL_ESTIMATORS))
        check_choice("kl.temperature", self.temperature, KL_TEMPERATURES)
        check_choice("kl.loss_estimator", self.loss_estimator, sorted(KL_ESTIMATORS))
        if self.loss_coef < 0:
            raise ValueError(f"kl.loss_coef={self.loss_coef}: must be >= 0 (0: off)")
        if not self.in_reward and self.type != "fixed":
            raise ValueError(
                f"kl.type={self.type!r} with kl.in_reward=false: a KL controller moves the reward's "
                f"beta, which kl.in_reward=false does not use; valid choices with kl.in_reward=false "
                f"are ['fixed'] (the loss's KL term has the fixed weight kl.loss_coef={self.loss_coef:g}); "
                f"set kl.type=fixed, or kl.in_reward=true for a controlled KL penalty")
        if self.type == "pi":  # the ranges are the controller's (kl.PI_RANGES), named by key
            check_pi_settings({"init_kl_coef": self.init_kl_coef, "target": self.target, **self.pi_settings()},
                              keys={"init_kl_coef": "kl.init_kl_coef", "target": "kl.target",
                                    **{name: f"kl.pi_{name}" for name in PI_DEFAULTS}},
                              where=" with kl.type=pi")

    def pi_settings(self) -> dict:
        """The pi controller's settings (``build_kl_controller``'s ``pi``): ``{name: kl.pi_<name>}``
        for each name of ``PI_DEFAULTS``."""
        return {name: getattr(self, f"pi_{name}") for name in PI_DEFAULTS}


@dataclass
class ReferenceConfig:
    """The frozen reference policy (group ``reference``)."""

    mode: Optional[str] = None
    """``offload`` (host copy swapped into the backbone), ``colocated`` (resident copy) or
    ``adapters_off`` (with ``model.lora.enabled``: the reference is the frozen base, the
    same forward with the adapters switched off; no reference weights kept). None:
    ``adapters_off`` with LoRA, ``offload`` without (:meth:`PPOConfig.__post_init__`)."""

    def __post_init__(self) -> None:
        if self.mode is not None:
            check_choice("reference.mode", self.mode, REFERENCE_MODES)


CRITIC_MODES = ("shared", "shared_detached", "separate")


@dataclass
class CriticConfig:
    """Where the critic (value function) lives (group ``critic``)."""

    mode: str = "shared"
    """``shared``: a value head on the actor's backbone, and the value loss trains that
    backbone too (InstructGPT/NeMo-Aligner's critic on the actor); ``shared_detached``: the
    value head reads the backbone's hidden states with the gradient stopped, so the critic
    cannot disturb the policy (Stiennon et al. 2020, App. G.1), at the cost of a weaker
    critic; ``separate``: its own backbone + value head and its own optimizer (twice the
    trained model state), checkpointed beside the actor (``critic.`` tensors) and resharded
    like it; the actor then has no value head. With ``model.lora.enabled``, ``separate`` is a
    second adapter set and a value head on the actor's frozen base (shared, not copied)."""
    init_from: Optional[str] = None
    """``separate``: checkpoint the critic starts from (backbone, and value head when it
    has one): an SFT/actor checkpoint, an RM checkpoint (its reward head becomes the value
    head) or a separate-critic PPO checkpoint (its critic). None: ``exp_manager.init_from``
    (the value head initialised)."""
    lr: Optional[float] = None
    """``separate``: the critic optimizer's peak learning rate (None: ``optim.lr``; the rest
    of ``optim`` applies to both)."""

    def __post_init__(self) -> None:
        check_choice("critic.mode", self.mode, CRITIC_MODES)
        if self.mode != "separate" and (self.init_from is not None or self.lr is not None):
            raise ValueError(f"critic.init_from / critic.lr are for critic.mode=separate "
                             f"(critic.mode={self.mode!r})")


@dataclass
class PPOExpManagerConfig(ExpManagerConfig):
    """Experiment folder, checkpoints and resume of the PPO job (group ``exp_manager``): the
    shared keys plus PPO's own."""

    init_from: Optional[str] = None
    """Checkpoint of the initial (SFT) policy; also the reference weights."""
    init_value_head: bool = True
    """Initialise the value head if ``init_from`` has none (an SFT checkpoint)."""


@dataclass
class MoEConfig:
    """Mixture-of-experts rollout settings (config section ``moe``; the MoE model itself is
    ``model.num_moe_experts`` and the ``model.moe_*`` keys)."""

    routing_replay: bool = False
    """R3 routing replay (arXiv 2510.11370): the megatron rollout records each token's top-k
    experts (``RolloutBatch.routes`` ``[B, P+R, L, k]``) and the actor's forwards of the
    step route the tokens to them (:mod:`nemo_rlhf.models.routing_replay`): the old
    log-probs' forward (and the values of a value head on the actor's backbone, which come
    out of that forward) and every training forward of the policy loss. The reference and a
    separate critic (``critic.mode=separate``) route by their own routers. The routes ride
    with the rows through the mini-batches and the fixed-row and token-budget micro-batches
    (``ppo.max_tokens_per_micro_batch``); an expert-parallel filler micro-batch is not
    replayed (its output is dropped). Refused (naming the key): a dense model,
    ``rollout.engine=vllm``, ``rollout.mode=async``, ``env.name``, ``rollout.use_kv_cache=false``,
    ``ppo.sequence_packing=true`` and ``model.recompute_granularity=full``."""

    def check(self, model: ModelConfig, rollout: RolloutConfig, ppo: Optional[PPOAlgoConfig] = None,
              env: Optional[EnvConfig] = None) -> None:
        """Refuse ``moe.routing_replay=true`` where it cannot run (naming the key and what works).

        Raises:
            ValueError: a dense model; ``rollout.engine`` other than megatron (only its
                decode records the routes); ``rollout.mode=async`` (the routes do not cross
                the rollout transport); ``env.name`` (multi-turn episodes record none);
                ``rollout.use_kv_cache=false`` (recording needs the KV-cache decode);
                ``ppo.sequence_packing=true`` (packed micro-batches carry no routes);
                ``model.recompute_granularity=full`` (the backward's recompute re-runs the
                routers after the replay of the micro-batch's forward is removed).
        """
        if not self.routing_replay:
            return
        if model.num_moe_experts is None:
            raise ValueError("moe.routing_replay=true with a dense model (model.num_moe_experts=null): "
                             "there are no routes to replay; set moe.routing_replay=false")
        if rollout.engine != "megatron":
            raise ValueError(f"moe.routing_replay=true with rollout.engine={rollout.engine}: only the "
                             f"megatron engine records the routes; set rollout.engine=megatron or "
                             f"moe.routing_replay=false")
        refused = [
            (rollout.mode == "async", f"rollout.mode={rollout.mode}",
             "the routes do not cross the rollout transport to the trainer; use rollout.mode=sync"),
            (env is not None and env.name is not None, f"env.name={getattr(env, 'name', None)}",
             "multi-turn episodes record no routes; routing replay covers single-turn rollouts"),
            (not rollout.use_kv_cache, "rollout.use_kv_cache=false",
             "the routes are recorded by the KV-cache decode; set rollout.use_kv_cache=true"),
            (ppo is not None and ppo.sequence_packing, "ppo.sequence_packing=true",
             "packed micro-batches carry no routes; set ppo.sequence_packing=false (the token budget "
             "ppo.max_tokens_per_micro_batch without packing carries them)"),
            (model.recompute_granularity == "full", "model.recompute_granularity=full",
             "the backward's recompute would re-run the routers without the replay; use "
             "model.recompute_granularity=selective or null"),
        ]
        for bad, key, why in refused:
            if bad:
                raise ValueError(f"moe.routing_replay=true with {key}: {why} (or set moe.routing_replay=false)")


@dataclass
class GuardConfig:
    """Reward-hacking guard (group ``guards``): warn or stop when the signs appear."""

    action: str = "warn"
    """``off``, ``warn`` or ``stop`` (save a checkpoint and stop)."""
    window: int = 5
    """Steps between the two compared entries: step s is compared with step s - window (>= 1)."""
    max_length_growth: float = 1.5
    """Trigger when the raw reward (``reward_raw_mean``) rises while response length grows by
    more than this factor."""
    max_repetition: float = 0.5
    """Trigger when the raw reward rises while the n-gram repetition rate exceeds this."""
    kl_ceiling: float = 50.0
    """Trigger when kl_mean (per sequence) exceeds this, whatever the reward does."""
    gold_metric: Optional[str] = "eval/accuracy"
    """The trusted held-out metric (higher is better): trigger when ``proxy_metric`` rises
    while it falls between evaluations ``gold_window`` apart. Checked only on steps whose
    metrics hold both (``trainer.val_check_interval``; ``eval/accuracy`` needs
    ``trainer.eval_checker``); null turns the check off."""
    proxy_metric: str = "eval/reward"
    """The held-out raw reward (what PPO optimises) compared with ``gold_metric``."""
    gold_window: int = 2
    """Evaluations between the two compared ones (>= 1)."""
    gold_min_drop: float = 0.0
    """How far (absolute) the gold metric must fall to trigger (>= 0)."""
    gold_min_gain: Optional[float] = None
    """"Reward up, quality flat": trigger when ``proxy_metric`` rose by more than
    ``proxy_min_rise`` while ``gold_metric`` rose by less than this (absolute) between the
    compared evaluations (null: off)."""
    proxy_min_rise: float = 0.0
    """With ``gold_min_gain``: the proxy's rise (absolute) that counts as a rise (>= 0)."""
    kl_over_target: Optional[float] = None
    """With ``kl.type=adaptive`` or ``pi``: trigger when ``kl_mean`` exceeds this multiple of
    ``kl.target`` at every step of a whole window (``window + 1`` steps): the controller
    is not holding its target (null: off)."""

    def __post_init__(self) -> None:
        check_choice("guards.action", self.action, GUARD_ACTIONS)
        if self.window < 1:
            raise ValueError(f"guards.window={self.window}: must be >= 1")
        if self.gold_window < 1:
            raise ValueError(f"guards.gold_window={self.gold_window}: must be >= 1")
        if self.gold_min_drop < 0:
            raise ValueError(f"guards.gold_min_drop={self.gold_min_drop}: must be >= 0")
        if self.proxy_min_rise < 0:
            raise ValueError(f"guards.proxy_min_rise={self.proxy_min_rise}: must be >= 0")
        if self.kl_over_target is not None and self.kl_over_target <= 0:
            raise ValueError(f"guards.kl_over_target={self.kl_over_target}: must be > 0 (null: off)")


@dataclass
class PPOConfig:
    """The whole PPO job."""

    trainer: PPOTrainerConfig = field(default_factory=PPOTrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOAlgoConfig = field(default_factory=PPOAlgoConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    """``train_file``: PPO prompts; ``val_file``: held-out evaluation prompts."""
    exp_manager: PPOExpManagerConfig = field(default_factory=PPOExpManagerConfig)
    guards: GuardConfig = field(default_factory=GuardConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    """MoE rollout settings (``moe.routing_replay``)."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """W&B / MLflow beside TensorBoard (:mod:`nemo_rlhf.metrics.trackers`)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn / tool rollouts (:mod:`nemo_rlhf.envs.config`; ``env.name`` null:
    single-turn, docs/multi-turn.md)."""

    def __post_init__(self) -> None:
        # Every rollout row holds at least its first generated token (an EOS drawn first
        # gives the one-token response [EOS]), so with >= 1 new token no response is
        # empty and every score has a token to sit on.
        if self.rollout.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens={self.rollout.max_new_tokens}: the PPO "
                             f"trainer needs >= 1 (a response must have a token to carry its "
                             f"score)")
        est, n = self.ppo.advantage_estimator, self.rollout.n_samples_per_prompt
        traits = estimator_traits(est)
        if traits.needs_groups and n < 2:
            raise ValueError(f"ppo.advantage_estimator={est} compares the samples of one prompt: "
                             f"set rollout.n_samples_per_prompt >= 2 (got {n})")
        if not traits.needs_values and self.critic.mode == "separate":
            raise ValueError(f"critic.mode=separate with the critic-free ppo.advantage_estimator="
                             f"{est}: no critic is trained; use critic.mode=shared")
        for key in ("lam_critic", "lam_policy", "lam_policy_alpha"):
            if getattr(self.ppo, key) is not None and key not in estimator_parameters(est):
                raise ValueError(f"ppo.{key}={getattr(self.ppo, key)} with ppo.advantage_estimator={est}, "
                                 f"which does not read it (only gae does): set it to null")
        if not traits.needs_values and self.trainer.critic_warmup_steps:
            raise ValueError(f"trainer.critic_warmup_steps={self.trainer.critic_warmup_steps} with "
                             f"the critic-free ppo.advantage_estimator={est}: set it to 0")
        if self.ppo.old_logprobs_from_rollout:
            self._check_rollout_logprobs()
        if self.rollout.mode == "async":
            self._check_async()
        self._check_env()
        self._check_eval_metric_names()
        self.moe.check(self.model, self.rollout, self.ppo, self.env)
        self._resolve_reference_mode()
        check_context_parallel(self)  # parallel.context_parallel_size: what is wired

    def _check_eval_metric_names(self) -> None:
        """A reward function that is also a held-out extra checker would write one metric,
        ``eval/<name>``, twice (the source's mean over the valid scores, then the checker's over
        every answer): refused, naming both keys."""
        sources = {f.name for f in self.reward.functions}
        for i, name in enumerate(self.trainer.eval_extra_checkers):
            if name in sources:
                raise ValueError(f"trainer.eval_extra_checkers[{i}]={name!r} is also in reward.functions: "
                                 f"the held-out evaluation logs each reward source as eval/{name} already; "
                                 f"remove it from trainer.eval_extra_checkers")

    def _check_env(self) -> None:
        """``env.name``: what multi-turn rollouts support so far; the ``env`` reward
        function needs an environment; ``env.turn_rewards=per_turn`` needs one too, a
        per-token estimator (not ``EstimatorTraits.outcome_only``) and no ``env`` reward
        function (it would count the environment's reward twice). With
        ``ppo.old_logprobs_from_rollout`` the episodes' behaviour log-probs are the old
        log-probs (megatron or vLLM engine, as single-turn: :meth:`_check_rollout_logprobs`),
        and with a value head on the actor's backbone the old values the megatron decode's
        (the vLLM engine has none: refused when the engine is built, as single-turn).
        ``rollout.min_new_tokens`` holds per policy turn on the megatron engine; the vLLM
        engine's episodes refuse it."""
        names = [f.name for f in self.reward.functions]
        checkers = [("trainer.eval_checker", self.trainer.eval_checker)] + [
            (f"trainer.eval_extra_checkers[{i}]", c) for i, c in enumerate(self.trainer.eval_extra_checkers)]
        for key, checker in checkers:
            if checker == "env":
                raise ValueError(f"{key}=env: the held-out evaluation is single-turn (no episode reward); "
                                 f"name a checker of the final answer (e.g. arithmetic_exact_match)")
        if not self.env.enabled:
            if "env" in names:
                raise ValueError("reward.functions names 'env' (the environment's episode reward) "
                                 "with env.name=null (single-turn rollouts, no environment): set "
                                 "env.name or remove the 'env' reward function")
            if self.env.turn_rewards != "sum":
                raise ValueError(f"env.turn_rewards={self.env.turn_rewards} with env.name=null "
                                 f"(single-turn rollouts, no environment reward): set env.name or "
                                 f"env.turn_rewards=sum")
            return
        if self.env.turn_rewards == "per_turn":
            est = self.ppo.advantage_estimator
            if estimator_traits(est).outcome_only:
                raise ValueError(f"env.turn_rewards=per_turn with ppo.advantage_estimator={est}, which reads "
                                 f"only each row's summed reward (where a turn's reward sits changes "
                                 f"nothing): use env.turn_rewards=sum, or a per-token estimator (gae, "
                                 f"reinforce_plus_plus)")
            if "env" in names:
                raise ValueError("env.turn_rewards=per_turn with reward.functions naming 'env': the "
                                 "environment's rewards already sit at the end of their turns, the 'env' "
                                 "function would count them again: remove it from reward.functions (or "
                                 "use env.turn_rewards=sum)")
        if self.rollout.min_new_tokens != 0 and self.rollout.engine == "vllm":
            # per policy turn on the megatron engine (nemo_rlhf.rollout.episodes)
            raise ValueError(f"env.name={self.env.name!r} with rollout.min_new_tokens="
                             f"{self.rollout.min_new_tokens} and rollout.engine=vllm: the vLLM engine's "
                             f"episodes do not apply a per-turn minimum yet (the megatron engine's do); "
                             f"set rollout.min_new_tokens=0 or rollout.engine=megatron")

    def _check_async(self) -> None:
        """``rollout.mode=async``: the trainer recomputes the old log-probs, and off-policy
        samples need the decoupled objective's importance weights (``ppo.rollout_is_cap``;
        ``ppo.rollout_mask_threshold`` alone only rejects rows)."""
        r, p = self.rollout, self.ppo
        if p.old_logprobs_from_rollout:
            raise ValueError("rollout.mode=async with ppo.old_logprobs_from_rollout=true: the rollout workers' "
                             "log-probs are the behaviour policy's, not the policy the update starts from; the "
                             "trainer recomputes them: set ppo.old_logprobs_from_rollout=false")
        if r.max_staleness > 0 and p.rollout_is_cap is None:
            # the row mask alone only rejects rows: the kept ones would train with weight 1,
            # not the pi_prox / pi_behav factor their older policy needs
            raise ValueError(f"rollout.mode=async with rollout.max_staleness={r.max_staleness} trains on samples "
                             f"of older policies, which need importance weights: set ppo.rollout_is_cap (e.g. "
                             f"2.0; ppo.rollout_is_mode=truncate or mask), with or without "
                             f"ppo.rollout_mask_threshold={p.rollout_mask_threshold} (the row mask only "
                             f"rejects rows), or rollout.max_staleness=0")

    def _resolve_reference_mode(self) -> None:
        """``reference.mode`` null -> ``adapters_off`` with LoRA, else ``offload``; LoRA
        refused where it cannot work."""
        lora = self.model.lora.enabled
        if self.reference.mode is None:
            self.reference.mode = "adapters_off" if lora else "offload"
        if self.reference.mode == "adapters_off" and not lora:
            raise ValueError("reference.mode=adapters_off needs model.lora.enabled=true (the "
                             "reference is the base under the adapters); without LoRA use "
                             "reference.mode=offload or colocated")
        if lora and self.critic.mode == "separate" and self.critic.init_from:
            raise ValueError(f"model.lora.enabled=true with critic.mode=separate and critic.init_from="
                             f"{self.critic.init_from}: the LoRA critic is a second adapter set on the "
                             f"actor's base (exp_manager.init_from), with its own value head; unset "
                             f"critic.init_from")

    def advantage_config(self) -> AdvantageConfig:
        """The advantage estimator's settings (``ppo.advantage_estimator``, ``gamma``,
        ``lam``, ``lam_critic``, ``lam_policy``, ``lam_policy_alpha``, ``norm_by_std``) as the
        math takes them."""
        p = self.ppo
        return AdvantageConfig(estimator=p.advantage_estimator, gamma=p.gamma, lam=p.lam,
                               lam_critic=p.lam_critic, lam_policy=p.lam_policy,
                               lam_policy_alpha=p.lam_policy_alpha, norm_by_std=p.norm_by_std)

    def objective(self) -> PPOObjective:
        """The PPO loss's settings (``ppo.clip_eps*``, ``dual_clip``, ``value_clip``,
        ``value_loss_coef``, ``entropy_coef``, ``loss_agg_mode``; ``kl.loss_*``, ``kl.clamp``
        (None: ``DEFAULT_KL_LOSS_CLAMP``); the horizon ``rollout.max_new_tokens``)."""
        p = self.ppo
        return PPOObjective(
            clip_eps=p.clip_eps, clip_eps_low=p.clip_eps_low, clip_eps_high=p.clip_eps_high,
            dual_clip=p.dual_clip, value_clip=p.value_clip, value_loss_coef=p.value_loss_coef,
            entropy_coef=p.entropy_coef, kl_loss_coef=self.kl.loss_coef, kl_estimator=self.kl.loss_estimator,
            kl_clamp=DEFAULT_KL_LOSS_CLAMP if self.kl.clamp is None else self.kl.clamp,
            loss_agg_mode=p.loss_agg_mode, norm_length=self.rollout.max_new_tokens)

    @property
    def kl_temperature(self) -> float:
        """Temperature of the two log-probs the KL penalty compares (``kl.temperature``):
        the rollout's ``logprob_temperature`` (``sampling``) or 1.0 (``unscaled``)."""
        return self.rollout.logprob_temperature if self.kl.temperature == "sampling" else 1.0

    def _check_rollout_logprobs(self) -> None:
        """``ppo.old_logprobs_from_rollout``: the rollout's log-probs must be the ones the
        KL and the ratio compare (their temperature, before any sampling processor)."""
        r = self.rollout
        if self.kl_temperature != r.logprob_temperature:
            raise ValueError(
                f"ppo.old_logprobs_from_rollout=true: the KL compares log-probs at temperature "
                f"{self.kl_temperature} (kl.temperature={self.kl.temperature}) but the rollout records "
                f"them at {r.logprob_temperature}: set kl.temperature=sampling")
        if r.engine == "vllm" and (r.top_k or r.top_p < 1.0) and not r.greedy:
            raise ValueError(
                f"ppo.old_logprobs_from_rollout=true with rollout.engine=vllm: vLLM records log-probs "
                f"after top-k/top-p (rollout.top_k={r.top_k}, rollout.top_p={r.top_p}), "
                f"not of the policy the update trains: set rollout.top_k=0 and rollout.top_p=1.0")
        if r.engine == "vllm" and r.min_new_tokens > 0:
            raise ValueError(
                f"ppo.old_logprobs_from_rollout=true with rollout.engine=vllm: vLLM records log-probs "
                f"after its min-tokens processor has removed EOS and the stop tokens from the first "
                f"rollout.min_new_tokens={r.min_new_tokens} positions, not the policy's own: "
                f"set rollout.min_new_tokens=0 or ppo.old_logprobs_from_rollout=false")


def validate_batch_sizes(ppo: PPOAlgoConfig, dp: int, n_samples_per_prompt: int = 1, pp: int = 1) -> None:
    """Rollout, global and micro batch sizes against the DP size and the group size.

    ``ppo.num_rollout_samples`` counts samples (rows); each DP rank holds whole groups of
    ``rollout.n_samples_per_prompt`` samples of one prompt.

    Raises:
        ValueError: naming the key, its value and what would work.
    """
    group = dp * n_samples_per_prompt
    if ppo.num_rollout_samples % group:
        raise ValueError(
            f"ppo.num_rollout_samples={ppo.num_rollout_samples} is not divisible by the data-"
            f"parallel size {dp} x rollout.n_samples_per_prompt={n_samples_per_prompt}: every DP "
            f"rank holds whole groups; valid: multiples of {group}")
    if ppo.num_rollout_samples % dp:
        raise ValueError(f"ppo.num_rollout_samples={ppo.num_rollout_samples} is not divisible by "
                         f"the data-parallel size {dp}")
    if ppo.global_batch_size % dp:
        raise ValueError(f"ppo.global_batch_size={ppo.global_batch_size} is not divisible by the "
                         f"data-parallel size {dp}")
    if ppo.num_rollout_samples % ppo.global_batch_size:
        raise ValueError(f"ppo.num_rollout_samples={ppo.num_rollout_samples} is not a multiple of "
                         f"ppo.global_batch_size={ppo.global_batch_size}")
    per_rank = ppo.global_batch_size // dp
    if per_rank % ppo.micro_batch_size:
        raise ValueError(f"ppo.global_batch_size/dp = {per_rank} is not a multiple of "
                         f"ppo.micro_batch_size={ppo.micro_batch_size}; valid micro batch sizes: "
                         f"{[d for d in range(1, per_rank + 1) if per_rank % d == 0]}")
    rollout_per_rank = ppo.num_rollout_samples // dp
    if rollout_per_rank % ppo.forward_micro_batch_size:
        raise ValueError(
            f"ppo.num_rollout_samples/dp = {rollout_per_rank} is not a multiple of "
            f"ppo.forward_micro_batch_size={ppo.forward_micro_batch_size}; valid: "
            f"{[d for d in range(1, rollout_per_rank + 1) if rollout_per_rank % d == 0]}")
