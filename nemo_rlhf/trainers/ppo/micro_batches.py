"""Micro-batches by a token budget, with their padding cut away (``ppo.max_tokens_per_micro_batch``).

A rollout is one ``[B, P+R]`` block: prompts left-padded to the longest prompt ``P``,
responses right-padded to the longest response ``R``. Run as is, every micro-batch pays
for the longest prompt and the longest response of the whole rollout. With a token budget
the rows of a mini-batch are sorted by their span (first prompt token to last response
token) and packed greedily into micro-batches of at most ``max_tokens`` tokens
(``rows x kept columns``, the compute a padded micro-batch really costs) and at most
``max_rows`` rows; each micro-batch then keeps only the columns its own rows need: the
leading columns that are left padding in every row, and the trailing response columns
beyond its longest response, are dropped. Positions come from the attention mask, and a
padded key is masked out, so the log-probs and values of the kept tokens are those of the
padded forward (up to floating-point summation order); the losses divide by global token
counts, so the split does not change them.

With ``pack`` (``ppo.sequence_packing``) the rows are also concatenated: the mini-batch's
sequences (their valid tokens only) are placed first-fit, longest first, into packed rows
of ``row_length`` tokens (at least its longest sequence;
:func:`nemo_rlhf.models.packing.first_fit_decreasing`),
and micro-batches are formed from whole packed rows within the budget
(``packed rows x their longest fill``). The forward runs over the packed rows
(:func:`nemo_rlhf.models.packing.pack_rows`: block-diagonal causal mask, positions per
sequence) and the last stage hands the loss ``[rows, columns]`` outputs as without packing.

Under pipeline parallelism the stages send each activation's shape ahead of it
(megatron's ``variable_seq_lengths``).

:func:`training_minibatches` is the update's schedule over one rollout: ``ppo_epochs``
passes, each a permutation cut into mini-batches of ``global_batch_size / DP`` rows, each
mini-batch cut into micro-batches (by ``micro_batch_size`` rows, or by the token budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from nemo_rlhf.algorithms.ppo.core import last_valid_index
from nemo_rlhf.distributed.split import chunk_slices
from nemo_rlhf.models.context_parallel import pad_to_cp_multiple
from nemo_rlhf.models.packing import first_fit_decreasing, pack_rows


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch: which rows, and which columns of the ``[B, P+R]`` rollout."""

    rows: tuple[int, ...]
    """Row indices into the rollout (this rank's), in the micro-batch's order."""
    start: int
    """First kept column of ``input_ids`` (the leading columns are left padding in every row)."""
    prompt_length: int
    """``P - start``: the kept prompt columns; response token ``j`` is column ``prompt_length + j``."""
    response_length: int
    """Kept response columns (the micro-batch's longest response, >= 1)."""
    bins: tuple[tuple[int, ...], ...] = ()
    """Packed micro-batches only: the packed rows, as positions into ``rows`` (empty: not packed)."""
    spans: tuple[tuple[int, int], ...] = ()
    """Packed micro-batches only: per row, its valid kept columns ``(a, b)``."""
    width: int = 0
    """Packed micro-batches only: tokens of the fullest packed row."""

    @property
    def tokens(self) -> int:
        """The compute this micro-batch costs: ``rows x columns`` padded, ``packed rows x
        width`` packed."""
        if self.bins:
            return len(self.bins) * self.width
        return len(self.rows) * (self.prompt_length + self.response_length)


def plan_micro_batches(prompt_starts: list[int], response_lengths: list[int], prompt_length: int,
                       rows: list[int], max_rows: int, max_tokens: int,
                       pack: bool = False, row_length: int = 0) -> list[MicroBatchPlan]:
    """Group ``rows`` into micro-batches of at most ``max_tokens`` padded tokens and
    ``max_rows`` rows, longest spans first (``pack``: packed rows, see the module).

    Args:
        prompt_starts: per rollout row, its first non-padding column (``< prompt_length``).
        response_lengths: per rollout row, its extent after the prompt: one past its last
            valid response token (the valid tokens of a prefix mask; with a holed multi-turn
            mask the environment tokens before the last policy token count too).
        prompt_length: ``P`` of the rollout.
        rows: the rows to plan (a mini-batch), any order.
        max_rows: rows per micro-batch at most (>= 1).
        max_tokens: padded tokens per micro-batch at most; a row longer than it alone is a
            micro-batch of one row.
        pack: concatenate the rows' valid tokens into packed rows of ``row_length``
            tokens (the budget then counts ``packed rows x their longest fill``;
            ``max_rows`` counts sequences).
        row_length: with ``pack``, tokens per packed row (0, or less than the longest row:
            the longest row's length).

    Returns:
        Plans covering every row of ``rows`` exactly once (host metadata only).

    Raises:
        ValueError: ``max_rows < 1`` or ``max_tokens < 1``.
    """
    if max_rows < 1 or max_tokens < 1:
        raise ValueError(f"plan_micro_batches: max_rows={max_rows} and max_tokens={max_tokens} must be >= 1")
    if pack:
        return _plan_packed(prompt_starts, response_lengths, prompt_length, rows, max_rows, max_tokens,
                            row_length)
    span = {r: prompt_length - prompt_starts[r] + max(1, response_lengths[r]) for r in rows}
    order = sorted(rows, key=lambda r: (-span[r], r))  # similar lengths side by side
    plans, current = [], []

    def close(group):
        start = min(prompt_starts[r] for r in group)
        resp = max(max(1, response_lengths[r]) for r in group)
        plans.append(MicroBatchPlan(tuple(group), start, prompt_length - start, resp))

    def width(group):  # the columns a micro-batch of these rows keeps
        return prompt_length - min(prompt_starts[x] for x in group) + max(max(1, response_lengths[x])
                                                                          for x in group)

    for r in order:
        if current and (len(current) + 1 > max_rows or (len(current) + 1) * width(current + [r]) > max_tokens):
            close(current)
            current = []
        current.append(r)
    if current:
        close(current)
    return plans


def _plan_packed(prompt_starts: list[int], response_lengths: list[int], prompt_length: int,
                 rows: list[int], max_rows: int, max_tokens: int, row_length: int) -> list[MicroBatchPlan]:
    """:func:`plan_micro_batches` with ``pack``: rows first-fit into packed rows, packed
    rows grouped into micro-batches in order."""
    n = [prompt_length - prompt_starts[r] + response_lengths[r] for r in rows]  # valid tokens
    bins = [[rows[i] for i in b] for b in first_fit_decreasing(n, max(max(n), row_length))]
    fill = [sum(prompt_length - prompt_starts[r] + response_lengths[r] for r in b) for b in bins]
    plans, current = [], []

    def close(group):
        members = [r for k in group for r in bins[k]]
        start = min(prompt_starts[r] for r in members)
        resp = max(max(1, response_lengths[r]) for r in members)
        pos, packed = 0, []
        for k in group:
            packed.append(tuple(range(pos, pos + len(bins[k]))))
            pos += len(bins[k])
        spans = tuple((prompt_starts[r] - start, prompt_length - start + response_lengths[r]) for r in members)
        plans.append(MicroBatchPlan(tuple(members), start, prompt_length - start, resp, tuple(packed),
                                    spans, max(fill[k] for k in group)))

    for k in range(len(bins)):
        grown = current + [k]
        if current and (sum(len(bins[j]) for j in grown) > max_rows
                        or len(grown) * max(fill[j] for j in grown) > max_tokens):
            close(current)
            grown = [k]
        current = grown
    if current:
        close(current)
    return plans


def row_extents(attention_mask: torch.Tensor, response_mask: torch.Tensor, prompt_length: int
                ) -> tuple[list[int], list[int]]:
    """Host lists ``(prompt_starts, response_lengths)`` of a rollout (one device-to-host copy).

    Args:
        attention_mask: ``[B, P+R]``; prompts left-padded to ``P``.
        response_mask: ``[B, R]`` bool; a row's length is one past its last True column,
            so a mask with holes (a multi-turn row: environment tokens between policy
            segments, #51) keeps every column up to its last policy token. For a valid
            prefix this is the prefix's length.
    """
    prompt_valid = attention_mask[:, :prompt_length].bool()
    starts = (prompt_length - prompt_valid.sum(1)).cpu()  # host: planning metadata
    lengths = (last_valid_index(response_mask) + 1).cpu()  # host: planning metadata
    return starts.tolist(), lengths.tolist()


_FULL_WIDTH = ("input_ids", "attention_mask", "routes")
"""The tensors of :func:`take` laid out over every ``[B, P+R]`` column (the rest: ``[B, R]``)."""


def take(plan: MicroBatchPlan, tensors: dict, prompt_length: int, device: torch.device, align: int = 1) -> dict:
    """The micro-batch of ``plan``: rows selected, columns trimmed.

    ``input_ids`` / ``attention_mask`` (``[B, P+R]``) and the MoE ``routes`` (``[B, P+R,
    L, k]``, routing replay) keep columns ``start .. P + response_length``; every other
    tensor (``[B, R]`` per response token) keeps its first ``response_length`` columns.
    ``prompt_length`` and ``response_length`` (ints: the kept prompt and response
    columns) are added for the loss, and
    for a packed plan ``packed`` (:class:`~nemo_rlhf.models.packing.PackedBatch`, on
    ``device``), which the forward runs over instead of the padded rows; ``align``: its
    sequences' slots rounded up to a multiple of it (``2 * context_parallel_size``:
    megatron's THD layout, :mod:`nemo_rlhf.models.cp_packing`).
    """
    idx = torch.tensor(plan.rows, dtype=torch.long, device=device)
    end = prompt_length + plan.response_length
    mb = {}
    for k, v in tensors.items():
        v = v.index_select(0, idx)
        mb[k] = v[:, plan.start:end] if k in _FULL_WIDTH else v[:, :plan.response_length]
    mb["prompt_length"], mb["response_length"] = plan.prompt_length, plan.response_length
    if plan.bins:
        mb["packed"] = pack_rows(mb["input_ids"], list(plan.spans), [list(b) for b in plan.bins],
                                 plan.prompt_length, align=align)
    return mb


def scatter_rows(plans: list[MicroBatchPlan], parts: list[torch.Tensor], batch_size: int,
                 response_length: int) -> torch.Tensor:
    """Reassemble per-micro-batch ``[rows, response_length_i]`` results into one
    ``[batch_size, response_length]`` tensor in rollout row order (zeros beyond each part).
    """
    first = parts[0]
    out = torch.zeros(batch_size, response_length, dtype=first.dtype, device=first.device)
    for plan, part in zip(plans, parts):
        idx = torch.tensor(plan.rows, dtype=torch.long, device=first.device)
        out[idx, :part.shape[1]] = part
    return out


def pad_for_context_parallel(mb: dict, cp: int) -> dict:
    """A padded (not packed) micro-batch for context parallelism: its ``input_ids`` and
    ``attention_mask`` ``[rows, S]`` right-padded to a multiple of ``2 * cp`` columns
    (megatron's load-balanced chunks, :func:`nemo_rlhf.models.context_parallel.cp_positions`;
    ids 0, mask 0: the padding attends to nothing real and no real token attends to it).
    The ``[rows, R]`` per-response-token tensors keep their ``R`` columns (the loss reads
    ``R`` from them). ``mb`` itself at ``cp == 1`` and for a packed micro-batch (its
    sequences are aligned to ``2 * cp`` when packed, :func:`take`).
    """
    if cp == 1 or "packed" in mb:
        return mb
    return {k: pad_to_cp_multiple(v, cp) if k in ("input_ids", "attention_mask") else v
            for k, v in mb.items()}


__all__ = ["MicroBatchPlan", "pad_for_context_parallel", "plan_micro_batches", "row_extents",
           "scatter_rows", "take"]


def training_minibatches(c, tensors: dict, rows_per_minibatch: int, prompt_length: int,
                         attention_mask: torch.Tensor, response_mask: torch.Tensor,
                         device: torch.device, dp_sum: Callable[[torch.Tensor], torch.Tensor],
                         seed: int, cp: int = 1) -> Iterator[tuple[list[dict], torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """The update's mini-batches of one rollout on this DP rank, in training order.

    Args:
        c: the ``ppo`` section (``ppo_epochs``, ``shuffle``, ``micro_batch_size``,
            ``max_tokens_per_micro_batch``, ``sequence_packing``, ``packed_row_length``).
        tensors: ``name -> [B, ...]`` on ``device``, what the loss reads; its
            ``response_mask [B, R]`` holds the tokens that train (rows left out: all 0).
        rows_per_minibatch: ``global_batch_size / DP``.
        prompt_length: ``P``, the prompt columns of the ``[B, P+R]`` block.
        attention_mask / response_mask: ``[B, P+R]`` / ``[B, R]``, the rollout's (the
            token budget's row extents: host metadata, read once).
        device: ``dims.device``.
        dp_sum: the sum over the DP group of a ``[3]`` float tensor on ``device``.
        seed: the permutations' seed (a host ``torch.Generator``: the same order on every
            device type).
        cp: ``parallel.context_parallel_size``: at ``cp > 1`` each micro-batch's
            ``input_ids`` / ``attention_mask`` columns are right-padded to a multiple of
            ``2 * cp`` (:func:`pad_for_context_parallel`; a token-budget micro-batch's
            after its columns are cut); a packed one's sequences are aligned to ``2 * cp``
            instead (:func:`take`).

    Yields:
        ``(micro-batches, n_tokens, n_seqs, routed_tokens, computed)`` per mini-batch: the
        micro-batches' tensors (packed ones carry ``"packed"``); the mini-batch's training
        tokens and its rows with a training token, summed over DP (float tensors on
        ``device``: the losses' global denominators); its micro-batches' non-padding tokens
        summed over DP (the same: the MoE router losses' denominator,
        :func:`nemo_rlhf.models.engine.forward_backward`); the ``rows x columns`` its
        micro-batches compute (a host int).
    """
    loss_mask = tensors["response_mask"]
    B = loss_mask.shape[0]
    extents = (row_extents(attention_mask, response_mask, prompt_length)
               if c.max_tokens_per_micro_batch else None)
    g = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(c.ppo_epochs):
        order_host = (torch.randperm(B, generator=g, device="cpu") if c.shuffle
                      else torch.arange(B, device="cpu"))
        order = order_host.to(device)
        for mb_slice in chunk_slices(B, rows_per_minibatch):
            idx = order[mb_slice]
            if extents is None:
                micro = [pad_for_context_parallel({k: v[idx[s]] for k, v in tensors.items()}, cp)
                         for s in chunk_slices(len(idx), c.micro_batch_size)]
            else:  # the token budget: rows packed, padding cut
                rows = order_host[mb_slice].tolist()
                micro = [pad_for_context_parallel(take(p, tensors, prompt_length, device, align=2 * cp), cp) for p in
                         plan_micro_batches(*extents, prompt_length, rows, len(rows),
                                            c.max_tokens_per_micro_batch, pack=c.sequence_packing,
                                            row_length=c.packed_row_length)]
            routed = sum(mb["attention_mask"].sum() for mb in micro)  # what the routers see
            counts = torch.stack([loss_mask[idx].sum().float(), loss_mask[idx].any(-1).sum().float(),
                                  torch.as_tensor(routed, device=device).float()])
            n_tokens, n_seqs, routed_tokens = dp_sum(counts)
            computed = sum(mb["packed"].tokens() if "packed" in mb else mb["input_ids"].numel()
                           for mb in micro)
            yield micro, n_tokens, n_seqs, routed_tokens, computed
