"""Distributed set-up: launcher environment, process groups, megatron parallel state, device.

Device discipline (the same code runs on CPU/gloo and CUDA/NCCL):

* ``dims.device`` (:class:`ParallelDims`, decided in :func:`initialize_distributed`) is the
  only source of the accelerator device: ``cuda:<local_rank>`` with CUDA, the host without.
* Tensors that meet model tensors are created on ``dims.device`` (``device=dims.device``
  or ``device=<a device tensor>.device``), or moved there at one boundary with
  :func:`to_device`: the rollout's entry (prompt ids) and the forward step (micro-batches
  of SFT/RM data, reward scores for the advantages).
* Results come back to the host only where they leave the accelerator: decoded text,
  JSON metrics (``float()`` / ``.tolist()``), checkpoints' host-side state, the offloaded
  reference (pinned host buffers). Code that means the host says so (``device="cpu"`` or
  a ``# host`` comment).
* Collectives: the default group is ``"cpu:gloo,cuda:nccl"`` on CUDA
  (:func:`~nemo_rlhf.distributed.parallel.resolve_backend`), so device tensors go to NCCL
  and host flags, metadata and pickled objects to gloo, in every group.
* ``NEMO_RLHF_DEVICE_GUARD=1`` (:mod:`nemo_rlhf.distributed.device_guard`) makes a
  CPU-only run fail where CUDA would: a host tensor meeting a device tensor, a host
  generator drawing for device tensors, a host tensor handed to an NCCL-only backend.
"""

from nemo_rlhf.distributed.device import to_device
from nemo_rlhf.distributed.launch_env import LaunchEnv, read_launch_env
from nemo_rlhf.distributed.parallel import (
    ParallelConfig,
    ParallelDims,
    destroy_distributed,
    initialize_distributed,
    reseed_model_parallel,
    resolve_backend,
    set_seed,
    validate_parallel_layout,
)

__all__ = [
    "LaunchEnv", "ParallelConfig", "ParallelDims", "destroy_distributed",
    "initialize_distributed", "read_launch_env", "reseed_model_parallel", "resolve_backend",
    "set_seed", "to_device", "validate_parallel_layout",
]
