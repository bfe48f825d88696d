"""The word-embedding lookup with its weight gradient added straight into megatron DDP's
``main_grad``.

Why: the backward of ``F.embedding`` returns a dense ``[vocab / tp, hidden]`` gradient (a
scatter of the ``[tokens, hidden]`` output gradient into zeros) that megatron DDP's hook
then adds into the parameter's persistent fp32 ``main_grad`` buffer and frees. That
transient is a whole copy of the embedding table: 108 MiB at SmolLM2's 49152 x 576 in fp32,
2 GiB for Llama-3-8B's 128256 x 4096 table in fp32 at TP=1. Adding the output gradient's rows into
``main_grad`` (``index_add_``) needs no such tensor.

How: :func:`use_main_grad_lookup` swaps the class of a built model's
``VocabParallelEmbedding`` for :class:`MainGradVocabParallelEmbedding` (no new state, same
parameters and keys). Its forward takes the ``main_grad`` route only when it applies
(tensor-parallel size 1, the weight trained and carrying ``main_grad``, grad mode on,
megatron's ``deterministic_mode`` off) and runs megatron's own forward otherwise. As with
the fused output layer (:func:`nemo_rlhf.models.vocab_parallel.chunked_linear_logprobs`)
autograd gets no gradient for the weight, so DDP's hooks must not wait for it
(``overlap_grad_reduce=False``, as :func:`nemo_rlhf.models.engine.wrap_ddp` configures it);
a tied output layer's gradient still reaches ``main_grad`` through its own path.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding


class _LookupIntoMainGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)``; the backward adds the weight gradient into ``main_grad``."""

    @staticmethod
    def forward(ctx, ids, weight, main_grad):
        ctx.save_for_backward(ids)
        ctx.main_grad = main_grad
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        main_grad = ctx.main_grad
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        main_grad.index_add_(0, ids.reshape(-1), rows.to(main_grad.dtype))
        return None, None, None


class MainGradVocabParallelEmbedding(VocabParallelEmbedding):
    """megatron's ``VocabParallelEmbedding`` whose weight gradient goes into ``main_grad``
    (module docstring); megatron's forward wherever that route does not apply."""

    def forward(self, input_):
        """``[batch, seq]`` int64 token ids -> ``[batch, seq, hidden]`` in the weight's dtype."""
        main_grad = getattr(self.weight, "main_grad", None)
        if (main_grad is None or not self.weight.requires_grad or not torch.is_grad_enabled()
                or self.tp_group.size() > 1 or self.deterministic_mode
                or self.reduce_scatter_embeddings):
            return super().forward(input_)
        return _LookupIntoMainGrad.apply(input_, self.weight, main_grad)


def use_main_grad_lookup(model: torch.nn.Module) -> int:
    """Swap every ``VocabParallelEmbedding`` of ``model`` for
    :class:`MainGradVocabParallelEmbedding`; returns how many were swapped."""
    n = 0
    for module in model.modules():
        if type(module) is VocabParallelEmbedding:
            module.__class__ = MainGradVocabParallelEmbedding
            n += 1
    return n


__all__ = ["MainGradVocabParallelEmbedding", "use_main_grad_lookup"]
