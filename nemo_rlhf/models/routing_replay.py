"""MoE routing replay (R3, "Rollout Routing Replay", arXiv 2510.11370).

The rollout engine and the training forward compute the router logits with different
kernels / reduction orders (or precisions); a token whose top-k experts are close can then be
routed to different experts in the two passes, and its log-prob under the trainer differs from
the behaviour log-prob by far more than rounding (Megatron-LM #4168: GRPO on Qwen3-30B-A3B).
R3 records the experts each token was routed to during the rollout and makes the training
forward route every token to those same experts. The gating weights are still computed from
the *training* router's logits: R3 (its eq. 5-6) masks the training logits to the replayed
experts and takes the softmax over them, so the router keeps its gradients (through the
weights of the experts it chose in the rollout) while the discrete choice is the rollout's.

This module does that with megatron-core 0.16.1's own hook: ``TopKRouter.routing`` hands
its ``router_replay`` attribute (megatron's ``RouterReplay``, created only under
``moe_enable_routing_replay``, kept in a process-global list) to
``topk_routing_with_score_function``, which asks its ``get_replay_topk(scores, topk, ...)``
for ``(top-k scores, top-k indices)``. :class:`RoutingReplay` installs its own per-router
object there for the duration of a ``with`` block (no global list, so several models
(policy, reference, critic) do not share state) and removes it on exit. In replay the scores
are ``scores.gather(1, replayed_indices)``, exactly what megatron's ``REPLAY_FORWARD`` does:

* ``moe_router_pre_softmax=False`` (renormalised top-k, Qwen3-MoE / Mixtral): ``scores`` are
  the logits, the weights ``softmax`` over the k gathered logits: R3's masked softmax.
* ``moe_router_pre_softmax=True``: ``scores`` are the full softmax, the weights its k
  gathered entries (as without replay, only the indices are the rollout's).

Layout: a router called on hidden states ``[s, b, hidden]`` sees ``s * b`` tokens in
``(s, b)`` order. Routes are kept batch-first, ``[B, S, L, k]`` int64 (``L`` = the MoE
layers of this pipeline stage, in module order; ``S`` = the positions of the forward), on the
routers' device. Recording follows a KV-cache decode: the first call of each layer (the
prefill, ``s = P``) and then one call per decode step (``s = 1``), concatenated along ``S``.
An index of ``-1`` in a replayed route means "no recorded route": the router's own top-k is
used there (the last position of a rollout, whose token was never fed to the model).

Not supported (raises): megatron's fused router (``moe_router_fusion``, TE) and the sinkhorn
router, which never call the hook.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def moe_routers(model: torch.nn.Module) -> list:
    """The megatron ``TopKRouter`` modules of ``model`` (this pipeline stage), in module
    order (= layer order); empty for a dense model."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class _LayerReplay:
    """The per-router object :class:`RoutingReplay` puts in ``TopKRouter.router_replay``
    (duck-typed as megatron's ``RouterReplay``: only ``get_replay_topk`` is called)."""

    def __init__(self, owner: "RoutingReplay", layer: int, router):
        self.owner, self.layer, self.router = owner, layer, router
        self.shape_sb: Optional[tuple[int, int]] = None  # (s, b) of the current call
        self.recorded: list[torch.Tensor] = []  # record: [s, b, k] per call
        self.target: Optional[torch.Tensor] = None  # replay: [S, B, k] for the forward

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk: Callable = None):
        """megatron's hook: ``(top-k scores [tokens, k], top-k indices [tokens, k])``."""
        probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        s, b = self._call_shape(scores.shape[0])
        if self.owner.mode == "record":
            self.recorded.append(idx.detach().view(s, b, topk))
            return probs, idx
        target = self.target
        if target is None:
            raise RuntimeError(f"routing replay: MoE layer {self.layer} has no route to replay")
        want = (s, b, topk)
        if tuple(target.shape) != want:
            raise ValueError(f"routing replay: MoE layer {self.layer} is called on {s} positions x {b} "
                             f"rows with top-{topk}, expected a route [B, S, L, k] = "
                             f"[{b}, {s}, {len(self.owner.layers)}, {topk}] (batch-first), got "
                             f"[B, S, L, k] = [{target.shape[1]}, {target.shape[0]}, "
                             f"{len(self.owner.layers)}, {target.shape[2]}]")
        forced = target.reshape(s * b, topk).to(scores.device)
        forced = torch.where(forced < 0, idx, forced)
        return scores.gather(1, forced), forced

    def _call_shape(self, tokens: int) -> tuple[int, int]:
        sb = self.shape_sb
        if sb is None or sb[0] * sb[1] != tokens:
            raise RuntimeError(f"routing replay: MoE layer {self.layer}'s router saw {tokens} tokens, "
                               f"its input shape was {sb}")
        return sb


class RoutingReplay:
    """Record or replay the top-k experts of every MoE layer of ``model`` (a context manager).

    ``with RoutingReplay(model, "record") as rr: generate(...)``, then :meth:`routes` is the
    ``[B, S, L, k]`` int64 route of every position of the decode (the module docstring).
    ``with RoutingReplay(model, "replay", routes): model_forward(...)`` routes every token of
    each forward in the block to ``routes`` (same ``[B, S, L, k]`` as that forward's
    ``[B, S]`` input; every forward and activation-recompute of the block replays the same
    route). A dense model: :attr:`active` is False and both modes do nothing (``routes()`` is
    None).

    Args:
        model: this rank's pipeline stage (megatron ``GPTModel`` / ``ActorCriticModel``,
            optionally wrapped).
        mode: ``"record"`` or ``"replay"``.
        routes: replay only: ``[B, S, L, k]`` integer expert ids (``-1``: the router's own
            choice at that position), on any device (moved to the routers').

    Raises:
        ValueError: a bad ``mode``; ``routes`` missing in replay / given in record, not 4-D,
            or with ``L`` other than the stage's MoE layers; a router that cannot replay
            (fused or sinkhorn routing), another replay already installed. During the block:
            a layer whose call does not match the route (naming the layer, expected and got
            shapes). An expert id out of range is refused at construction (one host sync).
    """

    def __init__(self, model: torch.nn.Module, mode: str, routes: Optional[torch.Tensor] = None):
        if mode not in ("record", "replay"):
            raise ValueError(f"RoutingReplay: mode={mode!r}; valid: 'record', 'replay'")
        if (routes is None) != (mode == "record"):
            raise ValueError(f"RoutingReplay: mode={mode!r} " + (
                "needs the routes to replay" if routes is None else "takes no routes"))
        self.mode = mode
        self.routers = moe_routers(model)
        self.active = bool(self.routers)
        for i, r in enumerate(self.routers):
            if r.config.moe_router_fusion or getattr(r, "routing_type", "aux_loss") == "sinkhorn":
                raise ValueError(f"RoutingReplay: MoE layer {i} uses fused or sinkhorn routing, "
                                 f"which megatron runs without the replay hook")
            if getattr(r, "router_replay", None) is not None:
                raise ValueError(f"RoutingReplay: MoE layer {i} already has a router_replay installed")
        self.layers = [_LayerReplay(self, i, r) for i, r in enumerate(self.routers)]
        if routes is not None and self.active:
            if routes.dim() != 4 or routes.shape[2] != len(self.layers):
                raise ValueError(f"RoutingReplay: routes must be [B, S, L, k] with L = "
                                 f"{len(self.layers)} MoE layers on this stage, got {tuple(routes.shape)}")
            experts = self.routers[0].config.num_moe_experts
            if int(routes.max()) >= experts or int(routes.min()) < -1:
                raise ValueError(f"RoutingReplay: routes hold expert ids in [{int(routes.min())}, "
                                 f"{int(routes.max())}]; valid: 0..{experts - 1} (or -1: the router's own)")
            for i, lr in enumerate(self.layers):
                lr.target = routes[:, :, i, :].transpose(0, 1)  # [S, B, k]
        self._handles: list = []

    def __enter__(self) -> "RoutingReplay":
        for lr in self.layers:
            lr.router.router_replay = lr
            self._handles.append(lr.router.register_forward_pre_hook(self._pre_hook(lr), with_kwargs=True))
        return self

    @staticmethod
    def _pre_hook(lr: _LayerReplay):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["input"]  # [s, b, hidden]
            lr.shape_sb = (int(x.shape[0]), int(x.shape[1]))
        return hook

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for lr in self.layers:
            lr.router.router_replay = None

    def routes(self) -> Optional[torch.Tensor]:
        """Record mode: the recorded ``[B, S, L, k]`` int64 routes (``S`` = prefill length +
        decode steps), on the routers' device; None for a dense model.

        Raises:
            RuntimeError: replay mode; nothing recorded; layers called a different number of
                times or on different shapes; a call after the first with more than one
                position (a decode without the KV cache recomputes the whole sequence every
                step: record needs ``rollout.use_kv_cache=true``).
        """
        if self.mode != "record":
            raise RuntimeError("RoutingReplay.routes(): only in record mode")
        if not self.active:
            return None
        first = self.layers[0].recorded
        if not first:
            raise RuntimeError("RoutingReplay.routes(): no router call was recorded")
        for lr in self.layers:
            shapes = [tuple(t.shape) for t in lr.recorded]
            if shapes != [tuple(t.shape) for t in first]:
                raise RuntimeError(f"RoutingReplay.routes(): MoE layer {lr.layer} was called on "
                                   f"{shapes}, layer 0 on {[tuple(t.shape) for t in first]}")
            if any(s[0] != 1 for s in shapes[1:]):
                raise RuntimeError("RoutingReplay.routes(): a call after the prefill saw more than one "
                                   "position: recording needs the KV-cache decode "
                                   "(rollout.use_kv_cache=true)")
        per_layer = [torch.cat(lr.recorded, dim=0) for lr in self.layers]  # [S, B, k] each
        return torch.stack(per_layer, dim=2).transpose(0, 1).contiguous()  # [B, S, L, k]
