"""SFT job: ``python -m nemo_rlhf.train_sft [hydra overrides]``.

Config: ``conf/sft.yaml`` over the typed schema
:class:`~nemo_rlhf.trainers.sft.SFTRunConfig` (registered in Hydra's ConfigStore as
``sft_schema``, so a misspelt key fails naming it). Multi-rank: ``torchrun
--nproc-per-node 2 -m nemo_rlhf.train_sft parallel.tensor_model_parallel_size=2``.
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
from nemo_rlhf.trainers.sft import SFTRunConfig, register_configs, run_sft

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="sft")
def hydra_main(dcfg: DictConfig) -> None:
    """The Hydra job (``main`` checks the command line first)."""
    signals = Signals()  # first: a SIGUSR1 during set-up must not kill the job
    notes = adopt_for_hydra_job(dcfg, "sft")  # the init_from checkpoint's model
    cfg: SFTRunConfig = to_typed(dcfg, SFTRunConfig)
    configure_job_logging()
    for note in notes:
        logging.getLogger("nemo_rlhf").info(note)
    try:
        code = run_sft(cfg, signals)
    finally:
        destroy_distributed()
    if code:
        sys.exit(code)


def main() -> None:
    """Console entry: a renamed key (``trainer.save_interval``) is refused naming the new one."""
    run_console_entry(hydra_main)


if __name__ == "__main__":
    main()
