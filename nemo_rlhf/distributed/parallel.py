"""Process groups and megatron's ``parallel_state``: the one place that touches them.

:func:`initialize_distributed` reads the launcher's environment (torchrun or SLURM),
initialises ``torch.distributed`` (gloo without CUDA, NCCL with), megatron's model-parallel
groups and the tensor-parallel RNG tracker, and returns a :class:`ParallelDims` -- the
object the rest of the package is handed (torchtitan's ParallelDims habit). Everything
outside ``nemo_rlhf/distributed/`` reads ranks and groups from that object, never from
megatron's global getters.

:func:`validate_parallel_layout` checks the layout against the world size and the model
before any model is built, with errors that name the config keys and the values that
would work.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_rlhf.config import check_choice
from nemo_rlhf.distributed import cpu_compat, device_guard, phase
from nemo_rlhf.distributed.launch_env import LaunchEnv, read_launch_env


BACKENDS = ("auto", "gloo", "nccl")
"""The choices of ``parallel.backend``."""


@dataclass
class ParallelConfig:
    """Parallel layout (config group ``parallel``). Data parallel size is derived."""

    tensor_model_parallel_size: int = 1
    """Ranks a layer's weights are split across (megatron TP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages the layers are split into (megatron PP)."""
    expert_model_parallel_size: int = 1
    """Ranks a mixture-of-experts layer's experts are split across (megatron EP; each holds
    ``model.num_moe_experts / EP`` of them). An expert-parallel group is made of ranks of
    different data-parallel replicas (the same TP and PP position), so EP must divide the
    data-parallel size; the expert weights are then data-parallel over the remaining
    ``DP / EP`` ranks (megatron's expert-data-parallel group). Under context parallelism
    megatron carves the expert groups from the ``DP x CP`` ranks (EP must divide that; at
    DP = 1, CP = EP = 2 the expert group is the CP group). 1 for a dense model."""
    context_parallel_size: int = 1
    """Ranks a sequence is split across (megatron CP, load-balanced: CP rank ``r`` holds
    chunks ``r`` and ``2 CP - 1 - r`` of ``2 CP``; sequence lengths must be divisible by
    ``2 CP``). The attention all-gathers keys and values over the CP group
    (:mod:`nemo_rlhf.models.context_parallel`). The data-parallel size is
    ``world / (TP x PP x CP)``. Packed micro-batches (``ppo.sequence_packing``) align
    every sequence to ``2 CP`` and chunk each one (megatron's THD layout,
    :mod:`nemo_rlhf.models.cp_packing`). The PPO trainer runs it (what it refuses:
    docs/parallelism.md); the SFT and RM trainers, the RM server and ``evaluate`` refuse
    values > 1."""
    backend: str = "auto"
    """``auto`` (NCCL for CUDA tensors plus gloo for host tensors with CUDA, gloo
    without), ``gloo``, or ``nccl`` (the same map as ``auto``: host-side flags and object
    collectives always take gloo). See :func:`resolve_backend`."""
    timeout_minutes: float = 30.0
    """Collective timeout of every process group, in minutes (fractions allowed: 0.1 is
    6 s). A collective that waits longer on a hung peer fails; the trainer's error names
    this rank, the phase and the step (:mod:`nemo_rlhf.distributed.phase`)."""

    def __post_init__(self) -> None:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "expert_model_parallel_size", "context_parallel_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{key}={value!r}: must be an integer >= 1")
        value = self.timeout_minutes
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"parallel.timeout_minutes={value!r}: must be a number of minutes > 0 "
                             f"(e.g. 30, or 0.5 for 30 s)")
        check_choice("parallel.backend", self.backend, BACKENDS)


def resolve_backend(backend: str, cuda: bool) -> str:
    """The ``torch.distributed`` backend string for ``parallel.backend``.

    With NCCL the default group gets a device -> backend map, ``"cpu:gloo,cuda:nccl"``:
    CUDA tensors are reduced by NCCL and host tensors (flags, metadata, pickled objects)
    by gloo, in the default group and in every group created from it (megatron's groups
    inherit the map). A plain ``"nccl"`` would hand host tensors to NCCL, which fails.

    Args:
        backend: ``auto``, ``gloo`` or ``nccl`` (``parallel.backend``).
        cuda: whether this process drives a CUDA device.

    Returns:
        ``"gloo"`` or ``"cpu:gloo,cuda:nccl"``.
    """
    if backend == "gloo" or (backend == "auto" and not cuda):
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_parallel_layout(
    parallel: ParallelConfig,
    world_size: int,
    num_layers: int | None = None,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    vocab_size: int | None = None,
    num_moe_experts: int | None = None,
) -> int:
    """Check a TP/PP/CP/EP layout against the world size and the model; return the DP size.

    Args:
        num_moe_experts: ``model.num_moe_experts`` (None: a dense model, or not known to
            the caller; either way ``parallel.expert_model_parallel_size`` must then be 1).

    Raises:
        ValueError: naming the offending key (``parallel.tensor_model_parallel_size``,
            ``parallel.pipeline_model_parallel_size``, ``parallel.expert_model_parallel_size``,
            ``parallel.context_parallel_size``,
            ``model.num_layers``, ...), its value and the values that would work.
    """
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if world_size % tp != 0 or tp > world_size:
        raise ValueError(
            f"parallel.tensor_model_parallel_size={tp} does not divide the world size "
            f"{world_size}; valid values: {_divisors(world_size)}"
        )
    if world_size % (tp * pp) != 0:
        valid = [d for d in _divisors(world_size // tp)]
        raise ValueError(
            f"parallel.pipeline_model_parallel_size={pp} with tensor_model_parallel_size={tp}: "
            f"tp*pp={tp * pp} does not divide the world size {world_size}; valid "
            f"pipeline_model_parallel_size values for this TP: {valid}"
        )
    if num_layers is not None and num_layers % pp != 0:
        raise ValueError(
            f"model.num_layers={num_layers} is not divisible by "
            f"parallel.pipeline_model_parallel_size={pp}; valid PP sizes for this model: "
            f"{[d for d in _divisors(num_layers) if world_size % (tp * d) == 0]}"
        )
    # Heads and KV heads (query groups) are checked together, so that a GQA model whose
    # query-head count TP happens to fail first (SmolLM2: 9 heads, 3 KV heads, TP=2) is
    # told about the binding constraint, the KV heads, and gets the sizes valid for both.
    facts = []
    if num_query_groups is not None and num_query_groups != num_attention_heads:
        facts.append(("model.num_query_groups", num_query_groups, " (KV heads)"))
    if num_attention_heads is not None:
        facts.append(("model.num_attention_heads", num_attention_heads, ""))
    if any(value % tp != 0 for _, value, _ in facts):
        fits = [d for d in _divisors(min(v for _, v, _ in facts))
                if all(v % d == 0 for _, v, _ in facts)]
        in_world = [d for d in fits if world_size % d == 0]
        names = " and ".join(f"{k}={v}{note}" for k, v, note in facts)
        where = "" if in_world == fits else f"; of those, {in_world} divide the world size {world_size}"
        raise ValueError(
            f"parallel.tensor_model_parallel_size={tp} must divide {names}; valid TP sizes: "
            f"{fits}{where}"
        )
    cp = parallel.context_parallel_size
    if world_size % (tp * pp * cp) != 0:
        valid = _divisors(world_size // (tp * pp))
        raise ValueError(
            f"parallel.context_parallel_size={cp} with tensor_model_parallel_size={tp} and "
            f"pipeline_model_parallel_size={pp}: tp*pp*cp={tp * pp * cp} does not divide the world "
            f"size {world_size}; valid context_parallel_size values for this TP and PP: {valid}"
        )
    dp = world_size // (tp * pp * cp)
    _validate_expert_parallel(parallel.expert_model_parallel_size, dp, tp, pp, num_moe_experts, cp)
    return dp


def _validate_expert_parallel(ep: int, dp: int, tp: int, pp: int, num_moe_experts: int | None,
                              cp: int = 1) -> None:
    """megatron's rules for ``parallel.expert_model_parallel_size``: a MoE model, EP
    dividing the data-parallel x context-parallel size (its expert groups, of EP x expert TP
    (= TP) ranks per pipeline stage, tile the world: megatron's ``initialize_model_parallel``
    requires ``world_size % (TP x EP x PP) == 0`` and carves the expert groups from the
    ``DP x CP`` ranks of a TP x PP position, CP ranks included) and the experts
    (``num_moe_experts % EP == 0``, megatron's ``MoELayer``)."""
    if ep == 1:
        return
    if num_moe_experts is None:
        raise ValueError(
            f"parallel.expert_model_parallel_size={ep} on a dense model (model.num_moe_experts is "
            f"null): expert parallelism splits a mixture-of-experts layer's experts; set "
            f"parallel.expert_model_parallel_size=1")
    ranks = dp * cp
    valid = [d for d in _divisors(ranks) if num_moe_experts % d == 0]
    if ranks % ep:
        with_cp = f" x context_parallel_size={cp}" if cp > 1 else ""
        raise ValueError(
            f"parallel.expert_model_parallel_size={ep} must divide the data-parallel size {dp}"
            f"{with_cp} (world size {ranks * tp * pp} / (tensor_model_parallel_size={tp} x "
            f"pipeline_model_parallel_size={pp})): megatron builds each expert-parallel group from "
            f"ranks of different data-parallel (or context-parallel) ranks; valid values for this "
            f"layout and model.num_moe_experts={num_moe_experts}: {valid}")
    if num_moe_experts % ep:
        raise ValueError(
            f"model.num_moe_experts={num_moe_experts} is not divisible by "
            f"parallel.expert_model_parallel_size={ep}: every expert-parallel rank holds the same "
            f"number of experts; valid values for this layout and model: {valid}")


@dataclass
class ParallelDims:
    """The parallel layout of this process, built once and passed explicitly.

    Group attributes are ``torch.distributed`` process groups; ``*_rank`` are this process's
    ranks inside them; ``*_size`` the group sizes.
    """

    world_size: int
    rank: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    mp_group: object
    """Model-parallel group (TP x PP): ranks that hold one copy of the model."""
    embedding_group: object
    device: torch.device
    """The accelerator device of this rank: ``cuda:<local_rank>``, or the host without CUDA
    (``cpu:0`` under the device guard). The one source of the device: tensors that meet
    model tensors are created on it or moved to it at one boundary (the rollout's entry,
    the forward step); see ``nemo_rlhf/distributed/__init__.py``."""
    ep: int = 1
    """Expert-parallel size (``parallel.expert_model_parallel_size``)."""
    ep_rank: int = 0
    """This rank's index in its expert-parallel group: it holds experts
    ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)`` of every MoE layer."""
    ep_group: object = None
    """Expert-parallel group: the ``ep`` ranks (one per data-parallel replica, same TP and
    PP position) that split the experts among them and exchange tokens."""
    expert_dp_group: object = None
    """Expert-data-parallel group: the ``dp / ep`` ranks holding the same experts, over
    which megatron DDP reduces the expert weights' gradients."""
    expert_mp_group: object = None
    """Expert model-parallel group (expert TP x EP x PP): the ranks that together hold one
    copy of every expert, over which the experts' share of the gradient norm is summed."""
    cp: int = 1
    """Context-parallel size (``parallel.context_parallel_size``)."""
    cp_rank: int = 0
    """This rank's index in its CP group: it holds positions
    :func:`nemo_rlhf.models.context_parallel.cp_positions` of every sequence."""
    cp_group: object = None
    """Context-parallel group: the ``cp`` ranks (same TP, PP and DP position) that split a
    sequence. ``dp_group`` does not include it; gradients are summed over both."""

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the embedding (first pipeline stage)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the output layer and value head (last pipeline stage)."""
        return self.pp_rank == self.pp - 1

    @property
    def pp_last_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline."""
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_last_rank()

    @property
    def pp_first_rank(self) -> int:
        """Global rank of the first pipeline stage in this rank's pipeline."""
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_first_rank()

    @property
    def tp_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (broadcast source)."""
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_src_rank()

    @property
    def dp_src_rank(self) -> int:
        """Global rank of DP rank 0 in this rank's DP group."""
        return dist.get_global_rank(self.dp_group, 0) if self.world_size > 1 else 0

    def describe(self) -> dict:
        """JSON-able summary: ``{"tp": .., "pp": .., "dp": .., "world_size": ..}``, with
        ``"ep"`` under expert parallelism and ``"cp"`` under context parallelism (absent: 1)."""
        out = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "world_size": self.world_size}
        if self.ep > 1:
            out["ep"] = self.ep
        if self.cp > 1:
            out["cp"] = self.cp
        return out


def _make_dims(local_rank: int) -> ParallelDims:
    from megatron.core import parallel_state as ps

    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
    elif device_guard.is_active():
        device = device_guard.EMULATED_DEVICE
    else:
        device = torch.device("cpu")
    return ParallelDims(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        local_rank=local_rank,
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        embedding_group=ps.get_embedding_group(check_initialized=False),
        ep=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(),
        expert_dp_group=ps.get_expert_data_parallel_group(),
        expert_mp_group=ps.get_expert_tensor_model_pipeline_parallel_group(),
        cp=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_group=ps.get_context_parallel_group(),
        device=device,
    )


def initialize_distributed(
    parallel: ParallelConfig,
    seed: int = 1234,
    num_layers: int | None = None,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    launch_env: LaunchEnv | None = None,
    num_moe_experts: int | None = None,
) -> ParallelDims:
    """Initialise torch.distributed, megatron's parallel state and the TP RNG tracker.

    Idempotent for the same layout: if torch.distributed is already initialised (e.g. by
    a test harness), only megatron's state is (re)built on the existing default group.

    Args:
        parallel: the layout; validated against the world size and the model first.
        seed: base seed; megatron's tracker derives the TP-rank seeds from it.
        num_layers, num_attention_heads, num_query_groups, num_moe_experts: model facts for
            validation (``num_moe_experts`` None: a dense model; then
            ``parallel.expert_model_parallel_size`` must be 1).
        launch_env: overrides the environment (tests).

    Raises:
        ValueError: bad layout (see :func:`validate_parallel_layout`), raised before any
            process group is created.
    """
    env = launch_env or read_launch_env()
    validate_parallel_layout(parallel, env.world_size, num_layers, num_attention_heads,
                             num_query_groups, num_moe_experts=num_moe_experts)
    cpu_compat.activate_if_no_cuda()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(env.local_rank)
    else:  # NEMO_RLHF_DEVICE_GUARD=1: check against the backend a CUDA machine would get
        device_guard.activate_if_requested(resolve_backend(parallel.backend, cuda=True))
    backend = resolve_backend(parallel.backend, cuda)
    phase.set_timeout_minutes(parallel.timeout_minutes)
    if not dist.is_initialized():
        if env.launcher == "single" and env.master_port == 0:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            init_method = f"tcp://127.0.0.1:{free_port()}"
        else:
            init_method = f"tcp://{env.master_addr}:{env.master_port}"
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(minutes=parallel.timeout_minutes),
        )
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        distributed_timeout_minutes=parallel.timeout_minutes,
        create_gloo_process_groups="nccl" in backend,
    )
    set_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return _make_dims(env.local_rank)


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (CPU and, through megatron, the TP tracker)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def destroy_distributed() -> None:
    """Tear down megatron's groups and the default process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (bound and released; racy by nature)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reseed_model_parallel(seed: int) -> None:
    """Re-seed every generator and megatron's TP RNG tracker (same weights on rebuild)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    set_seed(seed)
    model_parallel_cuda_manual_seed(seed)
