"""The training jobs' collective helpers, in one place.

Two kinds, kept apart by the device rule (``dims.device`` is the one source of the device;
host metadata never goes through an NCCL collective):

* tensors that meet model tensors (token counts, loss statistics, whitening sums) are
  reduced on the device they are on (``dims.device``): :meth:`JobCollectives.dp_sum`,
  :meth:`~JobCollectives.dp_sum_named`, :meth:`~JobCollectives.dp_reduce_stats`,
  :meth:`~JobCollectives.from_last_stage`;
* host values and Python objects (reward scores fetched over HTTP, messages, metrics
  dicts) go through the object collectives or host tensors (the gloo part of the backend
  map): :meth:`~JobCollectives.mp_broadcast`, :meth:`~JobCollectives.to_reporter`,
  :meth:`~JobCollectives.raise_together`, :func:`bcast_text`, :func:`reduce_from_last_stage`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from nemo_rlhf.algorithms.ppo import stat_reduce_op


class RankFailure(RuntimeError):
    """A step failed on another rank; the message is that rank's error."""


class JobCollectives:
    """One job's collectives over its ``ParallelDims`` (``dims``).

    Args:
        dims: :class:`~nemo_rlhf.distributed.ParallelDims` (``dp_group``, ``mp_group``,
            ``pp_group``, ``is_last_stage``, ``device``).

    The *reporter* is the first rank that is DP rank 0, TP rank 0 and on the last pipeline
    stage: it holds the step's metrics (computed on the last stage, reduced over DP).
    """

    def __init__(self, dims) -> None:
        self.dims = dims
        flags = [None] * dims.world_size
        dist.all_gather_object(flags, dims.dp_rank == 0 and dims.tp_rank == 0 and dims.is_last_stage)
        self.reporter = flags.index(True)
        self.is_reporter = dims.rank == self.reporter
        self.is_mp_src = dims.tp_rank == 0 and dims.pp_rank == 0
        """Model-parallel rank 0 of a DP group: where host-side work (scoring) runs once."""

    # --- device tensors ------------------------------------------------------------------
    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the DP group, in place (its own device)."""
        if self.dims.dp > 1:
            dist.all_reduce(t, group=self.dims.dp_group)
        return t

    def dp_max(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` element-wise maximum over the DP group, in place (its own device)."""
        if self.dims.dp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dims.dp_group)
        return t

    def cp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the context-parallel group, in place (its own device):
        quantities of which each CP rank holds its positions' share (the MoE router
        metrics)."""
        if self.dims.cp > 1:
            dist.all_reduce(t, group=self.dims.cp_group)
        return t

    def pp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the pipeline stages, in place (its own device): per-stage sums
        of every layer (the MoE router metrics)."""
        if self.dims.pp > 1:
            dist.all_reduce(t, group=self.dims.pp_group)
        return t

    def dp_sum_named(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Scalar tensors summed over DP in one all-reduce (stacked in the dict's order)."""
        return dict(zip(sums, self.dp_sum(torch.stack(list(sums.values())))))

    def dp_reduce_stats(self, stats: dict) -> dict:
        """Token statistics (``merge_token_stats``' partial sums / maxima / minima) reduced
        over DP, each by its own op (:func:`~nemo_rlhf.algorithms.ppo.stat_reduce_op`)."""
        return _reduce_stats(stats, self.dims.dp, self.dims.dp_group)

    def cp_reduce_stats(self, stats: dict) -> dict:
        """Token statistics of one CP rank's positions reduced over the context-parallel
        group, each by its own op (as :meth:`dp_reduce_stats`): the training losses' under
        ``parallel.context_parallel_size`` > 1. Only for statistics computed on a CP shard:
        the ``[B, R]`` tensors of the forward-only passes are whole on every CP rank."""
        return _reduce_stats(stats, self.dims.cp, self.dims.cp_group)

    def whiten_reduce(self, s, sq, n):
        """The whitening's ``(sum, sum of squares, count)`` over DP (one all-reduce)."""
        t = self.dp_sum(torch.stack([s, sq, n]).float())
        return t[0], t[1], t[2]

    def from_last_stage(self, value: Optional[float]) -> float:
        """A float the last pipeline stage computed (the same on its DP and TP ranks), on
        every rank: a broadcast over the pipeline group on ``dims.device`` (no
        communication without pipeline parallelism)."""
        if self.dims.pp == 1:
            return float(value)
        t = torch.tensor([0.0 if value is None else float(value)], dtype=torch.float64,
                         device=self.dims.device)
        dist.broadcast(t, src=dist.get_global_rank(self.dims.pp_group, self.dims.pp - 1),
                       group=self.dims.pp_group)
        return float(t[0])

    # --- host objects --------------------------------------------------------------------
    def mp_broadcast(self, obj):
        """A picklable object from model-parallel rank 0 to its TP x PP group."""
        if self.dims.tp * self.dims.pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.dims.mp_group, 0),
                                   group=self.dims.mp_group)
        return box[0]

    def to_reporter(self, obj):
        """An object computed on the reporter, moved to global rank 0 (which logs)."""
        if self.reporter == 0:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.reporter)
        return box[0]

    def raise_together(self, failure: Optional[BaseException], what: str,
                       error: type = RankFailure) -> None:
        """Every rank learns whether one failed (``failure`` not None there); all raise.

        One host flag all-reduce per call; the message is gathered only on failure.

        Raises:
            ``failure`` on the rank where it happened, ``error`` (a :class:`RankFailure`
            by default) naming that
            rank and its error (``"<what> failed on rank r (stopping every rank): ..."``)
            on the others: no rank is left waiting in a collective.
        """
        if self.dims.world_size == 1:
            if failure is not None:
                raise failure
            return
        flag = torch.tensor([0.0 if failure is None else 1.0], device="cpu")  # host: gloo
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0.0:
            return
        info = None if failure is None else f"{type(failure).__name__}: {failure}"
        infos = [None] * self.dims.world_size
        dist.all_gather_object(infos, info)
        if failure is not None:
            raise failure
        src = next(i for i, m in enumerate(infos) if m is not None)
        raise error(f"{what} failed on rank {src} (stopping every rank): {infos[src]}")


def _reduce_stats(stats: dict, size: int, group) -> dict:
    """``stats`` (scalar tensors named as :func:`~nemo_rlhf.algorithms.ppo.stat_reduce_op`
    reads them) all-reduced over ``group`` of ``size`` ranks, each by its own op, in sorted
    key order (the same on every rank); ``stats`` itself when ``size == 1``."""
    if size == 1:
        return stats
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    for k in sorted(stats):
        t = stats[k].clone()
        dist.all_reduce(t, op=ops[stat_reduce_op(k)], group=group)
        stats[k] = t
    return stats


def bcast_text(message: Optional[str]) -> Optional[str]:
    """Rank 0's message (or None) on every rank (a host object)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def reduce_from_last_stage(values: dict[str, float], dims, keys: Sequence[str]) -> dict[str, float]:
    """Sum ``values`` over the DP ranks' last pipeline stages; return them on every rank.

    Args:
        values: this rank's partial sums (read on the last stage only; ignored elsewhere).
        keys: the metric names, the same list on every rank.

    Returns:
        ``{key: global sum}`` on every rank.
    """
    # host metadata: reduced by the gloo part of the backend map
    t = torch.tensor([float(values.get(k, 0.0)) if dims.is_last_stage else 0.0 for k in keys],
                     dtype=torch.float64, device="cpu")
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dims.dp > 1:
            dist.all_reduce(t, group=dims.dp_group)
        if dims.pp > 1:
            dist.all_reduce(t, group=dims.pp_group)
    return dict(zip(keys, t.tolist()))


__all__ = ["JobCollectives", "RankFailure", "bcast_text", "reduce_from_last_stage"]
