"""The reward's config schema (group ``reward`` of the PPO job): where scores come from --
the served RM (and an ensemble of RMs) and rule-based reward functions -- and what an
invalid score does. Beside the reward code it configures; ``nemo_rlhf.trainers.ppo.config``
exposes it as ``PPOConfig.reward``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from nemo_rlhf.config import check_choice
from nemo_rlhf.reward.ensemble import ENSEMBLE_AGGREGATES
from nemo_rlhf.reward.functions import INVALID_SCORE_ACTIONS, RM_INPUTS, check_reward_function_spec
from nemo_rlhf.reward.normalization import NORMALIZATION_MODES

__all__ = ["RMEnsembleConfig", "RewardConfig", "RewardFunctionSpec"]


@dataclass
class RewardFunctionSpec:
    """One rule-based reward source."""

    name: str = ""
    """Registered name or ``module:function`` (required)."""
    weight: float = 1.0
    """Weight in the sum of sources."""


@dataclass
class RMEnsembleConfig:
    """More served RMs scored beside the primary one (group ``reward.ensemble``): the
    conservative ensemble of :mod:`nemo_rlhf.reward.ensemble`. Empty lists (the default):
    the single RM of ``reward.rm_url`` / ``rm_address_file``. ``python -m launchers.local
    --rm-checkpoint A --rm-ensemble-checkpoint B --rm-ensemble-checkpoint C`` serves and
    wires them."""

    rm_urls: list[str] = field(default_factory=list)
    """The other members' service URLs (``http://host:port``)."""
    rm_address_files: list[str] = field(default_factory=list)
    """The other members' address files (as ``reward.rm_address_file``); after ``rm_urls``."""
    aggregate: str = "mean_minus_std"
    """Per sample over the members' standardised scores: ``mean``, ``min`` (worst case) or
    ``mean_minus_std`` (``mean - std_coef * std``; Coste et al. 2023)."""
    std_coef: float = 1.0
    """``k`` of ``mean_minus_std`` (>= 0)."""

    @property
    def members(self) -> list[str]:
        """The other members' URLs and address files, in order."""
        return [*self.rm_urls, *self.rm_address_files]

    def __post_init__(self) -> None:
        check_choice("reward.ensemble.aggregate", self.aggregate, ENSEMBLE_AGGREGATES)
        if not self.std_coef >= 0:
            raise ValueError(f"reward.ensemble.std_coef={self.std_coef}: must be >= 0")


@dataclass
class RewardConfig:
    """Where scores come from (group ``reward``): the served RM and/or reward functions."""

    rm_url: Optional[str] = None
    """RM service URL (``http://host:port``)."""
    rm_address_file: Optional[str] = None
    """File the RM server writes its address to (used when rm_url is None)."""
    rm_weight: float = 1.0
    """Weight of the RM score in the sum of sources."""
    functions: list[RewardFunctionSpec] = field(default_factory=list)
    """Rule-based sources (e.g. the task's checker)."""
    timeout_s: float = 60.0
    """Seconds without an answer from the RM server after which the client checks that it
    is alive (``GET /health``); a busy server is waited on (``max_wait_s``), one that does
    not answer spends a retry (:mod:`nemo_rlhf.reward.client`)."""
    max_retries: int = 3
    """Retries before a scoring error stops training (connection errors, 5xx, a server
    that does not answer ``/health``)."""
    max_wait_s: float = 3600.0
    """The longest one scoring request may wait on a server that is alive but busy
    (seconds); past it the step fails naming the server."""
    restart_wait_s: float = 60.0
    """How long a refused connection to the RM server (killed, being restarted) is waited
    on before the step fails, in seconds, counted from the first refusal in a row (polled
    at most 1 s apart; no retry spent meanwhile): a server restarted on the same address
    within it completes the request, each item scored. 0: a refused connection spends a
    retry (``max_retries``) like any connection error. The error past it names the URL
    and how long it waited."""
    max_abs_score: Optional[float] = 1.0e6
    """A raw score of any source past this magnitude is invalid, like NaN / Inf
    (``invalid_scores`` says what happens); null: no magnitude limit."""
    invalid_scores: str = "error"
    """What an invalid score (NaN, +-Inf, ``|x| > max_abs_score``; per sample and source)
    does: ``error`` stops the step with an error naming the source, the value and its
    position; ``skip`` excludes the sample from the PPO step (no advantage, no loss
    token, not in the reward means or the running normalisation; with a group estimator,
    e.g. ``grpo``, its whole group, whose baseline it would enter), counts it in
    ``reward/invalid_scores`` (samples, summed over DP) and ``reward/invalid_fraction``
    (of ``ppo.num_rollout_samples``), ``reward/excluded_samples`` (rows left out), and
    warns once per step naming the source and value. A step with no sample left stops
    with an error. A wrong number of scores or a non-number is always an error."""
    wait_for_server_s: float = 300.0
    """Deadline for the RM server's /health at start-up."""
    normalization: str = "running"
    """Of the RM score: ``none``, ``fixed`` (the RM checkpoint's stats) or ``running``."""
    clip: Optional[float] = None
    """Clip normalised scores to [-clip, clip] (None: off)."""
    rm_input: str = "conversation"
    """What the served RM reads of a multi-turn episode (``env.name`` set; single-turn rows
    are always the (prompt, response) texts): ``conversation`` (the whole episode: the
    prompt and every turn, rendered with the RM's chat template; sent as the trajectory's
    own ids when the RM's ``/metadata`` shows the policy's tokenizer, chat template and
    system prompt, else as messages) or ``final_answer`` (the last policy turn alone, as a
    single-turn response). Reward functions (rule checkers) score the final answer either
    way."""
    ensemble: RMEnsembleConfig = field(default_factory=RMEnsembleConfig)
    """Other RMs whose scores join the primary RM's in a conservative ensemble
    (:class:`RMEnsembleConfig`); the ensemble is the ``rm`` source."""

    def __post_init__(self) -> None:
        check_choice("reward.normalization", self.normalization, NORMALIZATION_MODES)
        check_choice("reward.invalid_scores", self.invalid_scores, INVALID_SCORE_ACTIONS)
        check_choice("reward.rm_input", self.rm_input, RM_INPUTS)
        if not self.restart_wait_s >= 0:
            raise ValueError(f"reward.restart_wait_s={self.restart_wait_s}: must be >= 0 (seconds; 0: no wait)")
        if not self.timeout_s > 0 or not self.max_wait_s > 0 or self.max_retries < 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s}, reward.max_wait_s={self.max_wait_s}, "
                             f"reward.max_retries={self.max_retries}: the seconds must be > 0, the retries >= 0")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"reward.clip={self.clip}: must be > 0 (or null: off)")
        for i, spec in enumerate(self.functions):
            check_reward_function_spec(f"reward.functions[{i}].name", spec.name)
        if self.ensemble.members and not (self.rm_url or self.rm_address_file):
            raise ValueError(f"reward.ensemble lists {len(self.ensemble.members)} more RM(s) but no primary "
                             f"RM is set (reward.rm_url / reward.rm_address_file): the ensemble is the "
                             f"primary RM and those")
