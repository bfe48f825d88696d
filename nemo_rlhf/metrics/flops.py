"""Model FLOPs of a GPT forward pass and of the phases of one PPO step.

Model FLOPs count the arithmetic the model itself requires (the convention of MFU, "model
FLOPs utilisation", PaLM, Chowdhery et al. 2022, appendix B), not what an implementation
happens to execute: no activation recomputation, no padding of the vocabulary beyond the
model's own padded output layer, nothing for norms, activations, softmax or the optimizer.
A multiply-add is 2 FLOPs.

For a decoder layer with hidden size ``h``, ``a`` query heads and ``g`` key/value groups of
width ``d`` (``kv_channels``, default ``h / a``), MLP width ``f`` and ``m`` MLP input
matrices (``m = 2`` for a gated MLP such as SwiGLU, which has a gate and an up
projection, else ``m = 1``), the matrix products of one token cost

    2 * [ h * (a*d + 2*g*d)     query, key and value projections
        + a*d * h               attention output projection
        + (m + 1) * h * f ]     MLP: m input matrices and the output matrix

and its attention over a context of ``c`` tokens costs ``2 * a*d * c`` for the scores
``Q K^T`` plus ``2 * a*d * c`` for the weighted sum of values. Over a sequence of ``S``
tokens the context is counted as the full ``S`` (not the causal ``S/2`` on average), as
Narayanan et al. 2021 ("Efficient large-scale language model training on GPU clusters
using Megatron-LM", section 5.1) and PaLM do: ``4 * a*d * S^2`` per layer and sequence.
The output layer costs ``2 * h * V`` per token (``V`` the padded vocabulary; tied
embeddings still run this product), the value head ``2 * h`` per token; an embedding
lookup costs nothing.

A mixture-of-experts layer (``model.num_moe_experts`` = ``E`` experts of width ``f_e``, each
token routed to ``k`` of them, ``model.moe_router_topk``) counts the experts a token runs and
its router, i.e. its active parameters: the MLP term becomes ``k * (m + 1) * h * f_e + h * E``
(``2 * 3.04e9`` FLOPs per token for Qwen3-30B-A3B's matrices, whose model card counts 3.3B
activated parameters, the input embedding included). Tokens are counted once: expert
parallelism moves them to other ranks, it adds no model FLOPs.

A forward pass over ``B`` sequences of ``S`` tokens therefore costs

    F(B, S) = B * S * L * 2 * [h*(a*d + 2*g*d) + a*d*h + (m+1)*h*f]
            + B * L * 4 * a*d * S^2
            + B * S * 2 * h * V              (output layer)
            + B * S * 2 * h                  (value head, when computed)

and training (forward + backward, the backward pass computing the gradients of both
activations and weights) ``3 * F``. For standard attention (``g = a``, ``a*d = h``) and
``f = 4h`` without gating this is Narayanan et al.'s ``72 B S L h^2 (1 + S/(6h) +
V/(12 L h))`` per training iteration without recomputation; PaLM's ``6N + 12 L H Q T`` per
training token is the same count with ``N`` the parameters of the matrix products.

One PPO step (:class:`PPOStepFlops`) of ``B`` rollouts, prompts left-padded to ``P`` and
responses right-padded to ``R`` (``S = P + R``, the shapes the trainer computes on):

* rollout: a prefill over the ``P`` prompt tokens (logits only for the last position,
  which gives the first response token), then ``R - 1`` decode steps, step ``t`` feeding
  one token that attends to a cache of ``P + t`` keys (its own included);
* old log-probs and values: one forward over ``B x S`` with the value head;
* reference log-probs: one forward over ``B x S`` without it;
* train: ``ppo_epochs`` passes of forward + backward over ``B x S``, value head included.

Simplified: the attention term of the decode steps counts the real cache length, while the
full-sequence passes count ``S^2`` (the convention above); pipeline bubbles and tensor
parallelism do not change model FLOPs and are not modelled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


def _dims(cfg) -> tuple[int, int, int, int, int, int, int]:
    """``(L, h, q, kv, mlp_matrices, f, V)`` of a :class:`~nemo_rlhf.models.config.ModelConfig`."""
    heads = cfg.num_attention_heads
    d = cfg.kv_channels or cfg.hidden_size // heads
    groups = cfg.num_query_groups or heads
    f = cfg.ffn_hidden_size or 4 * cfg.hidden_size
    mlp_in = 2 if cfg.activation == "swiglu" else 1
    # the padded vocabulary (raises, naming model.vocab_size, while it is still unset)
    return (cfg.num_layers, cfg.hidden_size, heads * d, 2 * groups * d, mlp_in, f,
            cfg.padded_vocab_size)


def mlp_matmul_flops_per_token(cfg) -> int:
    """FLOPs of one token through one layer's MLP: ``2 * (m+1)*h*f`` dense; for a MoE layer
    the ``k`` experts it is routed to and the router, ``2 * [k*(m+1)*h*f_e + h*E]``."""
    _, h, _, _, mlp_in, f, _ = _dims(cfg)
    if cfg.num_moe_experts is None:
        return 2 * (mlp_in + 1) * h * f
    return 2 * (cfg.moe_router_topk * (mlp_in + 1) * h * cfg.moe_expert_ffn_size + h * cfg.num_moe_experts)


def layer_matmul_flops_per_token(cfg) -> int:
    """FLOPs of one token through one layer's matrix products (no attention scores):
    ``2 * [h*(a*d + 2*g*d) + a*d*h] +`` :func:`mlp_matmul_flops_per_token` (dense:
    ``2 * (m+1)*h*f``)."""
    _, h, q, kv, _, _, _ = _dims(cfg)
    return 2 * (h * (q + kv) + q * h) + mlp_matmul_flops_per_token(cfg)


def forward_flops(cfg, batch: int, seq_len: int, *, value_head: bool = False,
                  logits: bool = True) -> int:
    """FLOPs of one forward pass over ``batch`` sequences of ``seq_len`` tokens.

    Args:
        cfg: a :class:`~nemo_rlhf.models.config.ModelConfig` (``vocab_size`` set).
        batch: ``B`` sequences.
        seq_len: ``S`` tokens each (padding included: the model computes on it).
        value_head: add the value head's ``2 * h`` per token.
        logits: add the output layer's ``2 * h * V`` per token.

    Returns:
        ``F(B, S)`` of the module docstring, in FLOPs.
    """
    if batch < 0 or seq_len < 0:
        raise ValueError(f"forward_flops: batch={batch} and seq_len={seq_len} must be >= 0")
    L, h, q, _, _, _, V = _dims(cfg)
    tokens = batch * seq_len
    total = tokens * L * layer_matmul_flops_per_token(cfg) + batch * L * 4 * q * seq_len ** 2
    if logits:
        total += tokens * 2 * h * V
    if value_head:
        total += tokens * 2 * h
    return total


def decode_flops(cfg, batch: int, prompt_len: int, new_tokens: int) -> int:
    """FLOPs of generating ``new_tokens`` per row with a KV cache (no value head).

    A prefill over ``prompt_len`` tokens (logits of the last position only), then
    ``new_tokens - 1`` steps of one token each; step ``t`` (1-based) attends to
    ``prompt_len + t`` keys. ``new_tokens = 0`` costs nothing.
    """
    if new_tokens <= 0 or batch <= 0:
        return 0
    L, h, q, _, _, _, V = _dims(cfg)
    prefill = forward_flops(cfg, batch, prompt_len, logits=False) + batch * 2 * h * V
    steps = new_tokens - 1
    per_token = L * layer_matmul_flops_per_token(cfg) + 2 * h * V
    # sum over t = 1..steps of the context prompt_len + t
    context_sum = steps * prompt_len + steps * (steps + 1) // 2
    return prefill + batch * (steps * per_token + L * 4 * q * context_sum)


@dataclass
class PPOStepFlops:
    """Model FLOPs of the phases of one PPO step (see the module docstring)."""

    rollout: int
    """Generation: prefill + decode steps."""
    old_logprobs_values: int
    """Forward over the rollouts with the value head (old log-probs and values)."""
    reference_logprobs: int
    """Forward with the reference weights (no value head)."""
    train: int
    """``ppo_epochs`` x (forward + backward) over the rollouts, value head included."""

    @property
    def total(self) -> int:
        """Sum of the phases."""
        return self.rollout + self.old_logprobs_values + self.reference_logprobs + self.train

    def to_dict(self) -> dict:
        """The phases and the total, in FLOPs."""
        return {**asdict(self), "total": self.total}


def ppo_step_flops(cfg, *, batch: int, prompt_len: int, response_len: int,
                   ppo_epochs: int) -> PPOStepFlops:
    """Model FLOPs of one PPO step on one model replica.

    Args:
        cfg: the policy's :class:`~nemo_rlhf.models.config.ModelConfig`.
        batch: ``B`` rollouts (this replica's).
        prompt_len: ``P``, the longest prompt (prompts are left-padded to it).
        response_len: ``R``, the decoding steps run (responses are right-padded to it).
        ppo_epochs: passes over the rollouts in the update.
    """
    seq = prompt_len + response_len
    fwd_values = forward_flops(cfg, batch, seq, value_head=True)
    return PPOStepFlops(
        rollout=decode_flops(cfg, batch, prompt_len, response_len),
        old_logprobs_values=fwd_values,
        reference_logprobs=forward_flops(cfg, batch, seq),
        train=3 * ppo_epochs * fwd_values,
    )


__all__ = ["PPOStepFlops", "decode_flops", "forward_flops", "layer_matmul_flops_per_token",
           "ppo_step_flops"]
