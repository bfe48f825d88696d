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

Simplified: rows are not concatenated into one sequence (megatron's THD packed format,
which needs transformer-engine's attention); what is saved is the padding between a
micro-batch's rows and the rollout's longest row. Needs a fixed micro-batch shape under
pipeline parallelism, so the trainer allows it at ``pipeline_model_parallel_size=1`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def tokens(self) -> int:
        """Padded size ``rows x columns``: the compute this micro-batch costs."""
        return len(self.rows) * (self.prompt_length + self.response_length)


def plan_micro_batches(prompt_starts: list[int], response_lengths: list[int], prompt_length: int,
                       rows: list[int], max_rows: int, max_tokens: int) -> list[MicroBatchPlan]:
    """Pack ``rows`` into micro-batches of at most ``max_tokens`` padded tokens and
    ``max_rows`` rows, longest spans first.

    Args:
        prompt_starts: per rollout row, its first non-padding column (``< prompt_length``).
        response_lengths: per rollout row, its valid response tokens.
        prompt_length: ``P`` of the rollout.
        rows: the rows to plan (a mini-batch), any order.
        max_rows: rows per micro-batch at most (>= 1).
        max_tokens: padded tokens per micro-batch at most; a row longer than it alone is a
            micro-batch of one row.

    Returns:
        Plans covering every row of ``rows`` exactly once (host metadata only).

    Raises:
        ValueError: ``max_rows < 1`` or ``max_tokens < 1``.
    """
    if max_rows < 1 or max_tokens < 1:
        raise ValueError(f"plan_micro_batches: max_rows={max_rows} and max_tokens={max_tokens} must be >= 1")
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


def row_extents(attention_mask: torch.Tensor, response_mask: torch.Tensor, prompt_length: int
                ) -> tuple[list[int], list[int]]:
    """Host lists ``(prompt_starts, response_lengths)`` of a rollout (one device-to-host copy).

    Args:
        attention_mask: ``[B, P+R]``; prompts left-padded to ``P``.
        response_mask: ``[B, R]`` bool, a valid prefix per row.
    """
    prompt_valid = attention_mask[:, :prompt_length].bool()
    starts = (prompt_length - prompt_valid.sum(1)).cpu()  # host: planning metadata
    lengths = response_mask.sum(1).cpu()  # host: planning metadata
    return starts.tolist(), lengths.tolist()


def take(plan: MicroBatchPlan, tensors: dict, prompt_length: int, device: torch.device) -> dict:
    """The micro-batch of ``plan``: rows selected, columns trimmed.

    ``input_ids`` / ``attention_mask`` (``[B, P+R]``) keep columns ``start ..
    P + response_length``; every other tensor (``[B, R]`` per response token) keeps its
    first ``response_length`` columns. ``prompt_length`` (int) is added for the loss.
    """
    idx = torch.tensor(plan.rows, dtype=torch.long, device=device)
    end = prompt_length + plan.response_length
    mb = {}
    for k, v in tensors.items():
        v = v.index_select(0, idx)
        mb[k] = v[:, plan.start:end] if k in ("input_ids", "attention_mask") else v[:, :plan.response_length]
    mb["prompt_length"] = plan.prompt_length
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


__all__ = ["MicroBatchPlan", "plan_micro_batches", "row_extents", "scatter_rows", "take"]
