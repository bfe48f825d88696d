"""Forward/backward through megatron's pipeline schedule, with megatron DDP.

One call of :func:`forward_backward` runs a list of micro-batches through
``get_forward_backward_func()`` (no pipelining for PP=1, 1F1B for PP>1). The loss function
gets the last stage's model output and the micro-batch and returns
``(loss, stats)`` where ``loss`` is already divided by the **global** token count of the
whole mini-batch (across micro-batches and DP ranks), so the schedule and DDP are told not
to rescale it (``calculate_per_token_loss``) and DDP sums gradients over DP ranks.

Batches are batch-first dicts of tensors; every micro-batch of one call has the same
``[micro_batch_size, seq]`` shape (pipeline stages exchange fixed-size activations), unless
the call allows variable shapes (token-budget and packed micro-batches: each activation's
shape is then sent ahead of it).

Expert parallelism (a MoE model at ``parallel.expert_model_parallel_size`` > 1): every MoE
layer call is a collective over the expert-parallel group, whose ranks hold different
data-parallel batches; a call whose ranks hold fewer micro-batches than the group's most
runs extra ones (copies of its last micro-batch, their loss multiplied by 0, their
statistics dropped and their routed tokens not counted in the ``moe/`` metrics; forward-only:
a ``[1, 1]`` batch where it has none), so that every rank
calls the layers equally often (:func:`nemo_rlhf.models.moe.agree_on_micro_batch_count`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Callable, Optional

import torch

from nemo_rlhf.distributed.device import to_device
from nemo_rlhf.models.moe import agree_on_micro_batch_count, expert_exchange_group, filler_forward
from nemo_rlhf.models.packing import PackedBatch
from nemo_rlhf.models.routing_replay import RoutingReplay

LossFn = Callable[[object, dict], tuple[torch.Tensor, dict]]


def wrap_ddp(model: torch.nn.Module, grad_reduce_in_fp32: bool = True,
             use_distributed_optimizer: bool = False) -> torch.nn.Module:
    """Wrap a model stage in megatron-core ``DistributedDataParallel``.

    Gradients accumulate into fp32 ``param.main_grad`` buffers (``grad_reduce_in_fp32``)
    and are summed over the DP group by :func:`finalize_grads` (all-reduced; with
    ``use_distributed_optimizer``, megatron's ZeRO-1 layout, reduce-scattered into each
    rank's shard, CUDA only).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        # False: the fused output layer (models.vocab_parallel.chunked_linear_logprobs) and
        # the word-embedding lookup (models.embedding) write their weight gradients into
        # main_grad and give autograd none, so no hook may wait for those gradients
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model inside DDP wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``[batch, seq]`` int64 counting only valid tokens (left padding safe).

    Args:
        attention_mask: ``[batch, seq]`` bool/int, True/1 for real tokens.
    """
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """megatron attention mask ``[batch, 1, seq, seq]`` bool, True = masked out.

    Causal plus padding: a query never attends to a later position or to a padded key.
    Padded query rows attend to themselves only (their outputs are ignored), which keeps
    the softmax finite.
    """
    b, s = attention_mask.shape
    valid = attention_mask.bool()
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal.unsqueeze(0) & valid.unsqueeze(1)
    eye = torch.eye(s, dtype=torch.bool, device=attention_mask.device).unsqueeze(0)
    allowed = allowed | eye
    return (~allowed).unsqueeze(1)


def model_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  with_values: Optional[bool] = None, logprob_request=None,
                  packed: Optional[PackedBatch] = None):
    """Run one stage's forward on a batch-first batch.

    Args:
        input_ids: ``[batch, seq]`` int64.
        attention_mask: ``[batch, seq]``, 1 for real tokens (left or right padding).
        with_values: actor-critic stages only: whether the last stage returns the values
            with the logits (None: the model's default, ``(logits, values)``).
        logprob_request: actor-critic stages only: a
            :class:`~nemo_rlhf.models.logprobs.LogprobRequest`; the last stage returns
            response log-probs (``ResponseLogprobs``) where it would return logits.
        packed: the micro-batch packed (:func:`nemo_rlhf.models.packing.pack_rows` of
            ``input_ids``): the forward runs over its ``[bins, W]`` rows with its
            block-diagonal causal mask and per-sequence positions; the last stage's outputs
            come back in ``input_ids``' padded ``[batch, seq]`` layout.

    Under context parallelism (the model built with ``parallel.context_parallel_size`` =
    ``cp`` > 1) every CP rank is given the whole ``[batch, seq]`` batch (``seq`` divisible
    by ``2 cp``) and runs its own positions
    (:func:`nemo_rlhf.models.context_parallel.cp_positions`): its ids and position ids,
    and the causal-padding mask's rows of its queries over every key; the last stage's
    outputs are then ``[batch, seq/cp, ...]`` in that order. A ``logprob_request`` then
    becomes a :class:`~nemo_rlhf.models.context_parallel.CPLogprobRequest` (the fused
    output layer over the rank's positions that predict response tokens; ``[batch,
    seq/cp]`` results).

    Returns:
        Last stage: the model's output (``(logits, values)``, logits, or rewards); other
        stages: hidden states for the next stage (``[W, bins, hidden]`` when packed).

    A packed micro-batch under context parallelism runs in megatron's THD layout: every
    sequence's slot cut into ``2 cp`` chunks, the last stage's outputs ``[bins, W/cp]`` of
    this rank's packed positions, not unpacked (:mod:`nemo_rlhf.models.cp_packing`).

    Raises:
        ValueError: under context parallelism, a packed micro-batch whose slots are not
            multiples of ``2 cp`` (:func:`~nemo_rlhf.models.cp_packing.cp_packed_layout`).
    """
    kwargs = {} if with_values is None else {"with_values": with_values}
    cp = getattr(unwrap(model).config, "context_parallel_size", 1) or 1
    if cp > 1:
        return _cp_forward(model, input_ids, attention_mask, cp, packed, logprob_request, kwargs)
    if logprob_request is not None:
        kwargs["logprob_request"] = logprob_request
    if getattr(unwrap(model).config, "num_moe_experts", None):
        # megatron's MoE padding mask ([rows, cols] bool, True = padding): padded positions
        # stay out of the router losses and the routed-token counts (the routing is the same)
        kwargs["padding_mask"] = (packed.segment_ids == 0) if packed is not None else ~attention_mask.bool()
    if packed is not None:
        return model(packed.input_ids, packed.position_ids, packed.attention_mask(), packed=packed,
                     **kwargs)
    return model(input_ids, position_ids_for(attention_mask), causal_padding_mask(attention_mask),
                 **kwargs)


def _cp_forward(model, input_ids, attention_mask, cp: int, packed, logprob_request, kwargs):
    """:func:`model_forward` of this CP rank's positions (see there)."""
    from megatron.core import parallel_state as ps

    from nemo_rlhf.models.context_parallel import (  # lazy: megatron stays out of the CLI
        CPLogprobRequest, cp_logprob_request, cp_positions)
    from nemo_rlhf.models.cp_packing import (  # lazy: megatron stays out of the CLI
        cp_packed_inputs, cp_packed_layout, rope_at_positions)

    rank = ps.get_context_parallel_rank()
    moe = bool(getattr(unwrap(model).config, "num_moe_experts", None))
    if packed is not None:  # megatron's THD layout, nemo_rlhf.models.cp_packing
        layout = cp_packed_layout(packed, cp, rank)
        if logprob_request is not None:
            kwargs["logprob_request"] = CPLogprobRequest(logprob_request, layout.targets,
                                                         layout.predicts.reshape(-1).nonzero().squeeze(1))
        if moe:  # the MoE padding mask of this rank's packed positions (as at CP=1)
            kwargs["padding_mask"] = (packed.segment_ids == 0).gather(1, layout.positions)
        ids, position_ids, mask = cp_packed_inputs(packed, layout)
        with rope_at_positions(unwrap(model), position_ids):
            return model(ids, position_ids, mask, **kwargs)
    if logprob_request is not None:  # the fused output layer on this rank's positions
        kwargs["logprob_request"] = cp_logprob_request(logprob_request, input_ids, cp, rank)
    pos = cp_positions(input_ids.shape[1], cp, rank, input_ids.device)
    if moe:  # the MoE padding mask of this rank's positions (as at CP=1)
        kwargs["padding_mask"] = (~attention_mask.bool()).index_select(1, pos)
    return model(input_ids.index_select(1, pos), position_ids_for(attention_mask).index_select(1, pos),
                 causal_padding_mask(attention_mask).index_select(2, pos), **kwargs)


def forward_backward(
    model: torch.nn.Module,
    micro_batches: list[dict],
    loss_fn: Optional[LossFn],
    forward_only: bool = False,
    device: Optional[torch.device] = None,
    with_values: Optional[bool] = None,
    logprob_request=None,
    variable_shapes: bool = False,
    routed_tokens=None,
    replay_routes: bool = False,
) -> list[dict]:
    """Run micro-batches through megatron's schedule; return the per-micro-batch stats.

    Args:
        model: one pipeline stage (DDP-wrapped or bare).
        micro_batches: dicts with ``input_ids`` and ``attention_mask`` ``[mbs, seq]`` plus
            whatever ``loss_fn`` reads; all the same shape. A micro-batch with a ``packed``
            entry (:class:`~nemo_rlhf.models.packing.PackedBatch`) runs packed (shapes are
            then variable); its loss function still gets ``[mbs, seq]`` outputs.
        loss_fn: ``(output, micro_batch) -> (loss, stats)``; ``loss`` is a scalar already
            normalised by the global token count. If None (forward only), the stats hold
            the raw output under ``"output"``.
        forward_only: no backward pass (evaluation, old log-probs, reference log-probs).
        device: ``dims.device``: each micro-batch's tensors are moved there in the forward
            step, the one boundary between host data and the model (no copy for tensors
            already there). None: the micro-batches must already be on the model's device.
        with_values: actor-critic stages: whether ``loss_fn`` gets ``(logits, values)``
            (True) or the logits (False); see :func:`model_forward`.
        logprob_request: actor-critic stages: response log-probs instead of logits (the
            fused, chunked output layer); see :func:`model_forward`. A micro-batch with a
            ``prompt_length`` entry (int) gets the request at that prompt length.
        variable_shapes: the micro-batches may differ in shape (token-budget micro-batches
            with their padding cut); under pipeline parallelism each activation's shape is
            then sent ahead of it (megatron's ``variable_seq_lengths``).
        routed_tokens: the non-padding tokens (``attention_mask`` sum) of the whole
            optimizer step, over every micro-batch and DP rank (a float or a scalar tensor):
            the MoE router losses' denominator. Required by a training call of a MoE model
            with ``model.moe_aux_loss_coeff`` or ``model.moe_z_loss_coeff`` > 0; unused
            otherwise. Each micro-batch's router losses then enter the gradient weighted by
            its share of these tokens (see :func:`router_loss_coefficients`).
        replay_routes: MoE routing replay (``moe.routing_replay``): every micro-batch
            carries ``routes`` ``[mbs, seq, L, k]`` int64 (the columns of its
            ``input_ids``; ``L``: this stage's MoE layers) and its forward routes each token
            to them (:class:`~nemo_rlhf.models.routing_replay.RoutingReplay`, installed
            around that micro-batch's forward only). An expert-parallel filler micro-batch
            is not replayed (its output is discarded, its loss multiplied by 0). Not with
            packed micro-batches, nor with ``model.recompute_granularity=full`` (the
            backward's recompute re-runs the routers after the replay is removed; the PPO
            config refuses both). Under context parallelism the routes are padded (``-1``)
            to the ids' columns and cut to this CP rank's positions like the ids
            (:func:`~nemo_rlhf.models.context_parallel.cp_routes`).

    Returns:
        On the last pipeline stage, one stats dict per micro-batch; elsewhere ``[]``.

    Raises:
        ValueError: micro-batches of different shapes without ``variable_shapes``; a
            training call of a MoE model with router losses and no ``routed_tokens``;
            ``replay_routes`` with a micro-batch without ``routes`` or a packed one (and as
            :class:`~nemo_rlhf.models.routing_replay.RoutingReplay` for a bad route).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batches, dummies = _pad_for_expert_parallel(model, list(micro_batches), forward_only, device)
    if not micro_batches:
        return []
    # packed activations are [W, bins, hidden], not the padded [seq, mbs, hidden]
    variable_shapes = variable_shapes or any("packed" in mb for mb in micro_batches)
    mbs, seq = micro_batches[0]["input_ids"].shape
    for i, mb in enumerate(micro_batches):
        if not variable_shapes and tuple(mb["input_ids"].shape) != (mbs, seq):
            raise ValueError(
                f"micro-batch {i} has shape {tuple(mb['input_ids'].shape)}, expected {(mbs, seq)}"
            )
    it = iter(enumerate(micro_batches))
    real = len(micro_batches) - dummies
    if replay_routes:
        for i, mb in enumerate(micro_batches[:real]):
            if "routes" not in mb or "packed" in mb:
                raise ValueError(f"forward_backward(replay_routes=True): micro-batch {i} "
                                 + ("is packed (moe.routing_replay with ppo.sequence_packing)" if "packed" in mb
                                    else "has no 'routes'"))
    cfg = unwrap(model).config
    cp = getattr(cfg, "context_parallel_size", 1) or 1
    if cp > 1:
        from megatron.core import parallel_state as ps

        cp_rank = ps.get_context_parallel_rank()
    else:
        cp_rank = 0
    user_coeffs = (getattr(cfg, "moe_aux_loss_coeff", 0.0), getattr(cfg, "moe_z_loss_coeff", None))
    weighted = router_loss_coefficients(cfg, forward_only, routed_tokens)
    if weighted is not None:
        # megatron keeps the router losses' backward scale in a class attribute, created by
        # the first call that needs it and then updated in place; one made by a backward
        # outside the schedule is a 0-d tensor that the schedule's [1]-shaped update cannot
        # be copied into. The schedule sets it before every backward: start from none.
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.main_loss_backward_scale = None

    def step(data_iterator, stage):
        index, mb = next(data_iterator)
        if device is not None:
            mb = to_device(mb, device)
        dev = mb["input_ids"].device
        request = logprob_request
        if request is not None and "prompt_length" in mb:
            request = replace(request, prompt_length=mb["prompt_length"])
        if weighted is not None:  # this micro-batch's router losses (a filler's: none)
            cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff = (0.0, None) if index >= real else weighted
        replay = nullcontext()  # (a filler routes by its own choice: its output is dropped)
        if replay_routes and index < real:
            routes = mb["routes"]
            if cp > 1:  # this CP rank's positions of the routes, as of the ids (model_forward)
                from nemo_rlhf.models.context_parallel import cp_routes  # lazy: megatron stays out of the CLI

                routes = cp_routes(routes, mb["input_ids"].shape[1], cp, cp_rank)
            replay = RoutingReplay(stage, "replay", routes)
        with filler_forward(index >= real), replay:  # a filler's routed tokens are not counted
            out = model_forward(stage, mb["input_ids"], mb["attention_mask"], with_values, request,
                                packed=mb.get("packed"))

        def loss_func(output):
            one = torch.ones((), dtype=torch.int, device=dev)
            if index >= real:  # an expert-parallel filler: no loss, no statistics
                if forward_only:
                    return torch.zeros((), dtype=torch.float32, device=dev), one, {}
                return loss_fn(output, mb)[0] * 0.0, one, {}
            if loss_fn is None:
                return torch.zeros((), dtype=torch.float32, device=dev), one, {"output": output}
            loss, stats = loss_fn(output, mb)
            return loss, one, stats

        return out, loss_func

    # between pipeline stages, variable shapes are sent ahead of each activation (megatron's
    # variable_seq_lengths: one small p2p per transfer); fixed shapes need none
    variable_before = cfg.variable_seq_lengths
    cfg.variable_seq_lengths = variable_shapes or variable_before
    try:
        results = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=it,
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=forward_only,
        )
    finally:
        cfg.variable_seq_lengths = variable_before
        if weighted is not None:
            cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff = user_coeffs
    return list(results or [])[:real] if real else []


def router_loss_coefficients(cfg, forward_only: bool, routed_tokens) -> Optional[tuple]:
    """The router-loss coefficients a training micro-batch runs with: ``(aux, z)`` divided
    by ``routed_tokens``, or None (no router loss: forward only, a dense model, both 0).

    megatron-core's router, under ``calculate_per_token_loss`` (this project's setting: the
    losses arrive divided by the global token count), attaches each micro-batch's
    ``coeff * loss * T_mb`` (``T_mb`` its non-padding tokens) to the gradient and expects
    the gradients to be divided by the global token count later; here nothing divides them
    later, so the coefficient is divided first: each micro-batch's loss enters with weight
    ``T_mb / routed_tokens``, a token-weighted mean over the step whatever the micro-batch
    and DP sizes. The losses are linear in their coefficient and megatron logs
    ``loss / coeff``, so the logged values stay unscaled.

    Under context parallelism the same coefficients give CP = 1's gradient (checked by
    ``tests/distributed/test_ppo_context_parallel_moe.py``): megatron's load-balancing loss
    (``TopKRouter._apply_aux_loss``) takes the tokens per expert and the token count over
    the router's TP x CP group and the probabilities of this rank's positions, so the CP
    ranks' losses sum to the whole micro-batch's, and it attaches each one times the
    micro-batch's whole token count (``get_tokens_per_expert_and_token_count`` all-reduces
    the local counts in place, so its "local" count is the group's too); the gradients summed
    over CP are CP = 1's. The z-loss is not (megatron divides its coefficient by the TP x CP
    size and logs each rank's own token mean): refused under CP by the PPO config.

    Args:
        cfg: the model's megatron ``TransformerConfig`` (its MoE coefficients are the
            user's: ``model.moe_aux_loss_coeff`` / ``model.moe_z_loss_coeff``).
        forward_only: no backward pass (no router loss is computed).
        routed_tokens: see :func:`forward_backward`.

    Raises:
        ValueError: router losses on, a training call, and ``routed_tokens`` None or < 1.
    """
    aux, z = getattr(cfg, "moe_aux_loss_coeff", 0.0) or 0.0, getattr(cfg, "moe_z_loss_coeff", None) or 0.0
    if forward_only or not getattr(cfg, "num_moe_experts", None) or not (aux or z):
        return None
    if routed_tokens is None or float(routed_tokens) < 1:
        raise ValueError(
            f"a training forward/backward of a MoE model with router losses "
            f"(model.moe_aux_loss_coeff={aux}, model.moe_z_loss_coeff={z}) needs "
            f"routed_tokens, the step's non-padding tokens over every micro-batch and DP rank "
            f"(got {routed_tokens})")
    n = float(routed_tokens)
    return aux / n, (z / n if z else None)


def _pad_for_expert_parallel(model, micro_batches: list[dict], forward_only: bool,
                             device: Optional[torch.device]) -> tuple[list[dict], int]:
    """``micro_batches`` extended to the expert-parallel group's most (see the module
    docstring), and how many were added (0 without expert parallelism: no collective).

    Raises:
        ValueError: on every rank of the group, a training call where some rank has no
            micro-batch and others have some (there is nothing to run a zero-loss copy of).
    """
    group = expert_exchange_group(model)
    if group is None:
        return micro_batches, 0
    if device is None:  # the micro-batches are on the model's device (forward_backward's contract)
        device = next(unwrap(model).parameters()).device
    fewest, most = agree_on_micro_batch_count(len(micro_batches), group, device)
    extra = most - len(micro_batches)
    if not extra:
        return micro_batches, 0
    if fewest == 0 and not forward_only:
        raise ValueError(
            f"a training forward/backward at parallel.expert_model_parallel_size > 1 where some "
            f"expert-parallel rank has no micro-batch and another has {most}: every data-parallel "
            f"rank of an expert-parallel group must train on rows")
    if micro_batches:
        filler = micro_batches[-1]
    else:
        ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        filler = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return micro_batches + [filler] * extra, extra


def finalize_grads(model: torch.nn.Module) -> None:
    """All-reduce gradients over DP (sum), and tied-embedding grads across PP stages."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([model])
