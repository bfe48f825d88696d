"""Mixture-of-experts support around megatron-core's ``MoELayer`` (``model.num_moe_experts``).

The layers themselves are megatron's (router ``TopKRouter``, ``SequentialMLP`` experts,
the ``allgather`` token dispatcher; see :func:`nemo_rlhf.models.decode_layers.local_layer_spec`).
This module holds what megatron-core 0.16.1 lacks to run them here:

* :func:`patch_router_gemm_without_te`: megatron's ``RouterGatingLinearFunction`` reads the
  module global ``te_general_gemm``, which ``moe_utils`` only defines when
  transformer-engine imports; without TE (this project's CPU runs, or a GPU without TE) the
  router's forward raises ``NameError``. Setting it to None selects megatron's own
  ``torch.mm`` branch, the same arithmetic TE would do.

* :class:`RouterLoad` / :func:`router_load_metrics`: the PPO update's ``moe/`` metrics
  (tokens per expert, busiest and idlest over the mean, and megatron's aux loss).

Expert parallelism (``parallel.expert_model_parallel_size`` = EP > 1): each rank of an
expert-parallel group holds ``E / EP`` experts of every layer (megatron's ``SequentialMLP``
with its local experts) and every MoE layer call is a collective over the group (megatron's
``allgather`` dispatcher gathers the group's tokens, each rank runs its experts on those
routed to them, a reduce-scatter returns every rank its tokens' outputs). The ranks of the
group belong to different data-parallel replicas, which hold different batches, so two
things megatron assumes here must be made true:

* :class:`~nemo_rlhf.models.moe_dispatch.PaddedAllGatherTokenDispatcher`: the ranks may
  hold different token counts in one call (prompts padded to another length, the last
  forward micro-batch shorter, token-budget micro-batches): the counts are exchanged and the
  shorter ones padded with rows routed to no expert, so the all-gather / reduce-scatter see
  equal shapes; the padding is cut off again.
* Every rank of the group calls the layers equally often: the forward/backward schedule pads
  a rank's micro-batch list to the group's longest (:func:`agree_on_micro_batch_count`,
  :mod:`nemo_rlhf.models.engine`) and decoding stops only when every rank of the group is
  done (:mod:`nemo_rlhf.rollout.generate`). :func:`expert_exchange_group` names the group.

Simplified: no shared experts, no grouped GEMM (CUDA kernels), no token dropping
(capacity factor), no expert bias / sigmoid routing (DeepSeek-V3's); the ``alltoall``
dispatcher is not used (megatron 0.16.1 hands ``all_to_all_single`` its split sizes as
tensors, which torch 2.13 refuses with a ``TypeError``); the allgather dispatcher moves every
token of the group to every rank (``EP x`` the activations an all-to-all would move), which
is what makes it run on gloo as on NCCL.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.distributed as dist


def patch_router_gemm_without_te() -> None:
    """Define ``megatron.core.transformer.moe.moe_utils.te_general_gemm = None`` when
    transformer-engine did not import (idempotent; a no-op where TE defined it)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def expert_exchange_group(model: torch.nn.Module):
    """The process group over which ``model``'s MoE layers exchange tokens in every call
    (megatron's TP x EP group of its token dispatchers) when the experts are split across
    ranks (EP > 1); None for a dense model or at EP = 1, where a rank's MoE calls wait for
    no other data-parallel replica."""
    for m in model.modules():
        d = getattr(m, "token_dispatcher", None)
        if d is not None and hasattr(d, "tp_ep_group"):  # a megatron MoETokenDispatcher
            return d.tp_ep_group if d.ep_size > 1 else None
    return None


def agree_on_micro_batch_count(count: int, group, device: torch.device) -> tuple[int, int]:
    """``(fewest, most)`` micro-batches of the ranks of ``group`` (one ``[2]`` int64
    all-reduce on ``device``): with expert parallelism every rank of the group must run as
    many MoE layer calls as the others."""
    both = torch.tensor([-count, count], dtype=torch.long, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return -int(both[0]), int(both[1])


_FILLER = [False]
"""Whether the forward running now is an expert-parallel filler (:func:`filler_forward`)."""


@contextlib.contextmanager
def filler_forward(active: bool = True):
    """Mark the forwards of the ``with`` block as expert-parallel fillers (the zero-loss
    copies :mod:`nemo_rlhf.models.engine` runs so that every EP rank calls the MoE layers
    equally often): :class:`RouterLoad` does not count their tokens. ``active=False``: a
    no-op."""
    before = _FILLER[0]
    _FILLER[0] = before or active
    try:
        yield
    finally:
        _FILLER[0] = before


def all_done_in_group(done: bool, group, device: torch.device) -> bool:
    """Whether every rank of ``group`` is ``done`` (one ``[1]`` all-reduce on ``device``):
    a decoding loop at EP > 1 stops only when all of them are."""
    flag = torch.tensor([0 if done else 1], dtype=torch.long, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return not bool(flag.item())


AUX_LOSS_NAME = "load_balancing_loss"
"""megatron's tracker entry of the ``aux_loss`` load-balancing loss (``TopKRouter._apply_aux_loss``)."""
Z_LOSS_NAME = "z_loss"
"""megatron's tracker entry of the router z-loss (``TopKRouter.apply_z_loss``)."""


class RouterLoad:
    """Tokens routed to each expert in the forwards run while installed (a context manager).

    Forward hooks on every megatron ``TopKRouter`` of ``model`` (none for a dense model:
    then :attr:`active` is False and nothing is recorded) add each call's ``routing_map
    [tokens, experts]`` column sums to :attr:`counts`, padded positions left out (the
    router's padding mask, which :func:`nemo_rlhf.models.engine.model_forward` passes;
    padded positions are routed like real tokens but are not the batch's). On exit it also
    reads (and clears) megatron's router-loss tracker, which the routers fill in training
    passes when ``model.moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` > 0.

    Forwards marked by :func:`filler_forward` (expert-parallel filler copies) are not
    counted, nor training-mode forwards without autograd: under full activation recompute
    each layer of a training pass runs twice, first without autograd, then again in the
    backward, so each routed token is counted once (eval-mode forwards are counted).

    Attributes:
        counts: ``[routers on this stage, experts]`` float64 on the routers' device.
        calls: router calls (one per layer and micro-batch forward).
        aux_loss_sum: the tracker's aux losses summed over layers and calls (0.0 without).
        z_loss_sum: the same for the z-loss.
    """

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.active = bool(self.routers)
        self.counts: Optional[torch.Tensor] = None
        self.calls = 0
        self.aux_loss_sum = 0.0
        self.z_loss_sum = 0.0
        self._handles: list = []

    def _hook(self, index: int):
        def hook(module, inputs, output):
            if _FILLER[0]:  # an expert-parallel filler micro-batch (a copy): not counted
                return
            if module.training and not torch.is_grad_enabled():
                # full activation recompute's first run of a layer in a training pass
                # (without autograd; the backward runs it again, with): counted once, in the
                # run that also computes the router losses
                return
            routing_map = output[1]  # [tokens, experts] bool, tokens in [seq, batch] order
            padding = inputs[1] if len(inputs) > 1 else None  # [seq, batch] bool, True = padding
            if padding is not None:
                routing_map = routing_map & ~padding.reshape(-1, 1)
            self.counts[index] += routing_map.sum(0).to(self.counts.dtype)
            self.calls += 1
        return hook

    def __enter__(self) -> "RouterLoad":
        if self.active:
            from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

            clear_aux_losses_tracker()
            w = self.routers[0].weight
            self.counts = torch.zeros(len(self.routers), w.shape[0], dtype=torch.float64, device=w.device)
            self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.active:
            from megatron.core.transformer.moe.moe_utils import (
                clear_aux_losses_tracker,
                get_moe_layer_wise_logging_tracker,
            )

            tracker = get_moe_layer_wise_logging_tracker()
            for name, attr in ((AUX_LOSS_NAME, "aux_loss_sum"), (Z_LOSS_NAME, "z_loss_sum")):
                if tracker.get(name) is not None:
                    setattr(self, attr, float(tracker[name]["values"].sum()))
            clear_aux_losses_tracker()

    def stage_sums(self, dp_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                   cp_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """``[6]`` float64 to be summed over the pipeline stages (:func:`router_load_metrics`):
        per layer ``max_e / mean_e`` and ``min_e / mean_e`` of its tokens per expert, summed
        over this stage's layers; the layer count; the aux-loss and z-loss sums; the router
        calls.

        Args:
            dp_sum: sums a tensor over the data-parallel group (in place, returning it; e.g.
                :meth:`~nemo_rlhf.trainers.collectives.JobCollectives.dp_sum`); every DP rank
                calls it together. The tokens per expert are summed over DP *before* the
                ratios, so the metrics are the whole batch's whatever the DP size (a mean of
                per-rank ratios would change with it). None: this rank's counts alone.
            cp_sum: sums a tensor over the context-parallel group (in place, returning it;
                :meth:`~nemo_rlhf.trainers.collectives.JobCollectives.cp_sum`), called
                before ``dp_sum``: a CP rank routes only its positions of every sequence, so
                the tokens per expert and megatron's aux losses (each CP rank's the
                share of its positions, taken with the whole sequences' counts:
                ``TopKRouter._apply_aux_loss``) are summed over CP; the router calls are
                not (every CP rank makes the same calls). None: no CP.
        """
        losses = [self.aux_loss_sum, self.z_loss_sum, float(self.calls)]
        packed = torch.cat([self.counts.flatten(), self.counts.new_tensor(losses)])
        if cp_sum is not None:
            packed = torch.cat([cp_sum(packed[:-1].clone()), packed[-1:]])
        if dp_sum is not None:
            packed = dp_sum(packed)
        c = packed[:-3].view_as(self.counts)
        aux, z, calls = packed[-3], packed[-2], packed[-1]
        mean = c.mean(1).clamp_min(1e-12)
        return torch.stack([(c.max(1).values / mean).sum(), (c.min(1).values / mean).sum(),
                            c.new_tensor(float(c.shape[0])), aux, z, calls])


def router_load_metrics(sums: torch.Tensor) -> dict:
    """The ``moe/`` metrics of :meth:`RouterLoad.stage_sums` (DP-summed counts) summed over
    the pipeline stages.

    Returns:
        ``moe/tokens_per_expert_max_over_mean`` and ``..._min_over_mean`` (the mean over
        layers of each layer's busiest / idlest expert's tokens over the mean expert's, the
        tokens of every DP rank together: 1 = balanced; top-k of E experts at most E / k),
        ``moe/aux_loss`` and ``moe/z_loss`` (the load-balancing loss and the z-loss, unscaled
        by their coefficients, averaged over layer calls and DP ranks; each present only
        when the routers computed it: ``model.moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` > 0).
    """
    s = [float(x) for x in sums]
    layers = max(s[2], 1.0)  # the model's MoE layers (each stage counted its own)
    out = {"moe/tokens_per_expert_max_over_mean": s[0] / layers,
           "moe/tokens_per_expert_min_over_mean": s[1] / layers}
    if s[5]:
        for i, key in ((3, "moe/aux_loss"), (4, "moe/z_loss")):
            if s[i]:
                out[key] = s[i] / s[5]
    return out


def refuse_expert_parallel(parallel, job: str) -> None:
    """Refuse ``parallel.expert_model_parallel_size`` > 1 in a job that does not support it
    (``evaluate``, the RM server): their data-parallel ranks may run a different number of
    forward calls (decoding chunks, scoring requests), which under expert parallelism would
    leave a rank waiting in a MoE layer's collective; the PPO, SFT and RM trainers make
    their calls equal and are tested at EP=2 (:mod:`nemo_rlhf.models.engine`,
    :func:`nemo_rlhf.trainers.common.forward_calls`).

    Raises:
        ValueError: naming the key, the job and the value that works.
    """
    ep = parallel.expert_model_parallel_size
    if ep > 1:
        raise ValueError(
            f"parallel.expert_model_parallel_size={ep} in the {job} job: expert parallelism is "
            f"supported by the PPO, SFT and RM trainers only (their data-parallel ranks' forward "
            f"calls are made equal in number); set parallel.expert_model_parallel_size=1 "
            f"here (a checkpoint saved at any EP loads at EP=1)")
