"""The PPO step's tensors: token rewards and advantages (step 5), and what the update's
mini-batches read (step 6). Pure functions of the step's data plus the job's collectives
(the DP reductions of the whitening and of the rollout's sums)."""

from __future__ import annotations

from typing import Optional

import torch

from nemo_rlhf.algorithms import ppo as P
from nemo_rlhf.trainers.ppo.episode_source import is_episode_batch
from nemo_rlhf.trainers.ppo.step_data import Advantages, ForwardResults


def step_advantages(cfg, advantage_cfg: P.AdvantageConfig, kl_coef: float, collectives, batch,
                    scores: torch.Tensor, fwd: ForwardResults) -> tuple[Advantages, dict]:
    """Token rewards, advantages and returns of the rollout, and its metrics over DP.

    Token rewards are ``-beta * KL_t`` (``beta``: ``kl_coef``, the KL controller's value;
    0 without ``kl.in_reward``) plus the score at the last response token, and with
    ``env.turn_rewards=per_turn`` on an episode batch each turn's environment reward at the
    last policy token of that turn
    (:meth:`~nemo_rlhf.trainers.ppo.episode_source.EpisodeRolloutBatch.turn_reward_placements`);
    the advantage estimator
    is ``advantage_cfg``'s (``gae``: the returns with ``ppo.lam_critic``, the advantages
    with ``ppo.lam_policy`` or VAPO's per-row ``ppo.lam_policy_alpha`` lambda, each
    ``ppo.lam`` when null); ``gae`` advantages are whitened over every DP rank's valid
    tokens. Rows whose score is NaN (``reward.invalid_scores=skip``, marked by
    :func:`~nemo_rlhf.trainers.ppo.scoring.step_scores`) are left out: no advantage, no
    return, no loss token (group estimators see their whole group, already excluded).

    Args:
        cfg: the :class:`~nemo_rlhf.trainers.ppo.config.PPOConfig`.
        batch: the ``RolloutBatch`` (``response_mask [B, R]``, ``ended``, ``truncated``).
        scores: ``[B]`` float32 on the batch's device.
        fwd: the step's :class:`ForwardResults` (``[B, R]`` float32 log-probs, values).

    Returns:
        ``(Advantages, metrics)``: ``kl_mean`` in nats per sequence, ``kl_per_token``,
        ``reward_mean/std``, ``response_length``, ``advantages_mean``, ``returns_mean/std``,
        each over every DP rank's kept rows; ``kl_coef``, the beta applied to the token
        rewards (the controller's value; 0 with ``kl.in_reward=false``) and, when the loss
        has a KL term, ``kl_loss_coef`` (``kl.loss_coef``, the weight applied to it). Where
        ``ppo.normalize_advantages`` whitens (``gae``), ``advantages_whitened``: 1, or 0 on
        a rollout whose kept sequences all got the same task reward (score, missing-EOS
        penalty, per-turn rewards; the spread over DP by :func:`~nemo_rlhf.algorithms.ppo.
        masked_spread`), whose advantages are left raw unless
        ``ppo.whiten_constant_rewards``. With
        a critic: ``critic/value_error_pos_<lo>-<hi>``, the mean ``|V - R|`` of the
        critic's old values against the returns (its targets) over the kept tokens of each
        log2 response-position bucket (:mod:`~nemo_rlhf.algorithms.ppo.critic_metrics`).
    """
    mask, c = batch.response_mask, cfg
    beta = kl_coef if c.kl.in_reward else 0.0
    keep = torch.isfinite(scores)  # [B]: False on rows reward.invalid_scores=skip leaves out
    rewards, kl = P.compute_token_rewards(
        fwd.kl_logprobs, fwd.ref_logprobs, torch.where(keep, scores, 0.0), mask, beta,
        kl_estimator=c.kl.estimator, kl_clamp=c.kl.clamp, ended=batch.ended,
        missing_eos_penalty=c.ppo.missing_eos_penalty)
    turn_rewards = None
    if c.env.turn_rewards == "per_turn" and is_episode_batch(batch):  # each turn's reward at its end
        turn_rewards = P.turn_reward_tensor(batch.turn_reward_placements(), mask)
        rewards = rewards + turn_rewards
    full_mask, mask = mask, mask & keep[:, None]  # from here on: the rows that train
    group_ids = P.group_ids_from_samples(mask.shape[0], c.rollout.n_samples_per_prompt, device=mask.device)
    adv, ret = P.compute_advantages(  # group estimators: whole groups left out, see step_scores
        advantage_cfg, rewards, fwd.values, full_mask if advantage_cfg.traits.needs_groups else mask,
        group_ids, reduce_fn=collectives.whiten_reduce)
    adv, ret = torch.where(mask, adv, 0.0), torch.where(mask, ret, 0.0)
    scores = torch.where(keep, scores, 0.0)
    raw_adv = adv
    whitened = None
    if c.ppo.normalize_advantages and advantage_cfg.traits.batch_whitening:
        adv_w = P.masked_whiten(adv, mask, reduce_fn=collectives.whiten_reduce)
        if c.ppo.whiten_constant_rewards:
            adv, whitened = adv_w, True
        else:  # a rollout whose sequences all got the same task reward keeps raw advantages
            task_reward = scores.float()
            if c.ppo.missing_eos_penalty is not None:
                task_reward = task_reward + torch.where(batch.ended, float(c.ppo.missing_eos_penalty), 0.0)
            if turn_rewards is not None:
                task_reward = task_reward + turn_rewards.sum(-1)
            varies = P.masked_spread(task_reward, keep, reduce_max_fn=collectives.dp_max) > 0
            adv = torch.where(varies, adv_w, adv)
            whitened = varies
    seq_kl = torch.where(mask, kl, 0.0).sum(-1)
    ret_masked = torch.where(mask, ret, 0.0)
    named = {
        "kl": seq_kl.sum(), "score": scores.sum(),
        "token_reward": torch.where(mask, rewards, 0.0).sum(), "tokens": mask.sum().float(),
        "truncated": (batch.truncated & keep).float().sum(), "sequences": keep.float().sum(),
        "advantage": torch.where(mask, raw_adv, 0.0).sum(), "return": ret_masked.sum(),
        "return_sq": ret_masked.pow(2).sum(), "score_sq": (scores ** 2).sum()}
    if fwd.values is not None:  # the critic's |V - R| by response position (same buckets on every rank)
        err_sums, err_counts = P.value_error_by_position_sums(fwd.values, ret, mask)
        named.update({f"value_error_{k}": x for k, x in enumerate(err_sums.unbind())})
        named.update({f"value_error_count_{k}": x for k, x in enumerate(err_counts.unbind())})
    sums = collectives.dp_sum_named(named)  # one all-reduce of the rollout's sums
    n_tok, n_seq = sums["tokens"], sums["sequences"]
    ret_mean, score_mean = sums["return"] / n_tok, sums["score"] / n_seq
    metrics = {
        "kl_mean": float(sums["kl"] / n_seq),  # nats per sequence (summed over its tokens)
        "kl_per_token": float(sums["kl"] / n_tok),
        "reward_mean": float(score_mean),
        "reward_std": float((sums["score_sq"] / n_seq - score_mean ** 2).clamp_min(0).sqrt()),
        "token_reward_sum_mean": float(sums["token_reward"] / n_seq),
        "response_length": float(n_tok / n_seq),
        "truncated_fraction": float(sums["truncated"] / n_seq),
        "advantages_mean": float(sums["advantage"] / n_tok),
        "returns_mean": float(ret_mean),
        "returns_std": float((sums["return_sq"] / n_tok - ret_mean ** 2).clamp_min(0).sqrt()),
        "kl_coef": float(beta),  # the beta the token rewards carry
    }
    if c.kl.loss_coef > 0:
        metrics["kl_loss_coef"] = float(c.kl.loss_coef)  # the KL loss term's weight
    if whitened is not None:  # 0: every kept sequence got the same task reward, not whitened
        metrics["advantages_whitened"] = float(whitened)
    if fwd.values is not None:
        n = P.POSITION_BUCKETS
        metrics.update(P.value_error_by_position_from_sums(
            torch.stack([sums[f"value_error_{k}"] for k in range(n)]),
            torch.stack([sums[f"value_error_count_{k}"] for k in range(n)])))
    return Advantages(advantages=adv, returns=ret, kl=kl, loss_mask=mask), metrics


def training_tensors(cfg, critic, collectives, batch, fwd: Optional[ForwardResults],
                     adv: Optional[Advantages]) -> tuple[dict, dict]:
    """What the update's mini-batches read, by name (``[B, ...]`` rows), and the rollout
    correction's metrics (``ppo.rollout_is_cap`` / ``ppo.rollout_mask_threshold``): its
    token statistics and :func:`correction_row_shares`.

    ``response_mask`` is the loss mask (:attr:`Advantages.loss_mask`); the critic role adds
    what its value loss reads (:meth:`~nemo_rlhf.trainers.ppo.roles.CriticRole.training_tensors`).
    With ``moe.routing_replay`` the inputs include the rollout's ``routes`` ``[B, P+R, L, k]``
    (this stage's MoE layers; every stage), which the actor's training forwards replay.
    Off the last pipeline stage (``fwd`` None) only the inputs.
    """
    c = cfg.ppo
    tensors = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
               "response_mask": batch.response_mask if adv is None else adv.loss_mask}
    if cfg.moe.routing_replay:
        if batch.routes is None:
            raise ValueError("moe.routing_replay=true: the rollout batch has no routes (the megatron "
                             "engine records them; RolloutBatch.routes is None)")
        tensors["routes"] = batch.routes
    correction = {}
    if fwd is None:
        return tensors, correction
    tensors.update(old_logprobs=fwd.old_logprobs, advantages=adv.advantages)
    if c.rollout_is_cap is not None or c.rollout_mask_threshold is not None:
        how = dict(tis_cap=c.rollout_is_cap, mask_threshold=c.rollout_mask_threshold, is_mode=c.rollout_is_mode)
        tensors["rollout_weights"], rc = P.rollout_correction_weights(
            fwd.old_logprobs, batch.logprobs, batch.response_mask, **how)
        correction = {f"rollout_correction/{k}": v for k, v in
                      P.finalize_token_stats(collectives.dp_reduce_stats(rc)).items() if k != "valid_tokens"}
        correction.update(correction_row_shares(collectives, P.rollout_correction_row_counts(
            fwd.old_logprobs, batch.logprobs, batch.response_mask, **how), c))
    tensors.update(critic.training_tensors(fwd, adv))
    if cfg.kl.loss_coef > 0:
        tensors.update(ref_logprobs=fwd.ref_logprobs)
    return tensors, correction


def correction_row_shares(collectives, counts: dict, ppo_cfg) -> dict:
    """The shares of rows (sequences) the rollout correction touches, over every DP rank's
    rows: global sums of
    :func:`~nemo_rlhf.algorithms.ppo.rollout_correction.rollout_correction_row_counts`'
    counts (one all-reduce), divided by the global count of rows with a policy token.

    Returns:
        ``rollout_correction/masked_rows_fraction`` (rows masked whole by
        ``ppo.rollout_mask_threshold``; 0 without it) and, with ``ppo.rollout_is_cap``,
        ``rollout_correction/is_truncated_rows_fraction`` (``rollout_is_mode=truncate``) or
        ``rollout_correction/is_masked_rows_fraction`` (``mask``): the kept rows with a token
        whose weight was truncated to the cap or dropped. 0 when no rank has a policy token.
    """
    sums = collectives.dp_sum_named(dict(counts))
    rows = float(sums["rows"])
    share = (lambda n: float(n) / rows if rows else 0.0)
    out = {"rollout_correction/masked_rows_fraction": share(sums["masked_rows"])}
    if ppo_cfg.rollout_is_cap is not None:
        kind = "truncated" if ppo_cfg.rollout_is_mode == "truncate" else "masked"
        out[f"rollout_correction/is_{kind}_rows_fraction"] = share(sums["capped_rows"])
    return out


__all__ = ["correction_row_shares", "step_advantages", "training_tensors"]
