"""A rollout worker of ``rollout.mode=async``:
``python -m nemo_rlhf.rollout_worker --worker-index I [the trainer's hydra overrides]``.

Started beside the PPO trainer (``launchers.local`` starts ``rollout.num_workers`` of them;
the Slurm launcher one job step of them), with the trainer's own config and overrides: it
composes the same config (``--config-name`` as the trainer's), adopts the same
``exp_manager.init_from`` model, and then serves the trainer's controller
(:func:`~nemo_rlhf.rollout.transport.serve_rollout_worker`) until told to stop:

* its own single-process world (TP=1, PP=1, no DP), on its own device (the first visible
  GPU, else the host): one full copy of the actor, built when the first weights arrive, in
  their dtype (LoRA arrives merged, the value head is not sent);
* ``rollout.engine`` (megatron's KV-cache decode, or a vLLM engine refit in memory from
  that copy) generates each item with the sampling seeds of the DP rank and step it is for,
  exactly as a trainer rank would in ``rollout.mode=sync``; with ``env.name``, one episode
  per row (a fresh environment each, the item's problems), as the synchronous
  ``EpisodeRolloutSource`` runs them.

The worker index comes from ``--worker-index``, else ``NEMO_RLHF_ROLLOUT_WORKER`` or, under
``srun``, ``SLURM_PROCID``. Exit codes: 0 when the controller stopped it, 1 on an error
(the controller reports a worker that died).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from typing import Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from nemo_rlhf.checkpoint.faults import maybe_crash
from nemo_rlhf.checkpoint.source import adopt_for_hydra_job
from nemo_rlhf.config import configure_job_logging, to_typed
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed import ParallelConfig, destroy_distributed, initialize_distributed
from nemo_rlhf.distributed.launch_env import LaunchEnv
from nemo_rlhf.envs.config import get_env_factory
from nemo_rlhf.models.actor_critic import build_model
from nemo_rlhf.models.config import LoRAConfig
from nemo_rlhf.models.full_tensors import fill_model, model_full_tensors
from nemo_rlhf.rollout.engines import build_rollout_engine
from nemo_rlhf.rollout.transport import RolloutItem, serve_rollout_worker
from nemo_rlhf.trainers.ppo.config import PPOConfig
from nemo_rlhf.trainers.ppo.episode_source import run_episode_batch

log = logging.getLogger("nemo_rlhf.rollout_worker")

ConfigStore.instance().store(name="ppo_schema", node=PPOConfig)
PRECISION_OF_DTYPE = {torch.float32: "32", torch.bfloat16: "bf16-mixed", torch.float16: "fp16-mixed"}


class RolloutWorker:
    """One worker's model and engine (see the module docstring).

    Args:
        cfg: the trainer's composed config.
    """

    def __init__(self, cfg: PPOConfig):
        self.cfg = cfg
        self.tok = Tokenizer(cfg.data.tokenizer_dir)
        if cfg.model.vocab_size == 0:
            cfg.model.vocab_size = self.tok.vocab_size
        self.model_cfg = replace(cfg.model, lora=LoRAConfig())  # the weights arrive merged
        local = LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0,
                          launcher="single")
        self.dims = initialize_distributed(ParallelConfig(backend=cfg.parallel.backend,
                                                          timeout_minutes=cfg.parallel.timeout_minutes),
                                           seed=cfg.trainer.seed, launch_env=local)
        self.model = None
        self.engine = None
        self.env_factory = get_env_factory(cfg.env) if cfg.env.enabled else None

    def _build(self, dtype: torch.dtype) -> None:
        if dtype not in PRECISION_OF_DTYPE:
            raise ValueError(f"weights in {dtype}: a rollout worker builds float32, bfloat16 or float16 models")
        model = build_model(self.model_cfg, self.dims, PRECISION_OF_DTYPE[dtype], kind="actor_critic",
                            seed=self.cfg.trainer.seed)
        if hasattr(model, model.head_name):
            delattr(model, model.head_name)  # the actor's weights only
        self.model = model.eval()
        self.engine = build_rollout_engine(self.cfg.rollout, self.dims, self.model_cfg,
                                           eos_token_id=self.tok.eos_id, pad_token_id=self.tok.pad_id,
                                           decode_fn=self.tok.decode, params_dtype=dtype)

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Full tensors (the trainer's :func:`~nemo_rlhf.trainers.ppo.async_rollout.full_weights`)
        into the model, built on the first call in the dtype of the largest tensor (the
        precision's parameter dtype; norms may stay float32, as the trainer's do).

        Raises:
            ValueError: a tensor missing, unused, or of another shape or dtype than the
                model's own (the same precision recipe on both sides keeps every dtype).
        """
        if self.model is None:
            self._build(max(tensors.values(), key=lambda t: t.numel()).dtype)
        own = model_full_tensors(self.model)
        mismatched = sorted((k, str(t.dtype), str(own[k].dtype)) for k, t in tensors.items()
                            if k in own and t.dtype != own[k].dtype)
        if mismatched:
            raise ValueError(f"weights of other dtypes than the worker's model (key, sent, model): "
                             f"{mismatched[:3]}")
        fill_model(self.model, tensors)

    def generate(self, item: RolloutItem, version: int):
        """The item's responses, sampled as DP rank ``item.dp_rank`` of step ``item.step``
        (``NEMO_RLHF_CRASH_AT=rollout_worker:<step>`` kills the worker there: a test). With
        ``env.name``: one episode per row of ``item.problems`` (a fresh environment each),
        on the same path as the synchronous
        :class:`~nemo_rlhf.trainers.ppo.episode_source.EpisodeRolloutSource`
        (:func:`~nemo_rlhf.trainers.ppo.episode_source.run_episode_batch`), an
        ``EpisodeRolloutBatch``.

        Raises:
            ValueError: ``env.name`` set and the item carries no problems.
        """
        maybe_crash("rollout_worker", item.step)
        dims = replace(self.dims, dp_rank=item.dp_rank)  # its sampling seeds
        self.engine.dims = dims
        if self.cfg.env.enabled:
            if item.problems is None or len(item.problems) != len(item.prompts):
                raise ValueError(f"env.name={self.cfg.env.name!r}: the rollout item of step {item.step} carries "
                                 f"no problem per row (the trainer runs without env.name?)")
            vllm = self.engine if self.cfg.rollout.engine == "vllm" else None
            return run_episode_batch(self.cfg, dims, self.model, self.tok, item.problems, self.cfg.rollout,
                                     call_index=item.step - 1, factory=self.env_factory, vllm_engine=vllm,
                                     weights_version=version)
        return self.engine.generate(self.model, item.prompts, self.cfg.rollout, call_index=item.step - 1,
                                    weights_version=version)

    def serve(self, index: int) -> int:
        """Serve the controller until it stops this worker; the engine closed at the end
        (before the process groups go: vLLM's shutdown destroys its own)."""
        try:
            return serve_rollout_worker(index, self.cfg.exp_manager.exp_dir, self.cfg.rollout.worker_timeout_s,
                                        self.dims.device, self.load_weights, self.generate,
                                        connect_timeout_s=self.cfg.rollout.worker_start_timeout_s)
        finally:
            if self.engine is not None:
                self.engine.close()


def worker_index(argv: list[str], env=os.environ) -> tuple[int, list[str]]:
    """``(index, the remaining arguments)``: ``--worker-index I`` taken out of ``argv``,
    else ``NEMO_RLHF_ROLLOUT_WORKER``, else ``SLURM_PROCID``.

    Raises:
        SystemExit: no index given, or not an integer >= 0.
    """
    rest, index = [], None
    it = iter(argv)
    for a in it:
        if a == "--worker-index":
            index = next(it, None)
        elif a.startswith("--worker-index="):
            index = a.split("=", 1)[1]
        else:
            rest.append(a)
    index = index if index is not None else env.get("NEMO_RLHF_ROLLOUT_WORKER", env.get("SLURM_PROCID"))
    if index is None or not str(index).isdigit():
        raise SystemExit(f"error: a rollout worker needs --worker-index I (an integer >= 0; got {index!r})")
    return int(index), rest


_INDEX: Optional[int] = None


@hydra.main(version_base=None, config_path="../conf", config_name="ppo")
def hydra_main(dcfg: DictConfig) -> None:
    """The Hydra job (``main`` takes ``--worker-index`` out of the command line first)."""
    notes = adopt_for_hydra_job(dcfg, "ppo")  # the same model as the trainer's
    cfg: PPOConfig = to_typed(dcfg, PPOConfig)
    configure_job_logging()
    for note in notes:
        log.info(note)
    if cfg.rollout.mode != "async":
        raise SystemExit("error: rollout workers serve rollout.mode=async (the trainer's config says "
                         f"rollout.mode={cfg.rollout.mode})")
    if not 0 <= _INDEX < cfg.rollout.num_workers:
        raise SystemExit(f"error: --worker-index {_INDEX} is outside 0 .. rollout.num_workers-1 "
                         f"({cfg.rollout.num_workers - 1})")
    code = RolloutWorker(cfg).serve(_INDEX)
    destroy_distributed()
    if code:
        sys.exit(code)


def main() -> None:
    """Console entry (``nemo-rlhf-rollout-worker``)."""
    global _INDEX
    _INDEX, sys.argv[1:] = worker_index(sys.argv[1:])
    if not any(a.startswith("hydra.run.dir=") for a in sys.argv[1:]):  # not the trainer's folder
        sys.argv.append(f"hydra.run.dir=${{exp_manager.exp_dir}}/hydra/rollout_worker_{_INDEX}/"
                        f"${{now:%Y-%m-%d_%H-%M-%S}}")
    hydra_main()


if __name__ == "__main__":
    main()
