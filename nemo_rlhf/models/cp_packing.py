"""Packed micro-batches under context parallelism (``ppo.sequence_packing`` with CP > 1).

Layout: megatron's packed-sequence (THD) convention. Every sequence of a packed row takes
a slot of its tokens rounded up to a multiple of ``2 CP``
(:func:`~nemo_rlhf.models.packing.pack_rows` with ``align = 2 CP``; the row's tail is one
more slot), and every slot is cut into ``2 CP`` chunks of which CP rank ``r`` holds chunks
``r`` and ``2 CP - 1 - r`` (:func:`~nemo_rlhf.models.context_parallel.cp_positions` per
slot): each rank holds ``W / CP`` positions of every packed row and does the same causal
attention work for every sequence.

Attention: the CP attention (:class:`~nemo_rlhf.models.context_parallel.AllGatherCPAttention`)
all-gathers the keys and values in rank order; here the keys' positions differ row by row,
so the forward gives it the whole mask in that order: causal *within* a sequence only
(the packed batch's block-diagonal mask, :meth:`~nemo_rlhf.models.packing.PackedBatch.attention_mask`,
its rows this rank's queries and its columns every rank's keys), marked with
:data:`KEYS_IN_RANK_ORDER` so that the attention takes it as it is (no reordering, no
causal mask of its own). No query attends across a sequence boundary.

Positions: the position ids restart at 0 in every sequence (learned absolute positions,
sharded like the ids), and RoPE rotates each of the rank's tokens by its position within
its sequence (:func:`rope_at_positions`, replacing megatron's slice of the table by the
unpacked layout); the relative positions within a sequence, all that RoPE's scores see, are
the unpacked ones.

Outputs: the last stage is not unpacked: it returns ``[bins, W/CP]`` per-position outputs
of this rank, and :class:`CPPackedLayout` maps each to the response token it predicts
(``row * R + j``; the target is the next token of its own sequence), which is how the
losses shard their ``[rows, R]`` inputs (:func:`shard_packed`) and how the forward-only
passes are gathered back to ``[rows, R]`` (:func:`gather_packed_response`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from nemo_rlhf.models.context_parallel import _GatherSequence, cp_positions

KEYS_IN_RANK_ORDER = "_cp_keys_in_rank_order"
"""The attribute that marks an attention mask whose columns are the keys in the
all-gather's rank order and that is already complete (causal within each sequence)."""


@dataclass(frozen=True)
class CPPackedLayout:
    """This CP rank's share of a :class:`~nemo_rlhf.models.packing.PackedBatch` (see the
    module docstring). ``s = W / cp``; every tensor on the packed batch's device."""

    positions: torch.Tensor
    """``[bins, s]`` int64: the packed-row positions this rank holds, in its order."""
    key_positions: torch.Tensor
    """``[bins, W]`` int64: the packed-row position of each all-gathered key (rank order)."""
    targets: torch.Tensor
    """``[bins, s]`` int64: each position's next token within its sequence (0: none)."""
    response_index: torch.Tensor
    """``[bins, s]`` int64: the flat ``[rows * R]`` index of the response token each
    position predicts (0 where not :attr:`predicts`)."""
    predicts: torch.Tensor
    """``[bins, s]`` bool: the position predicts a response token of its sequence."""
    all_response_index: torch.Tensor
    """``[bins, W]``: :attr:`response_index` of every rank, rank order (the gather's)."""
    all_predicts: torch.Tensor
    """``[bins, W]``: :attr:`predicts` of every rank, rank order."""


def _rank_positions(slots: tuple, cp: int, rank: int) -> torch.Tensor:
    """``[bins, W/cp]`` host int64: each packed row's positions of CP rank ``rank`` (every
    slot cut into ``2 cp`` chunks)."""
    host = torch.device("cpu")  # host: index metadata
    rows = []
    for lengths in slots:
        parts, offset = [], 0
        for n in lengths:
            parts.append(offset + cp_positions(n, cp, rank, host))
            offset += n
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def cp_packed_layout(packed, cp: int, rank: int) -> CPPackedLayout:
    """The :class:`CPPackedLayout` of CP rank ``rank`` (computed once per packed batch and
    rank, kept on it).

    Args:
        packed: a :class:`~nemo_rlhf.models.packing.PackedBatch` built with ``align`` a
            multiple of ``2 * cp``.
        cp / rank: the CP size and this rank.

    Raises:
        ValueError: a slot not divisible by ``2 * cp`` (the batch was packed without
            ``align = 2 * cp``; the message names ``ppo.sequence_packing``).
    """
    cache = packed.__dict__.setdefault("_cp_layouts", {})
    if (cp, rank) in cache:
        return cache[(cp, rank)]
    if any(n % (2 * cp) for lengths in packed.slots for n in lengths):
        raise ValueError(f"ppo.sequence_packing under parallel.context_parallel_size={cp}: the packed rows' "
                         f"slots {packed.slots} must be multiples of 2 * CP = {2 * cp} "
                         f"(pack_rows(..., align={2 * cp}))")
    dev = packed.input_ids.device
    ids, seg = packed.input_ids, packed.segment_ids
    bins, W = ids.shape
    rows, S, P = packed.rows, packed.seq, packed.prompt_length
    R = S - P
    nxt_same = torch.zeros_like(seg, dtype=torch.bool)
    nxt_same[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    targets = torch.where(nxt_same, torch.cat([ids[:, 1:], ids.new_zeros(bins, 1)], 1), 0)
    src = packed.source_index.view(bins, W)
    col = src % S
    j = col + 1 - P  # the response token the next position holds
    predicts = nxt_same & (src < rows * S) & (j >= 0) & (j < R)
    flat = torch.where(predicts, (src // S) * R + j, 0)
    every = [_rank_positions(packed.slots, cp, r).to(dev) for r in range(cp)]
    pos, keys = every[rank], torch.cat(every, dim=1)
    layout = CPPackedLayout(
        positions=pos, key_positions=keys, targets=targets.gather(1, pos),
        response_index=flat.gather(1, pos), predicts=predicts.gather(1, pos),
        all_response_index=flat.gather(1, keys), all_predicts=predicts.gather(1, keys))
    cache[(cp, rank)] = layout
    return layout


def cp_packed_inputs(packed, layout: CPPackedLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's forward inputs: ``(input_ids [bins, s], position_ids [bins, s],
    attention_mask [bins, 1, s, W] bool)``, the mask's columns the keys in rank order, True
    = masked, causal within a sequence, marked :data:`KEYS_IN_RANK_ORDER`."""
    pos, keys = layout.positions, layout.key_positions
    full = packed.attention_mask()  # [bins, 1, W, W]
    bins, s, W = pos.shape[0], pos.shape[1], keys.shape[1]
    mask = full.gather(2, pos.view(bins, 1, s, 1).expand(bins, 1, s, W))
    mask = mask.gather(3, keys.view(bins, 1, 1, W).expand(bins, 1, s, W))
    setattr(mask, KEYS_IN_RANK_ORDER, True)
    return packed.input_ids.gather(1, pos), packed.position_ids.gather(1, pos), mask


@contextmanager
def rope_at_positions(gpt, position_ids: torch.Tensor):
    """Within the block, ``gpt``'s rotary embedding returns the frequencies of
    ``position_ids`` (``[bins, s]``: each token's position in its sequence) as
    ``[s, bins, 1, rot_dim]``, which megatron's unfused RoPE broadcasts over the heads, in
    place of its CP slice of the ``[W, 1, 1, rot_dim]`` table. Nothing without RoPE."""
    rot = getattr(gpt, "rotary_pos_emb", None)
    if rot is None or getattr(gpt, "position_embedding_type", "rope") != "rope":
        yield
        return
    emb = rot.get_emb(int(position_ids.max()) + 1)  # [L, 1, 1, d]
    table = emb.view(emb.shape[0], emb.shape[-1])[position_ids]  # [bins, s, d]
    freqs = table.transpose(0, 1).unsqueeze(2).contiguous()

    def forward(*args, **kwargs):
        return freqs

    rot.forward = forward  # the instance's, shadowing the class's (and its cache)
    try:
        yield
    finally:
        del rot.forward


def shard_packed(t: torch.Tensor, layout: CPPackedLayout) -> torch.Tensor:
    """A ``[rows, R]`` per-response-token tensor on this rank's packed positions:
    ``[bins, s]`` of ``t``'s dtype, ``t``'s entry where the position predicts a response
    token, 0 (False) elsewhere."""
    picked = t.reshape(-1)[layout.response_index.reshape(-1)].view(layout.response_index.shape)
    return torch.where(layout.predicts, picked, torch.zeros((), dtype=t.dtype, device=t.device))


def gather_packed_response(local: torch.Tensor, layout: CPPackedLayout, rows: int, R: int,
                           group) -> torch.Tensor:
    """Per-position outputs ``[bins, s]`` of every CP rank back to ``[rows, R]`` (an
    all-gather over ``group``; 0 where no position predicts the token)."""
    gathered = _GatherSequence.apply(local.transpose(0, 1).contiguous(), group).transpose(0, 1)  # [bins, W]
    out = local.new_zeros(rows * R)
    keep = layout.all_predicts
    out[layout.all_response_index[keep]] = gathered[keep]
    return out.view(rows, R)


def packed_sequence_tokens(mask: torch.Tensor, layout: CPPackedLayout) -> torch.Tensor:
    """``[bins, s]`` float32: each position's whole row's training-token count (``n_b`` of
    ``seq-mean-token-mean``) from the ``[rows, R]`` loss mask."""
    counts = mask.bool().sum(1, keepdim=True).to(torch.float32).expand(mask.shape)
    return shard_packed(counts.contiguous(), layout)


__all__ = ["CPPackedLayout", "KEYS_IN_RANK_ORDER", "cp_packed_inputs", "cp_packed_layout",
           "gather_packed_response", "packed_sequence_tokens", "rope_at_positions", "shard_packed"]
