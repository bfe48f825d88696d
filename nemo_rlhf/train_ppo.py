"""PPO main job: ``python -m nemo_rlhf.train_ppo [hydra overrides]`` (console: nemo-rlhf-ppo).

Config: ``conf/ppo.yaml`` over the typed schema :class:`~nemo_rlhf.trainers.ppo.config.PPOConfig`
(registered in Hydra's ConfigStore, so a misspelt key fails with its name). Exit codes:
0 done, :data:`REQUEUE_EXIT_CODE` saved after SIGTERM/SIGUSR1 or ``max_time_per_run``
(the launchers turn it into a requeue), 1 error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from nemo_rlhf.checkpoint import load_checkpoint, load_model_weights, read_metadata, save_checkpoint
from nemo_rlhf.checkpoint.policy import prune, resume_run
from nemo_rlhf.config import check_renamed_keys, to_typed
from nemo_rlhf.data.datasets import load_prompt_dataset
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed import destroy_distributed, initialize_distributed
from nemo_rlhf.metrics import MetricsLogger
from nemo_rlhf.models.actor_critic import build_model
from nemo_rlhf.models.config import agree_on_precision
from nemo_rlhf.models.engine import wrap_ddp
from nemo_rlhf.trainers.optimizers import build_optimizer, validate_optimizer
from nemo_rlhf.trainers.ppo.config import PPOConfig, validate_batch_sizes
from nemo_rlhf.trainers.ppo.guards import RewardHackingGuard
from nemo_rlhf.trainers.ppo.reference import ReferencePolicy
from nemo_rlhf.trainers.ppo.rewards import build_reward
from nemo_rlhf.trainers.ppo.trainer import PPOTrainer

REQUEUE_EXIT_CODE = 42
log = logging.getLogger("nemo_rlhf.ppo")

ConfigStore.instance().store(name="ppo_schema", node=PPOConfig)


class _Signals:
    """Records SIGTERM / SIGUSR1 so the loop can finish the step, save and exit."""

    def __init__(self):
        self.received = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def any_rank(self) -> bool:
        t = torch.tensor([1.0 if self.received else 0.0], device="cpu")  # host flag: gloo
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def _file_hash(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _reference_fingerprint(cfg: PPOConfig) -> str:
    """The reference (initial) weights, independent of the parallel layout: the checksums
    of the ``init_from`` checkpoint's shards, or the seed of a random initialisation."""
    if not cfg.exp_manager.init_from:
        return f"random-init:seed={cfg.trainer.seed}"
    files = read_metadata(cfg.exp_manager.init_from).get("files") or {}
    digest = hashlib.sha256(json.dumps(sorted((k, v[1]) for k, v in files.items())).encode())
    return digest.hexdigest()[:16]


def build(cfg: PPOConfig):
    """Set up distributed, data, model, optimizer, reference, reward; return the trainer."""
    tok = Tokenizer(cfg.data.tokenizer_dir)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tok.vocab_size
    dims = initialize_distributed(cfg.parallel, seed=cfg.trainer.seed,
                                  num_layers=cfg.model.num_layers,
                                  num_attention_heads=cfg.model.num_attention_heads,
                                  num_query_groups=cfg.model.num_query_groups)
    validate_batch_sizes(cfg.ppo, dims.dp, cfg.rollout.n_samples_per_prompt)
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
        load_model_weights(cfg.exp_manager.init_from, model,
                           init_heads=cfg.exp_manager.init_value_head)
    reference = ReferencePolicy(model, cfg.reference.mode, build_fn=make_stage)
    ddp = wrap_ddp(model, use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
    optimizer = build_optimizer(ddp, cfg.optim, dims, cfg.trainer.precision)
    critic = build_separate_critic(cfg, dims) if separate else None
    reward = build_reward(cfg.reward, dims) if (dims.tp_rank == 0 and dims.pp_rank == 0) else None
    trainer = PPOTrainer(cfg, dims, ddp, optimizer, reference, reward, tok, prompts, eval_prompts,
                         critic=critic)
    trainer.fingerprint = {
        "model": cfg.model.fingerprint(),
        "tokenizer": _file_hash(Path(cfg.data.tokenizer_dir) / "tokenizer.json"),
        "train_prompts": _file_hash(cfg.data.train_file),
        "reference": _reference_fingerprint(cfg),
    }
    return trainer


def build_separate_critic(cfg: PPOConfig, dims) -> tuple:
    """``critic.mode=separate``: the critic's own stage (backbone + value head, DDP-wrapped)
    and optimizer, from ``critic.init_from`` or ``exp_manager.init_from``.

    From a separate-critic PPO checkpoint the critic part is loaded; from any other (SFT,
    actor, RM) the backbone, the value head from the checkpoint's value head or an RM's
    reward head, else initialised (``exp_manager.init_value_head``).
    """
    from dataclasses import replace

    critic = build_model(cfg.model, dims, cfg.trainer.precision, kind="critic",
                         seed=cfg.trainer.seed + 1)
    source = cfg.critic.init_from or cfg.exp_manager.init_from
    if source:
        part = "critic" if read_metadata(source).get("has_critic") else "model"
        load_model_weights(source, critic, init_heads=cfg.exp_manager.init_value_head, part=part,
                           head_aliases={"value_head": "reward_head"})
    ddp = wrap_ddp(critic, use_distributed_optimizer=cfg.optim.use_distributed_optimizer)
    optim = cfg.optim if cfg.critic.lr is None else replace(cfg.optim, lr=cfg.critic.lr)
    return ddp, build_optimizer(ddp, optim, dims, cfg.trainer.precision)


def fit(cfg: PPOConfig, trainer, sig: "_Signals | None" = None) -> int:
    """The training loop; returns the process exit code."""
    exp = Path(cfg.exp_manager.exp_dir)
    ckpt_root = exp / "checkpoints"
    sig = sig or _Signals()
    start = time.time()
    g = cfg.guards
    guard = RewardHackingGuard(g.window, g.max_length_growth, g.max_repetition, g.kl_ceiling)
    resume(cfg, trainer, ckpt_root, guard)
    logger = MetricsLogger(exp, enabled=trainer.is_reporter or trainer.dims.rank == 0,
                           total_steps=cfg.trainer.max_steps, start_step=trainer.step)
    cfg_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)

    def save():
        state = {**trainer.state_dict(), "guard": guard.state_dict()}
        path = save_checkpoint(ckpt_root, trainer.step, trainer.model, trainer.optimizer, state,
                               cfg_dict, trainer.dims, trainer.fingerprint, critic=trainer.critic)
        if cfg.exp_manager.keep_last and trainer.dims.rank == 0:
            prune(ckpt_root, cfg.exp_manager.keep_last)
        return path

    if trainer.step == 0 and cfg.trainer.val_check_interval:
        logger.log_metrics(trainer.evaluate(), step=0)
    code = 0
    while trainer.step < cfg.trainer.max_steps:
        metrics = trainer.train_step()
        trainer.step += 1
        step = trainer.step
        if trainer.nonfinite_in_a_row >= cfg.trainer.max_consecutive_nonfinite:
            raise RuntimeError(
                f"{trainer.nonfinite_in_a_row} consecutive updates had a non-finite loss or "
                f"gradient norm (trainer.max_consecutive_nonfinite="
                f"{cfg.trainer.max_consecutive_nonfinite}); stopping, the last good checkpoint "
                f"is kept in {ckpt_root}")
        if cfg.trainer.val_check_interval and (step % cfg.trainer.val_check_interval == 0
                                               or step == cfg.trainer.max_steps):
            metrics.update(trainer.evaluate())
        logger.log_metrics(metrics, step)
        if cfg.trainer.sample_table_every and step % cfg.trainer.sample_table_every == 0:
            logger.log_samples(trainer.sample_table(), step)
        message = guard.update(step, metrics) if g.action != "off" else None
        message = _bcast_text(message)
        stop_for_guard = message is not None and g.action == "stop"
        if message:
            log.warning("reward-hacking guard: %s", message)
        out_of_time = (cfg.trainer.max_time_per_run is not None
                       and time.time() - start > cfg.trainer.max_time_per_run)
        signalled = sig.any_rank()
        periodic = cfg.exp_manager.save_interval and step % cfg.exp_manager.save_interval == 0
        if periodic or step == cfg.trainer.max_steps or signalled or out_of_time or stop_for_guard:
            save()
        if stop_for_guard:
            log.error("stopping: reward-hacking guard (%s)", message)
            code = 3
            break
        if signalled or out_of_time:
            log.warning("saved step %d after %s; exiting with requeue code %d", step,
                        sig.received or "max_time_per_run", REQUEUE_EXIT_CODE)
            code = REQUEUE_EXIT_CODE
            break
    logger.close()
    return code


def resume(cfg: PPOConfig, trainer, ckpt_root: Path, guard=None) -> None:
    """Load the checkpoint ``exp_manager.resume`` selects (the one policy of
    :mod:`nemo_rlhf.checkpoint.policy`) into the trainer and the guard, if any."""
    em = cfg.exp_manager
    path, why, state = resume_run(
        em.resume, ckpt_root, trainer.fingerprint,
        lambda p: load_checkpoint(p, trainer.model, trainer.optimizer, critic=trainer.critic),
        em.ignore_fingerprint)
    if path is None:
        log.info("starting fresh: %s", why)
        return
    trainer.load_state_dict(state)
    if guard is not None and state.get("guard"):
        guard.load_state_dict(state["guard"])
    log.info("resumed from %s at step %d (%s)", path, trainer.step, why)


def _bcast_text(message):
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@hydra.main(version_base=None, config_path="../conf", config_name="ppo")
def hydra_main(dcfg: DictConfig) -> None:
    """The Hydra job (``main`` checks the command line first)."""
    sig = _Signals()  # first: a SIGUSR1 during set-up must not kill the job
    # merging into the schema rejects keys added with `+` that the schema does not have
    cfg: PPOConfig = to_typed(dcfg, PPOConfig)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    exp = Path(cfg.exp_manager.exp_dir)
    exp.mkdir(parents=True, exist_ok=True)
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0:
        (exp / "config.yaml").write_text(OmegaConf.to_yaml(dcfg, resolve=True))
        with open(exp / "command_lines.txt", "a") as f:
            f.write(json.dumps({"time": time.time(), "argv": sys.argv}) + "\n")
    trainer = build(cfg)
    code = fit(cfg, trainer, sig)
    destroy_distributed()
    if code:
        sys.exit(code)


def main() -> None:
    """Console entry (``nemo-rlhf-ppo``): a renamed key is refused naming the new one."""
    try:
        check_renamed_keys(sys.argv[1:])
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    hydra_main()


if __name__ == "__main__":
    main()
