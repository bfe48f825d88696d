"""The token dispatcher of the MoE layers under expert parallelism (see :mod:`nemo_rlhf.models.moe`).

A module of its own because it subclasses megatron's dispatcher at import time, while
:mod:`nemo_rlhf.models.moe` imports megatron only where it is called (the checkpoint tools
import it without building a model).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher


class PaddedAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's ``allgather`` token dispatcher for expert-parallel ranks holding different
    numbers of tokens (installed by :func:`use_padded_dispatcher`).

    At EP > 1 :meth:`token_dispatch` first all-gathers every rank's token count (one
    ``[1]`` int64 tensor on the tokens' device, over megatron's TP x EP group); a rank with
    fewer than the most pads its ``hidden [tokens, h]``, ``probs [tokens, experts]`` and
    routing map ``[tokens, experts]`` with zero rows routed to no expert (no expert computes
    them, their outputs are zero), and :meth:`token_combine` cuts the reduce-scattered
    ``[most, h]`` back to its own ``[tokens, h]``. When every count is equal nothing is padded
    and the arithmetic is megatron's. At EP = 1 it is megatron's class unchanged.
    """

    _local_tokens: Optional[int] = None

    def token_dispatch(self, hidden_states, probs):
        """``hidden_states [tokens, h]`` and ``probs [tokens, experts]`` of this rank (and
        the routing map set by ``dispatch_preprocess``) padded to the group's most tokens,
        then megatron's all-gather: ``[TP x EP x most, h]`` and ``[TP x EP x most, experts]``."""
        self._local_tokens = None
        if self.ep_size > 1:
            n = hidden_states.shape[0]
            group = self.tp_ep_group
            counts = torch.empty(dist.get_world_size(group), dtype=torch.long, device=hidden_states.device)
            dist.all_gather_into_tensor(counts, torch.full((1,), n, dtype=torch.long,
                                                           device=hidden_states.device), group=group)
            most = int(counts.max())
            if most > n:
                pad = most - n
                hidden_states = torch.cat([hidden_states, hidden_states.new_zeros(pad, hidden_states.shape[1])])
                probs = torch.cat([probs, probs.new_zeros(pad, probs.shape[1])])
                self.routing_map = torch.cat(
                    [self.routing_map, self.routing_map.new_zeros(pad, self.routing_map.shape[1])])
                self._local_tokens = n
        return super().token_dispatch(hidden_states, probs)

    def token_combine(self, hidden_states):
        """megatron's reduce-scatter of the experts' outputs ``[TP x EP x most, h]`` to this
        rank's ``[most, h]``, the padding cut off: ``[tokens, h]``."""
        out = super().token_combine(hidden_states)
        return out if self._local_tokens is None else out[:self._local_tokens]


def use_padded_dispatcher(model: torch.nn.Module) -> int:
    """Make every megatron ``allgather`` dispatcher of ``model`` a
    :class:`PaddedAllGatherTokenDispatcher` (its subclass with no state of its own: the
    instance's class is swapped). Returns how many were swapped (0 for a dense model)."""
    swapped = 0
    for m in model.modules():
        d = getattr(m, "token_dispatcher", None)
        if type(d) is MoEAllGatherTokenDispatcher:
            d.__class__ = PaddedAllGatherTokenDispatcher
            swapped += 1
    return swapped
