"""Build the PPO side's reward from config: the served RM and/or reward functions.

Scores are fetched on the *scoring ranks*: model-parallel rank 0 (TP rank 0, PP rank 0)
of every data-parallel replica. megatron's DP group of such a rank holds exactly the
scoring ranks (the DP group joins the ranks with the same TP and PP coordinates), so a
collective over ``dims.dp_group`` called on the scoring ranks only is a collective over
all of them: :func:`gather_over_scoring_ranks` is the one place that does it.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist

from nemo_rlhf.reward.client import RewardModelClient
from nemo_rlhf.reward.config import RewardConfig
from nemo_rlhf.reward.ensemble import RewardModelEnsemble
from nemo_rlhf.reward.functions import (
    CombinedReward,
    RemoteRewardModel,
    RewardFunctionScorer,
    WeightedSource,
    means_from_sums,
)
from nemo_rlhf.reward.normalization import RewardNormalizer
from nemo_rlhf.trainers.collectives import RankFailure


log = logging.getLogger("nemo_rlhf.ppo")

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


def _is_address_file(cfg: RewardConfig, index: int) -> bool:
    """Whether ensemble member ``index`` (0: the primary RM) is an address file, not a URL."""
    if index == 0:
        return not cfg.rm_url
    return index > len(cfg.ensemble.rm_urls)


RENDERING_KEYS = ("tokenizer_fingerprint", "chat_template", "system_prompt")
"""What must agree between the policy and a served RM (its ``/metadata`` ``scorer``) for the
RM to read a multi-turn episode as the trajectory's own ids (:func:`rm_reads_trajectory_ids`)."""


def rm_reads_trajectory_ids(policy_rendering: dict | None, scorer_meta: dict) -> bool:
    """Whether a served RM may be sent an episode's trajectory ids instead of its messages
    (``reward.rm_input=conversation``): it tokenises and renders as the policy does, i.e.
    the same :attr:`~nemo_rlhf.data.tokenizer.Tokenizer.fingerprint`, ``data.chat_template``
    and ``data.system_prompt`` (:data:`RENDERING_KEYS`). Then the trajectory's ids are the
    conversation as the RM's template renders it, and the policy's tokens reach the RM as
    sampled (token-in/token-out: no decode and re-encode, which BPE does not survive at a
    seam). False when ``policy_rendering`` is None or the RM does not say (an older server)."""
    if policy_rendering is None or scorer_meta.get("tokenizer_fingerprint") is None:
        return False
    return all(policy_rendering.get(k) == scorer_meta.get(k) for k in RENDERING_KEYS)


def policy_rendering(tokenizer, data_cfg) -> dict:
    """The policy's side of :data:`RENDERING_KEYS`: its tokenizer's fingerprint and
    ``data.chat_template`` / ``data.system_prompt``."""
    return {"tokenizer_fingerprint": tokenizer.fingerprint, "chat_template": data_cfg.chat_template,
            "system_prompt": data_cfg.system_prompt}


def build_reward(cfg: RewardConfig, dims=None, rendering: dict | None = None):
    """A ``CombinedReward`` over the RM client (if configured) and the reward functions.

    ``rendering``: the policy's :func:`policy_rendering`; with ``reward.rm_input=conversation``
    each served RM whose ``/metadata`` matches it reads a multi-turn episode as the
    trajectory's ids, any other as messages (:func:`rm_reads_trajectory_ids`). None: messages.

    The RM client waits for the server's ``/health`` (``reward.wait_for_server_s``); the
    RM's normalisation stats come from its ``/metadata`` when ``normalization: fixed``, and
    its identity (``RM_IDENTITY_KEYS``) always does. With ``reward.ensemble`` members the
    ``rm`` source is a :class:`~nemo_rlhf.reward.ensemble.RewardModelEnsemble` of the
    primary RM and them (each waited for; their identities recorded under ``ensemble``).
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
        kw = dict(timeout_s=cfg.timeout_s, max_retries=cfg.max_retries, max_wait_s=cfg.max_wait_s,
                  restart_wait_s=cfg.restart_wait_s,
                  allow_nonfinite=cfg.invalid_scores == "skip")  # CombinedReward judges them
        members = [cfg.rm_url or cfg.rm_address_file, *cfg.ensemble.members]
        clients = [RewardModelClient(where, **kw) if not _is_address_file(cfg, i) else
                   RewardModelClient.from_address_file(where, wait_s=cfg.wait_for_server_s, **kw)
                   for i, where in enumerate(members)]
        metas = []
        for client in clients:
            client.wait_until_healthy(cfg.wait_for_server_s)
            metas.append(client.metadata().get("scorer") or {})  # the RM checkpoint's description
        scorer_meta = metas[0]
        identity = {k: scorer_meta.get(k) for k in RM_IDENTITY_KEYS}
        send_ids = [rm_reads_trajectory_ids(rendering, m) for m in metas]
        if cfg.rm_input == "conversation":
            log.info("reward: the RM reads multi-turn episodes whole, as %s", ", ".join(
                f"{w}: {'the trajectory ids' if ids else 'messages (its chat template)'}"
                for w, ids in zip(members, send_ids)))
        source = RemoteRewardModel(clients[0], cfg.rm_input, send_ids[0])
        if len(clients) > 1:
            source = RewardModelEnsemble(clients, metas, members, cfg.ensemble.aggregate,
                                         cfg.ensemble.std_coef, cfg.rm_input, send_ids)
            identity["ensemble"] = [{k: m.get(k) for k in RM_IDENTITY_KEYS} for m in metas[1:]]
            log.info("reward: an ensemble of %d RMs (%s, std_coef=%g): %s", len(clients),
                     cfg.ensemble.aggregate, cfg.ensemble.std_coef, ", ".join(members))
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
        sources.append(WeightedSource("rm", source, cfg.rm_weight, norm, identity))
    for i, spec in enumerate(cfg.functions):
        sources.append(WeightedSource(spec.name.split(":")[-1],
                                      RewardFunctionScorer(spec.name, f"reward.functions[{i}].name"),
                                      spec.weight))
    if not sources:
        raise ValueError("no reward source: set reward.rm_url / reward.rm_address_file and/or "
                         "reward.functions")
    gather = (functools.partial(gather_over_scoring_ranks, dims)
              if dims is not None and dims.dp > 1 else None)
    return CombinedReward(sources, gather=gather, max_abs_score=cfg.max_abs_score,
                          invalid_scores=cfg.invalid_scores)


class InvalidScoresError(RuntimeError):
    """``reward.invalid_scores=skip`` left no sample of a step to train on (every rank)."""


def step_scores(dims, out, step: int, n_samples_per_prompt: int = 1,
                whole_groups: bool = False) -> tuple[torch.Tensor, dict]:
    """A scoring rank's step scores and reward metrics from :meth:`CombinedReward.combine`.

    Call on every scoring rank together (one host all-gather over them).

    Args:
        dims: :class:`~nemo_rlhf.distributed.ParallelDims` of this (scoring) rank.
        out: the :class:`~nemo_rlhf.reward.functions.RewardOutput` of this rank's ``[B]``
            samples.
        step: the step being scored (1-based), for the warning.
        n_samples_per_prompt: the group size (``rollout.n_samples_per_prompt``).
        whole_groups: exclude a whole group when one of its samples is invalid (a group
            estimator: its baseline would include the invalid score).

    Returns:
        ``(scores, metrics)``: ``[B]`` float32 host scores, NaN on the rows excluded from
        the step (the trainer's mark: no advantage, no loss token); the ``reward/*``
        means over every DP rank's valid samples (:meth:`RewardOutput.metric_sums` summed
        over the scoring ranks, divided by the summed count: ``reward/total``,
        ``reward/<source>``, ``reward/<source>_normalized``, and ``reward/rm_ensemble_std``,
        the mean over all those samples of each sample's spread over the ensemble's
        members, not a std pooled over samples), ``reward_raw_mean`` (raw weighted score
        over every DP rank's valid samples) and, when ``out`` judged scores
        (``reward.invalid_scores=skip``), ``reward/invalid_scores`` (samples with an invalid
        score, summed over DP), ``reward/invalid_fraction`` (of all samples) and
        ``reward/excluded_samples`` (rows left out, summed over DP). The same on every
        scoring rank.
    """
    scores = out.scores
    valid = out.valid
    keep = None
    if valid is not None:
        keep = valid
        if whole_groups and n_samples_per_prompt > 1:
            keep = valid.reshape(-1, n_samples_per_prompt).all(-1).repeat_interleave(n_samples_per_prompt)
        scores = torch.where(keep, scores, float("nan"))
        shown = ", ".join(f"source {name!r} returned {value!r} at position {i}"
                          for name, i, value in out.invalid[:5])
        more = f" and {len(out.invalid) - 5} more" if len(out.invalid) > 5 else ""
        log.warning("step %d: reward.invalid_scores=skip: %d of %d sample(s) on DP rank %d left out "
                    "of the step (%d row(s) with their groups): %s%s", step, int((~valid).sum()),
                    len(valid), dims.dp_rank, int((~keep).sum()), shown, more)
    raw = out.raw_scores if valid is None else out.raw_scores[valid]
    names, sums = out.metric_sums(prefix="reward/")  # [len(names) + 1] float64 host
    local = torch.cat([torch.tensor([float(raw.sum()), raw.numel(),  # host
                                     0.0 if valid is None else float((~valid).sum()),
                                     0.0 if keep is None else float((~keep).sum()), len(scores)],
                                    dtype=torch.float64, device="cpu"), sums])
    total = gather_over_scoring_ranks(dims, local).sum(0)  # one host gather for every metric
    metrics = {**means_from_sums(names, total[5:]),
               "reward_raw_mean": float(total[0] / total[1]) if total[1] else float("nan")}
    if out.skipping:
        metrics["reward/invalid_scores"] = float(total[2])
        metrics["reward/invalid_fraction"] = float(total[2] / total[4])
        metrics["reward/excluded_samples"] = float(total[3])
        metrics["reward/trained_samples"] = float(total[4] - total[3])
    return scores, metrics


def check_samples_left(metrics: dict, step: int) -> None:
    """Raise :class:`InvalidScoresError` when ``reward.invalid_scores=skip`` excluded every
    sample of the step (``metrics`` from :func:`step_scores`, the same on every rank)."""
    if metrics.get("reward/trained_samples", 1.0) == 0:
        raise InvalidScoresError(
            f"step {step}: every one of the {int(metrics['reward/excluded_samples'])} samples had an "
            f"invalid score (NaN, Inf or past reward.max_abs_score) or shares a group with one "
            f"(reward.invalid_scores=skip): nothing left to train on; stopping (the warnings above "
            f"name the sources and values)")


def score_rollout(reward, collectives, rows: list, texts: list[str], step: int,
                  n_samples_per_prompt: int, whole_groups: bool) -> tuple[torch.Tensor, dict]:
    """Step 3 on every rank: model-parallel rank 0 of each DP group fetches and combines the
    scores of its rows, the result is broadcast to its TP x PP group.

    Args:
        reward: the ``CombinedReward`` (used on the scoring ranks only).
        collectives: the job's :class:`~nemo_rlhf.trainers.collectives.JobCollectives`.
        rows / texts: this DP rank's prompt rows (``.prompt``, ``.extras``) and responses.
        step: the step being scored (1-based).
        n_samples_per_prompt / whole_groups: as :func:`step_scores`.

    Returns:
        ``([B] float32 host scores, NaN on excluded rows; reward metrics)``, the same on the
        TP x PP group.

    Raises:
        the reward source's error on the rank where it failed and ``RewardScoringError``
        (:mod:`nemo_rlhf.trainers.ppo.trainer`'s, naming that rank) on the others;
        :class:`InvalidScoresError` when every sample was left out.
    """
    from_rank = None
    raw, failure = None, None
    if collectives.is_mp_src:
        try:
            raw = reward.fetch([r.prompt for r in rows], texts, [r.extras for r in rows])
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            failure = exc
    collectives.raise_together(failure, "reward scoring", RewardScoringError)
    if collectives.is_mp_src:
        out = reward.combine(raw)  # running normalisation: a scoring-rank collective
        from_rank = step_scores(collectives.dims, out, step, n_samples_per_prompt, whole_groups)
    scores, metrics = collectives.mp_broadcast(from_rank)
    check_samples_left(metrics, step)  # the same metrics on every rank
    return scores, metrics


class RewardScoringError(RankFailure):
    """Scoring failed on another rank; the message is that rank's error."""

