"""Where a PPO step's samples come from: one interface (:class:`RolloutSource`) the trainer
calls the same way whatever makes them, chosen once by :func:`build_rollout_source`.

* :class:`LocalRolloutSource` (``rollout.mode=sync``): the trainer's ranks generate with
  ``rollout.engine`` (:mod:`nemo_rlhf.rollout.engines`) and the actor's current weights.
* :class:`~nemo_rlhf.trainers.ppo.async_rollout.RemoteRolloutSource`
  (``rollout.mode=async``): rollout workers on their own processes generate, each step's
  items by the weights version the staleness schedule names; no rollout engine is built on
  the trainer.

Per step ``s`` (1-based) the trainer calls :meth:`RolloutSource.begin` with ``s - 1``
before it draws the prompts, :meth:`RolloutSource.rollout` with ``s`` and this DP rank's
prompt indices (a :class:`~nemo_rlhf.rollout.generate.RolloutBatch` on ``dims.device``),
and :meth:`RolloutSource.after_update` with ``s`` once the actor's weights are version
``s``; :meth:`RolloutSource.metrics` with the step's metrics; its state rides in the
checkpoint's trainer state.

* :class:`~nemo_rlhf.trainers.ppo.episode_source.EpisodeRolloutSource` (``env.name`` set):
  multi-turn episodes with an environment on the trainer's ranks (docs/multi-turn.md).
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

from nemo_rlhf.models.engine import unwrap
from nemo_rlhf.rollout.config import RolloutConfig
from nemo_rlhf.rollout.engines import MegatronRolloutEngine, RolloutEngine, build_rollout_engine
from nemo_rlhf.rollout.generate import RolloutBatch
from nemo_rlhf.trainers.ppo.async_rollout import RemoteRolloutSource
from nemo_rlhf.trainers.ppo.episode_source import EpisodeRolloutSource


class RolloutSource(Protocol):
    """What the PPO trainer needs of the source of its samples (see the module docstring).
    Every method is called on every rank (some are collective)."""

    def begin(self, step: int) -> None:
        """Before the prompts of step ``step + 1`` are drawn (every step; ``step``: the
        steps trained so far, the weights version the actor holds)."""
        ...

    def rollout(self, step: int, prompt_indices: list[int]) -> RolloutBatch:
        """This DP rank's samples of step ``step`` for the prompts ``prompt_indices``
        (indices into the training prompts, each repeated ``rollout.n_samples_per_prompt``
        times), on ``dims.device``."""
        ...

    def after_update(self, step: int) -> None:
        """Step ``step``'s update is done: the actor's weights are version ``step``."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], cfg: RolloutConfig, *, call_index: int) -> RolloutBatch:
        """The actor's responses to token-id ``prompts`` outside the training rollout (the
        held-out evaluation's greedy decode), as
        :meth:`~nemo_rlhf.rollout.engines.RolloutEngine.generate`."""
        ...

    def metrics(self) -> dict[str, float]:
        """The source's numbers, logged with the step's metrics."""
        ...

    def state_dict(self) -> dict:
        """JSON-able state a resume needs ({}: none); collective."""
        ...

    def load_state_dict(self, sd: dict) -> None:
        """A checkpoint's :meth:`state_dict` (``{}`` from a checkpoint without one)."""
        ...

    def close(self) -> None:
        """Free the source's resources (idempotent)."""
        ...


class LocalRolloutSource:
    """The trainer's ranks generate (``rollout.mode=sync``): the TP/PP ranks of a DP group
    cooperate in ``engine``'s decode with the actor's current weights; the sampling seeds are
    a function of ``(rollout.seed, dp_rank, step)``, so a resumed run draws the same tokens.

    Args:
        engine: the :class:`~nemo_rlhf.rollout.engines.RolloutEngine`.
        rollout_cfg: the ``rollout`` section (sampling and stopping rules).
        actor: the :class:`~nemo_rlhf.trainers.ppo.roles.PolicyRole` (``model``,
            ``weights_version``).
        encoded: the training prompts' token ids, by index.
    """

    def __init__(self, engine: RolloutEngine, rollout_cfg: RolloutConfig, actor, encoded: list):
        self.engine, self.rollout_cfg, self.actor, self.encoded = engine, rollout_cfg, actor, encoded

    def begin(self, step: int) -> None:
        pass

    def rollout(self, step: int, prompt_indices: list[int]) -> RolloutBatch:
        return self.generate([self.encoded[i] for i in prompt_indices], self.rollout_cfg, call_index=step - 1)

    def after_update(self, step: int) -> None:
        pass  # (the engine refits from the actor when its weights version changed)

    def generate(self, prompts, cfg: RolloutConfig, *, call_index: int) -> RolloutBatch:
        return self.engine.generate(self.actor.model, prompts, cfg, call_index=call_index,
                                    weights_version=self.actor.weights_version)

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def close(self) -> None:
        self.engine.close()


def build_rollout_source(cfg, dims, actor, tokenizer, encoded: list, sampler, collectives, timers,
                         with_values: bool = False, prompts: Optional[list] = None) -> RolloutSource:
    """The source ``rollout.mode`` and ``env.name`` name, built once (collective for
    ``rollout.engine=vllm`` in ``sync``): :class:`EpisodeRolloutSource` when ``env.name``
    is set in ``sync`` (on the engine built here, megatron or vllm), else as ``rollout.mode``
    says (``async`` with ``env.name``: the workers run the episodes).

    Args:
        cfg: the :class:`~nemo_rlhf.trainers.ppo.config.PPOConfig`.
        dims: this rank's :class:`~nemo_rlhf.distributed.ParallelDims`.
        actor: the :class:`~nemo_rlhf.trainers.ppo.roles.PolicyRole`.
        tokenizer: ``eos_id``, ``pad_id``, ``decode``.
        encoded: the training prompts' token ids.
        sampler: the trainer's prompt sampler (``async``: its look-ahead copy).
        collectives: :class:`~nemo_rlhf.trainers.collectives.JobCollectives`.
        timers: the trainer's :class:`~nemo_rlhf.metrics.timers.Timers`.
        with_values: the rollout also returns the actor-critic's values
            (``ppo.old_logprobs_from_rollout`` with the value head on the actor).
        prompts: the training prompt rows (``.prompt``, ``.extras``); needed with ``env.name``.

    Raises:
        ValueError / ImportError: as :func:`~nemo_rlhf.rollout.engines.build_rollout_engine`
        and :func:`~nemo_rlhf.envs.config.get_env_factory`; ``env.name`` without ``prompts``.
    """
    common = dict(eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id, decode_fn=tokenizer.decode)
    if cfg.rollout.mode == "async":  # the evaluation decodes with the actor itself: no engine's resources
        decode = MegatronRolloutEngine(dims, vocab_size=cfg.model.vocab_size,
                                       max_sequence_length=cfg.model.max_position_embeddings,
                                       with_values=with_values, **common)
        return RemoteRolloutSource(cfg, dims, actor, encoded, sampler, collectives, timers, decode,
                                   tokenizer=tokenizer, prompts=prompts)
    engine = build_rollout_engine(cfg.rollout, dims, cfg.model, params_dtype=unwrap(actor.model).config.params_dtype,
                                  with_values=with_values, record_routes=cfg.moe.routing_replay, **common)
    if cfg.env.enabled:
        if prompts is None:
            raise ValueError(f"env.name={cfg.env.name!r}: build_rollout_source needs the prompt rows "
                             f"(prompts=) to start the episodes")
        return EpisodeRolloutSource(cfg, dims, actor, tokenizer, prompts, engine, collectives,
                                    with_values=with_values)
    return LocalRolloutSource(engine, cfg.rollout, actor, encoded)


__all__ = ["EpisodeRolloutSource", "LocalRolloutSource", "RemoteRolloutSource", "RolloutSource",
           "build_rollout_source"]
