"""Distributed set-up: launcher environment, process groups, megatron parallel state."""

from nemo_rlhf.distributed.launch_env import LaunchEnv, read_launch_env
from nemo_rlhf.distributed.parallel import (
    ParallelConfig,
    ParallelDims,
    destroy_distributed,
    initialize_distributed,
    reseed_model_parallel,
    set_seed,
    validate_parallel_layout,
)

__all__ = [
    "LaunchEnv", "ParallelConfig", "ParallelDims", "destroy_distributed",
    "initialize_distributed", "read_launch_env", "reseed_model_parallel", "set_seed",
    "validate_parallel_layout",
]
