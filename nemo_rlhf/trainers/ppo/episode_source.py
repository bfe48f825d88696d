"""Multi-turn rollouts for PPO (#51): :class:`EpisodeRolloutSource`, the
:class:`~nemo_rlhf.trainers.ppo.rollout_source.RolloutSource` that runs one episode per
sample with the environment ``env.name`` names, on the megatron actor
(:func:`~nemo_rlhf.rollout.episodes.run_episodes`: KV cache kept across turns, TP/PP) or,
with ``rollout.engine=vllm``, on the vLLM engine
(:func:`~nemo_rlhf.rollout.vllm_episodes.run_episodes_vllm`: refit from the actor when its
weights version moved; prefix caching across turns), and
hands the trainer a :class:`EpisodeRolloutBatch` laid out by
:func:`~nemo_rlhf.rollout.trajectory.to_padded_batch`.

The batch is the single-turn ``RolloutBatch`` layout with holes: ``response_mask`` is the
loss mask (False on the environment's tokens), ``attention_mask`` is 1 on every prompt,
policy and environment token, ``response_lengths`` is each row's extent after the prompt
(policy + environment tokens), ``logprobs`` the behaviour log-probs of the policy tokens (0
elsewhere), ``truncated`` an episode cut at an ``env`` limit and ``ended`` its complement.
Every reducer of the PPO step reads the mask (docs/multi-turn.md), so the score lands on
each row's last *policy* token. The episodes ride along as host objects
(:attr:`EpisodeRolloutBatch.episodes`): the trainer scores the final answer (the last
policy turn's text, :meth:`EpisodeRolloutBatch.final_texts`) and gives reward functions
the episode reward (``extras["env_reward"]``: the ``env`` reward function) and the served
RM the whole conversation (``extras["conversation"]``, ``reward.rm_input``).
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from nemo_rlhf.data.datasets import encode_prompt
from nemo_rlhf.envs.builtin import ENV_REWARD_KEY
from nemo_rlhf.envs.config import get_env_factory
from nemo_rlhf.reward.functions import CONVERSATION_EXTRA
from nemo_rlhf.rollout.episodes import Episode, EpisodeRolloutBatch, run_episodes
from nemo_rlhf.rollout.generate import RolloutBatch
from nemo_rlhf.rollout.trajectory import to_padded_batch
from nemo_rlhf.rollout.vllm_episodes import run_episodes_vllm

__all__ = ["EPISODE_METRICS", "EpisodeRolloutBatch", "EpisodeRolloutSource", "episode_extras",
           "episode_metric_sums", "episode_metrics_from_sums", "episode_texts", "is_episode_batch",
           "run_episode_batch"]

EPISODE_METRICS = ("episode/turns_mean", "episode/tool_calls_mean", "episode/malformed_call_rate",
                   "episode/truncated_rate", "episode/policy_tokens_mean", "episode/total_tokens_mean",
                   "episode/env_reward_mean")
"""The per-step metrics of :class:`EpisodeRolloutSource` (means over every DP rank's
episodes)."""


def episode_extras(episode: Episode) -> dict:
    """What a multi-turn row adds to its prompt row's ``extras`` for the reward sources:
    ``env_reward`` (the sum of the environment's per-turn rewards, 0.0 when it gave none),
    ``env_turn_rewards`` (per answered turn, None where none), ``turns``, and the whole
    conversation under :data:`~nemo_rlhf.reward.functions.CONVERSATION_EXTRA`
    (``{"messages": Episode.messages, "prompt_ids": the trajectory's prompt, "response_ids":
    everything after it}``: what the served RM reads with ``reward.rm_input=conversation``)."""
    rewards, tr = episode.turn_rewards, episode.trajectory
    return {ENV_REWARD_KEY: float(sum(r for r in rewards if r is not None)),
            "env_turn_rewards": list(rewards), "turns": tr.turns,
            CONVERSATION_EXTRA: {"messages": [dict(m) for m in episode.messages],
                                 "prompt_ids": list(tr.prompt_ids),
                                 "response_ids": list(tr.token_ids[tr.prompt_length:])}}


def episode_metric_sums(episodes: List[Episode]) -> list[float]:
    """This rank's sums behind :data:`EPISODE_METRICS`: ``[episodes, turns, tool calls,
    episodes with a malformed call, truncated episodes, policy tokens, tokens after the
    prompt, episode reward]``. Tool calls and malformed calls are the episode totals the
    environment reports in its last ``info`` (``tool_calls``, ``malformed_calls``, as
    :class:`~nemo_rlhf.envs.ToolEnvironment` does; 0 for an environment that reports none)."""
    s = [0.0] * 8
    for ep in episodes:
        tr, last = ep.trajectory, (ep.infos[-1] if ep.infos else {})
        s[0] += 1
        s[1] += tr.turns
        s[2] += float(last.get("tool_calls", 0))
        s[3] += float(last.get("malformed_calls", 0) > 0)
        s[4] += float(tr.truncated)
        s[5] += tr.policy_tokens
        s[6] += len(tr) - tr.prompt_length
        s[7] += float(sum(r for r in ep.turn_rewards if r is not None))  # episode_extras' env_reward
    return s


def episode_metrics_from_sums(sums: list[float]) -> dict[str, float]:
    """:data:`EPISODE_METRICS` from :func:`episode_metric_sums` (summed over DP): each a sum
    over episodes divided by the episodes; ``malformed_call_rate`` is the share of episodes
    with at least one malformed tool call."""
    n = max(sums[0], 1.0)
    return dict(zip(EPISODE_METRICS, (sums[1] / n, sums[2] / n, sums[3] / n, sums[4] / n,
                                      sums[5] / n, sums[6] / n, sums[7] / n)))


def run_episode_batch(cfg, dims, model, tokenizer, problems: list[dict], rollout_cfg, *, call_index: int,
                      factory=None, vllm_engine=None, weights_version: Optional[int] = None,
                      with_values: bool = False) -> EpisodeRolloutBatch:
    """One episode per problem (``{"prompt": text, **extras}``; a fresh environment each,
    from ``factory`` or :func:`~nemo_rlhf.envs.config.get_env_factory` of ``cfg.env``), laid
    out by :func:`~nemo_rlhf.rollout.trajectory.to_padded_batch` on ``dims.device`` as an
    :class:`EpisodeRolloutBatch`. The path of :class:`EpisodeRolloutSource` (sync) and of a
    rollout worker (``rollout.mode=async``): the same seeds for the same ``dims.dp_rank``
    and ``call_index``.

    Args:
        cfg: the PPO config (``env``, ``data.chat_template``, ``data.system_prompt``,
            ``model.vocab_size``, ``model.max_position_embeddings``).
        dims: the :class:`~nemo_rlhf.distributed.ParallelDims` the sampling seeds read
            (``dp_rank``) and the batch's device.
        model: the actor (megatron) the episodes decode with (the vLLM engine refits from it).
        tokenizer: ``encode``, ``decode``, ``eos_id``, ``pad_id``.
        rollout_cfg: the decoding settings (a ``RolloutConfig``).
        call_index: mixes into the sampler seed (the step's: ``step - 1``).
        vllm_engine: run on this vLLM engine (:func:`run_episodes_vllm`) rather than
            megatron's decode (:func:`run_episodes`).
        weights_version: the model's weights version (the vLLM engine refits when it moved).
        with_values: the batch's ``values`` (``[B, R]`` float32, last pipeline stage) are the
            actor-critic's values from the megatron decode (:attr:`Episode.values`: 0 on the
            environment's tokens and the padding): the old values of
            ``ppo.old_logprobs_from_rollout`` with a value head on the actor's backbone.

    Raises:
        as :func:`~nemo_rlhf.envs.config.get_env_factory` (a bad ``env.name``);
        ValueError: ``with_values`` with ``vllm_engine``.
    """
    factory = factory or get_env_factory(cfg.env)
    envs = [factory(cfg.env) for _ in problems]
    io = dict(encode_prompt=lambda text: encode_prompt(tokenizer, text, cfg.data.chat_template,
                                                       cfg.data.system_prompt),
              encode_observation=lambda text: tokenizer.encode(cfg.env.encode_observation_text(text)),
              decode_fn=tokenizer.decode, call_index=call_index)
    limits = cfg.env.limits()
    if vllm_engine is not None:
        if with_values:
            raise ValueError("run_episode_batch(with_values=True): the values come from the megatron "
                             "engine's decode (rollout.engine=megatron)")
        episodes = run_episodes_vllm(vllm_engine, model, envs, problems, rollout_cfg, limits,
                                     weights_version=weights_version, **io)
    else:
        episodes = run_episodes(model, dims, envs, problems, rollout_cfg, limits, eos_token_id=tokenizer.eos_id,
                                pad_token_id=tokenizer.pad_id, vocab_size=cfg.model.vocab_size,
                                max_sequence_length=cfg.model.max_position_embeddings,
                                with_values=with_values, **io)
    padded = to_padded_batch([ep.trajectory for ep in episodes], tokenizer.pad_id, device=dims.device)
    P = padded.prompt_length
    values = None
    if with_values and dims.is_last_stage:  # in to_padded_batch's columns, as the log-probs
        values = torch.zeros(padded.logprobs.shape, dtype=torch.float32)  # host: filled from lists, moved below
        for b, ep in enumerate(episodes):
            values[b, :len(ep.values)] = torch.tensor(ep.values, dtype=torch.float32)
        values = values.to(dims.device)
    return EpisodeRolloutBatch(
        input_ids=padded.input_ids, attention_mask=padded.attention_mask, prompt_length=P,
        response_ids=padded.input_ids[:, P:].clone(), response_mask=padded.response_mask,
        response_lengths=padded.response_lengths, ended=~padded.truncated, truncated=padded.truncated,
        logprobs=padded.logprobs, values=values, vocab_size=cfg.model.vocab_size, episodes=episodes)


def episode_texts(batch: EpisodeRolloutBatch, tokenizer) -> list[str]:
    """Each episode's text after its prompt (policy and environment tokens, EOS dropped)."""
    eos = tokenizer.eos_id
    return [tokenizer.decode([t for t in ep.trajectory.token_ids[ep.trajectory.prompt_length:] if t != eos])
            for ep in batch.episodes]

class EpisodeRolloutSource:
    """Multi-turn rollouts on the trainer's ranks (``env.name`` set; ``rollout.engine`` megatron
    or vllm, ``rollout.mode=sync``): see the module docstring.

    Args:
        cfg: the :class:`~nemo_rlhf.trainers.ppo.config.PPOConfig` (``env``, ``rollout``,
            ``model``, ``data``).
        dims: this rank's :class:`~nemo_rlhf.distributed.ParallelDims`.
        actor: the :class:`~nemo_rlhf.trainers.ppo.roles.PolicyRole`.
        tokenizer: ``encode``, ``decode``, ``eos_id``, ``pad_id`` (and what
            :func:`~nemo_rlhf.data.datasets.encode_prompt` reads).
        prompts: the training prompt rows (``.prompt``, ``.extras``), by index.
        engine: the engine ``build_rollout_source`` built: :meth:`generate` decodes with it,
            and with ``rollout.engine=vllm`` the episodes (the training rollout's and the
            held-out evaluation's, :meth:`generate_episodes`) run on it.
        collectives: :class:`~nemo_rlhf.trainers.collectives.JobCollectives` (the metrics'
            DP sum).
        with_values: the training rollout's batches carry the actor-critic's values from the
            megatron decode (``ppo.old_logprobs_from_rollout`` with a value head on the
            actor's backbone; :func:`run_episode_batch`).

    Raises:
        as :func:`~nemo_rlhf.envs.config.get_env_factory` (a bad ``env.name``).
    """

    def __init__(self, cfg, dims, actor, tokenizer, prompts: list, engine, collectives, with_values: bool = False):
        self.cfg, self.dims, self.actor, self.tok = cfg, dims, actor, tokenizer
        self.with_values = with_values
        self.prompts, self.engine, self.collectives = prompts, engine, collectives
        self.factory = get_env_factory(cfg.env)
        self._metrics: dict[str, float] = {}

    def problem(self, index: int) -> dict:
        """Episode ``index``'s problem: ``{"prompt": text, **extras}``."""
        row = self.prompts[index]
        return {"prompt": row.prompt, **row.extras}

    def begin(self, step: int) -> None:
        pass

    def rollout(self, step: int, prompt_indices: list[int]) -> EpisodeRolloutBatch:
        """Run one episode per index (a fresh environment each) and lay them out; the
        episode metrics are summed over DP here (every rank calls it)."""
        batch = self._run([self.problem(i) for i in prompt_indices], self.cfg.rollout, step - 1,
                          with_values=self.with_values)
        sums = torch.tensor(episode_metric_sums(batch.episodes), dtype=torch.float64, device=self.dims.device)
        self._metrics = episode_metrics_from_sums(self.collectives.dp_sum(sums).tolist())
        return batch

    def _run(self, problems: list[dict], cfg, call_index: int, with_values: bool = False) -> EpisodeRolloutBatch:
        """One episode per problem (a fresh environment each) with the decoding settings
        ``cfg`` (a ``RolloutConfig``), laid out as an :class:`EpisodeRolloutBatch`
        (:func:`run_episode_batch`)."""
        vllm = self.engine if self.cfg.rollout.engine == "vllm" else None
        return run_episode_batch(self.cfg, self.dims, self.actor.model, self.tok, problems, cfg,
                                 call_index=call_index, factory=self.factory, vllm_engine=vllm,
                                 weights_version=self.actor.weights_version, with_values=with_values)

    def after_update(self, step: int) -> None:
        pass

    def generate(self, prompts, cfg, *, call_index: int) -> RolloutBatch:
        """Single-turn decoding of token-id prompts, with the actor's weights (no
        environment; the held-out evaluation runs episodes: :meth:`generate_episodes`)."""
        return self.engine.generate(self.actor.model, prompts, cfg, call_index=call_index,
                                    weights_version=self.actor.weights_version)

    def generate_episodes(self, problems: list[dict], cfg, *, call_index: int) -> EpisodeRolloutBatch:
        """Episodes outside the training rollout (the held-out evaluation's, ``cfg`` greedy):
        one per problem (``{"prompt": raw prompt text, **extras}``), a fresh environment
        each, on the same path as :meth:`rollout` but with the decoding settings ``cfg``;
        :attr:`EpisodeRolloutBatch.episode_texts` filled. The step's episode metrics are
        left as they are (the evaluation reports its own) and nothing is reduced over DP
        here; every rank calls it with its rows (decoding may hold collectives)."""
        batch = self._run(list(problems), cfg, call_index)
        batch.episode_texts = episode_texts(batch, self.tok)
        return batch

    def metrics(self) -> dict[str, float]:
        """The last rollout's :data:`EPISODE_METRICS` and the engine's."""
        return {**self.engine.metrics(), **self._metrics}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def close(self) -> None:
        self.engine.close()


def is_episode_batch(batch: Any) -> bool:
    """Whether ``batch`` holds episodes (multi-turn rows)."""
    return isinstance(batch, EpisodeRolloutBatch)
