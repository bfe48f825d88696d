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
loss = policy + value_loss_coef * value - entropy_coef * entropy; then the KL controller update.

The actor and the critic are roles (:mod:`nemo_rlhf.trainers.ppo.roles`) chosen once here:
the step asks them for log-probs, values and training steps and reads no critic-mode flag;
the collectives are :mod:`nemo_rlhf.trainers.collectives`'.

Layout: every rank generates (TP/PP ranks of a DP group cooperate), scores are fetched
once per model-parallel group and broadcast; PPO math runs on the last pipeline stage,
which holds logits and values. Metrics are reduced over DP and reported by one rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from nemo_rlhf.algorithms import ppo as P
from nemo_rlhf.checkpoint import load_checkpoint, save_checkpoint
from nemo_rlhf.checkpoint.faults import maybe_crash
from nemo_rlhf.checkpoint.policy import prune, resume_run
from nemo_rlhf.data.sampler import ResumableSampler
from nemo_rlhf.distributed.device import to_device
from nemo_rlhf.distributed.phase import in_phase
from nemo_rlhf.metrics.logger import MetricsLogger
from nemo_rlhf.metrics.timers import Timers
from nemo_rlhf.models.moe import RouterLoad, router_load_metrics
from nemo_rlhf.trainers.collectives import JobCollectives, bcast_text
from nemo_rlhf.trainers.loop import Experiment, Signals, fit
from nemo_rlhf.trainers.ppo.config import PPOConfig
from nemo_rlhf.trainers.ppo.evaluation import HeldOutEvaluation, evaluate_policy
from nemo_rlhf.trainers.ppo.guards import RewardHackingGuard
from nemo_rlhf.trainers.ppo.micro_batches import training_minibatches
from nemo_rlhf.trainers.ppo.roles import CriticRole, ForwardPasses, PolicyRole, build_critic_role
from nemo_rlhf.trainers.ppo.episode_source import episode_extras, is_episode_batch
from nemo_rlhf.trainers.ppo.rollout_source import RolloutSource, build_rollout_source
from nemo_rlhf.trainers.ppo.scoring import RewardScoringError, score_rollout
from nemo_rlhf.trainers.ppo.state import (dp_group_slice, log_prompt_ids, ppo_fingerprint, restore_run_state,
                                          run_state)
from nemo_rlhf.trainers.ppo.step_data import Advantages, ForwardResults
from nemo_rlhf.trainers.ppo.step_metrics import rollout_quality, update_metrics
from nemo_rlhf.trainers.ppo.step_tensors import step_advantages, training_tensors

log = logging.getLogger("nemo_rlhf.ppo")


class PPOTrainer:
    """The PPO job: the six steps over an actor and a critic role, the reference, the
    reward sources and the prompt sampler.

    Args:
        cfg: the validated :class:`PPOConfig`.
        dims: :class:`~nemo_rlhf.distributed.ParallelDims`.
        model: DDP-wrapped actor(-critic) stage holding the initial policy's weights.
        optimizer: :class:`~nemo_rlhf.trainers.mixed_precision.MixedPrecisionOptimizer` over it.
        reference: :class:`~nemo_rlhf.trainers.ppo.reference.ReferencePolicy`.
        reward: a ``CombinedReward`` (called on model-parallel rank 0 of each DP group).
        tokenizer: encode/decode and the special token ids.
        prompts / eval_prompts: lists of ``PromptSample`` (prompt_ids, prompt, extras).
        critic: ``(critic stage, its optimizer)`` for ``critic.mode=separate`` (the critic's
            own DDP-wrapped backbone + value head); None: the value head on ``model``.
        signals: the :class:`~nemo_rlhf.trainers.loop.Signals` the entry point installed
            before the set-up (None: installed here).

    The roles (:mod:`nemo_rlhf.trainers.ppo.roles`) are chosen here, once: ``actor`` (a
    :class:`PolicyRole`) and ``critic`` (a :class:`CriticRole`: the value head on the
    actor's backbone, a separate critic, or none). :meth:`fit` runs the loop of
    :mod:`nemo_rlhf.trainers.loop`; the methods under "the run" are its hooks.
    """

    job = "ppo"

    def __init__(self, cfg: PPOConfig, dims, model, optimizer, reference, reward, tokenizer,
                 prompts: list, eval_prompts: Optional[list], critic: Optional[tuple] = None,
                 signals: Optional[Signals] = None):
        self.cfg, self.dims = cfg, dims
        self.reference, self.reward, self.tok = reference, reward, tokenizer
        self.prompts, self.eval_prompts = prompts, eval_prompts or []
        self.signals = signals or Signals()
        self.logger: Optional[MetricsLogger] = None
        g = cfg.guards
        self.guard = RewardHackingGuard(
            g.window, g.max_length_growth, g.max_repetition, g.kl_ceiling, g.gold_metric, g.proxy_metric,
            g.gold_window, g.gold_min_drop, g.proxy_min_rise, g.gold_min_gain,
            kl_target=cfg.kl.target if cfg.kl.type in ("adaptive", "pi") else None, kl_over_target=g.kl_over_target)
        self.kl_ctl = P.build_kl_controller(cfg.kl.type, cfg.kl.init_kl_coef, cfg.kl.target, cfg.kl.horizon,
                                            cfg.kl.pi_settings() if cfg.kl.type == "pi" else None)
        self.sampler = ResumableSampler(len(prompts), cfg.trainer.seed, cfg.ppo.shuffle)
        self.advantage_cfg, self.objective = cfg.advantage_config(), cfg.objective()
        passes = ForwardPasses.from_config(cfg.ppo, cfg.model.vocab_size, dims)
        self.critic: CriticRole = build_critic_role(self.advantage_cfg.needs_values, critic, passes)
        self.actor = PolicyRole(model, optimizer, passes, dims, cfg.rollout.logprob_temperature,
                                cfg.kl_temperature, with_values=self.critic.on_actor_backbone,
                                routing_replay=cfg.moe.routing_replay)
        self.step = 0
        self.nonfinite_in_a_row = 0
        self.timers = Timers()
        self.encoded = [p.prompt_ids for p in prompts]
        self.evaluation = HeldOutEvaluation(cfg, has_prompts=bool(self.eval_prompts))
        self.collectives = JobCollectives(dims)
        self.rollout_source: RolloutSource = build_rollout_source(
            cfg, dims, self.actor, tokenizer, self.encoded, self.sampler, self.collectives, self.timers,
            with_values=cfg.ppo.old_logprobs_from_rollout and self.critic.on_actor_backbone, prompts=prompts)
        """Where the samples come from (:mod:`~nemo_rlhf.trainers.ppo.rollout_source`): the
        local engine, or the rollout workers of ``rollout.mode=async``; chosen here, once."""
        self.is_mp_src, self.is_reporter = self.collectives.is_mp_src, self.collectives.is_reporter
        self.run_config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
        self.exp = Experiment(cfg.exp_manager.exp_dir, dims.rank == 0, self.run_config)
        self.fingerprint = ppo_fingerprint(cfg)
        self._resumed = False
        self._last_batch = None  # (prompt indices, RolloutBatch, scores) of the last step
        self._step_kl: Optional[float] = None  # kl_mean of the step, for the KL controller
        self.reward_changed: Optional[str] = None
        """Set on resume when a reward source is not the one the checkpoint recorded (a
        refreshed RM): the message logged; the next step's metrics say so
        (``reward/source_changed``)."""
        self._source_change_logged = False

    @property
    def model(self):
        """The actor's DDP-wrapped stage."""
        return self.actor.model

    @property
    def optimizer(self):
        """The actor's optimizer."""
        return self.actor.optimizer

    @property
    def weights_version(self) -> int:
        """The actor's weights version (:attr:`PolicyRole.weights_version`)."""
        return self.actor.weights_version

    @weights_version.setter
    def weights_version(self, value: int) -> None:
        self.actor.weights_version = value

    # --- the rollout's text ----------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], greedy: bool = False):
        """The actor's responses to token-id prompts outside the training rollout (the
        evaluation's; :meth:`RolloutSource.generate`); the sampling seeds are a function of
        ``(rollout.seed, dp_rank, step)``."""
        cfg = replace(self.cfg.rollout, greedy=True) if greedy else self.cfg.rollout
        return self.rollout_source.generate(prompt_ids, cfg, call_index=self.step)

    def generate_eval(self, rows: list):
        """The held-out evaluation's greedy decoding of ``rows`` (``prompt_ids``, ``prompt``,
        ``extras``): single-turn, :meth:`generate` of the ``prompt_ids``; with ``env.name``,
        greedy episodes with the environment (fresh ones; problems ``{"prompt": prompt,
        **extras}``), an :class:`~nemo_rlhf.trainers.ppo.episode_source.EpisodeRolloutBatch`
        (:meth:`EpisodeRolloutSource.generate_episodes`)."""
        if self.cfg.env.name is not None:  # an EpisodeRolloutSource, or async a RemoteRolloutSource
            return self.rollout_source.generate_episodes(
                [{"prompt": r.prompt, **r.extras} for r in rows], replace(self.cfg.rollout, greedy=True),
                call_index=self.step)
        return self.generate([r.prompt_ids for r in rows], greedy=True)

    def response_texts(self, batch) -> list[str]:
        """The responses' text (EOS and padding dropped), one per row; of a multi-turn
        batch, each episode's final answer (its last policy turn)."""
        if is_episode_batch(batch):
            return batch.final_texts(self.tok.decode, self.tok.eos_id)
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
        if not (self.dims.tp_rank or self.dims.pp_rank):
            log_prompt_ids(self.cfg.exp_manager.exp_dir, self.step + 1, self.dims.dp_rank, mine[::n])
        return mine

    @in_phase("rollout")
    def rollout(self, idx: list[int]):
        """Step 2: this DP rank's samples for its prompts (a ``RolloutBatch``) from the
        rollout source (generated here, or by the rollout workers: this waits for them)."""
        with self.timers("rollout"):
            batch = self.rollout_source.rollout(self.step + 1, idx)
        maybe_crash("rollout", self.step + 1)
        return batch

    @in_phase("reward")
    def score(self, idx: list[int], batch) -> tuple[torch.Tensor, dict]:
        """Step 3: scores ``[B]`` float32 on ``dims.device`` from the reward sources (computed
        on the host by MP rank 0, broadcast as an object, moved to the device here; NaN on
        a row ``reward.invalid_scores=skip`` leaves out), and reward metrics,
        ``reward_raw_mean`` (raw weighted score mean over DP) included
        (:func:`~nemo_rlhf.trainers.ppo.scoring.score_rollout`).

        Raises:
            the reward source's error on the rank where it failed and
            :class:`RewardScoringError` (same message) on every other rank, all in the
            same step: no rank is left waiting in a collective.
        """
        rows = [self.prompts[i] for i in idx]
        if is_episode_batch(batch):  # the reward functions see the episode's reward (the `env` one)
            rows = [replace(r, extras={**r.extras, **episode_extras(ep)}) for r, ep in zip(rows, batch.episodes)]
        with self.timers("reward"):
            scores, metrics = score_rollout(
                self.reward, self.collectives, rows, self.response_texts(batch),
                self.step + 1, self.cfg.rollout.n_samples_per_prompt, self.advantage_cfg.traits.needs_groups)
        return to_device(scores, self.dims.device), metrics

    def raise_if_scoring_failed(self, failure: Optional[BaseException]) -> None:
        """Every rank learns whether a scoring rank's reward call failed; all raise
        (:meth:`~nemo_rlhf.trainers.collectives.JobCollectives.raise_together`)."""
        self.collectives.raise_together(failure, "reward scoring", RewardScoringError)

    @in_phase("forward")
    def compute_old_and_reference(self, batch) -> Optional[ForwardResults]:
        """Steps 4-5a: old log-probs (the actor's forward, or the rollout's with
        ``ppo.old_logprobs_from_rollout``), values (the critic role's), reference log-probs
        (weights swapped in); None off the last pipeline stage. With ``moe.routing_replay``
        the actor's forward replays the rollout's routes (and so do the values of a value
        head on its backbone: the same forward); the reference and a separate critic route
        by their own routers."""
        kl_temp, values_on_actor = self.cfg.kl_temperature, self.critic.on_actor_backbone
        if self.cfg.ppo.old_logprobs_from_rollout:  # the rollout's own (kl_temp checked in the config)
            old = {"logprobs": batch.logprobs} if self.dims.is_last_stage else None
            if old is not None and values_on_actor:
                old["values"] = batch.values
        else:
            with self.timers("old_logprobs_values"):
                old = self.actor.logprobs(batch, with_values=values_on_actor, kl_temperature=kl_temp,
                                          replay_routes=self.cfg.moe.routing_replay)
        values = self.critic.values(batch, old, self.timers)
        with self.timers("reference_logprobs"), self.reference.swapped_in() as ref_model:
            ref = self.actor.logprobs(batch, ref_model, temperature=kl_temp)
        if old is None:
            return None
        return ForwardResults(old_logprobs=old["logprobs"], ref_logprobs=ref["logprobs"],
                              kl_logprobs=old.get("kl_logprobs", old["logprobs"]), values=values)

    @in_phase("advantages")
    def compute_advantages(self, batch, scores, fwd: Optional[ForwardResults]
                           ) -> tuple[Optional[Advantages], dict]:
        """Step 5: token rewards (``-beta*KL`` when ``kl.in_reward``), the advantage
        estimator (``ppo.advantage_estimator``), whitening (``gae``); returns them and the
        rollout's metrics (reduced over DP) on the last stage, ``(None, {})`` elsewhere."""
        if fwd is None:
            return None, {}
        with self.timers("advantages"):
            adv, metrics = step_advantages(self.cfg, self.advantage_cfg, self.kl_ctl.value, self.collectives,
                                           batch, scores, fwd)
            metrics.update(rollout_quality(self.collectives, batch, fwd.old_logprobs,
                                           self.critic.explained_variance_sums(fwd, adv, adv.loss_mask)))
        self._step_kl = metrics["kl_mean"]
        return adv, metrics

    @in_phase("update")
    def update(self, batch, fwd: Optional[ForwardResults], adv: Optional[Advantages]) -> dict:
        """Step 6: ``ppo_epochs`` x mini-batches, one optimizer step each for the actor and
        for a critic with its own (during ``trainer.critic_warmup_steps`` only the critic
        trains); ``fwd`` / ``adv`` are None off the last pipeline stage."""
        c, P_len = self.cfg.ppo, batch.prompt_length
        tensors, correction = training_tensors(self.cfg, self.critic, self.collectives, batch, fwd, adv)
        warmup = self.step < self.cfg.trainer.critic_warmup_steps
        actor_trains = not warmup or self.critic.warmup_trains_actor_head
        variable_shapes = bool(c.max_tokens_per_micro_batch)  # the token budget's micro-batches
        self.model.train()  # training passes: dropout on (forward-only passes run in eval)
        self.critic.train()
        all_stats, norms, critic_norms, skipped = [], [], [], 0
        computed_tokens = 0  # rows x columns of every training micro-batch (shapes: host ints)
        with RouterLoad(self.model) as load:  # MoE: tokens per expert in these passes
            for micro, n_tokens, n_seqs, routed_tokens, computed in training_minibatches(
                    c, tensors, c.global_batch_size // self.dims.dp, P_len, batch.attention_mask,
                    batch.response_mask, self.dims.device, self.collectives.dp_sum,
                    seed=self.cfg.trainer.seed + self.step, cp=self.dims.cp):
                computed_tokens += computed
                res, stepped = [], True
                if actor_trains:
                    res, stepped, norm = self.actor.train_minibatch(
                        micro, self.actor.loss_fn(self.objective, n_tokens, n_seqs, P_len, value_only=warmup),
                        P_len, variable_shapes=variable_shapes, value_head_only=warmup,
                        routed_tokens=routed_tokens)
                    norms.append(norm)
                critic_out = self.critic.train_minibatch(micro, self.objective, n_tokens, n_seqs, P_len,
                                                         variable_shapes=variable_shapes,
                                                         routed_tokens=routed_tokens)
                if critic_out is not None:
                    critic_res, critic_stepped, critic_norm = critic_out
                    critic_norms.append(critic_norm)
                    stepped = stepped and critic_stepped
                    res = [{**c_, **a} for c_, a in zip(critic_res, res)] if res else critic_res
                maybe_crash("update", self.step + 1)
                skipped += int(not stepped)
                self.nonfinite_in_a_row = 0 if stepped else self.nonfinite_in_a_row + 1
                if res:
                    # (context parallel: each CP rank's statistics are of its positions)
                    all_stats.append(self.collectives.dp_reduce_stats(
                        self.collectives.cp_reduce_stats(P.merge_token_stats(res))))
        out = update_metrics(all_stats, norms, critic_norms)
        if load.active:
            sums = load.stage_sums(self.collectives.dp_sum, self.collectives.cp_sum)
            out.update(router_load_metrics(self.collectives.pp_sum(sums)))
        out["skipped_updates"] = skipped
        out["lr"] = self.optimizer.lr
        out.update(correction)
        if computed_tokens:
            real = float(batch.attention_mask.sum()) * c.ppo_epochs
            out["padding_fraction"] = 1.0 - real / computed_tokens
        return out

    # --- one step --------------------------------------------------------------------------
    def train_step(self) -> dict:
        """Run the six steps once; return the step's metrics (valid on the reporter)."""
        t0 = time.perf_counter()
        self.rollout_source.begin(self.step)  # (async, the first time: the workers get the weights)
        idx = self.sample_prompts()                                  # 1. prompts
        batch = self.rollout(idx)                                    # 2. rollout
        scores, reward_metrics = self.score(idx, batch)              # 3. rewards
        fwd = self.compute_old_and_reference(batch)                  # 4. reference, old log-probs
        adv, metrics = self.compute_advantages(batch, scores, fwd)   # 5. advantages
        with self.timers("train"):
            metrics.update(self.update(batch, fwd, adv))             # 6. PPO updates
        self.rollout_source.after_update(self.step + 1)  # (async: the new weights to the workers)
        self._last_batch = (idx, batch, scores)
        return self._step_metrics(t0, batch, metrics, reward_metrics, fwd is not None)

    @in_phase("metrics")
    def _step_metrics(self, t0: float, batch, metrics: dict, reward_metrics: dict,
                      last_stage: bool) -> dict:
        """The step's metrics on the reporter; the KL controller's update (every rank, from
        the step's KL as the last stage reduced it over DP)."""
        gen_tokens = self.collectives.dp_sum(batch.response_mask.sum().float().reshape(1))[0]
        self.kl_ctl.update(self.collectives.from_last_stage(self._step_kl), self.cfg.ppo.num_rollout_samples)
        metrics = self.collectives.to_reporter({**metrics, **reward_metrics} if last_stage else None) or {}
        metrics.update(self.timers.pop())
        metrics.update(self.rollout_source.metrics())
        elapsed = time.perf_counter() - t0
        metrics["timing/step_s"] = elapsed
        # (rollout.mode=async: the controller's, over the workers' generation seconds, not the wait)
        metrics.setdefault("generated_tokens_per_s",
                           float(gen_tokens) / max(metrics.get("timing/rollout_s", elapsed), 1e-9))
        metrics["episodes_per_s"] = self.cfg.ppo.num_rollout_samples / elapsed
        metrics["consumed_samples"] = self.sampler.consumed_samples
        if self.reward_changed and not self._source_change_logged:
            metrics["reward/source_changed"] = 1.0
            self._source_change_logged = True
        return metrics

    # --- evaluation ----------------------------------------------------------------------
    @in_phase("eval", step_offset=0)
    def evaluate(self) -> dict:
        """The held-out evaluation (:func:`~nemo_rlhf.trainers.ppo.evaluation.evaluate_policy`)."""
        return evaluate_policy(self.evaluation, self.eval_prompts, self.generate_eval,
                               self.response_texts, self.reward, self.dims, self.step, self.is_mp_src,
                               self.raise_if_scoring_failed)

    def sample_table(self, n: int = 4) -> list[dict]:
        """A few (prompt, response, reward) rows of the last rollout (this rank's)."""
        idx, batch, scores = self._last_batch
        texts = self.response_texts(batch)
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
            lambda p: load_checkpoint(p, self.model, self.optimizer, critic=self.critic.checkpoint),
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
        message is the reason to save and stop (the same on every rank). At step 0 the metrics
        are the initial policy's evaluation alone: the guard records it as an evaluation."""
        action = self.cfg.guards.action
        message = self.guard.update(self.step, metrics, evaluation_only=self.step == 0) \
            if action != "off" else None
        message = bcast_text(message)
        if message:
            log.warning("reward-hacking guard: %s", message)
        return f"reward-hacking guard ({message})" if message and action == "stop" else None

    @in_phase("save", step_offset=0)
    def save(self) -> Path:
        """Checkpoint every model, optimizer and the trainer state (all ranks); prune to
        ``exp_manager.keep_last`` (0: keep all)."""
        root = self.exp.checkpoint_dir
        path = save_checkpoint(root, self.step, self.model, self.optimizer, self.state_dict(),
                               self.run_config, self.dims, self.fingerprint, critic=self.critic.checkpoint,
                               lora_base=self.cfg.exp_manager.init_from if self.cfg.model.lora.enabled else None,
                               verify=self.cfg.exp_manager.verify_after_save)
        if self.cfg.exp_manager.keep_last and self.dims.rank == 0:
            prune(root, self.cfg.exp_manager.keep_last)
        return path

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
        self.rollout_source.close()

    # --- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-able trainer state for checkpoints (:func:`~nemo_rlhf.trainers.ppo.state.run_state`;
        collective: the rollout source's)."""
        return run_state(step=self.step, sampler=self.sampler, kl_ctl=self.kl_ctl, reward=self.reward,
                         nonfinite_in_a_row=self.nonfinite_in_a_row, initial_eval=self.evaluation.initial,
                         guard=self.guard, rollout_state=self.rollout_source.state_dict())

    def load_state_dict(self, sd: dict) -> None:
        """A checkpoint's trainer state (:func:`~nemo_rlhf.trainers.ppo.state.restore_run_state`),
        after its weights were loaded (the actor's weights version moves on)."""
        self.weights_version += 1  # the checkpoint's weights were loaded
        restored = restore_run_state(sd, sampler=self.sampler, kl_ctl=self.kl_ctl, reward=self.reward,
                                     guard=self.guard, rollout_source=self.rollout_source)
        self.step, self.nonfinite_in_a_row = restored.step, restored.nonfinite_in_a_row
        self.evaluation.initial = restored.initial_eval
        if restored.reward_changed:
            self.reward_changed = restored.reward_changed
            self.evaluation.rescore_initial = True


__all__ = ["PPOTrainer", "RewardScoringError", "dp_group_slice", "ppo_fingerprint"]
