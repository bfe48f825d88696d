"""RM job: ``python -m nemo_rlhf.train_rm [hydra overrides]``.

Config: ``conf/rm.yaml`` over the typed schema
:class:`~nemo_rlhf.trainers.rm.RMRunConfig` (registered in Hydra's ConfigStore as
``rm_schema``, so a misspelt key fails naming it). Multi-rank: ``torchrun
--nproc-per-node 2 -m nemo_rlhf.train_rm parallel.tensor_model_parallel_size=2``.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from nemo_rlhf.checkpoint.source import adopt_for_hydra_job
from nemo_rlhf.config import configure_job_logging, run_console_entry, to_typed
from nemo_rlhf.distributed import destroy_distributed
from nemo_rlhf.trainers.loop import Signals
from nemo_rlhf.trainers.rm import RMRunConfig, register_configs, run_rm

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="rm")
def hydra_main(dcfg: DictConfig) -> None:
    """The Hydra job (``main`` checks the command line first)."""
    signals = Signals()  # first: a SIGUSR1 during set-up must not kill the job
    notes = adopt_for_hydra_job(dcfg, "rm")  # the init_from checkpoint's model
    cfg: RMRunConfig = to_typed(dcfg, RMRunConfig)
    configure_job_logging()
    for note in notes:
        logging.getLogger("nemo_rlhf").info(note)
    try:
        code = run_rm(cfg, signals)
    finally:
        destroy_distributed()
    if code:
        sys.exit(code)


def main() -> None:
    """Console entry: a renamed key (``trainer.save_interval``) is refused naming the new one."""
    run_console_entry(hydra_main)


if __name__ == "__main__":
    main()
