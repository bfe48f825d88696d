"""Rollout generation on a megatron-core actor under TP/PP/DP, with a KV cache.

:func:`generate` runs one DP rank's prompts through this rank's pipeline stage of the
actor: a prefill over the left-padded prompts, then one token per step, with megatron's
``StaticInferenceContext`` holding the keys and values (``use_kv_cache=False`` recomputes
the whole sequence every step instead; tests and the benchmark use it as the reference).

Layout of the result (:class:`RolloutBatch`) is the contract with the trainer: prompts
left-padded to ``P`` (the longest prompt), responses from column ``P`` on, right-padded.
A forward of the training engine over ``batch.input_ids`` / ``batch.attention_mask``
(positions from the cumsum of the mask, causal + padding mask) sees exactly the inputs the
sampler saw, and :func:`response_logprobs` reads the log-probs of the response tokens from
its vocab-parallel logits, so rollout and training log-probs agree to rounding.

Positions: learned absolute position embeddings get per-row ``position_ids`` (count of
real tokens before the token), in the prefill and in every decode step. RoPE in
megatron-core is applied by column (the cache slot), in training as in inference, so a
left-padded row sees its positions shifted by a constant, which RoPE's relative form
makes harmless (and the training forward applies the same shift).

Parallelism: every rank of one model-parallel (TP x PP) group must be given the same
prompts (checked). Stages hand hidden states ``[s, batch, hidden]`` to the next stage with
``torch.distributed`` send/recv on the pipeline group; the last stage's logits are gathered
across TP (megatron requires ``runtime_gather_output`` in inference); TP rank 0 of the last
stage samples and broadcasts ``(token, log-prob, stop flag)`` to its TP group and then to
every stage of its pipeline, so all ranks agree on every token and stop at the same step.
Under context parallelism (``parallel.context_parallel_size`` > 1) CP does not shard the
weights, so every CP rank decodes the whole sequence itself on the incremental KV-cache path
(no CP communication in the attention; RoPE's whole table, not megatron's CP slice) and CP
rank 0 samples: its ``(token, log-prob, stop flag)`` is broadcast over the CP group each
step, so the CP ranks end with identical rollouts (values, with ``with_values``, are each
rank's own of the same weights and inputs). DP ranks sample from different seeds (``cfg.seed``, DP rank and a call index); TP and PP
ranks do not enter the seed, so a TP or PP layout with one rank's weights draws one rank's
tokens (``tests/distributed/test_rollout_parallel.py``; a fresh random initialisation
differs with PP, docs/models.md, so layouts that must agree start from one checkpoint). With expert
parallelism (a MoE actor at ``parallel.expert_model_parallel_size`` > 1) every MoE layer call
is a collective over DP ranks, so a rank whose rows are all done keeps stepping (finished
rows, pad tokens) until every rank of its expert-parallel group is done: its batch then has
more (padding) response columns than it would alone, the same valid tokens.

Speed: masks, positions and buffers are built once per call and sliced per step; without
left padding decode steps pass no mask; with the CPU shim active its TorchFunctionMode is
suspended for the loop (:func:`nemo_rlhf.distributed.cpu_compat.suspended`). The model's
local layer spec (:mod:`nemo_rlhf.models.decode_layers`) gives the layers an incremental
path for this static-batching context: RoPE on the new tokens only with rotated keys cached,
no GQA copies, and no per-op megatron wrappers at TP=1 (megatron's own static path
re-rotates the whole cache and repeats keys/values every step); and
:class:`~nemo_rlhf.rollout.incremental_stage.IncrementalStage` runs the whole pipeline stage
(embedding, layers, final norm, the last token's logits) without ``GPTModel`` /
``TransformerBlock``'s wrappers, with logits bit-identical to the model's own call.
``torch.inference_mode`` is not used: megatron caches its RoPE table (``lru_cache``) and an
inference tensor cached there would break a later training forward of the same length.
Measured with ``benchmarks/bench_rollout.py`` (fp32, 2 threads, idle 2-core machine, medians
of 5 interleaved pairs, two runs each): 4 layers / hidden 256, 64 + 64 tokens, greedy:
1.46x-1.52x / 1.42x-1.47x transformers' ``generate`` at batch 8 / 32 (megatron's own static
path: 0.62x / 0.61x); SmolLM2-135M-Instruct's real weights, 64 + 32 tokens: greedy 1.07x-1.10x
/ 1.11x-1.16x, sampling (T=0.7, top-p 0.9) 1.24x / 1.27x. At that size most of a greedy
step is the same fp32 GEMMs on both sides (the output layer alone streams 113 MB of
weights per step), so the greedy margin is the smaller one.

Simplified: the batch is static (finished rows keep being computed, feeding pad tokens,
until every row is done; no continuous batching or cache compaction); pipeline stages run
one after the other per step (no micro-batch interleaving across stages); no CUDA graphs,
flash-decode or sequence parallelism; the sampler sees the gathered full vocabulary (no
vocab-parallel sampling).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from nemo_rlhf.distributed import cpu_compat
from nemo_rlhf.distributed.device import to_device
from nemo_rlhf.models.actor_critic import ActorCriticModel
from nemo_rlhf.models.engine import causal_padding_mask, position_ids_for, unwrap
from nemo_rlhf.models.moe import all_done_in_group, expert_exchange_group
from nemo_rlhf.models.routing_replay import RoutingReplay, moe_routers
from nemo_rlhf.rollout.config import RolloutConfig
from nemo_rlhf.rollout.incremental_stage import IncrementalStage
from nemo_rlhf.rollout.sampling import choose_tokens

DecodeFn = Callable[[list[int]], str]

_CALL_COUNTER = itertools.count()


@dataclass
class RolloutBatch:
    """One DP rank's rollouts, batch-first, on ``dims.device`` (every tensor field).

    ``B`` = number of prompts, ``P`` = longest prompt, ``R`` = longest response (the number
    of decoding steps run, <= ``max_new_tokens``).
    """

    input_ids: torch.Tensor
    """``[B, P+R]`` int64: prompt left-padded to P, response from column P, right-padded."""
    attention_mask: torch.Tensor
    """``[B, P+R]`` int64: 1 on real prompt and response tokens, 0 on padding."""
    prompt_length: int
    """``P``: the column where responses start."""
    response_ids: torch.Tensor
    """``[B, R]`` int64, right-padded with the pad id."""
    response_mask: torch.Tensor
    """``[B, R]`` bool: True on generated tokens, the EOS/stop token included."""
    response_lengths: torch.Tensor
    """``[B]`` int64: generated tokens per row (= ``response_mask.sum(-1)``)."""
    ended: torch.Tensor
    """``[B]`` bool: the row stopped on EOS, a stop token or a stop string."""
    truncated: torch.Tensor
    """``[B]`` bool: the row hit ``max_new_tokens`` without a stop."""
    logprobs: torch.Tensor
    """``[B, R]`` float32: sampling log-probs of the response tokens, 0 where masked."""
    vocab_size: int = 0
    """Real vocabulary size the sampler used (padded rows excluded); 0 = unknown."""
    values: Optional[torch.Tensor] = None
    """``[B, R]`` float32, with ``generate(..., with_values=True)``: the critic's value of
    the state each response token is chosen in (the value head on the decode step's final
    hidden state: position ``P-1+j`` for token ``j``), 0 where masked; None otherwise."""
    routes: Optional[torch.Tensor] = None
    """``[B, P+R, L, k]`` int64, with ``generate(..., record_routes=True)`` (MoE routing
    replay, :mod:`nemo_rlhf.models.routing_replay`): the top-k experts each MoE layer of this
    pipeline stage (``L`` of them) routed each position of ``input_ids`` to in the decode;
    ``-1`` at the last column (that token is never fed) and in the padding columns of
    :meth:`pad_response_to` (the router's own choice there). None otherwise."""

    @property
    def batch_size(self) -> int:
        """``B``."""
        return int(self.input_ids.shape[0])

    @property
    def response_length(self) -> int:
        """``R``."""
        return int(self.response_ids.shape[1])

    def pad_response_to(self, length: int, pad_token_id: int) -> "RolloutBatch":
        """A copy with the response columns right-padded to ``length`` (>= R).

        Useful to give every DP rank / micro-batch the same ``[B, P+length]`` shape.

        Raises:
            ValueError: if ``length`` < R.
        """
        extra = length - self.response_length
        if extra < 0:
            raise ValueError(f"pad_response_to({length}): shorter than the responses ({self.response_length})")
        if extra == 0:
            return self
        b = self.batch_size

        def pad(t: torch.Tensor, value) -> torch.Tensor:
            return torch.cat([t, torch.full((b, extra), value, dtype=t.dtype, device=t.device)],
                             dim=1)

        return replace(
            self,
            input_ids=pad(self.input_ids, pad_token_id),
            attention_mask=pad(self.attention_mask, 0),
            response_ids=pad(self.response_ids, pad_token_id),
            response_mask=pad(self.response_mask, False),
            logprobs=pad(self.logprobs, 0.0),
            values=None if self.values is None else pad(self.values, 0.0),
            routes=None if self.routes is None else torch.cat(
                [self.routes, self.routes.new_full((b, extra, *self.routes.shape[2:]), -1)], dim=1),
        )


# --------------------------------------------------------------------------- checks


def _check_inputs(prompts, cfg: RolloutConfig, eos_token_id: int, pad_token_id: int,
                  vocab_size: int, max_sequence_length: int, decode_fn) -> None:
    cfg.validate()
    if vocab_size < 1:
        raise ValueError(f"generate: vocab_size={vocab_size} must be >= 1")
    for name, tok in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if not 0 <= tok < vocab_size:
            raise ValueError(f"generate: {name}={tok} is outside the vocabulary [0, {vocab_size})")
    for i, tok in enumerate(cfg.stop_token_ids):
        if tok >= vocab_size:
            raise ValueError(
                f"rollout.stop_token_ids[{i}]={tok} is outside the vocabulary [0, {vocab_size})"
            )
    if cfg.stop_strings and decode_fn is None:
        raise ValueError(
            f"rollout.stop_strings={cfg.stop_strings!r} needs a decode_fn (token ids -> str); "
            f"pass decode_fn= or set rollout.stop_strings=[]"
        )
    if len(prompts) == 0:
        raise ValueError("generate: the prompt list is empty; give at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty; every prompt needs >= 1 token")
        if len(p) + cfg.max_new_tokens > max_sequence_length:
            raise ValueError(
                f"generate: prompt {i} has {len(p)} tokens; with rollout.max_new_tokens="
                f"{cfg.max_new_tokens} that is {len(p) + cfg.max_new_tokens} > "
                f"max_sequence_length={max_sequence_length}; shorten the prompt to <= "
                f"{max_sequence_length - cfg.max_new_tokens} tokens or lower max_new_tokens"
            )
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"generate: prompt {i} has token id {lo if lo < 0 else hi} outside the "
                f"vocabulary [0, {vocab_size})"
            )


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int):
    """Left-pad prompts to the longest one (on the host: the caller moves the result).

    Returns:
        ``(ids [B, P] int64, mask [B, P] bool, lengths [B] int64)``, host tensors.
    """
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device="cpu")
    width = int(lengths.max())
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device="cpu")
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long, device="cpu")
    mask = torch.arange(width, device="cpu").unsqueeze(0) >= (width - lengths).unsqueeze(1)
    return ids, mask, lengths


def _check_prompts_agree(dims, ids: torch.Tensor) -> None:
    """All ranks of one model-parallel group must hold the same prompts (one all-reduce)."""
    group = dims.mp_group
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    # host metadata (gloo part of the backend map): ids are the host prompt tensor
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.long, device="cpu").view_as(ids) % 1_000_003
    sig = torch.tensor([ids.shape[0], ids.shape[1], int((ids * weights).sum())], dtype=torch.long,
                       device="cpu")
    both = torch.cat([sig, -sig])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if not (torch.equal(both[:3], sig) and torch.equal(-both[3:], sig)):
        raise ValueError(
            "generate: the ranks of one model-parallel group (TP x PP) were given different "
            "prompts; split prompts by DP rank only"
        )


def sampler_seed(seed: int, dp_rank: int, call_index: int) -> int:
    """Seed of the sampler's generator: a hash of ``(seed, dp_rank, call_index)``."""
    digest = hashlib.blake2b(f"{seed}:{dp_rank}:{call_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


# --------------------------------------------------------------------------- the loop


class _StageRunner:
    """Runs this rank's pipeline stage for one step and returns the last stage's logits."""

    def __init__(self, model, dims, batch: int, use_cache: bool, max_seq: int):
        from megatron.core.inference.contexts import StaticInferenceContext

        self.model, self.dims = model, dims
        cfg = model.config
        self.hidden = cfg.hidden_size
        self.dtype = cfg.pipeline_dtype or cfg.params_dtype
        self.ctx = StaticInferenceContext(batch, max_seq) if use_cache else None
        self.batch = batch
        # an actor-critic returns (logits, values) unless told otherwise
        self.kwargs = {"with_values": False} if isinstance(model, ActorCriticModel) else {}
        # the whole stage without megatron's model/block wrappers, where it applies
        self.stage = IncrementalStage.for_model(model, max_seq) if use_cache else None
        cp = getattr(cfg, "context_parallel_size", 1) or 1
        if cp > 1 and self.stage is None:  # the model's own forward would shard the sequence
            raise ValueError(
                f"generate under parallel.context_parallel_size={cp}: every CP rank decodes the whole "
                f"sequence on the incremental KV-cache path (IncrementalStage), which this model "
                f"stage does not take (rollout.use_kv_cache={use_cache}); set rollout.use_kv_cache=true "
                f"with a dense local-spec model, or parallel.context_parallel_size=1")

    def __call__(self, ids_BS: torch.Tensor, pos_BS: torch.Tensor, mask_B1QK: torch.Tensor):
        """Forward ``[B, s]`` tokens; return ``[B, padded_vocab]`` logits on the last stage."""
        dims, pp = self.dims, self.dims.pp
        s = ids_BS.shape[1]
        if not dims.is_first_stage:
            buf = torch.empty(s, self.batch, self.hidden, dtype=self.dtype, device=ids_BS.device)
            dist.recv(buf, group=dims.pp_group, group_src=dims.pp_rank - 1)
            if self.stage is None:
                self.model.set_input_tensor(buf)
        if self.stage is not None:
            out = self.stage(ids_BS, pos_BS, mask_B1QK, self.ctx,
                             None if dims.is_first_stage else buf)
        else:
            out = self.model(ids_BS, pos_BS, mask_B1QK, inference_context=self.ctx,
                             runtime_gather_output=True, **self.kwargs)
        if self.ctx is not None:
            self.ctx.sequence_len_offset += s
            self.ctx.enable_decode_mode()
        if dims.pp_rank < pp - 1:
            dist.send(out.contiguous(), group=dims.pp_group, group_dst=dims.pp_rank + 1)
            return None
        return out if self.stage is not None else out[:, -1, :]


def _share_choice(dims, packed_3B: torch.Tensor) -> None:
    """Broadcast ``(tokens, logprobs, stop)`` from TP rank 0 (and CP rank 0) of the last
    stage to all ranks."""
    if dims.is_last_stage and getattr(dims, "cp", 1) > 1:
        dist.broadcast(packed_3B, group=dims.cp_group, group_src=0)
    if dims.is_last_stage and dims.tp > 1:
        dist.broadcast(packed_3B, group=dims.tp_group, group_src=0)
    if dims.pp > 1:
        dist.broadcast(packed_3B, group=dims.pp_group, group_src=dims.pp - 1)


def generate(
    model,
    dims,
    prompts: Sequence[Sequence[int]],
    cfg: RolloutConfig,
    *,
    eos_token_id: int,
    pad_token_id: int,
    vocab_size: int,
    max_sequence_length: int,
    decode_fn: Optional[DecodeFn] = None,
    call_index: Optional[int] = None,
    with_values: bool = False,
    record_routes: bool = False,
) -> RolloutBatch:
    """Generate responses for this DP rank's prompts.

    Args:
        model: this rank's pipeline stage of the actor (megatron ``GPTModel`` /
            ``ActorCriticModel``, optionally DDP-wrapped). Put in eval mode for the call
            (restored afterwards); an actor-critic is called for its logits only.
        dims: :class:`nemo_rlhf.distributed.ParallelDims` of this process.
        prompts: ``B`` lists of token ids (each non-empty); the same on every rank of one
            TP x PP group, different across DP ranks (the caller splits).
        cfg: sampling and stopping rules.
        eos_token_id: ends a response (after ``min_new_tokens``).
        pad_token_id: fills left padding, right padding and finished rows' inputs.
        vocab_size: real vocabulary size; padded embedding rows are never sampled.
        max_sequence_length: longest prompt + response the model accepts.
        decode_fn: ``token_ids -> str`` for ``cfg.stop_strings`` (response so far).
        call_index: mixes into the sampler seed; None = a per-process counter, so
            successive calls draw differently. Pass it for reproducible rollouts.
        with_values: also return the actor-critic's values of the states that choose the
            response tokens (:attr:`RolloutBatch.values`, on the last pipeline stage; None
            elsewhere), from its value head on each decode step's final hidden state (the
            old values of ``ppo.old_logprobs_from_rollout``). Needs the KV cache.
        record_routes: also return each MoE layer's chosen experts per position
            (:attr:`RolloutBatch.routes`, on this rank's stage's layers) for routing replay.
            Needs the KV cache and a MoE model.

    Returns:
        :class:`RolloutBatch` on every rank of the group (same tokens on all of them).

    Raises:
        ValueError: bad config, empty prompt list or prompt, a prompt id outside the
            vocabulary, ``len(prompt) + max_new_tokens > max_sequence_length`` (naming the
            prompt index and the lengths), stop strings without ``decode_fn``; raised
            before any forward. Also if the model-parallel ranks got different prompts, or
            ``with_values`` without the KV cache or for a model with no value head;
            ``record_routes`` without the KV cache or for a dense model.
    """
    _check_inputs(prompts, cfg, eos_token_id, pad_token_id, vocab_size, max_sequence_length,
                  decode_fn)
    if with_values and (not cfg.use_kv_cache or not isinstance(unwrap(model), ActorCriticModel)
                        or type(unwrap(model)).head_name != "value_head"):
        raise ValueError("generate(with_values=True): the values come from an actor-critic's value head "
                         "on the KV-cache decode path (rollout.use_kv_cache=true)")
    if record_routes and (not cfg.use_kv_cache or not moe_routers(model)):
        raise ValueError("generate(record_routes=True): routing replay records a MoE model's routes "
                         "on the KV-cache decode path (rollout.use_kv_cache=true, model.num_moe_experts set)")
    if call_index is None:
        call_index = next(_CALL_COUNTER)
    prompt_ids, prompt_mask, prompt_lengths = left_pad(prompts, pad_token_id)
    _check_prompts_agree(dims, prompt_ids)
    # the boundary: everything the loop touches lives on the accelerator from here on
    prompt_ids, prompt_mask, prompt_lengths = to_device(
        (prompt_ids, prompt_mask, prompt_lengths), dims.device)

    core = unwrap(model)
    was_training = core.training
    core.eval()
    try:
        recorder = RoutingReplay(core, "record") if record_routes else contextlib.nullcontext()
        with torch.no_grad(), cpu_compat.suspended(), recorder:
            out = _decode(core, dims, prompt_ids, prompt_mask, prompt_lengths, cfg,
                          eos_token_id, pad_token_id, vocab_size, decode_fn, call_index,
                          with_values)
        if record_routes:  # [B, P+R-1, L, k] on the routers' device (dims.device)
            rec = recorder.routes()
            last = rec.new_full((rec.shape[0], 1, *rec.shape[2:]), -1)
            out = replace(out, routes=torch.cat([rec, last], dim=1))
        return out
    finally:
        core.train(was_training)
        if not dims.is_first_stage:
            core.set_input_tensor(None)


def _decode(model, dims, prompt_ids, prompt_mask, prompt_lengths, cfg: RolloutConfig,
            eos_token_id, pad_token_id, vocab_size, decode_fn, call_index,
            with_values: bool = False) -> RolloutBatch:
    B, P = prompt_ids.shape
    R = cfg.max_new_tokens
    L = P + R
    # context parallelism: every CP rank decodes the whole sequence (the incremental path
    # does not shard it); CP rank 0 samples and its choice is broadcast (_share_choice)
    is_sampler = dims.is_last_stage and dims.tp_rank == 0 and getattr(dims, "cp_rank", 0) == 0
    dev = dims.device

    # Pre-allocated state on the accelerator, shared by every step.
    seq_ids = torch.full((B, L), pad_token_id, dtype=torch.long, device=dev)
    seq_ids[:, :P] = prompt_ids
    seq_mask = torch.zeros(B, L, dtype=torch.bool, device=dev)
    seq_mask[:, :P] = prompt_mask
    logprobs = torch.zeros(B, max(R, 0), dtype=torch.float32, device=dev)
    lengths = torch.zeros(B, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    ended = torch.zeros(B, dtype=torch.bool, device=dev)
    stop_ids = torch.tensor(sorted({eos_token_id, *cfg.stop_token_ids}), dtype=torch.long,
                            device=dev)
    generator = None
    if is_sampler and not cfg.greedy:
        generator = torch.Generator(device=dev).manual_seed(
            sampler_seed(cfg.seed, dims.dp_rank, call_index))
    packed = torch.zeros(3, B, dtype=torch.float64, device=dev)

    runner = _StageRunner(model, dims, B, cfg.use_kv_cache, L)
    values = None
    if with_values and dims.is_last_stage:
        if runner.stage is None:
            raise RuntimeError("generate(with_values=True): this model stage does not take the "
                               "incremental decode path (IncrementalStage.for_model), which computes "
                               "the values")
        runner.stage.value_head = model.value_head
        values = torch.zeros(B, max(R, 0), dtype=torch.float32, device=dev)
    prefill_pos = position_ids_for(prompt_mask)
    # no left padding: no prefill mask either (the attention is causal by default)
    prefill_mask = None if bool(prompt_mask.all()) else causal_padding_mask(prompt_mask)
    # Decode step t feeds response token t-1 at position len_b + t - 1 and attends to every
    # cached key but the left padding: both precomputed, sliced per step (views, no ops).
    decode_pos_BR = (prompt_lengths.unsqueeze(1)
                     + torch.arange(max(R - 1, 0), device=dev)).contiguous()
    key_pad_B11L = None  # no left padding: no mask at all in decode steps
    if not bool(prompt_mask.all()):
        key_pad_B11L = torch.zeros(B, 1, 1, L, dtype=torch.bool, device=dev)
        key_pad_B11L[:, 0, 0, :P] = ~prompt_mask

    ep_group = expert_exchange_group(model)  # EP > 1: stop when the group is done
    steps = 0
    for t in range(R):
        if not cfg.use_kv_cache:
            m = seq_mask[:, :P + t]
            logits_BV = runner(seq_ids[:, :P + t], position_ids_for(m), causal_padding_mask(m))
        elif t == 0:
            logits_BV = runner(prompt_ids, prefill_pos, prefill_mask)
        else:
            logits_BV = runner(seq_ids[:, P + t - 1:P + t], decode_pos_BR[:, t - 1:t],
                               None if key_pad_B11L is None else key_pad_B11L[..., :P + t])
        if is_sampler:
            suppress = stop_ids if t < cfg.min_new_tokens else None
            tokens, lp = choose_tokens(
                logits_BV, vocab_size=vocab_size, greedy=cfg.greedy, temperature=cfg.temperature,
                top_k=cfg.top_k, top_p=cfg.top_p, suppress_ids=suppress, generator=generator)
            stop = torch.isin(tokens, stop_ids) if t >= cfg.min_new_tokens else torch.zeros_like(done)
            if cfg.stop_strings and t >= cfg.min_new_tokens:
                stop = _stop_strings_hit(stop, done, tokens, seq_ids[:, P:P + t], lengths,
                                         cfg.stop_strings, decode_fn)
            packed[0] = tokens.to(torch.float64)
            packed[1] = lp.to(torch.float64)
            packed[2] = stop.to(torch.float64)
        _share_choice(dims, packed)
        active = ~done
        tokens = packed[0].long()
        seq_ids[:, P + t] = torch.where(active, tokens, pad_token_id)
        seq_mask[:, P + t] = active
        logprobs[:, t] = torch.where(active, packed[1].float(), 0.0)
        if values is not None:
            values[:, t] = torch.where(active, runner.stage.last_values, 0.0)
        lengths += active
        newly = active & packed[2].bool()
        ended |= newly
        done |= newly
        steps = t + 1
        if ep_group is None and bool(done.all()):
            break
        if ep_group is not None and all_done_in_group(bool(done.all()), ep_group, dev):
            break

    input_ids = seq_ids[:, :P + steps].clone()
    attention_mask = seq_mask[:, :P + steps].long()
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_length=P,
        response_ids=input_ids[:, P:].clone(),
        response_mask=seq_mask[:, P:P + steps].clone(),
        response_lengths=lengths,
        ended=ended,
        truncated=~ended,
        logprobs=logprobs[:, :steps].clone(),
        vocab_size=vocab_size,
        values=None if values is None else values[:, :steps].clone(),
    )


def _stop_strings_hit(stop_B, done_B, tokens_B, prev_BT, lengths_B, stop_strings, decode_fn):
    """Rows (active, not already stopped) whose decoded response contains a stop string."""
    stop_B = stop_B.clone()
    for b in torch.nonzero(~done_B & ~stop_B).flatten().tolist():
        n = int(lengths_B[b])
        text = decode_fn(prev_BT[b, :n].tolist() + [int(tokens_B[b])])
        if any(s in text for s in stop_strings):
            stop_B[b] = True
    return stop_B


# --------------------------------------------------------------------------- training side


def logprob_diff_stats(rollout_logprobs: torch.Tensor, train_logprobs: torch.Tensor,
                       mask: torch.Tensor) -> dict[str, float]:
    """Mismatch between the sampler's and the trainer's log-probs over valid tokens.

    Args:
        rollout_logprobs, train_logprobs: ``[B, R]`` float.
        mask: ``[B, R]`` bool/int, True on response tokens.

    Returns:
        ``{"rollout_train_logprob_diff_mean": mean |diff|, "rollout_train_logprob_diff_max":
        max |diff|}`` over the masked tokens of this rank (0.0 when there are none).
    """
    m = mask.bool()
    diff = (rollout_logprobs.detach().float() - train_logprobs.detach().float()).abs()[m]
    if diff.numel() == 0:
        return {"rollout_train_logprob_diff_mean": 0.0, "rollout_train_logprob_diff_max": 0.0}
    return {"rollout_train_logprob_diff_mean": float(diff.mean()),
            "rollout_train_logprob_diff_max": float(diff.max())}
