"""LoRA adapters on megatron's tensor-parallel linears (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models", eq. 3: ``h = W0 x + (alpha / r) * B A x``).

:func:`apply_lora` adds one :class:`LoRAAdapter` beside each targeted linear
(``model.lora.target_modules``) of every layer and freezes every other parameter except
the value / reward head. The adapter is a sibling module (``linear_qkv`` gets
``linear_qkv_lora`` in the same attention module), so the base keys, the HF mapping and
the decode layers are untouched; a forward hook on the base linear adds the adapter's
output to the base's first return value and keeps megatron's ``(output, bias)`` tuple.

Tensor parallelism (``x``: the base's input, ``tp``: the TP size):

* column-parallel base (``linear_qkv``, ``linear_fc1``; output sharded): ``A [r, in]``
  replicated, ``B [out/tp, r]`` sharded along the output like the base weight. The
  ``[seq, batch, r]`` product ``A x`` goes through megatron's
  ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), so A's
  gradient and the input gradient through A are the sums over the output shards.
* row-parallel base (``linear_proj``, ``linear_fc2``; input sharded): ``A [r, in/tp]``
  sharded along the input, ``B [out, r]`` replicated. The partial products ``A_i x_i`` are
  all-reduced (``reduce_from_tensor_model_parallel_region``) before B, as the base's
  partial products are before its bias.

``B`` starts at zero (the adapted model equals the base), ``A`` Kaiming-uniform (as
``torch.nn.Linear``), drawn for the full matrix from a generator seeded by the run's seed
(``trainer.seed``, through :func:`~nemo_rlhf.models.actor_critic.build_model`) and the
module's name with the layer's global number (:func:`global_module_name`;
:func:`adapter_seed`), so two seeds draw different A's, every TP layout slices the same full
A and every PP stage draws its layers' A as one stage would. Frozen base parameters have
``requires_grad=False``: megatron's DDP gives them no grad buffer and the optimizers
(:mod:`nemo_rlhf.trainers.mixed_precision`, :mod:`nemo_rlhf.trainers.optimizers`) no state.

Simplified: no sequence parallelism (the project does not wire it in); one adapter set per
model (no second set for a critic); adapters on the output layer or embeddings are not
offered; the dropout of a replicated input uses the default generator, the same on every
TP rank (as megatron's hidden dropout), that of a sharded input megatron's TP RNG tracker.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterator, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from nemo_rlhf.models.config import LoRAConfig
from nemo_rlhf.models.heads import is_head_param
from nemo_rlhf.models.lora_keys import ADAPTER_SUFFIX, has_adapters, is_adapter_param


def adapter_seed(seed: Optional[int], name: str) -> int:
    """The seed of the generator that draws the full ``A`` of the adapter ``name``.

    Args:
        seed: the run's seed (``trainer.seed``), or None for a build whose adapters are
            loaded next (checkpoint tools, conversions): the name alone then, as ``seed=0``.
        name: the base linear's module name with the layer's global number
            (:func:`global_module_name`), so each adapter of a model draws its own ``A`` and
            the same one at any TP / PP layout.

    Returns:
        the CRC-32 of ``name`` started from ``seed mod 2**32`` (``zlib.crc32(name, seed)``):
        32 bits, as torch's CPU generator keeps only the low 32 bits of a seed; for one name,
        distinct for seeds that differ mod ``2**32`` (the CRC of fixed data is a bijection
        of its start value); ``seed=0`` is ``crc32(name)``.
    """
    return zlib.crc32(name.encode(), (0 if seed is None else seed) & 0xFFFFFFFF)


def _tp(base) -> tuple[int, int]:
    group = getattr(base, "tp_group", None)
    if group is None or not torch.distributed.is_initialized():
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


class LoRAAdapter(torch.nn.Module):
    """``delta(x) = scale * B A dropout(x)`` for one column- or row-parallel base linear.

    Args:
        base: the megatron ``ColumnParallelLinear`` / ``RowParallelLinear``.
        cfg: ``model.lora``.
        name: the base's module name with the layer's global number (seeds A's generator
            with ``seed``: :func:`adapter_seed`; :func:`global_module_name`).
        gated: the base is a gated MLP's ``linear_fc1`` (each rank's output rows are
            ``[gate_i; up_i]``; :meth:`load_full` and checkpoints follow that layout).
        seed: the run's seed (``trainer.seed``); None: A from the name alone.

    Parameters: ``lora_a [r, in]`` and ``lora_b [out/tp, r]`` (column) or
    ``lora_a [r, in/tp]`` and ``lora_b [out, r]`` (row), in the base weight's dtype.
    """

    def __init__(self, base, cfg: LoRAConfig, name: str, gated: bool = False,
                 seed: Optional[int] = None):
        super().__init__()
        if getattr(base, "sequence_parallel", False):
            raise ValueError(f"model.lora on {name}: sequence parallelism is not supported")
        self.column = isinstance(base, ColumnParallelLinear)
        if not self.column and not isinstance(base, RowParallelLinear):
            raise TypeError(f"model.lora on {name}: {type(base).__name__} is not a megatron "
                            f"ColumnParallelLinear / RowParallelLinear")
        self.tp_size, self.tp_rank = _tp(base)
        self.tp_group = getattr(base, "tp_group", None)
        self.gated = gated and self.column
        self.gather_output = bool(getattr(base, "gather_output", False)) if self.column else False
        self.scale, self.dropout_p, self.enabled = cfg.scale, cfg.dropout, True
        w = base.weight
        out_local, in_local = w.shape
        self.in_full = in_local if self.column else in_local * self.tp_size
        self.out_full = out_local * self.tp_size if self.column else out_local
        r = cfg.rank
        a_full = torch.empty(r, self.in_full, dtype=torch.float32)
        gen = torch.Generator().manual_seed(adapter_seed(seed, name))
        bound = 1.0 / math.sqrt(self.in_full)  # kaiming_uniform_(a=sqrt(5)), torch.nn.Linear's
        a_full.uniform_(-bound, bound, generator=gen)
        a = a_full if self.column else a_full.chunk(self.tp_size, dim=1)[self.tp_rank]
        self.lora_a = torch.nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
        self.lora_b = torch.nn.Parameter(torch.zeros(out_local, r, device=w.device, dtype=w.dtype))
        sharded = self.lora_b if self.column else self.lora_a
        tensor_parallel.set_tensor_model_parallel_attributes(sharded, True, 0 if self.column else 1, 1)

    def shard_of(self, a_full: torch.Tensor, b_full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(A, B)`` of the full TP=1 matrices ``a_full [r, in]``,
        ``b_full [out, r]`` (a gated ``linear_fc1``'s ``b_full`` rows: ``[gate; up]``)."""
        if self.column:
            if self.gated:
                gate, up = b_full.chunk(2, dim=0)
                b = torch.cat([gate.chunk(self.tp_size)[self.tp_rank], up.chunk(self.tp_size)[self.tp_rank]])
            else:
                b = b_full.chunk(self.tp_size, dim=0)[self.tp_rank]
            return a_full, b
        return a_full.chunk(self.tp_size, dim=1)[self.tp_rank], b_full

    @torch.no_grad()
    def load_full(self, a_full: torch.Tensor, b_full: torch.Tensor) -> None:
        """Set this rank's shards from the full TP=1 matrices (see :meth:`shard_of`)."""
        a, b = self.shard_of(a_full, b_full)
        self.lora_a.copy_(a)
        self.lora_b.copy_(b)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.dropout_p > 0):
            return x
        if self.column:  # a replicated input: the same mask on every TP rank
            return torch.nn.functional.dropout(x, self.dropout_p, True)
        with tensor_parallel.get_cuda_rng_tracker().fork():  # a sharded input: per-rank masks
            return torch.nn.functional.dropout(x, self.dropout_p, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [seq, batch, in or in/tp]`` -> ``[seq, batch, out/tp or out]`` (the base's
        output layout)."""
        h = torch.nn.functional.linear(self._dropout(x), self.lora_a)  # [s, b, r]
        if self.tp_size > 1:
            h = (copy_to_tensor_model_parallel_region(h, group=self.tp_group) if self.column
                 else reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        out = torch.nn.functional.linear(h, self.lora_b) * self.scale
        if self.gather_output and self.tp_size > 1:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """megatron distributed-checkpoint tensors: the sharded factor split along TP like
        the base weight (a gated ``linear_fc1``'s B as megatron's swiglu factory splits it)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {"lora_b": 0} if self.column else {"lora_a": 1}
        sd = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axis, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if self.gated:
            key = f"{prefix}lora_b"
            sd[key] = apply_swiglu_sharded_factory(
                sd[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
        return sd


def _hook(adapter: LoRAAdapter):
    def hook(module, args, kwargs, output):
        if not adapter.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + adapter(x).to(out.dtype), bias
    return hook


def global_module_name(model: torch.nn.Module, name: str) -> str:
    """``name`` with a pipeline stage's local layer index replaced by the layer's global
    index: megatron numbers a stage's ``decoder.layers.<i>`` from 0 on every stage, its
    ``TransformerLayer.layer_number`` (1-based) globally. ``decoder.layers.0.mlp.linear_fc1``
    on the second of two stages of a 4-layer model -> ``decoder.layers.2.mlp.linear_fc1``;
    unchanged on a single stage and outside the layers."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            layer = model.get_submodule(".".join(parts[:i + 2]))
            number = getattr(layer, "layer_number", None)
            if number is not None:
                parts[i + 1] = str(number - 1)
            break
    return ".".join(parts)


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig, gated_fc1: bool,
               seed: Optional[int] = None) -> list[str]:
    """Add adapters to ``model``'s targeted linears and freeze all but adapters and heads.

    Args:
        model: a bare (not DDP-wrapped) GPT stage.
        cfg: ``model.lora`` (``enabled``).
        gated_fc1: the MLP is gated (swiglu): ``linear_fc1``'s output is ``[gate; up]``.
        seed: the run's seed (``trainer.seed``), with each adapter's global name the seed of
            its ``A`` (:func:`adapter_seed`); None: the name alone (adapters loaded next).

    Returns:
        the adapted linears' module names.

    Raises:
        ValueError: a target module found nowhere in the stage.
    """
    if any(getattr(m, "is_expert", False) for m in model.modules()):
        raise ValueError("model.lora.enabled=true on a mixture-of-experts model "
                         "(model.num_moe_experts): adapters on the experts are not built yet")
    targets = set(cfg.target_modules)
    found, names = set(), []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        adapter = LoRAAdapter(module, cfg, global_module_name(model, name),
                              gated=gated_fc1 and leaf == "linear_fc1", seed=seed)
        parent.add_module(leaf + ADAPTER_SUFFIX, adapter)
        module.register_forward_hook(_hook(adapter), with_kwargs=True)
        # a plain attribute, not a submodule (no second state-dict entry): the decode
        # layers' matmul fast path reads it and calls the module instead (has_lora)
        object.__setattr__(module, "_lora_adapter", adapter)
        found.add(leaf)
        names.append(name)
    missing = targets - found
    if missing:
        raise ValueError(f"model.lora.target_modules: {sorted(missing)} not found in the model; "
                         f"its linears are {sorted(found) or 'none'}")
    for n, p in model.named_parameters():
        if not is_adapter_param(n) and not is_head_param(n):
            p.requires_grad_(False)
    return names


def has_lora(linear: torch.nn.Module) -> bool:
    """Whether a base linear carries an adapter (its forward hook adds the adapter's
    output, so the linear must be called as a module, not by its weight)."""
    return linear.__dict__.get("_lora_adapter") is not None


@torch.no_grad()
def merged_weight(linear: torch.nn.Module) -> torch.Tensor:
    """This rank's shard of ``W + scale * B A`` of an adapted base linear (the base
    weight itself without an adapter or with it disabled), in the weight's dtype; the
    product is formed in fp32 (``[out/tp, in]`` column-, ``[out, in/tp]`` row-parallel:
    the base weight's own shard, since B is sharded by the output and A by the input)."""
    adapter = linear.__dict__.get("_lora_adapter")
    w = linear.weight
    if adapter is None or not adapter.enabled:
        return w.detach()
    delta = adapter.lora_b.float() @ adapter.lora_a.float() * adapter.scale
    return (w.float() + delta).to(w.dtype)


def adapters(model: torch.nn.Module) -> Iterator[LoRAAdapter]:
    """The model's adapters (through DDP wrappers)."""
    return (m for m in model.modules() if isinstance(m, LoRAAdapter))


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Within the block ``model`` computes as its base (every adapter skipped, not
    multiplied by zero: the base's outputs bit for bit); the previous states are restored."""
    found = list(adapters(model))
    before = [a.enabled for a in found]
    try:
        for a in found:
            a.enabled = False
        yield model
    finally:
        for a, was in zip(found, before):
            a.enabled = was


__all__ = ["ADAPTER_SUFFIX", "LoRAAdapter", "adapters", "adapters_disabled", "apply_lora",
           "global_module_name", "has_adapters", "has_lora", "is_adapter_param", "merged_weight"]
