"""Reward-model server job: ``python -m nemo_rlhf.serve_rm checkpoint=<ckpt> [hydra overrides]``.

Config: ``conf/rm_server.yaml`` over the typed schema :class:`ServeRMConfig` (registered
in Hydra's ConfigStore, so a misspelt key fails with its name), e.g.::

    python -m nemo_rlhf.serve_rm checkpoint=experiments/rm/checkpoints \\
        server.port=0 server.address_file=experiments/ppo/rm_address
    torchrun --standalone --nproc_per_node 2 -m nemo_rlhf.serve_rm checkpoint=... \\
        parallel.tensor_model_parallel_size=2

Runs single-process or under torchrun / srun (:func:`initialize_distributed` reads the
launcher's environment). Global rank 0 serves HTTP (:func:`nemo_rlhf.reward.server.serve`,
bound to 127.0.0.1 unless ``server.host`` says otherwise) and builds the scorer on the
server's model thread, so ``/health`` answers 503 ``loading`` while the checkpoint loads;
the other ranks build their part of the model and wait in
:meth:`RewardModelScorer.serve_worker_loop`. SIGINT / SIGTERM to rank 0 stops the server,
which releases the other ranks, and exits with 0 (the other ranks ignore those signals
and leave on rank 0's stop message, or when its connection drops); any error exits
with 1.

Simplified on purpose: one model replica set per job; data-parallel replicas (world size
> TP x PP) split each batch but are served through the single HTTP front on rank 0.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from nemo_rlhf.config import to_typed
from nemo_rlhf.distributed import destroy_distributed, initialize_distributed
from nemo_rlhf.distributed.parallel import ParallelConfig
from nemo_rlhf.models.context_parallel import refuse_context_parallel
from nemo_rlhf.models.moe import refuse_expert_parallel
from nemo_rlhf.reward.rm_scorer import RewardModelScorer, RMScorerConfig, read_rm_checkpoint
from nemo_rlhf.reward.server import RMServerConfig, serve

log = logging.getLogger("nemo_rlhf.serve_rm")


@dataclass
class ServeRMConfig(RMScorerConfig):
    """The RM server job: the scorer's keys at the top level (``checkpoint``,
    ``tokenizer_dir``, ``micro_batch_size``, ...) plus the groups below."""

    server: RMServerConfig = field(default_factory=RMServerConfig)
    """HTTP server: host, port, address_file, batching limits, auth."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP layout the checkpoint is resharded to (any layout the model allows)."""
    seed: int = 1234
    """Seed of megatron's RNG tracker (the forward draws no random numbers; kept for parity)."""


ConfigStore.instance().store(name="rm_server_schema", node=ServeRMConfig)


def run(cfg: ServeRMConfig) -> None:
    """Initialise distributed, load the RM on every rank, serve on rank 0 until stopped.

    Raises:
        CheckpointError / ValueError / FileNotFoundError: bad checkpoint, layout or tokenizer
            (the layout is checked against the model before any process group exists).
        OSError: the server cannot bind ``server.host:server.port``.
        RuntimeError: the scorer failed to load on rank 0.
    """
    info = read_rm_checkpoint(cfg.checkpoint)
    refuse_expert_parallel(cfg.parallel, "RM server")
    refuse_context_parallel(cfg.parallel, "RM server")
    dims = initialize_distributed(cfg.parallel, seed=cfg.seed, num_layers=info.model.num_layers,
                                  num_attention_heads=info.model.num_attention_heads,
                                  num_query_groups=info.model.num_query_groups)
    log.info("rank %d/%d: serving %s (step %d) with %s", dims.rank, dims.world_size, info.path,
             info.step, dims.describe())
    try:
        if dims.rank == 0:
            # uvicorn handles SIGINT/SIGTERM (graceful shutdown, which releases the other
            # ranks) and then re-raises the signal: make that a clean exit, not a kill.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, _exit_cleanly)
            serve(lambda: RewardModelScorer(cfg, dims, info), cfg.server)
        else:
            # A group-wide signal (Ctrl-C, torchrun forwarding SIGTERM) reaches these ranks
            # too: they keep waiting for rank 0's stop message, which the signal triggers.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, _wait_for_rank0)
            RewardModelScorer(cfg, dims, info).serve_worker_loop()
    finally:
        destroy_distributed()


def _exit_cleanly(signum, frame) -> None:
    log.info("%s: reward model server stopped", signal.Signals(signum).name)
    raise SystemExit(0)


def _wait_for_rank0(signum, frame) -> None:
    log.info("%s: waiting for rank 0's stop message", signal.Signals(signum).name)


@hydra.main(version_base=None, config_path="../conf", config_name="rm_server")
def main(dcfg: DictConfig) -> None:
    """Hydra entry point (see the module docstring)."""
    cfg: ServeRMConfig = to_typed(dcfg, ServeRMConfig)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [rm-server] %(levelname)s %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    run(cfg)


if __name__ == "__main__":
    main()
