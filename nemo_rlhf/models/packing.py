"""Sequence packing: several sequences share one row, attention stays within each.

A padded micro-batch ``[rows, S]`` (prompts left-padded, responses right-padded) spends
its transformer compute on padding. :func:`pack_rows` re-lays it out as ``[bins, W]``
packed rows: the valid tokens of several sequences placed end to end in one row, the
row's tail the only padding. Three things keep every sequence's forward equal to its
padded forward (up to floating-point summation order):

* the attention mask (:meth:`PackedBatch.attention_mask`) is causal *and* block-diagonal:
  a token attends to the earlier tokens of its own sequence only (segment ids);
* the position ids restart at 0 for every sequence (learned absolute embeddings); rotary
  embeddings depend on relative positions only, and those are unchanged within a sequence;
* the last stage puts the final hidden states back in the padded layout
  (:meth:`PackedBatch.unpack`, a differentiable gather) before the output layer and the
  value head, so everything downstream (log-probs, values, losses) sees ``[rows, S]``
  tensors as without packing. The fused log-prob path reads only the valid response
  positions (:attr:`PackedBatch.response_index`), so no output-layer compute goes to
  padding either.

This is the remove-padding path of megatron's packed-sequence (THD) format expressed with
the local attention's dense mask, which runs on CPU/gloo and CUDA alike; its attention
cost per packed row is ``W^2``, the same order as a padded row's, and bins are no longer
than the longest sequence (see the planner,
:func:`nemo_rlhf.trainers.ppo.micro_batches.plan_micro_batches`). Transformer-engine's
varlen THD kernels (``PackedSeqParams``) are not wired in.

All index building is host-side metadata (small int tensors built on the host from host
lists, moved to the micro-batch's device once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """A padded micro-batch ``[rows, S]`` laid out as packed rows ``[bins, W]``.

    Built by :func:`pack_rows`; every tensor lives on the micro-batch's device.
    """

    input_ids: torch.Tensor
    """``[bins, W]`` int64: the sequences' tokens end to end, 0 in each row's tail."""
    position_ids: torch.Tensor
    """``[bins, W]`` int64: each token's position within its own sequence (0 in the tail)."""
    segment_ids: torch.Tensor
    """``[bins, W]`` int64: 1, 2, ... for the first, second, ... sequence of the row; 0 = padding."""
    unpack_index: torch.Tensor
    """``[rows * S]`` int64: for each padded position, its flat packed index (into
    ``bins * W``), or ``bins * W`` for a padding position (read as zeros)."""
    response_index: torch.Tensor
    """``[n]`` int64: flat indices into ``[rows * R]`` (``R = S - prompt_length``) of the
    valid response tokens, row-major: the positions whose log-probs are needed."""
    padded_input_ids: torch.Tensor
    """``[rows, S]`` int64: the padded micro-batch's ``input_ids`` (log-prob targets)."""
    prompt_length: int
    """``P`` of the padded micro-batch: response token ``j`` is column ``P + j``."""
    source_index: torch.Tensor = None
    """``[bins * W]`` int64: for each packed position, its flat padded position
    (``row * S + column``), or ``rows * S`` for padding (the inverse of ``unpack_index``)."""
    slots: tuple = ()
    """Per packed row, the lengths of its consecutive slots (host ints): each sequence's
    tokens rounded up to a multiple of ``align`` (:func:`pack_rows`), then the row's tail
    (if any). Context parallelism chunks every slot (megatron's THD layout)."""

    @property
    def rows(self) -> int:
        """Rows of the padded micro-batch (sequences)."""
        return self.padded_input_ids.shape[0]

    @property
    def seq(self) -> int:
        """``S``: columns of the padded micro-batch."""
        return self.padded_input_ids.shape[1]

    def tokens(self) -> int:
        """Packed size ``bins x W``: the compute this micro-batch costs (host int)."""
        return self.input_ids.numel()

    def attention_mask(self) -> torch.Tensor:
        """megatron attention mask ``[bins, 1, W, W]`` bool, True = masked out.

        Allowed: causal within a segment. Padding queries attend to themselves only (their
        outputs are never read), which keeps the softmax finite.
        """
        seg = self.segment_ids
        W = seg.shape[1]
        causal = torch.ones(W, W, dtype=torch.bool, device=seg.device).tril()
        same = (seg.unsqueeze(2) == seg.unsqueeze(1)) & (seg > 0).unsqueeze(1)
        eye = torch.eye(W, dtype=torch.bool, device=seg.device)
        return ~((causal & same) | eye).unsqueeze(1)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Per-token outputs of the packed forward, in the padded layout.

        Args:
            packed: ``[bins * W, ...]`` flattened batch-first (bin-major) outputs.

        Returns:
            ``[rows, S, ...]``; padding positions are zeros. Differentiable (a gather; its
            backward scatters into the packed positions).
        """
        zero = packed.new_zeros((1,) + tuple(packed.shape[1:]))
        out = torch.cat([packed, zero]).index_select(0, self.unpack_index)
        return out.view((self.rows, self.seq) + tuple(packed.shape[1:]))

    def unpack_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """megatron hidden states ``[W, bins, H]`` -> the padded layout ``[S, rows, H]``."""
        W, bins, H = hidden_states.shape
        flat = hidden_states.transpose(0, 1).reshape(bins * W, H)
        return self.unpack(flat).transpose(0, 1)


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of at most ``capacity`` tokens, first fit over the items longest first.

    Args:
        lengths: tokens per item (host ints).
        capacity: tokens per bin; an item longer than it gets a bin of its own.

    Returns:
        Bins as lists of item indices (each item in exactly one), in creation order (so the
        first bins hold the longest items).

    Raises:
        ValueError: ``capacity < 1``.
    """
    if capacity < 1:
        raise ValueError(f"first_fit_decreasing: capacity={capacity} must be >= 1")
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def pack_rows(input_ids: torch.Tensor, spans: list[tuple[int, int]], bins: list[list[int]],
              prompt_length: int, align: int = 1) -> PackedBatch:
    """Pack the valid tokens of a padded micro-batch into rows.

    Args:
        input_ids: ``[rows, S]`` int64, the padded micro-batch (its device is the packed
            batch's device).
        spans: per row, ``(a, b)``: its valid tokens are columns ``a .. b-1`` (host ints;
            left-padded prompt then right-padded response: ``a < prompt_length <= b``).
        bins: packed rows as lists of row indices (every row in exactly one), in order.
        prompt_length: ``P`` of the micro-batch; row ``i``'s valid response tokens are
            columns ``P .. b_i - 1``.
        align: each sequence's slot is its tokens rounded up to a multiple of ``align``
            (the rest of the slot is padding, segment 0), and so is every row's length:
            ``2 * context_parallel_size`` for megatron's THD layout under context
            parallelism (each sequence cut into ``2 CP`` chunks); 1: end to end.

    Returns:
        The :class:`PackedBatch`.

    Raises:
        ValueError: a span outside ``[0, S]`` or not around the prompt end, or bins that do
            not cover every row exactly once.
    """
    rows, S = input_ids.shape
    if align < 1:
        raise ValueError(f"pack_rows: align={align} must be >= 1")
    if len(spans) != rows or sorted(i for b in bins for i in b) != list(range(rows)):
        raise ValueError(f"pack_rows: {len(spans)} spans and bins {bins} must cover the {rows} rows once")
    for i, (a, b) in enumerate(spans):
        if not 0 <= a < prompt_length <= b <= S:
            raise ValueError(f"pack_rows: row {i} span ({a}, {b}) must satisfy 0 <= a < P={prompt_length} "
                             f"<= b <= S={S}")
    host = torch.device("cpu")  # host: index metadata, moved to the device once below
    n = torch.tensor([b - a for a, b in spans], dtype=torch.long, device=host)
    a = torch.tensor([s[0] for s in spans], dtype=torch.long, device=host)
    bin_of = torch.empty(rows, dtype=torch.long, device=host)
    offset = torch.empty(rows, dtype=torch.long, device=host)
    segment = torch.empty(rows, dtype=torch.long, device=host)
    fills, slots = [], []
    for k, members in enumerate(bins):
        used, lengths = 0, []
        for j, i in enumerate(members):
            bin_of[i], offset[i], segment[i] = k, used, j + 1
            lengths.append(-(-int(n[i]) // align) * align)
            used += lengths[-1]
        fills.append(used)
        slots.append(lengths)
    W, nb = max(fills), len(bins)
    slots = tuple(tuple(lengths + ([W - f] if W > f else [])) for lengths, f in zip(slots, fills))
    row = torch.repeat_interleave(torch.arange(rows, device=host), n)  # each valid token's row
    within = torch.arange(int(n.sum()), device=host) - torch.repeat_interleave(n.cumsum(0) - n, n)
    col = a[row] + within
    packed_pos = bin_of[row] * W + offset[row] + within
    padded_pos = row * S + col
    unpack_index = torch.full((rows * S,), nb * W, dtype=torch.long, device=host)
    unpack_index[padded_pos] = packed_pos
    source = torch.full((nb * W,), rows * S, dtype=torch.long, device=host)  # rows*S: the pad id
    source[packed_pos] = padded_pos
    positions = torch.zeros(nb * W, dtype=torch.long, device=host)
    positions[packed_pos] = within
    segments = torch.zeros(nb * W, dtype=torch.long, device=host)
    segments[packed_pos] = segment[row]
    R = S - prompt_length
    resp = [i * R + j for i, (_, b) in enumerate(spans) for j in range(b - prompt_length)]
    dev = input_ids.device
    flat_ids = torch.cat([input_ids.reshape(-1), input_ids.new_zeros(1)])
    return PackedBatch(
        input_ids=flat_ids.index_select(0, source.to(dev)).view(nb, W),
        position_ids=positions.to(dev).view(nb, W),
        segment_ids=segments.to(dev).view(nb, W),
        unpack_index=unpack_index.to(dev),
        response_index=torch.tensor(resp, dtype=torch.long, device=dev),
        padded_input_ids=input_ids,
        prompt_length=prompt_length,
        source_index=source.to(dev),
        slots=slots,
    )


__all__ = ["PackedBatch", "first_fit_decreasing", "pack_rows"]
