"""``python -m nemo_rlhf.evaluate``: the Hydra job (``conf/eval.yaml`` over
:class:`~nemo_rlhf.evaluate.config.EvalConfig`); the package docstring describes it."""

from __future__ import annotations

import logging

import hydra
import torch
from omegaconf import DictConfig

from nemo_rlhf.config import to_typed
from nemo_rlhf.distributed import destroy_distributed
from nemo_rlhf.evaluate.config import EvalConfig
from nemo_rlhf.evaluate.job import evaluate


@hydra.main(version_base=None, config_path="../../conf", config_name="eval")
def main(dcfg: DictConfig) -> None:
    """Run :func:`~nemo_rlhf.evaluate.job.evaluate` on the composed config; tear the
    process group down whatever happens."""
    cfg: EvalConfig = to_typed(dcfg, EvalConfig)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    torch.set_grad_enabled(False)
    try:
        evaluate(cfg)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
