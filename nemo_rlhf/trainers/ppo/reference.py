"""The frozen Reference policy: offloaded to host memory and swapped into the backbone.

``offload`` (default): this rank's shard of the initial policy's weights lives in host
memory (pinned when CUDA is present), one copy per rank. To compute reference log-probs
the reference weights are copied into the shared backbone's parameters, a forward-only
pass runs, and the actor's weights (stashed in a preallocated host buffer) are copied
back: no extra accelerator memory, and the actor's weights come back bit-identical.
When the model itself lives in host memory (CPU runs), the swap exchanges the parameters'
storage with the reference tensors instead (``param.data``; no copy and no stash buffer:
one model's worth of host memory less, and no copy time).

``colocated``: a second, frozen model stage holds the reference weights on the device:
no copies per step, one more model's worth of memory.

``adapters_off`` (LoRA, ``model.lora.enabled``): the base is frozen, so the initial policy
is the base itself: the reference pass is the actor's own forward with every adapter
skipped (:func:`nemo_rlhf.models.lora.adapters_disabled`); no weights are kept or copied.

The value head is not part of the reference (its values are never used).
"""

from __future__ import annotations

import contextlib

import torch

from nemo_rlhf.config import check_choice
from nemo_rlhf.models.engine import unwrap
from nemo_rlhf.models.heads import is_head_param
from nemo_rlhf.models.lora import adapters_disabled, has_adapters
from nemo_rlhf.trainers.ppo.config import REFERENCE_MODES


def _host_buffer(t: torch.Tensor) -> torch.Tensor:
    buf = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                      pin_memory=torch.cuda.is_available())
    return buf


def _backbone_params(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in unwrap(model).named_parameters()
            if not is_head_param(n)}


class ReferencePolicy:
    """Reference weights for one model stage.

    Args:
        model: the actor-critic stage whose *current* weights become the reference
            (build it from the initial checkpoint, then create this before any update).
        mode: ``offload``, ``colocated`` or ``adapters_off``.
        build_fn: ``() -> model stage`` used by ``colocated`` to build the resident copy.
        zero_copy: ``offload`` only: swap by exchanging the parameters' storage with the
            reference tensors instead of copying (None: when the model lives in host
            memory, the only place it can be).
        device: where the model lives (``dims.device``); the host is
            ``torch.device("cpu")`` exactly. None: read from the parameters.

    Raises:
        ValueError: an unknown ``mode``; ``colocated`` without ``build_fn``; ``zero_copy``
            with parameters off the host; ``adapters_off`` on a model without adapters.
    """

    def __init__(self, model, mode: str = "offload", build_fn=None, zero_copy=None, device=None):
        check_choice("reference.mode", mode, REFERENCE_MODES)
        self.mode = mode
        self.model = model
        self.zero_copy = False
        self.resident = None
        if mode == "adapters_off":
            if not has_adapters(unwrap(model)):
                raise ValueError("reference.mode=adapters_off: the model has no LoRA adapters "
                                 "(set model.lora.enabled=true, or reference.mode=offload)")
        elif mode == "offload":
            params = _backbone_params(model)
            host = torch.device("cpu")
            if device is not None:  # dims.device: under the device guard cpu:0, "the accelerator"
                on_host = torch.device(device) == host
            else:
                on_host = all(p.device == host for p in params.values())
            if zero_copy and not on_host:
                where = f"device={device}" if device is not None else "its parameters' devices"
                raise ValueError(f"ReferencePolicy(zero_copy=True): the model is not in host memory "
                                 f"({where}); the storage exchange needs both sides there")
            self.zero_copy = on_host if zero_copy is None else bool(zero_copy)
            self.ref = {}
            self.stash = {}
            for n, p in params.items():
                self.ref[n] = _host_buffer(p)
                self.ref[n].copy_(p.detach())
                if not self.zero_copy:
                    self.stash[n] = _host_buffer(p)
            self.resident = None
        else:
            if build_fn is None:
                raise ValueError("reference.mode=colocated needs a build_fn for the resident copy")
            self.resident = build_fn()
            src = _backbone_params(model)
            with torch.no_grad():
                for n, p in _backbone_params(self.resident).items():
                    p.copy_(src[n])
                    p.requires_grad_(False)
            self.resident.eval()

    def weight_bytes(self) -> int:
        """Bytes of reference weights this rank keeps anywhere: the host copy (``offload``,
        without the stash buffer), the resident stage's parameters (``colocated``), 0
        (``adapters_off``)."""
        if self.mode == "offload":
            return sum(t.numel() * t.element_size() for t in self.ref.values())
        if self.mode == "colocated":
            return sum(p.numel() * p.element_size() for p in _backbone_params(self.resident).values())
        return 0

    def host_bytes(self) -> int:
        """Host memory held (bytes): reference copy plus the stash buffer (offload; no stash
        with ``zero_copy``)."""
        if self.mode != "offload":
            return 0
        return sum(t.numel() * t.element_size() for t in list(self.ref.values()) + list(self.stash.values()))

    @contextlib.contextmanager
    def swapped_in(self):
        """Yield a model stage that computes with the reference weights.

        ``offload``: the actor's own stage with reference weights copied in; the actor's
        weights are restored on exit. Exception-safe: an error part-way through the
        swap-in (or in the body) restores every tensor already overwritten before it
        propagates; an error restoring one tensor does not stop the others from being
        restored, and the first such error is raised afterwards. ``zero_copy``: the same
        with the parameters' storage exchanged (and exchanged back) instead of copied.
        ``colocated``: the resident copy. ``adapters_off``: the actor's stage with its
        adapters skipped (re-enabled on exit, also on an error).
        """
        if self.mode == "colocated":
            yield self.resident
            return
        if self.mode == "adapters_off":
            with adapters_disabled(unwrap(self.model)):
                yield self.model
            return
        params = _backbone_params(self.model)
        if self.zero_copy:
            exchanged: list[str] = []
            try:
                with torch.no_grad():
                    for n, p in params.items():
                        p.data, self.ref[n] = self.ref[n], p.data
                        exchanged.append(n)
                yield self.model
            finally:
                with torch.no_grad():
                    for n in exchanged:  # the actor's own tensors back, the reference's aside
                        p = params[n]
                        p.data, self.ref[n] = self.ref[n], p.data
            return
        swapped: list[str] = []  # names whose parameter may hold reference weights
        try:
            with torch.no_grad():
                for n, p in params.items():
                    self.stash[n].copy_(p.detach(), non_blocking=True)
                    swapped.append(n)
                    p.copy_(self.ref[n], non_blocking=True)
            yield self.model
        finally:
            self._restore(params, swapped)

    def _restore(self, params: dict, names: list[str]) -> None:
        """Copy the stashed actor weights back into ``names``; try every one, then raise
        the first error (if any)."""
        first_error = None
        with torch.no_grad():
            for n in names:
                try:
                    params[n].copy_(self.stash[n], non_blocking=True)
                except Exception as exc:  # noqa: BLE001 - re-raised below
                    first_error = first_error or exc
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if first_error is not None:
            raise first_error
