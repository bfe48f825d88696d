"""PPO main job: ``python -m nemo_rlhf.train_ppo [hydra overrides]`` (console: nemo-rlhf-ppo).

Config: ``conf/ppo.yaml`` over the typed schema :class:`~nemo_rlhf.trainers.ppo.config.PPOConfig`
(registered in Hydra's ConfigStore, so a misspelt key fails with its name). :func:`build`
sets up the run, :meth:`~nemo_rlhf.trainers.ppo.trainer.PPOTrainer.fit` runs it (the loop
every job shares, :mod:`nemo_rlhf.trainers.loop`). Exit codes: 0 done,
:data:`REQUEUE_EXIT_CODE` saved after SIGTERM/SIGUSR1 or ``trainer.max_time_per_run`` (the
launchers turn it into a requeue), 3 stopped by the reward-hacking guard, 1 error.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from nemo_rlhf.checkpoint import load_model_weights, read_metadata, refuse_adapter_checkpoint_as_lora_base
from nemo_rlhf.checkpoint.source import adopt_for_hydra_job
from nemo_rlhf.config import configure_job_logging, run_console_entry, to_typed
from nemo_rlhf.data.datasets import load_prompt_dataset
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed import destroy_distributed, initialize_distributed
from nemo_rlhf.distributed.determinism import enable_deterministic_mode
from nemo_rlhf.distributed.phase import collective_errors
from nemo_rlhf.models.actor_critic import build_model
from nemo_rlhf.models.config import agree_on_precision
from nemo_rlhf.models.engine import wrap_ddp
from nemo_rlhf.trainers.loop import REQUEUE_EXIT_CODE, Signals
from nemo_rlhf.trainers.optimizers import build_optimizer, validate_optimizer
from nemo_rlhf.trainers.ppo.async_rollout import check_async_layout
from nemo_rlhf.trainers.ppo.config import PPOConfig, validate_batch_sizes
from nemo_rlhf.trainers.ppo.reference import ReferencePolicy
from nemo_rlhf.trainers.ppo.scoring import build_reward, policy_rendering
from nemo_rlhf.trainers.ppo.trainer import PPOTrainer

log = logging.getLogger("nemo_rlhf.ppo")

ConfigStore.instance().store(name="ppo_schema", node=PPOConfig)
__all__ = ["REQUEUE_EXIT_CODE", "build", "build_separate_critic", "main", "share_frozen_base"]


def build(cfg: PPOConfig, signals: Optional[Signals] = None) -> PPOTrainer:
    """Set up distributed, data, model, optimizer, reference, reward; return the trainer
    (``trainer.fit()`` runs it). ``trainer.deterministic`` is applied first, before any
    process group, model or cuBLAS handle exists."""
    if cfg.trainer.deterministic:
        enable_deterministic_mode()
    tok = Tokenizer(cfg.data.tokenizer_dir)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tok.vocab_size
    dims = initialize_distributed(cfg.parallel, seed=cfg.trainer.seed,
                                  num_layers=cfg.model.num_layers,
                                  num_attention_heads=cfg.model.num_attention_heads,
                                  num_query_groups=cfg.model.num_query_groups,
                                  num_moe_experts=cfg.model.num_moe_experts)
    validate_batch_sizes(cfg.ppo, dims.dp, cfg.rollout.n_samples_per_prompt, dims.pp)
    check_async_layout(cfg.rollout, dims)
    cfg.trainer.precision = agree_on_precision(cfg.trainer.precision, dims)
    validate_optimizer(cfg.optim, dims)
    max_prompt = cfg.model.max_position_embeddings - cfg.rollout.max_new_tokens
    prompts = load_prompt_dataset(cfg.data.train_file, tok, cfg.data, max_prompt).samples
    eval_prompts = (load_prompt_dataset(cfg.data.val_file, tok, cfg.data, max_prompt).samples
                    if cfg.data.val_file else [])

    def make_stage():
        return build_model(cfg.model, dims, cfg.trainer.precision, kind="actor_critic",
                           seed=cfg.trainer.seed)

    separate = cfg.critic.mode == "separate"
    model = make_stage()
    model.detach_value_head = cfg.critic.mode == "shared_detached"
    if separate and hasattr(model, model.head_name):
        delattr(model, model.head_name)  # the actor of a separate critic has no value head
    if cfg.exp_manager.init_from:
        if cfg.model.lora.enabled:
            refuse_adapter_checkpoint_as_lora_base(cfg.exp_manager.init_from, "exp_manager.init_from")
        load_model_weights(cfg.exp_manager.init_from, model,
                           init_heads=cfg.exp_manager.init_value_head)
    reference = ReferencePolicy(model, cfg.reference.mode, build_fn=make_stage, device=dims.device)
    ddp = wrap_ddp(model, use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
    optimizer = build_optimizer(ddp, cfg.optim, dims, cfg.trainer.precision)
    critic = build_separate_critic(cfg, dims, actor=model) if separate else None
    reward = (build_reward(cfg.reward, dims, policy_rendering(tok, cfg.data))
              if (dims.tp_rank == 0 and dims.pp_rank == 0) else None)
    return PPOTrainer(cfg, dims, ddp, optimizer, reference, reward, tok, prompts, eval_prompts,
                      critic=critic, signals=signals)


def build_separate_critic(cfg: PPOConfig, dims, actor=None) -> tuple:
    """``critic.mode=separate``: the critic's own stage (backbone + value head, DDP-wrapped)
    and optimizer, from ``critic.init_from`` or ``exp_manager.init_from``.

    From a separate-critic PPO checkpoint the critic part is loaded; from any other (SFT,
    actor, RM) the backbone, the value head from the checkpoint's value head or an RM's
    reward head, else initialised (``exp_manager.init_value_head``).

    With ``model.lora.enabled`` the critic is a second adapter set and a value head on the
    actor's frozen base: its base parameters are the bare ``actor``'s own tensors (shared
    storage, one base in memory for actor, critic and reference), and only its adapters
    and value head train (:func:`share_frozen_base`).
    """
    from dataclasses import replace

    critic = build_model(cfg.model, dims, cfg.trainer.precision, kind="critic",
                         seed=cfg.trainer.seed + 1)
    source = cfg.critic.init_from or cfg.exp_manager.init_from
    if cfg.model.lora.enabled:
        share_frozen_base(critic, actor)
        source = None  # the base is the actor's (loaded); the adapters start at B = 0
    if source:
        part = "critic" if read_metadata(source).get("has_critic") else "model"
        load_model_weights(source, critic, init_heads=cfg.exp_manager.init_value_head, part=part,
                           head_aliases={"value_head": "reward_head"})
    ddp = wrap_ddp(critic, use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
    optim = cfg.optim if cfg.critic.lr is None else replace(cfg.optim, lr=cfg.critic.lr)
    return ddp, build_optimizer(ddp, optim, dims, cfg.trainer.precision)


def share_frozen_base(critic, actor) -> int:
    """Point every frozen parameter of the bare ``critic`` stage at the bare ``actor``'s
    tensor of the same name (``param.data``: shared storage, no copy). Returns the number
    of parameters shared.

    Raises:
        ValueError: a frozen critic parameter with no actor parameter of its name and shape.
    """
    mine = dict(actor.named_parameters())
    shared = 0
    for name, p in critic.named_parameters():
        if p.requires_grad:
            continue
        theirs = mine.get(name)
        if theirs is None or theirs.shape != p.shape or theirs.requires_grad:
            raise ValueError(f"LoRA critic: its frozen {name} has no frozen actor parameter of the "
                             f"same shape to share")
        p.data = theirs.data
        shared += 1
    return shared


@hydra.main(version_base=None, config_path="../conf", config_name="ppo")
def hydra_main(dcfg: DictConfig) -> None:
    """The Hydra job (``main`` checks the command line first)."""
    signals = Signals()  # first: a SIGUSR1 during set-up must not kill the job
    notes = adopt_for_hydra_job(dcfg, "ppo")  # the init_from checkpoint's model
    # merging into the schema rejects keys added with `+` that the schema does not have
    cfg: PPOConfig = to_typed(dcfg, PPOConfig)
    configure_job_logging()
    for note in notes:
        logging.getLogger("nemo_rlhf").info(note)
    with collective_errors():  # a timed-out collective names this rank and the phase
        code = build(cfg, signals).fit()
    destroy_distributed()
    if code:
        sys.exit(code)


def main() -> None:
    """Console entry (``nemo-rlhf-ppo``): a renamed key is refused naming the new one."""
    run_console_entry(hydra_main)


if __name__ == "__main__":
    main()
