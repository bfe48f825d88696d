"""The PPO-RLHF trainer: the six steps of InstructGPT's PPO on one shared backbone.

Per step: (1) prompts from a resumable sampler; (2) rollout by ``rollout.engine`` (the actor's
KV-cache decode, or a vLLM engine refit from the actor's weights: ``rollout/engines.py``);
(3) scores from the served RM and/or reward functions; (4) reference log-probs with the
reference weights swapped into the backbone; (5) old log-probs and values from one
forward-only pass, or from the rollout itself (``ppo.old_logprobs_from_rollout``; every
forward-only pass runs in eval mode, the updates in train mode: without dropout the ratio
is exactly 1 on the first mini-batch), token rewards
``-beta*KL`` (both log-probs at ``kl.temperature``'s temperature) plus the score at the
last response token, GAE; (6) ``ppo_epochs`` over
mini-batches through megatron's pipeline schedule, one optimizer step per mini-batch,
loss = policy + vf_coef * value - entropy_bonus * entropy; then the KL controller update.

Layout: every rank generates (TP/PP ranks of a DP group cooperate), scores are fetched
once per model-parallel group and broadcast; PPO math runs on the last pipeline stage,
which holds logits and values. Metrics are reduced over DP and reported by one rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from nemo_rlhf.algorithms import ppo as P
from nemo_rlhf.checkpoint import load_checkpoint, read_metadata, save_checkpoint
from nemo_rlhf.checkpoint.faults import maybe_crash
from nemo_rlhf.checkpoint.policy import prune, resume_run
from nemo_rlhf.data.sampler import ResumableSampler
from nemo_rlhf.distributed.device import to_device
from nemo_rlhf.distributed.phase import in_phase
from nemo_rlhf.metrics.logger import MetricsLogger
from nemo_rlhf.metrics.timers import Timers
from nemo_rlhf.models.engine import finalize_grads, forward_backward, unwrap
from nemo_rlhf.models.logprobs import LogprobRequest, response_logprobs, response_values
from nemo_rlhf.rollout.engines import build_rollout_engine
from nemo_rlhf.trainers.loop import Experiment, Signals, fit
from nemo_rlhf.trainers.ppo.config import PPOConfig
from nemo_rlhf.trainers.ppo.evaluation import evaluate_policy
from nemo_rlhf.trainers.ppo.guards import RewardHackingGuard, ngram_repetition_rate
from nemo_rlhf.trainers.ppo.micro_batches import plan_micro_batches, row_extents, scatter_rows, take
from nemo_rlhf.trainers.ppo.rewards import check_samples_left, step_scores
from nemo_rlhf.trainers.ppo.step_data import Advantages, ForwardResults

log = logging.getLogger("nemo_rlhf.ppo")


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, i + size) for i in range(0, n, size)]


class PPOTrainer:
    """Owns the actor-critic stage, optimizer, reference, reward and sampler.

    Args:
        cfg: the validated :class:`PPOConfig`.
        dims: :class:`~nemo_rlhf.distributed.ParallelDims`.
        model: DDP-wrapped actor-critic stage holding the initial policy's weights.
        optimizer: :class:`~nemo_rlhf.trainers.optim.MixedPrecisionOptimizer` over it.
        reference: :class:`~nemo_rlhf.trainers.ppo.reference.ReferencePolicy`.
        reward: a ``CombinedReward`` (called on model-parallel rank 0 of each DP group).
        tokenizer: encode/decode and the special token ids.
        prompts / eval_prompts: lists of ``PromptSample`` (prompt_ids, prompt, extras).
        critic: ``(critic stage, its optimizer)`` for ``critic.mode=separate`` (the critic's
            own DDP-wrapped backbone + value head); None: the value head on ``model``.
        signals: the :class:`~nemo_rlhf.trainers.loop.Signals` the entry point installed
            before the set-up (None: installed here).

    :meth:`fit` runs the loop of :mod:`nemo_rlhf.trainers.loop`; the methods under "the
    run" are its hooks.
    """

    job = "ppo"

    def __init__(self, cfg: PPOConfig, dims, model, optimizer, reference, reward, tokenizer,
                 prompts: list, eval_prompts: Optional[list], critic: Optional[tuple] = None,
                 signals: Optional[Signals] = None):
        self.cfg, self.dims, self.model, self.optimizer = cfg, dims, model, optimizer
        self.critic_model, self.critic_optimizer = critic if critic is not None else (None, None)
        self.reference, self.reward, self.tok = reference, reward, tokenizer
        self.prompts, self.eval_prompts = prompts, eval_prompts or []
        self.signals = signals or Signals()
        self.logger: Optional[MetricsLogger] = None
        g = cfg.guards
        self.guard = RewardHackingGuard(g.window, g.max_length_growth, g.max_repetition,
                                        g.kl_ceiling, g.gold_metric, g.proxy_metric,
                                        g.gold_window, g.gold_min_drop)
        self.kl_ctl = P.build_kl_controller(cfg.kl.type, cfg.kl.initial_policy_kl_penalty,
                                            cfg.kl.target, cfg.kl.horizon)
        self.sampler = ResumableSampler(len(prompts), cfg.trainer.seed, cfg.ppo.shuffle)
        self.advantage_cfg = P.AdvantageConfig(
            estimator=cfg.ppo.advantage_estimator, gamma=cfg.ppo.discount_factor,
            lam=cfg.ppo.gae_lambda, norm_by_std=cfg.ppo.grpo_norm_by_std)
        self.needs_values = self.advantage_cfg.needs_values
        """Whether the critic is used (``gae``); critic-free estimators compute no values."""
        self.actor_values = self.needs_values and self.critic_model is None
        """Whether the actor's forward gives the values (a value head on its backbone)."""
        self.objective = P.PPOObjective(
            clip_eps=cfg.ppo.ratio_eps, clip_eps_low=cfg.ppo.ratio_eps_low,
            clip_eps_high=cfg.ppo.ratio_eps_high, dual_clip=cfg.ppo.dual_clip,
            value_clip=cfg.ppo.value_clip, value_loss_coef=cfg.ppo.value_loss_coef,
            entropy_coef=cfg.ppo.entropy_bonus, kl_coef=cfg.kl.loss_coef,
            kl_estimator=cfg.kl.loss_estimator,
            kl_clamp=P.DEFAULT_KL_LOSS_CLAMP if cfg.kl.clamp is None else cfg.kl.clamp,
            loss_agg_mode=cfg.ppo.loss_agg_mode, norm_length=cfg.rollout.max_new_tokens)
        self.step = 0
        self.weights_version = 0
        """Changes whenever the actor's weights do (an optimizer step, a checkpoint load): a
        rollout engine with its own copy of the weights refits when it differs."""
        if cfg.ppo.old_logprobs_from_rollout and self._kl_temperature() != cfg.rollout.logprob_temperature:
            raise ValueError(
                f"ppo.old_logprobs_from_rollout=true: the KL compares log-probs at temperature "
                f"{self._kl_temperature()} (kl.temperature={cfg.kl.temperature}) but the rollout records them "
                f"at {cfg.rollout.logprob_temperature}: set kl.temperature=sampling")
        if (cfg.ppo.old_logprobs_from_rollout and cfg.rollout.engine == "vllm"
                and (cfg.rollout.top_k or cfg.rollout.top_p < 1.0) and not cfg.rollout.greedy):
            raise ValueError(
                f"ppo.old_logprobs_from_rollout=true with rollout.engine=vllm: vLLM records log-probs "
                f"after top-k/top-p (rollout.top_k={cfg.rollout.top_k}, rollout.top_p={cfg.rollout.top_p}), "
                f"not of the policy the update trains: set rollout.top_k=0 and rollout.top_p=1.0")
        if (cfg.ppo.old_logprobs_from_rollout and cfg.rollout.engine == "vllm"
                and cfg.rollout.min_new_tokens > 0):
            raise ValueError(
                f"ppo.old_logprobs_from_rollout=true with rollout.engine=vllm: vLLM records log-probs "
                f"after its min-tokens processor has removed EOS and the stop tokens from the first "
                f"rollout.min_new_tokens={cfg.rollout.min_new_tokens} positions, not the policy's own: "
                f"set rollout.min_new_tokens=0 or ppo.old_logprobs_from_rollout=false")
        self.rollout_engine = build_rollout_engine(
            cfg.rollout, dims, cfg.model, eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id, decode_fn=tokenizer.decode,
            params_dtype=unwrap(model).config.params_dtype,
            with_values=cfg.ppo.old_logprobs_from_rollout and self.actor_values)
        self.nonfinite_in_a_row = 0
        self.timers = Timers()
        self.encoded = [p.prompt_ids for p in prompts]
        self.eval_encoded = [p.prompt_ids for p in self.eval_prompts]
        self.initial_eval = None  # (responses, rm scores) of the initial policy
        if self.eval_prompts and cfg.trainer.val_check_interval:
            log.info("held-out win rate: eval/win_rate_vs_initial is self-judged (by the reward being "
                     "optimised); %s", f"eval/judge_win_rate_vs_initial by trainer.eval_judge="
                     f"{cfg.trainer.eval_judge}" if cfg.trainer.eval_judge else
                     "set trainer.eval_judge (a second RM's URL or a reward function) for an independent one")
        self.is_mp_src = dims.tp_rank == 0 and dims.pp_rank == 0
        flags = [None] * dims.world_size
        dist.all_gather_object(flags, dims.dp_rank == 0 and dims.tp_rank == 0 and dims.is_last_stage)
        self.reporter = flags.index(True)
        self.is_reporter = dims.rank == self.reporter
        self.run_config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
        self.exp = Experiment(cfg.exp_manager.exp_dir, dims.rank == 0, self.run_config)
        self.fingerprint = ppo_fingerprint(cfg)
        self._resumed = False
        self._last_batch = None  # (prompt indices, RolloutBatch, scores) of the last step
        self.reward_changed: Optional[str] = None
        """Set on resume when a reward source is not the one the checkpoint recorded (a
        refreshed RM): the message logged; the next step's metrics say so
        (``reward/source_changed``)."""
        self._source_change_logged = False
        self.rescore_initial = False
        """The next evaluation re-scores the initial policy's responses (kept for the win
        rate) with the current reward: set when the reward changed on resume."""

    # --- helpers ---------------------------------------------------------------------
    def _mp_broadcast(self, obj):
        """Broadcast a picklable object from model-parallel rank 0 to its TP x PP group."""
        if self.dims.tp * self.dims.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.dims.mp_group, 0),
                                   group=self.dims.mp_group)
        return box[0]

    def _to_reporter(self, obj):
        """Move an object computed on the last stage (dp0, tp0) to global rank 0."""
        if self.reporter == 0:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.reporter)
        return box[0]

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dims.dp > 1:
            dist.all_reduce(t, group=self.dims.dp_group)
        return t

    def _dp_reduce_stats(self, stats: dict) -> dict:
        if self.dims.dp == 1:
            return stats
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        for k in sorted(stats):
            t = stats[k].clone()
            dist.all_reduce(t, op=ops[P.stat_reduce_op(k)], group=self.dims.dp_group)
            stats[k] = t
        return stats

    def _generate(self, prompt_ids: list[list[int]], greedy: bool = False):
        """Rollout for this DP rank's prompts by ``rollout.engine``; the sampling seeds are a
        function of ``(rollout.seed, dp_rank, step)``, so a resumed run draws the same tokens."""
        cfg = replace(self.cfg.rollout, greedy=True) if greedy else self.cfg.rollout
        return self.rollout_engine.generate(self.model, prompt_ids, cfg, call_index=self.step,
                                            weights_version=self.weights_version)

    def _response_texts(self, batch) -> list[str]:
        out = []
        for ids, mask in zip(batch.response_ids.tolist(), batch.response_mask.tolist()):
            toks = [t for t, m in zip(ids, mask) if m and t != self.tok.eos_id]
            out.append(self.tok.decode(toks))
        return out

    # --- the six steps -----------------------------------------------------------------
    def sample_prompts(self) -> list[int]:
        """Step 1: this DP rank's prompts of the next global batch, each repeated
        ``rollout.n_samples_per_prompt`` times (a group: contiguous, on one DP rank),
        logged to ``prompt_log.jsonl``."""
        n = self.cfg.rollout.n_samples_per_prompt
        idx = self.sampler.next_global_batch(self.cfg.ppo.num_rollout_samples // n)
        mine = dp_group_slice(idx, self.dims.dp_rank, self.dims.dp, n)
        self._log_prompt_ids(mine[::n])
        return mine

    @in_phase("rollout")
    def rollout(self, idx: list[int]):
        """Step 2: the actor generates for this DP rank's prompts (a ``RolloutBatch``)."""
        with self.timers("rollout"):
            batch = self._generate([self.encoded[i] for i in idx])
        maybe_crash("rollout", self.step + 1)
        return batch

    @in_phase("reward")
    def score(self, idx: list[int], batch) -> tuple[torch.Tensor, dict]:
        """Step 3: scores ``[B]`` float32 on ``dims.device`` from the reward sources (computed
        on the host by MP rank 0, broadcast as an object, moved to the device here), and
        reward metrics, ``reward_raw_mean`` (raw weighted score mean over DP) included.

        Raises:
            the reward source's error on the rank where it failed and
            :class:`RewardScoringError` (same message) on every other rank, all in the
            same step: no rank is left waiting in a collective.
        """
        with self.timers("reward"):
            return self._score(idx, batch)

    def _score(self, idx: list[int], batch) -> tuple[torch.Tensor, dict]:
        raw, failure = None, None
        if self.is_mp_src:
            rows = [self.prompts[i] for i in idx]
            try:
                raw = self.reward.fetch([r.prompt for r in rows], self._response_texts(batch),
                                        [r.extras for r in rows])
            except Exception as exc:  # noqa: BLE001 - every rank raises it below
                failure = exc
        self._raise_if_scoring_failed(failure)
        result = None
        if self.is_mp_src:
            out = self.reward.combine(raw)  # running normalisation: a scoring-rank collective
            # NaN marks a sample reward.invalid_scores=skip leaves out (rewards.step_scores)
            result = step_scores(self.dims, out, self.step + 1, self.cfg.rollout.n_samples_per_prompt,
                                 self.advantage_cfg.traits.needs_groups)
        scores, metrics = self._mp_broadcast(result)
        check_samples_left(metrics, self.step + 1)  # the same metrics on every rank
        return to_device(scores, self.dims.device), metrics

    def _raise_if_scoring_failed(self, failure: Optional[BaseException]) -> None:
        """Every rank learns whether a scoring rank's reward call failed; all raise.

        One flag all-reduce per call (host); the message is gathered only on failure.
        """
        if self.dims.world_size == 1:
            if failure is not None:
                raise failure
            return
        flag = torch.tensor([0.0 if failure is None else 1.0], device="cpu")  # host: gloo
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0.0:
            return
        info = None if failure is None else f"{type(failure).__name__}: {failure}"
        infos = [None] * self.dims.world_size
        dist.all_gather_object(infos, info)
        if failure is not None:
            raise failure
        src = next(i for i, m in enumerate(infos) if m is not None)
        raise RewardScoringError(f"reward scoring failed on rank {src} (stopping every rank): "
                                 f"{infos[src]}")

    def _forward_logprobs(self, model, batch, with_values: bool,
                          temperature: Optional[float] = None,
                          kl_temperature: Optional[float] = None):
        """Forward-only over the rollout in micro-batches (eval mode): ``logprobs`` [B, R]
        at ``temperature`` (default: the rollout's), ``values`` [B, R] if asked, and
        ``kl_logprobs`` at ``kl_temperature`` when that differs."""
        P_len = batch.prompt_length
        temp = self.cfg.rollout.logprob_temperature if temperature is None else temperature

        def loss_fn(output, mb):
            logits, values = output if isinstance(output, tuple) else (output, None)
            p = mb.get("prompt_length", P_len)
            lp, _ = response_logprobs(logits, (mb["input_ids"], p), self.dims, temp,
                                      vocab_size=self.cfg.model.vocab_size, compute_entropy=False)
            out = {"logprobs": lp}
            if kl_temperature is not None and kl_temperature != temp:
                out["kl_logprobs"], _ = response_logprobs(
                    logits, (mb["input_ids"], p), self.dims, kl_temperature,
                    vocab_size=self.cfg.model.vocab_size, compute_entropy=False)
            if with_values and values is not None:
                out["values"] = response_values(values, p, lp.shape[1])
            return torch.zeros((), device=lp.device), out

        micro, plans = self._forward_micro_batches(batch)
        temps = (temp,) if kl_temperature is None or kl_temperature == temp else (temp, kl_temperature)
        with torch.no_grad(), _eval_mode(model):
            res = forward_backward(model, micro, loss_fn, forward_only=True,
                                   with_values=with_values, variable_shapes=plans is not None,
                                   logprob_request=self._logprob_request(P_len, temps, entropy=False))
        return self._gather_forward(res, plans, batch)

    def _forward_micro_batches(self, batch) -> tuple[list[dict], Optional[list]]:
        """The forward-only passes' micro-batches: ``ppo.forward_micro_batch_size`` rows of
        the full width, or, with ``ppo.max_tokens_per_micro_batch``, grouped by the token
        budget with their padding cut, rows concatenated with ``ppo.sequence_packing``
        (and the plans, to put the rows back)."""
        P_len, B = batch.prompt_length, batch.input_ids.shape[0]
        tensors = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        budget = self.cfg.ppo.max_tokens_per_micro_batch
        if budget == 0:
            mbs = self.cfg.ppo.forward_micro_batch_size
            return [{k: v[s] for k, v in tensors.items()} for s in _chunks(B, mbs)], None
        starts, lengths = row_extents(batch.attention_mask, batch.response_mask, P_len)
        plans = plan_micro_batches(starts, lengths, P_len, list(range(B)), B, budget,
                                   pack=self.cfg.ppo.sequence_packing,
                                   row_length=self.cfg.ppo.packed_row_length)
        return [take(p, tensors, P_len, self.dims.device) for p in plans], plans

    @staticmethod
    def _gather_forward(res: list[dict], plans: Optional[list], batch) -> Optional[dict]:
        """The forward-only passes' per-micro-batch results as ``[B, R]`` tensors in row order."""
        if not res:
            return None
        if plans is None:
            return {k: torch.cat([r[k] for r in res]) for k in res[0]}
        B, R = batch.response_mask.shape
        return {k: scatter_rows(plans, [r[k] for r in res], B, R) for k in res[0]}

    def _forward_values(self, critic, batch) -> Optional[torch.Tensor]:
        """A separate critic's values ``[B, R]`` float32 over the rollout (forward-only,
        eval mode, micro-batches of ``ppo.forward_micro_batch_size``); None off the last
        pipeline stage."""
        P_len = batch.prompt_length

        def loss_fn(values, mb):
            v = response_values(values, mb.get("prompt_length", P_len), mb["input_ids"].shape[1]
                                - mb.get("prompt_length", P_len))
            return torch.zeros((), device=v.device), {"values": v}

        micro, plans = self._forward_micro_batches(batch)
        with torch.no_grad(), _eval_mode(critic):
            res = forward_backward(critic, micro, loss_fn, forward_only=True,
                                   variable_shapes=plans is not None)
        out = self._gather_forward(res, plans, batch)
        return None if out is None else out["values"]

    @in_phase("forward")
    def compute_old_and_reference(self, batch) -> Optional[ForwardResults]:
        """Steps 4-5a: old log-probs and values (actor, or the separate critic; the
        rollout's with ``ppo.old_logprobs_from_rollout``), reference log-probs (weights
        swapped in); None off the last pipeline stage."""
        kl_temp = self._kl_temperature()
        if self.cfg.ppo.old_logprobs_from_rollout:  # the rollout's own (kl_temp checked at start)
            old = {"logprobs": batch.logprobs} if self.dims.is_last_stage else None
            if old is not None and self.actor_values:
                old["values"] = batch.values
        else:
            with self.timers("old_logprobs_values"):
                old = self._forward_logprobs(self.model, batch, with_values=self.actor_values,
                                             kl_temperature=kl_temp)
        values = None
        if self.critic_model is not None:
            with self.timers("critic_values"):
                values = self._forward_values(self.critic_model, batch)
        with self.timers("reference_logprobs"), self.reference.swapped_in() as ref_model:
            ref = self._forward_logprobs(ref_model, batch, with_values=False, temperature=kl_temp)
        if old is None:
            return None
        return ForwardResults(old_logprobs=old["logprobs"], ref_logprobs=ref["logprobs"],
                              kl_logprobs=old.get("kl_logprobs", old["logprobs"]),
                              values=old.get("values") if values is None else values)

    def _logprob_request(self, prompt_length: int, temperatures: tuple, entropy: bool
                         ) -> Optional[LogprobRequest]:
        """The fused, chunked output layer's request (``ppo.logprob_chunk_size``; None: off,
        the forward returns logits)."""
        chunk = self.cfg.ppo.logprob_chunk_size
        if chunk == 0:
            return None
        return LogprobRequest(prompt_length, tuple(dict.fromkeys(temperatures)), self.cfg.model.vocab_size,
                              compute_entropy=entropy, chunk_size=chunk)

    def _kl_temperature(self) -> float:
        """Temperature of the two log-probs the KL penalty compares (``kl.temperature``)."""
        if self.cfg.kl.temperature == "sampling":
            return self.cfg.rollout.logprob_temperature
        return 1.0

    @in_phase("advantages")
    def compute_advantages(self, batch, scores, fwd: Optional[ForwardResults]
                           ) -> tuple[Optional[Advantages], dict]:
        """Step 5: token rewards (``-beta*KL`` when ``kl.in_reward``), the advantage
        estimator (``ppo.advantage_estimator``), whitening (``gae``); returns them and the
        rollout's metrics (reduced over DP) on the last stage, ``(None, {})`` elsewhere."""
        if fwd is None:
            return None, {}
        with self.timers("advantages"):
            adv, metrics = self._advantages(batch, scores, fwd)
            metrics.update(self._rollout_quality(batch, fwd, adv))
        return adv, metrics

    def _rollout_quality(self, batch, fwd: ForwardResults, adv: Advantages) -> dict:
        """The rollout-vs-train log-prob mismatch, the critic's explained variance, the
        n-gram repetition and the longest response, each over the whole batch (every DP
        rank's rows: one sum and one max all-reduce on ``dims.device``)."""
        mask = batch.response_mask
        dev = mask.device
        m = mask.bool()
        diff = (batch.logprobs.detach().float() - fwd.old_logprobs.detach().float()).abs()
        reps = self._repetition(batch)
        ev = (P.explained_variance_sums(fwd.values, adv.returns, mask) if self.needs_values
              else torch.zeros(5, dtype=torch.float64, device=dev))
        sums = torch.cat([torch.stack([torch.where(m, diff, 0.0).sum().double(), m.sum().double(),
                                       torch.tensor(float(sum(reps)), dtype=torch.float64, device=dev),
                                       torch.tensor(float(len(reps)), dtype=torch.float64, device=dev)]),
                          ev.to(dev)])
        maxes = torch.stack([torch.where(m, diff, 0.0).max() if diff.numel() else diff.new_zeros(()),
                             batch.response_lengths.max().float().to(dev)])
        if self.dims.dp > 1:
            dist.all_reduce(sums, group=self.dims.dp_group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=self.dims.dp_group)
        diff_sum, tokens, rep_sum, rows = (float(x) for x in sums[:4].tolist())
        out = {"rollout_train_logprob_diff_mean": diff_sum / tokens if tokens else 0.0,
               "rollout_train_logprob_diff_max": float(maxes[0]),
               "repetition": rep_sum / max(rows, 1.0),
               "response_length_max": float(maxes[1])}
        if self.needs_values:
            out["explained_variance"] = P.explained_variance_from_sums(sums[4:])
        return out

    def _advantages(self, batch, scores, fwd: ForwardResults) -> tuple[Advantages, dict]:
        mask = batch.response_mask
        c = self.cfg
        beta = self.kl_ctl.value if c.kl.in_reward else 0.0
        keep = torch.isfinite(scores)  # [B]: False on rows reward.invalid_scores=skip leaves out
        rewards, kl = P.compute_token_rewards(
            fwd.kl_logprobs, fwd.ref_logprobs, torch.where(keep, scores, 0.0), mask, beta,
            kl_estimator=c.kl.estimator, kl_clamp=c.kl.clamp, ended=batch.ended,
            missing_eos_penalty=c.ppo.missing_eos_penalty)
        full_mask, mask = mask, mask & keep[:, None]  # from here on: the rows that train
        group_ids = P.group_ids_from_samples(mask.shape[0], c.rollout.n_samples_per_prompt,
                                             device=mask.device)
        adv, ret = P.compute_advantages(  # group estimators: whole groups left out, see step_scores
            self.advantage_cfg, rewards, fwd.values,
            full_mask if self.advantage_cfg.traits.needs_groups else mask,
            group_ids, reduce_fn=self._whiten_reduce)
        adv, ret = torch.where(mask, adv, 0.0), torch.where(mask, ret, 0.0)
        scores = torch.where(keep, scores, 0.0)
        raw_adv = adv
        if c.ppo.normalize_advantages and self.advantage_cfg.traits.batch_whitening:
            adv = P.masked_whiten(adv, mask, reduce_fn=self._whiten_reduce)
        seq_kl = torch.where(mask, kl, 0.0).sum(-1)
        ret_masked = torch.where(mask, ret, 0.0)
        sums = self._dp_sum_named({  # one all-reduce of the rollout's sums
            "kl": seq_kl.sum(), "score": scores.sum(),
            "token_reward": torch.where(mask, rewards, 0.0).sum(), "tokens": mask.sum().float(),
            "truncated": (batch.truncated & keep).float().sum(),
            "sequences": keep.float().sum(),
            "advantage": torch.where(mask, raw_adv, 0.0).sum(), "return": ret_masked.sum(),
            "return_sq": ret_masked.pow(2).sum(), "score_sq": (scores ** 2).sum()})
        n_tok, n_seq = sums["tokens"], sums["sequences"]
        ret_mean = sums["return"] / n_tok
        score_mean = sums["score"] / n_seq
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
            "beta": float(self.kl_ctl.value),
        }
        return Advantages(advantages=adv, returns=ret, kl=kl, loss_mask=mask), metrics

    def _dp_sum_named(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Scalars summed over DP in one all-reduce (stacked in the dict's order)."""
        return dict(zip(sums, self._dp_sum(torch.stack(list(sums.values())))))

    def _whiten_reduce(self, s, sq, n):
        t = self._dp_sum(torch.stack([s, sq, n]).float())
        return t[0], t[1], t[2]

    def _ppo_loss_fn(self, n_tokens: torch.Tensor, n_seqs: torch.Tensor, P_len: int,
                     value_only: bool):
        """The micro-batches' loss function: the current log-probs, entropy (and values on a
        shared backbone) of the micro-batch, into :func:`~nemo_rlhf.algorithms.ppo.ppo_loss`
        over the global ``n_tokens`` / ``n_seqs`` (scalar tensors, all micro-batches and DP
        ranks); ``value_only``: a critic warm-up on the shared backbone."""
        temp, kl_temp = self.cfg.rollout.logprob_temperature, self._kl_temperature()
        with_kl = self.objective.kl_coef > 0 and not value_only

        def fn(output, mb):
            logits, values = output if isinstance(output, tuple) else (output, None)
            p = mb.get("prompt_length", P_len)  # a token-budget micro-batch has its own
            lp, ent = response_logprobs(logits, (mb["input_ids"], p), self.dims, temp,
                                        vocab_size=self.cfg.model.vocab_size)
            lp_kl = None
            if with_kl:
                lp_kl = lp if kl_temp == temp else response_logprobs(
                    logits, (mb["input_ids"], p), self.dims, kl_temp,
                    vocab_size=self.cfg.model.vocab_size, compute_entropy=False)[0]
            return P.ppo_loss(
                self.objective, lp, ent, mb["response_mask"], n_tokens, n_seqs,
                old_logprobs=mb["old_logprobs"], advantages=mb["advantages"],
                values=response_values(values, p, lp.shape[1]) if self.actor_values else None,
                old_values=mb.get("old_values"), returns=mb.get("returns"),
                kl_logprobs=lp_kl, ref_logprobs=mb.get("ref_logprobs"), policy=not value_only,
                rollout_weights=mb.get("rollout_weights"))

        return fn

    def _critic_loss_fn(self, n_tokens: torch.Tensor, n_seqs: torch.Tensor, P_len: int):
        """A separate critic's loss function (:func:`~nemo_rlhf.algorithms.ppo.critic_loss`)."""

        def fn(values, mb):
            m = mb["response_mask"]
            return P.critic_loss(self.objective, response_values(values, mb.get("prompt_length", P_len),
                                                                  m.shape[1]),
                                 mb["old_values"], mb["returns"], m, n_tokens, n_seqs)

        return fn

    @in_phase("update")
    def update(self, batch, fwd: Optional[ForwardResults], adv: Optional[Advantages]) -> dict:
        """Step 6: ``ppo_epochs`` x mini-batches, one optimizer step each (and one of the
        separate critic's); ``fwd`` / ``adv`` are None off the last pipeline stage."""
        c = self.cfg.ppo
        B = batch.input_ids.shape[0]
        per_rank = c.global_batch_size // self.dims.dp
        loss_mask = batch.response_mask if adv is None else adv.loss_mask  # [B, R]: rows that train
        tensors = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                   "response_mask": loss_mask}
        correction = {}
        if fwd is not None:
            tensors.update(old_logprobs=fwd.old_logprobs, advantages=adv.advantages)
            if c.rollout_is_cap is not None or c.rollout_mask_threshold is not None:
                tensors["rollout_weights"], rc = P.rollout_correction_weights(
                    fwd.old_logprobs, batch.logprobs, batch.response_mask,
                    tis_cap=c.rollout_is_cap, mask_threshold=c.rollout_mask_threshold)
                correction = {f"rollout_correction/{k}": v for k, v in
                              P.finalize_token_stats(self._dp_reduce_stats(rc)).items() if k != "valid_tokens"}
            if self.needs_values:
                tensors.update(old_values=fwd.values, returns=adv.returns)
            if self.cfg.kl.loss_coef > 0:
                tensors.update(ref_logprobs=fwd.ref_logprobs)
        value_only = self.step < self.cfg.trainer.critic_warmup_steps
        self.model.train()  # training passes: dropout on (forward-only passes run in eval)
        if self.critic_model is not None:
            self.critic_model.train()
        all_stats, norms, critic_norms, skipped = [], [], [], 0
        computed_tokens = 0  # rows x columns of every training micro-batch (shapes: host ints)
        extents = (row_extents(batch.attention_mask, batch.response_mask, batch.prompt_length)
                   if c.max_tokens_per_micro_batch else None)  # host metadata, once per step
        # host permutation (the same order on every device type), moved to the device
        g = torch.Generator(device="cpu").manual_seed(self.cfg.trainer.seed + self.step)
        for _ in range(c.ppo_epochs):
            order_host = (torch.randperm(B, generator=g, device="cpu") if c.shuffle
                          else torch.arange(B, device="cpu"))
            order = order_host.to(self.dims.device)
            for mb_slice in _chunks(B, per_rank):
                idx = order[mb_slice]
                counts = torch.stack([loss_mask[idx].sum().float(), loss_mask[idx].any(-1).sum().float()])
                n_tokens, n_seqs = self._dp_sum(counts)
                if extents is None:
                    micro = [{k: v[idx[s]] for k, v in tensors.items()}
                             for s in _chunks(len(idx), c.micro_batch_size)]
                else:  # the token budget: rows packed, padding cut
                    rows = order_host[mb_slice].tolist()
                    micro = [take(p, tensors, batch.prompt_length, self.dims.device) for p in
                             plan_micro_batches(*extents, batch.prompt_length, rows, len(rows),
                                                c.max_tokens_per_micro_batch, pack=c.sequence_packing,
                                                row_length=c.packed_row_length)]
                computed_tokens += sum(mb["packed"].tokens() if "packed" in mb else mb["input_ids"].numel()
                                       for mb in micro)
                res, stepped = [], True
                if self.critic_model is None or not value_only:  # a separate critic's warm-up
                    self.optimizer.zero_grad()                    # leaves the actor alone
                    res = forward_backward(
                        self.model, micro,
                        self._ppo_loss_fn(n_tokens, n_seqs, batch.prompt_length,
                                          value_only and self.critic_model is None),
                        with_values=self.actor_values, variable_shapes=extents is not None,
                        logprob_request=self._logprob_request(
                            batch.prompt_length, (self.cfg.rollout.logprob_temperature,
                                                  self._kl_temperature()), entropy=True))
                    finalize_grads(self.model)
                    stepped, norm = self._optimizer_step(value_only)
                    norms.append(norm)
                if self.critic_model is not None and self.needs_values:
                    self.critic_optimizer.zero_grad()
                    critic_res = forward_backward(
                        self.critic_model, micro,
                        self._critic_loss_fn(n_tokens, n_seqs, batch.prompt_length),
                        variable_shapes=extents is not None)
                    finalize_grads(self.critic_model)
                    critic_stepped, critic_norm = self.critic_optimizer.step()
                    critic_norms.append(critic_norm)
                    stepped = stepped and critic_stepped
                    res = [{**c_, **a} for c_, a in zip(critic_res, res)] if res else critic_res
                maybe_crash("update", self.step + 1)
                skipped += int(not stepped)
                self.nonfinite_in_a_row = 0 if stepped else self.nonfinite_in_a_row + 1
                if res:
                    all_stats.append(self._dp_reduce_stats(P.merge_token_stats(res)))
        out = {}
        if all_stats:
            first = P.finalize_token_stats(all_stats[0])
            out["first_minibatch/ratio_max"] = first.get("ratio_max", float("nan"))
            out["first_minibatch/ratio_min"] = first.get("ratio_min", float("nan"))
            merged = P.finalize_token_stats(P.merge_token_stats(all_stats))
            for k, v in merged.items():
                if k != "valid_tokens":
                    out[k] = v
        out["grad_norm"] = float(sum(norms) / len(norms)) if norms else 0.0
        if critic_norms:
            out["critic_grad_norm"] = float(sum(critic_norms) / len(critic_norms))
        out["skipped_updates"] = skipped
        out["lr"] = self.optimizer.lr
        out.update(correction)
        if computed_tokens:
            real = float(batch.attention_mask.sum()) * c.ppo_epochs
            out["padding_fraction"] = 1.0 - real / computed_tokens
        return out

    def _optimizer_step(self, value_only: bool) -> tuple[bool, float]:
        """One optimizer step; during critic warm-up (``value_only``) the value head's
        parameters only: the value loss's gradient into the shared backbone is dropped,
        so the policy does not move (no update, Adam state or weight decay)."""
        if value_only:
            return self.optimizer.step(only=_is_value_head)
        stepped, norm = self.optimizer.step()
        if stepped:
            self.weights_version += 1
        return stepped, norm

    @property
    def critic(self) -> Optional[tuple]:
        """``(critic stage, its optimizer)`` of a separate critic (checkpoints), or None."""
        return None if self.critic_model is None else (self.critic_model, self.critic_optimizer)

    # --- one step --------------------------------------------------------------------------
    def train_step(self) -> dict:
        """Run the six steps once; return the step's metrics (valid on the reporter)."""
        t0 = time.perf_counter()
        idx = self.sample_prompts()                                  # 1. prompts
        batch = self.rollout(idx)                                    # 2. rollout
        scores, reward_metrics = self.score(idx, batch)              # 3. rewards
        fwd = self.compute_old_and_reference(batch)                  # 4. reference, old log-probs
        adv, metrics = self.compute_advantages(batch, scores, fwd)   # 5. advantages
        with self.timers("train"):
            metrics.update(self.update(batch, fwd, adv))             # 6. PPO updates
        self._last_batch = (idx, batch, scores)
        return self._step_metrics(t0, batch, metrics, reward_metrics, fwd is not None)

    @in_phase("metrics")
    def _step_metrics(self, t0: float, batch, metrics: dict, reward_metrics: dict,
                      last_stage: bool) -> dict:
        """The step's metrics on the reporter; the KL controller's update (every rank)."""
        gen_tokens = self._dp_sum(batch.response_mask.sum().float().reshape(1))[0]
        metrics = self._to_reporter({**metrics, **reward_metrics} if last_stage else None) or {}
        kl_mean = self._bcast_float(metrics.get("kl_mean", 0.0))
        self.kl_ctl.update(kl_mean, self.cfg.ppo.num_rollout_samples)
        metrics.update(self.timers.pop())
        metrics.update(self.rollout_engine.metrics())
        elapsed = time.perf_counter() - t0
        metrics["timing/step_s"] = elapsed
        metrics["generated_tokens_per_s"] = float(gen_tokens) / max(metrics.get("timing/rollout_s", elapsed), 1e-9)
        metrics["episodes_per_s"] = self.cfg.ppo.num_rollout_samples / elapsed
        metrics["consumed_samples"] = self.sampler.consumed_samples
        if self.reward_changed and not self._source_change_logged:
            metrics["reward/source_changed"] = 1.0
            self._source_change_logged = True
        return metrics

    def _log_prompt_ids(self, idx: list[int]) -> None:
        """Append this step's prompt ids to ``<exp_dir>/prompt_log.jsonl`` (one line per
        DP rank and attempt), so recovery can be audited: no prompt twice, none skipped."""
        if self.dims.tp_rank or self.dims.pp_rank:
            return
        import json

        path = Path(self.cfg.exp_manager.exp_dir) / "prompt_log.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"step": self.step + 1, "dp_rank": self.dims.dp_rank,
                                "prompt_ids": idx}) + "\n")

    def _bcast_float(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device="cpu")  # host: gloo part of the map
        dist.broadcast(t, src=0)
        return float(t[0])

    def _repetition(self, batch) -> list[float]:
        return [ngram_repetition_rate([t for t, m in zip(ids, mk) if m])
                for ids, mk in zip(batch.response_ids.tolist(), batch.response_mask.tolist())]

    # --- evaluation ----------------------------------------------------------------------
    @in_phase("eval", step_offset=0)
    def evaluate(self) -> dict:
        """The held-out evaluation (:func:`~nemo_rlhf.trainers.ppo.evaluation.evaluate_policy`)."""
        return evaluate_policy(self)

    def sample_table(self, n: int = 4) -> list[dict]:
        """A few (prompt, response, reward) rows of the last rollout (this rank's)."""
        idx, batch, scores = self._last_batch
        texts = self._response_texts(batch)
        return [{"prompt": self.prompts[i].prompt, "response": texts[j],
                 "reward": float(scores[j])} for j, i in enumerate(idx[:n])]

    # --- the run (hooks of nemo_rlhf.trainers.loop.fit) ------------------------------------
    def fit(self) -> int:
        """Train to ``trainer.max_steps`` (:func:`nemo_rlhf.trainers.loop.fit`); the exit code."""
        return fit(self)

    def resume(self) -> None:
        """Load the checkpoint ``exp_manager.resume`` selects (:mod:`nemo_rlhf.checkpoint.policy`),
        once."""
        if self._resumed:
            return
        self._resumed = True
        em = self.cfg.exp_manager
        path, why, state = resume_run(
            em.resume, self.exp.checkpoint_dir, self.fingerprint,
            lambda p: load_checkpoint(p, self.model, self.optimizer, critic=self.critic),
            em.ignore_fingerprint)
        if path is None:
            log.info("starting fresh: %s", why)
            return
        self.load_state_dict(state)
        log.info("resumed from %s at step %d (%s)", path, self.step, why)

    def open_logs(self) -> None:
        self.logger = MetricsLogger(self.exp.dir, enabled=self.is_reporter or self.dims.rank == 0,
                                    total_steps=self.cfg.trainer.max_steps, start_step=self.step,
                                    trackers=self.cfg.logger if self.is_reporter else None,  # one run
                                    run_config=self.run_config)

    def on_fit_start(self) -> dict:
        """The step-0 evaluation (the initial policy's held-out numbers)."""
        return self.evaluate() if self.step == 0 and self.cfg.trainer.val_check_interval else {}

    def check_health(self) -> None:
        """Raises ``RuntimeError`` after ``trainer.max_consecutive_nonfinite`` skipped updates."""
        t = self.cfg.trainer
        if self.nonfinite_in_a_row >= t.max_consecutive_nonfinite:
            raise RuntimeError(
                f"{self.nonfinite_in_a_row} consecutive updates had a non-finite loss or "
                f"gradient norm (trainer.max_consecutive_nonfinite="
                f"{t.max_consecutive_nonfinite}); stopping, the last good checkpoint is kept "
                f"in {self.exp.checkpoint_dir}")

    def validate_now(self, last: bool) -> bool:
        n = self.cfg.trainer.val_check_interval
        return bool(n) and (self.step % n == 0 or last)

    def validate(self) -> dict:
        return self.evaluate()

    def final_metrics(self) -> dict:
        return {}

    def log(self, metrics: dict) -> None:
        """Metrics of the step to the sink; every ``trainer.sample_table_every`` steps a
        table of samples."""
        self.logger.log_metrics(metrics, self.step)
        every = self.cfg.trainer.sample_table_every
        if metrics and every and self.step % every == 0 and self._last_batch is not None:
            self.logger.log_samples(self.sample_table(), self.step)

    def stop_reason(self, metrics: dict) -> Optional[str]:
        """The reward-hacking guard (``guards.*``): warns; with ``guards.action=stop`` its
        message is the reason to save and stop (the same on every rank)."""
        action = self.cfg.guards.action
        message = self.guard.update(self.step, metrics) if action != "off" else None
        message = _bcast_text(message)
        if message:
            log.warning("reward-hacking guard: %s", message)
        return f"reward-hacking guard ({message})" if message and action == "stop" else None

    @in_phase("save", step_offset=0)
    def save(self) -> Path:
        """Checkpoint every model, optimizer and the trainer state (all ranks); prune to
        ``exp_manager.keep_last`` (0: keep all)."""
        root = self.exp.checkpoint_dir
        path = save_checkpoint(root, self.step, self.model, self.optimizer, self.state_dict(),
                               self.run_config, self.dims, self.fingerprint, critic=self.critic,
                               verify=self.cfg.exp_manager.verify_after_save)
        if self.cfg.exp_manager.keep_last and self.dims.rank == 0:
            prune(root, self.cfg.exp_manager.keep_last)
        return path

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
        self.rollout_engine.close()

    # --- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-able trainer state for checkpoints."""
        return {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "kl_controller": self.kl_ctl.state_dict(),
            "reward": _jsonable(self.reward.state_dict()) if self.reward else {},
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "initial_eval": self.initial_eval,
            "guard": self.guard.state_dict(),
            "reward_sources": self.reward.identities() if self.reward else {},
        }

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        self.weights_version += 1  # the checkpoint's weights were loaded
        self.sampler.load_state_dict(sd["sampler"])
        self.kl_ctl.load_state_dict(sd["kl_controller"])
        changed = {}
        if self.reward is not None:  # the scoring ranks, rank 0 among them
            changed = self.reward.changed_sources(sd.get("reward_sources") or {})
            if sd.get("reward"):
                self.reward.load_state_dict(sd["reward"], reset=list(changed))
        self.nonfinite_in_a_row = int(sd.get("nonfinite_in_a_row", 0))
        self.initial_eval = sd.get("initial_eval")
        if sd.get("guard"):
            self.guard.load_state_dict(sd["guard"])
        message = _bcast_text("; ".join(
            f"reward source {name!r} changed since the checkpoint ({_identity_text(before)} -> "
            f"{_identity_text(now)}): its normalisation statistics start over, the "
            f"reward-hacking guard's history is cleared and the initial policy's evaluation "
            f"is re-scored" for name, (before, now) in changed.items()) or None)
        if message:
            log.warning("%s", message)
            self.reward_changed = message
            self.rescore_initial = True
            self.guard.reset()


def _bcast_text(message: Optional[str]) -> Optional[str]:
    """Rank 0's message on every rank (a host object)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _identity_text(identity) -> str:
    if not identity:
        return "none recorded"
    return ", ".join(f"{k}={v}" for k, v in identity.items())


def _file_hash(path) -> str:
    """The first 16 hex digits of the SHA-256 of a file, or of a dataset folder's files
    (parquet shards, a ``save_to_disk`` folder): their relative names and contents in name
    order."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for file in files:
        if path.is_dir():
            h.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def ppo_fingerprint(cfg: PPOConfig) -> dict:
    """What a resume must match: the model shape, the tokenizer and prompt files (hashes),
    and the reference (initial) weights -- the checksums of the ``init_from`` checkpoint's
    shards (independent of the layout), or the seed of a random initialisation."""
    ref = f"random-init:seed={cfg.trainer.seed}"
    if cfg.exp_manager.init_from:
        files = read_metadata(cfg.exp_manager.init_from).get("files") or {}
        ref = hashlib.sha256(json.dumps(sorted((k, v[1]) for k, v in files.items())).encode())
        ref = ref.hexdigest()[:16]
    return {"model": cfg.model.fingerprint(),
            "tokenizer": _file_hash(Path(cfg.data.tokenizer_dir) / "tokenizer.json"),
            "train_prompts": _file_hash(cfg.data.train_file), "reference": ref}


class RewardScoringError(RuntimeError):
    """Scoring failed on another rank; the message is that rank's error."""


def _is_value_head(name: str) -> bool:
    return "value_head" in name.split(".")


@contextmanager
def _eval_mode(model):
    """Forward-only passes run in eval mode (no dropout); the previous mode is restored."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def dp_group_slice(global_idx: list[int], dp_rank: int, dp: int, n_samples_per_prompt: int
                   ) -> list[int]:
    """This DP rank's share of a global prompt batch, each prompt repeated
    ``n_samples_per_prompt`` times in a row: groups stay contiguous and on one rank.

    Args:
        global_idx: the step's prompt indices (all DP ranks), a multiple of ``dp`` long.

    Returns:
        ``len(global_idx) // dp * n_samples_per_prompt`` prompt indices.

    Raises:
        ValueError: if ``dp`` does not divide ``len(global_idx)``.
    """
    if len(global_idx) % dp:
        raise ValueError(f"{len(global_idx)} prompts do not split over {dp} data-parallel ranks")
    per = len(global_idx) // dp
    mine = global_idx[dp_rank * per:(dp_rank + 1) * per]
    return [i for i in mine for _ in range(n_samples_per_prompt)]


def _jsonable(obj):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


__all__ = ["PPOTrainer", "RewardScoringError", "dp_group_slice"]

