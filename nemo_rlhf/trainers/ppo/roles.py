"""The PPO job's roles: the policy (actor) and the critic, each behind one interface.

* :class:`PolicyRole` -- the actor's stage and optimizer: the log-probs (and, with the
  value head on its backbone, the values) of a rollout in forward-only micro-batches, the
  same pass for the reference (its weights swapped into the backbone), one training
  mini-batch (forward/backward through megatron's schedule, the optimizer step).
* :class:`CriticRole` -- where the values come from and how they are trained, chosen once
  where the job is assembled (:func:`build_critic_role`):
  :class:`SharedValueHead` (``critic.mode=shared`` / ``shared_detached``: a value head on
  the actor's backbone, trained by the actor's loss), :class:`SeparateCritic`
  (``critic.mode=separate``: its own backbone, head and optimizer) and :class:`NoCritic`
  (critic-free estimators: no values). The trainer's step reads no critic-mode flag: it
  asks the role.

The split follows verl's actor/critic workers and NeMo-RL's policy interface, without
their worker groups: the roles live in the trainer's processes.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Optional

import torch

from nemo_rlhf.algorithms import ppo as P
from nemo_rlhf.distributed.split import chunk_slices
from nemo_rlhf.models.engine import finalize_grads, forward_backward
from nemo_rlhf.models.logprobs import LogprobRequest, response_logprobs, response_values
from nemo_rlhf.models.context_parallel import (cp_response_index, cp_token_logprobs, gather_response,
                                               shard_response)
from nemo_rlhf.models.cp_packing import (cp_packed_layout, gather_packed_response, packed_sequence_tokens,
                                         shard_packed)
from nemo_rlhf.models.logprobs import ResponseLogprobs
from nemo_rlhf.models.vocab_parallel import vocab_parallel_logprobs
from nemo_rlhf.trainers.ppo.micro_batches import (pad_for_context_parallel, plan_micro_batches,
                                                  row_extents, scatter_rows, take)


@contextmanager
def eval_mode(model):
    """Forward-only passes run in eval mode (no dropout); the previous mode is restored."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def is_value_head(name: str) -> bool:
    """Whether a parameter name belongs to the value head."""
    return "value_head" in name.split(".")


def mb_response_columns(mb: dict, batch) -> tuple[int, int]:
    """``(P, R)`` of a forward-only micro-batch: a token-budget one's own prompt and
    response columns (:func:`~nemo_rlhf.trainers.ppo.micro_batches.take`), else the
    rollout's."""
    if "prompt_length" in mb:
        return mb["prompt_length"], mb["response_length"]
    return batch.prompt_length, batch.response_mask.shape[1]


def cp_sequence_tokens(mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each of this CP rank's positions' whole row's training-token count (``n_b`` of
    ``seq-mean-token-mean``, :func:`~nemo_rlhf.algorithms.ppo.losses.aggregate_loss`): the
    row's count over its whole ``[B, R]`` mask, not over the rank's shard of it.

    Args:
        mask: ``[B, R]`` the micro-batch's whole response (loss) mask.
        index: ``[S/cp]`` :func:`~nemo_rlhf.models.context_parallel.cp_response_index`'s.

    Returns:
        ``[B, S/cp]`` float32 on ``mask``'s device.
    """
    return mask.bool().sum(1, keepdim=True).to(torch.float32).expand(-1, index.numel())


class CPShard:
    """This CP rank's share of one micro-batch, padded (its ``[B, S/cp]`` positions,
    :func:`~nemo_rlhf.models.context_parallel.cp_response_index`) or packed (its ``[bins,
    W/cp]`` packed positions, :func:`~nemo_rlhf.models.cp_packing.cp_packed_layout`): how
    the ``[rows, R]`` loss inputs are sharded like the forward's outputs and how those are
    gathered back.

    Args:
        mb: the micro-batch (``input_ids``; a token-budget one's ``prompt_length``; a packed
            one's ``packed``).
        dims: ``ParallelDims`` (``cp`` > 1).
        prompt_length / response_length: ``P`` and ``R`` of the micro-batch's ``[rows, R]``
            tensors.
    """

    def __init__(self, mb: dict, dims, prompt_length: int, response_length: int) -> None:
        self.dims, self.response_length = dims, response_length
        self.packed = mb.get("packed")
        self.ids = mb["input_ids"]
        if self.packed is not None:
            self.layout = cp_packed_layout(self.packed, dims.cp, dims.cp_rank)
        else:
            self.prompt_length = prompt_length
            self.index, self.valid = cp_response_index(self.ids.shape[1], prompt_length, response_length, dims,
                                                       self.ids.device)

    def local(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``[rows, R]`` -> this rank's positions (0 / False where none); None stays None."""
        if t is None:
            return None
        return shard_packed(t, self.layout) if self.packed is not None else shard_response(t, self.index, self.valid)

    def logprobs(self, output, temperature: float, vocab_size: int, compute_entropy: bool = True):
        """``(logprobs, entropy)`` of this rank's positions from its logits (or the fused
        output layer's :class:`~nemo_rlhf.models.logprobs.ResponseLogprobs`)."""
        if self.packed is None or isinstance(output, ResponseLogprobs):
            return cp_token_logprobs(output, self.ids, self.dims, temperature, vocab_size=vocab_size,
                                     compute_entropy=compute_entropy)
        d = self.dims
        return vocab_parallel_logprobs(output, self.layout.targets, d.tp_group, d.tp_rank, temperature=temperature,
                                       vocab_size=vocab_size, compute_entropy=compute_entropy)

    def sequence_tokens(self, mask: torch.Tensor) -> torch.Tensor:
        """Each position's whole row's training-token count (``seq-mean-token-mean``)."""
        if self.packed is not None:
            return packed_sequence_tokens(mask, self.layout)
        return cp_sequence_tokens(mask, self.index)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-position outputs of every CP rank back to ``[rows, R]``."""
        if self.packed is not None:
            return gather_packed_response(local, self.layout, self.packed.rows, self.response_length,
                                          self.dims.cp_group)
        return gather_response(local, self.prompt_length, self.response_length, self.dims)


class ForwardPasses:
    """How a rollout is cut into forward-only micro-batches and put back together.

    Args:
        dims: ``ParallelDims`` (its ``device``: where micro-batches are built).
        vocab_size: the model's real vocabulary size.
        forward_micro_batch_size: rows per forward-only pass; a batch it does not divide
            has its last micro-batch topped up with copies of its last row (dropped again).
        max_tokens_per_micro_batch / sequence_packing / packed_row_length: the token
            budget (``ppo.*``; 0: fixed row counts).
        logprob_chunk_size: the fused output layer's chunk (0: the logits path).
    """

    def __init__(self, dims, vocab_size: int, forward_micro_batch_size: int,
                 max_tokens_per_micro_batch: int = 0, sequence_packing: bool = False,
                 packed_row_length: int = 0, logprob_chunk_size: int = 0) -> None:
        self.dims, self.vocab_size, self.forward_micro_batch_size = dims, vocab_size, forward_micro_batch_size
        self.max_tokens_per_micro_batch, self.sequence_packing = max_tokens_per_micro_batch, sequence_packing
        self.packed_row_length, self.logprob_chunk_size = packed_row_length, logprob_chunk_size

    @classmethod
    def from_config(cls, ppo, vocab_size: int, dims) -> "ForwardPasses":
        """The PPO job's: its ``ppo`` section's sizes."""
        return cls(dims, vocab_size, ppo.forward_micro_batch_size, ppo.max_tokens_per_micro_batch,
                   ppo.sequence_packing, ppo.packed_row_length, ppo.logprob_chunk_size)

    def micro_batches(self, batch, routes: bool = False) -> tuple[list[dict], Optional[list]]:
        """``forward_micro_batch_size`` rows of the full width, or, with
        ``max_tokens_per_micro_batch``, grouped by the token budget with their padding
        cut, rows concatenated with ``sequence_packing`` (and the plans, to put the rows
        back; None for fixed row counts). ``routes``: each micro-batch also carries the
        rollout's MoE ``routes`` (``[rows, columns, L, k]``, the same rows and columns as
        its ``input_ids``; routing replay). Under context parallelism (``dims.cp`` > 1) the
        micro-batches' columns (full-width, or a token-budget micro-batch's kept ones) are
        right-padded to a multiple of ``2 * cp``
        (:func:`~nemo_rlhf.trainers.ppo.micro_batches.pad_for_context_parallel`; MoE, and so
        ``routes``, is refused with CP).

        Raises:
            ValueError: ``routes`` for a batch without :attr:`RolloutBatch.routes`.
        """
        P_len, B = batch.prompt_length, batch.input_ids.shape[0]
        tensors = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        if routes:
            if getattr(batch, "routes", None) is None:
                raise ValueError("moe.routing_replay=true: the rollout batch has no routes (the megatron "
                                 "engine records them; RolloutBatch.routes is None)")
            tensors["routes"] = batch.routes
        budget = self.max_tokens_per_micro_batch
        if budget == 0:
            mbs = min(self.forward_micro_batch_size, B)
            filler = (-B) % mbs
            if filler:  # the last micro-batch topped up (megatron's schedule: one shape)
                tensors = {k: torch.cat([v, v[-1:].expand(filler, *v.shape[1:])]) for k, v in tensors.items()}
            return [pad_for_context_parallel({k: v[s] for k, v in tensors.items()}, self.dims.cp)
                    for s in chunk_slices(B + filler, mbs)], None
        starts, lengths = row_extents(batch.attention_mask, batch.response_mask, P_len)
        plans = plan_micro_batches(starts, lengths, P_len, list(range(B)), B, budget,
                                   pack=self.sequence_packing, row_length=self.packed_row_length)
        cp = self.dims.cp
        return [pad_for_context_parallel(take(p, tensors, P_len, self.dims.device, align=2 * cp), cp)
                for p in plans], plans

    @staticmethod
    def gather(res: list[dict], plans: Optional[list], batch) -> Optional[dict]:
        """Per-micro-batch results as ``[B, R]`` tensors in row order (None: no results,
        off the last pipeline stage)."""
        if not res:
            return None
        B = batch.input_ids.shape[0]
        if plans is None:  # (a topped-up last micro-batch's copies dropped)
            return {k: torch.cat([r[k] for r in res])[:B] for k in res[0]}
        R = batch.response_mask.shape[1]
        return {k: scatter_rows(plans, [r[k] for r in res], B, R) for k in res[0]}

    def logprob_request(self, prompt_length: int, temperatures: tuple, entropy: bool
                        ) -> Optional[LogprobRequest]:
        """The fused, chunked output layer's request (``logprob_chunk_size``; None: off,
        the forward returns logits)."""
        chunk = self.logprob_chunk_size
        if chunk == 0:
            return None
        return LogprobRequest(prompt_length, tuple(dict.fromkeys(temperatures)), self.vocab_size,
                              compute_entropy=entropy, chunk_size=chunk)


class PolicyRole:
    """The actor: its DDP-wrapped stage, optimizer and forward passes.

    Args:
        model: this rank's DDP-wrapped actor(-critic) stage.
        optimizer: its :class:`~nemo_rlhf.trainers.mixed_precision.MixedPrecisionOptimizer` (None:
            forward passes only, e.g. the evaluator).
        passes: the job's :class:`ForwardPasses`.
        dims: ``ParallelDims``.
        temperature: the rollout's ``logprob_temperature`` (the training log-probs').
        kl_temperature: the KL's (``kl.temperature``): both log-probs of the penalty.
        with_values: the actor's forward also returns the value head's values.
        routing_replay: ``moe.routing_replay`` (MoE routing replay, R3): the training
            forwards (:meth:`train_minibatch`) route every token to the rollout's recorded
            experts; the forward-only passes only when asked (:meth:`logprobs`'s
            ``replay_routes``: the old log-probs, not the reference).
    """

    def __init__(self, model, optimizer, passes: ForwardPasses, dims, temperature: float,
                 kl_temperature: float, with_values: bool, routing_replay: bool = False) -> None:
        self.model, self.optimizer, self.passes, self.dims = model, optimizer, passes, dims
        self.temperature, self.kl_temperature, self.with_values = temperature, kl_temperature, with_values
        self.routing_replay = routing_replay
        """``moe.routing_replay``: the training micro-batches carry the rollout's ``routes``
        and :meth:`train_minibatch`'s forwards replay them."""
        self.weights_version = 0
        """Changes whenever the weights do (an optimizer step, a checkpoint load): a rollout
        engine with its own copy of the weights refits when it differs."""

    def logprobs(self, batch, model=None, *, temperature: Optional[float] = None,
                 kl_temperature: Optional[float] = None, with_values: bool = False,
                 replay_routes: bool = False) -> Optional[dict]:
        """Forward-only over a rollout in micro-batches, in eval mode.

        Args:
            batch: a ``RolloutBatch`` (``input_ids [B, P+R]``, ``response_mask [B, R]``).
            model: the stage to run (None: the actor's; the reference passes the model its
                weights are swapped into).
            temperature: of ``logprobs`` (None: the rollout's).
            kl_temperature: also ``kl_logprobs`` at this temperature, when it differs.
            with_values: also the value head's ``values``.
            replay_routes: route every token of the forward to the rollout's recorded
                experts (``batch.routes`` ``[B, P+R, L, k]``; MoE routing replay); the
                values of a value head on this backbone then come from the same replayed
                forward.

        Returns:
            ``{"logprobs": [B, R] float32, "values"?, "kl_logprobs"?}`` on the last pipeline
            stage; None on the others.

        Raises:
            ValueError: ``replay_routes`` for a batch without routes, or with packed
                micro-batches (:func:`~nemo_rlhf.models.engine.forward_backward`).
        """
        model = self.model if model is None else model
        P_len, vocab, dims = batch.prompt_length, self.passes.vocab_size, self.dims
        temp = self.temperature if temperature is None else temperature

        def cp_loss_fn(output, mb):  # context parallel: this rank's positions, then gathered
            logits, values = output if isinstance(output, tuple) else (output, None)
            ids, shard = mb["input_ids"], CPShard(mb, dims, *mb_response_columns(mb, batch))

            def response_lp(t):
                return shard.gather(shard.logprobs(logits, t, vocab, compute_entropy=False)[0])

            out = {"logprobs": response_lp(temp)}
            if kl_temperature is not None and kl_temperature != temp:
                out["kl_logprobs"] = response_lp(kl_temperature)
            if with_values and values is not None:
                out["values"] = shard.gather(values.float())
            return torch.zeros((), device=ids.device), out

        def loss_fn(output, mb):
            if dims.cp > 1:
                return cp_loss_fn(output, mb)
            logits, values = output if isinstance(output, tuple) else (output, None)
            p = mb.get("prompt_length", P_len)
            lp, _ = response_logprobs(logits, (mb["input_ids"], p), dims, temp,
                                      vocab_size=vocab, compute_entropy=False)
            out = {"logprobs": lp}
            if kl_temperature is not None and kl_temperature != temp:
                out["kl_logprobs"], _ = response_logprobs(
                    logits, (mb["input_ids"], p), dims, kl_temperature, vocab_size=vocab,
                    compute_entropy=False)
            if with_values and values is not None:
                out["values"] = response_values(values, p, lp.shape[1])
            return torch.zeros((), device=lp.device), out

        micro, plans = self.passes.micro_batches(batch, routes=replay_routes)
        temps = (temp,) if kl_temperature is None or kl_temperature == temp else (temp, kl_temperature)
        with torch.no_grad(), eval_mode(model):
            res = forward_backward(model, micro, loss_fn, forward_only=True, with_values=with_values,
                                   variable_shapes=plans is not None, device=dims.device,
                                   logprob_request=self.passes.logprob_request(P_len, temps, entropy=False),
                                   replay_routes=replay_routes)
        return self.passes.gather(res, plans, batch)

    def loss_fn(self, objective: P.PPOObjective, n_tokens: torch.Tensor, n_seqs: torch.Tensor,
                P_len: int, value_only: bool) -> Callable:
        """The training micro-batches' loss function: the current log-probs, entropy (and
        values with a value head on this backbone) into :func:`~nemo_rlhf.algorithms.ppo.ppo_loss`
        over the global ``n_tokens`` / ``n_seqs`` (scalar tensors: all micro-batches and DP
        ranks); ``value_only``: the value loss alone (a critic warm-up on this backbone)."""
        temp, kl_temp, dims, vocab = self.temperature, self.kl_temperature, self.dims, self.passes.vocab_size
        with_kl = objective.kl_loss_coef > 0 and not value_only
        with_values = self.with_values

        def cp_fn(output, mb):
            """Context parallel: every per-token term on this rank's positions, the [B, R]
            inputs sharded alike; the global counts make the CP ranks' losses (and, summed
            by DDP over the data-parallel-with-CP group, their gradients) add up to CP=1's."""
            logits, values = output if isinstance(output, tuple) else (output, None)
            mask = mb["response_mask"]
            shard = CPShard(mb, dims, mb.get("prompt_length", P_len), mask.shape[1])  # a token-budget
            local = shard.local  # micro-batch has its own prompt length

            lp, ent = shard.logprobs(logits, temp, vocab)
            lp_kl = None
            if with_kl:
                lp_kl = lp if kl_temp == temp else shard.logprobs(logits, kl_temp, vocab, compute_entropy=False)[0]
            return P.ppo_loss(
                objective, lp, ent, local(mask.bool()), n_tokens, n_seqs,
                old_logprobs=local(mb["old_logprobs"]), advantages=local(mb["advantages"]),
                values=values.float() if with_values else None,
                old_values=local(mb.get("old_values")), returns=local(mb.get("returns")),
                kl_logprobs=lp_kl, ref_logprobs=local(mb.get("ref_logprobs")), policy=not value_only,
                rollout_weights=local(mb.get("rollout_weights")),
                sequence_tokens=shard.sequence_tokens(mask))

        def fn(output, mb):
            if dims.cp > 1:
                return cp_fn(output, mb)
            logits, values = output if isinstance(output, tuple) else (output, None)
            p = mb.get("prompt_length", P_len)  # a token-budget micro-batch has its own
            lp, ent = response_logprobs(logits, (mb["input_ids"], p), dims, temp, vocab_size=vocab)
            lp_kl = None
            if with_kl:
                lp_kl = lp if kl_temp == temp else response_logprobs(
                    logits, (mb["input_ids"], p), dims, kl_temp, vocab_size=vocab,
                    compute_entropy=False)[0]
            return P.ppo_loss(
                objective, lp, ent, mb["response_mask"], n_tokens, n_seqs,
                old_logprobs=mb["old_logprobs"], advantages=mb["advantages"],
                values=response_values(values, p, lp.shape[1]) if with_values else None,
                old_values=mb.get("old_values"), returns=mb.get("returns"),
                kl_logprobs=lp_kl, ref_logprobs=mb.get("ref_logprobs"), policy=not value_only,
                rollout_weights=mb.get("rollout_weights"))

        return fn

    def train_minibatch(self, micro: list[dict], loss_fn: Callable, P_len: int,
                        variable_shapes: bool, value_head_only: bool = False,
                        routed_tokens=None) -> tuple[list[dict], bool, float]:
        """One mini-batch: forward/backward over ``micro``, the gradients finalised (DP
        all-reduce), one optimizer step (``value_head_only``: the value head's parameters
        only, so the policy does not move: no update, Adam state or weight decay).
        ``routed_tokens``: the mini-batch's non-padding tokens over DP, the MoE router
        losses' denominator (:func:`~nemo_rlhf.models.engine.forward_backward`). With
        :attr:`routing_replay` each micro-batch carries ``routes`` and its forward replays
        them.

        Returns:
            ``(per-micro-batch statistics, stepped, grad norm)``; ``stepped`` is False for
            a skipped (non-finite) step.
        """
        self.optimizer.zero_grad()
        res = forward_backward(
            self.model, micro, loss_fn, with_values=self.with_values, variable_shapes=variable_shapes,
            logprob_request=self.passes.logprob_request(P_len, (self.temperature, self.kl_temperature),
                                                        entropy=True),
            routed_tokens=routed_tokens, replay_routes=self.routing_replay)
        finalize_grads(self.model)
        if value_head_only:
            stepped, norm = self.optimizer.step(only=is_value_head)
        else:
            stepped, norm = self.optimizer.step()
            if stepped:
                self.weights_version += 1
        return res, stepped, norm


class CriticRole:
    """Where the values ``V(s_t)`` come from and how they are trained (one interface for
    every ``critic.mode`` and for none).

    Attributes:
        needs_values: the advantage estimator reads values (False: :class:`NoCritic`).
        on_actor_backbone: the actor's forward gives the values (a value head on it).
        warmup_trains_actor_head: during ``trainer.critic_warmup_steps`` the actor's
            optimizer steps its value head only (True), or the actor is left alone (False).
    """

    needs_values = True
    on_actor_backbone = False
    warmup_trains_actor_head = False

    def values(self, batch, actor_out: Optional[dict], timers) -> Optional[torch.Tensor]:
        """The rollout's old values ``[B, R]`` float32 (None: no critic, or off the last
        pipeline stage); ``actor_out``: the actor's forward results (or the rollout's)."""
        raise NotImplementedError

    def train(self) -> None:
        """Training mode (dropout on) for the update."""

    def train_minibatch(self, micro: list[dict], objective, n_tokens, n_seqs, P_len: int,
                        variable_shapes: bool, routed_tokens=None) -> Optional[tuple[list[dict], bool, float]]:
        """The critic's own step on one mini-batch (None: trained by the actor's loss, or
        not at all). ``routed_tokens`` as in :meth:`PolicyRole.train_minibatch`."""
        return None

    def training_tensors(self, fwd, adv) -> dict:
        """What the value loss reads, by name: ``old_values`` and ``returns`` ``[B, R]``."""
        return {"old_values": fwd.values, "returns": adv.returns}

    def explained_variance_sums(self, fwd, adv, mask: torch.Tensor) -> Optional[torch.Tensor]:
        """The explained variance's five sums (float64, on ``mask.device``), None without
        a critic."""
        return P.explained_variance_sums(fwd.values, adv.returns, mask)

    @property
    def checkpoint(self) -> Optional[tuple]:
        """``(stage, optimizer)`` saved beside the actor (``critic.`` tensors), or None."""
        return None


class SharedValueHead(CriticRole):
    """``critic.mode=shared`` / ``shared_detached``: a value head on the actor's backbone,
    trained by the actor's loss (``value_loss_coef * value_loss``); detached, its input has
    the gradient stopped (set on the model when it is built). With ``moe.routing_replay``
    its values come out of the actor's replayed forwards (old values and trained values)."""

    on_actor_backbone = True
    warmup_trains_actor_head = True

    def values(self, batch, actor_out, timers):
        return None if actor_out is None else actor_out.get("values")


class SeparateCritic(CriticRole):
    """``critic.mode=separate``: its own backbone + value head and optimizer. Its forwards
    route by its own routers: with ``moe.routing_replay`` the training micro-batches it
    shares with the actor carry ``routes``, which it does not replay.

    Args:
        model: the critic's DDP-wrapped stage; optimizer: its optimizer.
        passes: the job's :class:`ForwardPasses`.
    """

    def __init__(self, model, optimizer, passes: ForwardPasses) -> None:
        self.model, self.optimizer, self.passes = model, optimizer, passes

    def values(self, batch, actor_out, timers):
        """Forward-only over the rollout (eval mode, the forward micro-batches)."""
        P_len, dims = batch.prompt_length, self.passes.dims

        def loss_fn(values, mb):
            if dims.cp > 1:  # this CP rank's positions, gathered to [B, R] on every CP rank
                v = CPShard(mb, dims, *mb_response_columns(mb, batch)).gather(values.float())
                return torch.zeros((), device=v.device), {"values": v}
            p = mb.get("prompt_length", P_len)
            v = response_values(values, p, mb["input_ids"].shape[1] - p)
            return torch.zeros((), device=v.device), {"values": v}

        with timers("critic_values"):
            micro, plans = self.passes.micro_batches(batch)
            with torch.no_grad(), eval_mode(self.model):
                res = forward_backward(self.model, micro, loss_fn, forward_only=True,
                                       variable_shapes=plans is not None)
            out = self.passes.gather(res, plans, batch)
        return None if out is None else out["values"]

    def train(self) -> None:
        self.model.train()

    def train_minibatch(self, micro, objective, n_tokens, n_seqs, P_len, variable_shapes,
                        routed_tokens=None):
        """:func:`~nemo_rlhf.algorithms.ppo.critic_loss` over the global counts, one step
        (under context parallelism on this CP rank's positions, as the actor's loss)."""
        dims = self.passes.dims

        def fn(values, mb):
            m = mb["response_mask"]
            if dims.cp > 1:
                shard = CPShard(mb, dims, mb.get("prompt_length", P_len), m.shape[1])
                return P.critic_loss(objective, values.float(), shard.local(mb["old_values"]),
                                     shard.local(mb["returns"]), shard.local(m.bool()), n_tokens, n_seqs,
                                     sequence_tokens=shard.sequence_tokens(m))
            return P.critic_loss(objective, response_values(values, mb.get("prompt_length", P_len), m.shape[1]),
                                 mb["old_values"], mb["returns"], m, n_tokens, n_seqs)

        self.optimizer.zero_grad()
        res = forward_backward(self.model, micro, fn, variable_shapes=variable_shapes,
                               routed_tokens=routed_tokens)
        finalize_grads(self.model)
        stepped, norm = self.optimizer.step()
        return res, stepped, norm

    @property
    def checkpoint(self):
        return self.model, self.optimizer


class NoCritic(CriticRole):
    """Critic-free estimators (``grpo``, ``rloo``, ``reinforce_plus_plus``, ...): no values
    are computed, none trained."""

    needs_values = False

    def values(self, batch, actor_out, timers):
        return None

    def training_tensors(self, fwd, adv) -> dict:
        return {}

    def explained_variance_sums(self, fwd, adv, mask):
        return None


def build_critic_role(needs_values: bool, separate: Optional[tuple], passes: ForwardPasses) -> CriticRole:
    """The job's critic role, chosen once.

    Args:
        needs_values: the estimator's :attr:`~nemo_rlhf.algorithms.ppo.EstimatorTraits.needs_values`.
        separate: ``(stage, optimizer)`` of ``critic.mode=separate``, or None (the value
            head on the actor's backbone).
        passes: the job's :class:`ForwardPasses`.
    """
    if not needs_values:
        return NoCritic()
    if separate is not None:
        return SeparateCritic(*separate, passes)
    return SharedValueHead()


def no_timers(_name: str):
    """A stand-in for :class:`~nemo_rlhf.metrics.timers.Timers` that times nothing."""
    return nullcontext()


__all__ = ["CriticRole", "ForwardPasses", "NoCritic", "PolicyRole", "SeparateCritic",
           "SharedValueHead", "build_critic_role", "eval_mode", "is_value_head"]
