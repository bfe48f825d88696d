"""Model architecture config (Hydra group ``model/``) and its translation to megatron-core.

Presets live in ``conf/model/*.yaml`` (``tiny`` for tests, ``llama`` for Llama-style
RMSNorm/SwiGLU/RoPE/GQA without biases, ``gpt2`` for LayerNorm/GELU/learned positions,
``qwen2`` for Llama-style with QKV biases); each YAML extends :class:`ModelConfig`.
:func:`load_model_preset` reads one by name and is what tests use outside Hydra.

The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by`` that does not
depend on TP, so checkpoints reshard across TP sizes; the padded rows are masked out of
log-probs and sampling (``ModelConfig.vocab_size`` is the real vocabulary).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from nemo_rlhf.config import check_choice

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu", "gelu_tanh")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")
ROPE_SCALINGS = (None, "llama3")
ROPE_SCALING_KEYS = ("rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                     "rope_original_max_position_embeddings")
"""``model.rope_scaling`` choices: none, or Llama 3.1+'s frequency-dependent scaling."""
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp")
"""``model.recompute_modules`` choices on the local layer spec (megatron's ``layernorm``
recompute needs transformer-engine)."""
MOE_KEYS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
            "moe_aux_loss_coeff", "moe_z_loss_coeff")
"""The mixture-of-experts keys; a dense model's fingerprint leaves them out."""
MOE_TOKEN_DISPATCHER = "allgather"
"""megatron's token dispatcher for the MoE layers: ``allgather`` (all-gathers the tokens over
the expert-parallel x TP group, a no-op at EP=1, TP=1), which needs no ``all_to_all``."""
PRECISIONS = ("32", "bf16-mixed", "fp16-mixed", "auto")
"""``trainer.precision`` choices; ``auto`` is resolved once at start-up (:func:`resolve_precision`)."""
HOST_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags (``/proc/cpuinfo``) of the bf16 dot-product instructions that make a host bf16
GEMM faster than fp32 (AMX; AVX-512 BF16); without them bf16 is emulated and slower."""
LORA_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""``model.lora.target_modules`` choices: megatron's names of the attention's QKV and output
projections and the MLP's two linears (column-, row-, column-, row-parallel)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the transformer's parallel linears (``model.lora``; Hu et al.
    2021, LoRA: ``y = W x + (alpha / rank) * B A dropout(x)``, B zero at start). With
    ``enabled`` every other parameter except the value / reward head is frozen
    (:mod:`nemo_rlhf.models.lora`)."""

    enabled: bool = False
    """Add adapters and freeze the base model."""
    rank: int = 8
    """``r``: inner width of each adapter (``A [r, in]``, ``B [out, r]``); > 0."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by ``alpha / rank``; > 0."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1) (training passes only)."""
    target_modules: list = field(default_factory=lambda: list(LORA_TARGET_MODULES))
    """Adapted linears of every layer, from :data:`LORA_TARGET_MODULES`; not empty."""

    def __post_init__(self) -> None:
        self.target_modules = list(self.target_modules)
        for module in self.target_modules:
            check_choice("model.lora.target_modules", module, LORA_TARGET_MODULES)
        if not self.target_modules:
            raise ValueError(f"model.lora.target_modules=[]: name at least one of {list(LORA_TARGET_MODULES)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"model.lora.target_modules={self.target_modules}: a module is named twice")
        if isinstance(self.rank, bool) or int(self.rank) != self.rank or self.rank <= 0:
            raise ValueError(f"model.lora.rank={self.rank!r}: must be an integer > 0")
        if not self.alpha > 0:
            raise ValueError(f"model.lora.alpha={self.alpha!r}: must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout={self.dropout!r}: must be in [0, 1)")

    @property
    def scale(self) -> float:
        """``alpha / rank``, the adapter output's factor."""
        return self.alpha / self.rank


@dataclass
class ModelConfig:
    """GPT architecture (config group ``model``)."""

    name: str = "tiny"
    """Preset name, recorded in checkpoints and metadata."""
    num_layers: int = 2
    """Transformer layers; must be divisible by ``parallel.pipeline_model_parallel_size``."""
    hidden_size: int = 64
    """Model width."""
    num_attention_heads: int = 4
    """Query heads; must be divisible by TP."""
    num_query_groups: Optional[int] = None
    """KV heads for grouped-query attention (None: = num_attention_heads); divisible by TP."""
    ffn_hidden_size: Optional[int] = None
    """MLP width (None: 4 * hidden_size)."""
    kv_channels: Optional[int] = None
    """Per-head width (None: hidden_size / num_attention_heads)."""
    vocab_size: int = 0
    """Real vocabulary size; 0 = take it from the tokenizer."""
    make_vocab_size_divisible_by: int = 128
    """Embedding rows are padded to a multiple of this (independent of TP)."""
    max_position_embeddings: int = 256
    """Longest sequence (prompt + response) in tokens."""
    normalization: str = "RMSNorm"
    """``RMSNorm`` or ``LayerNorm``."""
    layernorm_epsilon: float = 1e-5
    """Norm epsilon."""
    activation: str = "swiglu"
    """``swiglu`` (gated SiLU), ``gelu`` (erf) or ``gelu_tanh`` (GPT-2's gelu_new)."""
    position_embedding_type: str = "rope"
    """``rope`` or ``learned_absolute``."""
    rotary_base: int = 10000
    """RoPE theta."""
    rope_scaling: Optional[str] = None
    """RoPE frequency scaling: None, or ``llama3`` (every Llama 3.1 / 3.2 / 3.3 checkpoint:
    HF ``rope_scaling.rope_type``); its parameters are the four ``rope_*`` keys below, HF's
    names with the ``rope_`` prefix. Formula: transformers' ``_compute_llama3_parameters``
    (wavelengths above ``original_max_position_embeddings / low_freq_factor`` divided by
    ``factor``, below ``... / high_freq_factor`` kept, interpolated between)."""
    rope_scaling_factor: float = 8.0
    """``llama3``: the long-wavelength divisor (8 for Llama 3.1 / 3.3, 32 for 3.2)."""
    rope_low_freq_factor: float = 1.0
    """``llama3``: ``low_freq_factor``."""
    rope_high_freq_factor: float = 4.0
    """``llama3``: ``high_freq_factor``."""
    rope_original_max_position_embeddings: int = 8192
    """``llama3``: the pre-training context the wavelengths are compared with."""
    add_bias_linear: bool = False
    """Biases on all linear layers (GPT-2 style)."""
    add_qkv_bias: bool = False
    """Biases on the QKV projection only (Qwen2 style)."""
    qk_layernorm: bool = False
    """An RMSNorm / LayerNorm (``model.normalization``, ``layernorm_epsilon``) over each head's
    query and key, ``[head_dim]`` weights shared by the heads, before RoPE (Qwen3's ``q_norm``
    / ``k_norm``; megatron's ``qk_layernorm``)."""
    share_embeddings_and_output_weights: bool = False
    """Tie the input embedding and the output layer."""
    num_moe_experts: Optional[int] = None
    """Mixture of experts: routed experts per layer (None: a dense MLP). Every layer is a
    megatron ``MoELayer`` (router ``[experts, hidden]`` and ``SequentialMLP`` experts, each a
    gated / plain MLP of width ``moe_ffn_hidden_size``); no shared expert."""
    moe_router_topk: int = 2
    """MoE: experts per token (HF ``num_experts_per_tok``), 1 .. ``num_moe_experts``."""
    moe_ffn_hidden_size: Optional[int] = None
    """MoE: each expert's MLP width (HF ``moe_intermediate_size``; None: ``ffn_hidden_size``)."""
    moe_router_pre_softmax: bool = False
    """MoE: how the top-k experts' weights are computed from the router logits ``[tokens,
    experts]``. False: a softmax over the top-k logits, i.e. the softmax over all experts
    renormalised over the top k (qwen3_moe with ``norm_topk_prob=true``, Mixtral). True: the
    softmax over all experts, top-k probabilities taken as they are (qwen3_moe with
    ``norm_topk_prob=false``). megatron's ``moe_router_pre_softmax``."""
    moe_aux_loss_coeff: float = 0.0
    """MoE: coefficient of the load-balancing loss (Switch Transformer, Fedus et al. 2021,
    eq. 4: ``E / (k T^2) * sum_e P_e c_e`` over a micro-batch's ``T`` non-padding tokens,
    ``P_e`` the summed router probabilities and ``c_e`` the tokens routed to expert ``e``;
    megatron's ``aux_loss``) in training passes, per MoE layer. Weighted by each
    micro-batch's share of the optimizer step's non-padding tokens (every micro-batch and
    DP rank), so it is a token-weighted mean over the step's micro-batches, summed over the
    layers; added to the gradient only (logged as ``moe/aux_loss``, not in ``train/loss`` /
    ``policy_loss``). 0 (default): off. Not part of the architecture; not imported from
    the HF ``router_aux_loss_coef``."""
    moe_z_loss_coeff: float = 0.0
    """MoE: coefficient of the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5: the mean over
    non-padding tokens of ``logsumexp(router logits)^2``), weighted and added like
    ``moe_aux_loss_coeff`` (logged as ``moe/z_loss``). 0 (default): off. Not part of the
    architecture."""
    hidden_dropout: float = 0.0
    """Dropout after attention/MLP (RLHF usually trains with 0)."""
    attention_dropout: float = 0.0
    """Attention-probability dropout."""
    init_method_std: float = 0.02
    """Std of the normal weight init."""
    value_head_init_std: float = 0.0
    """Std of the value head's weight init; 0 starts with values == bias == 0."""
    recompute_granularity: Optional[str] = None
    """Activation recomputation in training passes (megatron-core's; forward-only passes
    keep nothing either way). None: every layer keeps its activations for the backward.
    ``full``: a recomputed layer keeps only its input ``[seq, batch, hidden]`` and runs its
    forward again in the backward (about one forward more of compute; per micro-batch the
    activations shrink from every layer's to one layer's plus the inputs). ``selective``:
    only ``recompute_modules`` are recomputed (cheap, smaller saving). Gradients are the
    same as without (tested). Not part of the architecture: checkpoints load either way."""
    recompute_method: str = "uniform"
    """``full`` only: ``uniform`` recomputes every layer of the stage, in units of
    ``recompute_num_layers`` (one input kept per unit); ``block`` recomputes the first
    ``recompute_num_layers`` layers of each pipeline stage and keeps the rest."""
    recompute_num_layers: int = 1
    """``full`` only: layers per recompute unit (``uniform``) or recomputed layers per
    pipeline stage (``block``); at most ``num_layers / pipeline_model_parallel_size``."""
    recompute_modules: list = field(default_factory=lambda: ["core_attn"])
    """``selective`` only: submodules recomputed in each layer, from ``core_attn`` (the
    attention scores and softmax: ``[batch, heads, seq, seq]``) and ``mlp`` (the MLP's
    ``ffn_hidden_size``-wide activations)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters (:class:`LoRAConfig`); off by default."""

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # ModelConfig(**asdict(cfg)), e.g. a job file's
            self.lora = LoRAConfig(**self.lora)
        check_choice("model.normalization", self.normalization, NORMALIZATIONS)
        check_choice("model.activation", self.activation, ACTIVATIONS)
        check_choice("model.position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS)
        check_choice("model.rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if self.rope_scaling is not None:
            if self.position_embedding_type != "rope":
                raise ValueError(f"model.rope_scaling={self.rope_scaling!r} needs "
                                 f"model.position_embedding_type=rope, not {self.position_embedding_type!r}")
            if not (self.rope_scaling_factor > 0 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
                    and self.rope_original_max_position_embeddings >= 1):
                raise ValueError(
                    f"model.rope_scaling=llama3: rope_scaling_factor={self.rope_scaling_factor} must be > 0, "
                    f"0 < rope_low_freq_factor={self.rope_low_freq_factor} < rope_high_freq_factor="
                    f"{self.rope_high_freq_factor}, rope_original_max_position_embeddings="
                    f"{self.rope_original_max_position_embeddings} >= 1")
        check_choice("model.recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)
        check_choice("model.recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        self.recompute_modules = list(self.recompute_modules)
        for module in self.recompute_modules:
            check_choice("model.recompute_modules", module, RECOMPUTE_MODULES)
        if self.recompute_num_layers < 1:
            raise ValueError(f"model.recompute_num_layers={self.recompute_num_layers}: must be >= 1")
        self._check_moe()
        for key in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
                    "make_vocab_size_divisible_by"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be >= 1")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; set model.kv_channels"
            )
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"model.num_query_groups={self.num_query_groups}"
            )

    def _check_moe(self) -> None:
        """The MoE keys' fixed rules (messages name the key, the value and what works)."""
        if self.num_moe_experts is None:
            if self.moe_ffn_hidden_size is not None:
                raise ValueError(f"model.moe_ffn_hidden_size={self.moe_ffn_hidden_size} is set on a dense "
                                 "model: set model.num_moe_experts too, or leave it null")
            for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
                if getattr(self, key):
                    raise ValueError(f"model.{key}={getattr(self, key)} is set on a dense model "
                                     "(model.num_moe_experts=null): it must be 0")
            return
        if self.num_moe_experts < 1:
            raise ValueError(f"model.num_moe_experts={self.num_moe_experts}: must be >= 1, or null (dense)")
        if not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(f"model.moe_router_topk={self.moe_router_topk}: must be in 1 .. "
                             f"model.num_moe_experts={self.num_moe_experts}")
        if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size < 1:
            raise ValueError(f"model.moe_ffn_hidden_size={self.moe_ffn_hidden_size}: must be >= 1 or null")
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be >= 0 (0: off)")
        if self.add_bias_linear:
            raise ValueError("model.add_bias_linear=true with model.num_moe_experts set: megatron's MoE "
                             "experts have no biases (use add_qkv_bias for attention biases)")
        if self.recompute_granularity == "selective" and "mlp" in self.recompute_modules:
            raise ValueError("model.recompute_modules contains 'mlp' with model.num_moe_experts set: "
                             "megatron's 'mlp' recompute is for dense MLPs; valid with MoE: ['core_attn']")

    @property
    def moe_expert_ffn_size(self) -> int:
        """Each expert's MLP width (MoE only): ``moe_ffn_hidden_size`` or ``ffn_hidden_size``
        (itself None: 4 * hidden_size)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows: ``vocab_size`` rounded up to ``make_vocab_size_divisible_by``."""
        if self.vocab_size < 1:
            raise ValueError("model.vocab_size is not set (0): set it or load a tokenizer first")
        m = self.make_vocab_size_divisible_by
        return int(math.ceil(self.vocab_size / m) * m)

    def fingerprint(self) -> dict:
        """Architecture facts that must match for weights to load (checkpoint fingerprint)."""
        from dataclasses import asdict

        d = asdict(self)
        for k in ("name", "hidden_dropout", "attention_dropout", "init_method_std",
                  "value_head_init_std", "max_position_embeddings", "recompute_granularity",
                  "recompute_method", "recompute_num_layers", "recompute_modules"):
            d.pop(k)
        # facts added later are left out at their defaults: the checkpoints written before
        # they existed keep their fingerprint
        if self.rope_scaling is None:
            for k in ROPE_SCALING_KEYS:
                d.pop(k)
        if not self.qk_layernorm:
            d.pop("qk_layernorm")
        for k in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):  # training, not architecture
            d.pop(k)
        if self.num_moe_experts is None:
            for k in MOE_KEYS:
                d.pop(k, None)
        lora = d.pop("lora")
        if self.lora.enabled:  # the adapters' keys and shapes (dropout does not change weights)
            d["lora"] = {k: lora[k] for k in ("rank", "alpha", "target_modules")}
        return d


def precision_dtype(precision: str) -> torch.dtype:
    """Parameter dtype of ``trainer.precision`` (``32`` -> fp32, ``bf16-mixed`` -> bf16,
    ``fp16-mixed`` -> fp16).

    Raises:
        ValueError: naming ``trainer.precision`` and the valid choices.
    """
    precision = str(precision)
    check_choice("trainer.precision", precision, PRECISIONS)
    if precision == "auto":
        raise ValueError("trainer.precision=auto must be resolved first (resolve_precision)")
    return {"32": torch.float32, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[precision]


def host_gemm_gflops(n: int = 256, reps: int = 3) -> dict[str, float]:
    """Best-of-``reps`` ``n x n x n`` host matrix products in fp32 and bf16, GFLOP/s
    (``2 n^3`` FLOPs each), on this process's torch threads. About 0.1 s where bf16 is
    slow (no AVX-512 BF16 / AMX: ~1 GFLOP/s), a few ms where it is fast.
    """
    import time

    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n, dtype=dtype, device="cpu")  # host: the probe is about the host
        b = torch.randn(n, n, dtype=dtype, device="cpu")
        a @ b
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        out[name] = 2 * n ** 3 / max(best, 1e-9) / 1e9
    return out


def cpu_flags(path: str = "/proc/cpuinfo") -> Optional[set]:
    """The CPU's feature flags (the first ``flags`` line of ``path``), None where unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def host_bf16(flags: Optional[set] = None, capability: Optional[str] = None,
              env: Optional[dict] = None) -> tuple[bool, str]:
    """Whether host bf16 GEMMs run on bf16 instructions, from what the machine *is*, not how
    busy it is: a bf16 dot-product flag (:data:`HOST_BF16_FLAGS`), torch's kernels at the
    AVX-512 level (``torch.backends.cpu.get_cpu_capability()``, which honours
    ``ATEN_CPU_CAPABILITY``), and oneDNN not capped below it (``ONEDNN_MAX_CPU_ISA``).

    Args:
        flags / capability / env: the CPU flags, torch's capability and the environment
            (None: this machine's; tests pass their own).

    Returns:
        ``(fast, reason)``.
    """
    import os

    flags = cpu_flags() if flags is None else flags
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    env = os.environ if env is None else env
    if flags is None:
        return False, "CPU flags unreadable (no /proc/cpuinfo)"
    have = [f for f in HOST_BF16_FLAGS if f in flags]
    if not have:
        return False, f"the CPU has none of {list(HOST_BF16_FLAGS)}: bf16 GEMMs are emulated"
    if not capability.upper().startswith("AVX512"):
        return False, f"torch's CPU kernels are {capability} (ATEN_CPU_CAPABILITY?), below AVX-512"
    isa = env.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if isa and isa != "ALL" and "BF16" not in isa and "AMX" not in isa:
        return False, f"ONEDNN_MAX_CPU_ISA={isa} caps oneDNN below its bf16 kernels"
    return True, f"the CPU has {', '.join(have)} and torch's kernels are {capability}"


def resolve_precision(precision: str, device: torch.device, host_bf16=host_bf16) -> tuple[str, str]:
    """The concrete ``trainer.precision`` for ``auto`` (others are returned as they are).

    On CUDA: ``bf16-mixed`` where the GPU supports bf16, else ``32``. On the host:
    ``bf16-mixed`` where the CPU has bf16 instructions that torch uses (:func:`host_bf16`),
    else ``32``; log-probs, KL, advantages and losses stay fp32 either way. The choice
    depends on the machine only, never on its load (a timing probe, used before, read bf16
    slower than fp32 while other jobs shared the cores). Called on one rank
    and broadcast (:func:`agree_on_precision`).

    Args:
        precision: ``trainer.precision``.
        device: ``dims.device``.
        host_bf16: ``() -> (fast, reason)`` (tests pass a fake).

    Returns:
        ``(precision, reason)``: the concrete choice and a sentence saying why.
    """
    precision = str(precision)
    check_choice("trainer.precision", precision, PRECISIONS)
    if precision != "auto":
        return precision, "set explicitly"
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ("bf16-mixed" if ok else "32"), f"CUDA device {'supports' if ok else 'lacks'} bf16"
    fast, reason = host_bf16()
    return ("bf16-mixed" if fast else "32"), reason


def agree_on_precision(precision: str, dims) -> str:
    """:func:`resolve_precision` on global rank 0, broadcast to every rank (an object
    collective: the gloo part of the backend map), logged once. Every entry point calls
    it before building a model, so checkpoints record the concrete choice."""
    import logging

    import torch.distributed as dist

    box = [resolve_precision(precision, dims.device) if dims.rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    choice, reason = box[0]
    if dims.rank == 0 and str(precision) == "auto":
        logging.getLogger("nemo_rlhf").info("trainer.precision=auto -> %s (%s)", choice, reason)
    return choice


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def build_transformer_config(model: ModelConfig, tp: int, pp: int, precision: str = "32", ep: int = 1,
                             cp: int = 1):
    """megatron-core ``TransformerConfig`` for a model and a parallel layout (``ep``: the
    expert-parallel size, MoE only; megatron's expert TP is left at ``tp``; ``cp``: the
    context-parallel size, which megatron's RoPE reads to give global positions).

    Weights are created on the CPU (``use_cpu_initialization``) and moved to the device by
    the caller; all CUDA-only fusions are off. megatron's ``deterministic_mode`` follows
    ``torch.are_deterministic_algorithms_enabled()`` (``trainer.deterministic`` turns it on
    before any model is built: :mod:`nemo_rlhf.distributed.determinism`).

    Raises:
        ValueError: ``model.recompute_num_layers`` larger than a pipeline stage's layers
            (``full`` recompute).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = precision_dtype(precision)
    recompute = {}
    if model.recompute_granularity == "full":
        per_stage = model.num_layers // pp
        if model.recompute_num_layers > per_stage:
            raise ValueError(
                f"model.recompute_num_layers={model.recompute_num_layers} is more than the "
                f"{per_stage} layers of a pipeline stage (model.num_layers={model.num_layers}, "
                f"parallel.pipeline_model_parallel_size={pp})")
        recompute = dict(recompute_granularity="full", recompute_method=model.recompute_method,
                         recompute_num_layers=model.recompute_num_layers)
    elif model.recompute_granularity == "selective":
        recompute = dict(recompute_granularity="selective",
                         recompute_modules=list(model.recompute_modules))
    moe = {}
    if model.num_moe_experts is not None:
        moe = dict(
            num_moe_experts=model.num_moe_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_expert_ffn_size,
            moe_router_pre_softmax=model.moe_router_pre_softmax,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_z_loss_coeff=model.moe_z_loss_coeff or None,
            moe_token_dispatcher_type=MOE_TOKEN_DISPATCHER,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_fusion=False,
            expert_model_parallel_size=ep,
        )
    swiglu = model.activation == "swiglu"
    act = {"swiglu": F.silu, "gelu": F.gelu, "gelu_tanh": _gelu_tanh}[model.activation]
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        kv_channels=model.kv_channels,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        normalization=model.normalization,
        layernorm_epsilon=model.layernorm_epsilon,
        gated_linear_unit=swiglu,
        activation_func=act,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias or model.add_bias_linear,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        use_cpu_initialization=True,
        perform_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        deallocate_pipeline_outputs=False,
        # Losses are already divided by global token counts (passed in), so neither the
        # pipeline schedule nor DDP may rescale them by micro-batch or DP counts.
        calculate_per_token_loss=True,
        deterministic_mode=torch.are_deterministic_algorithms_enabled(),
        **recompute,
        **moe,
    )


def load_model_preset(name: str, **overrides) -> ModelConfig:
    """Read ``conf/model/<name>.yaml`` into a :class:`ModelConfig` (outside Hydra).

    Raises:
        ValueError: unknown preset; the message names ``model`` and lists the valid presets.
    """
    from omegaconf import OmegaConf

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        valid = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        raise ValueError(f"model={name!r}: unknown model preset; valid presets: {valid}")
    schema = OmegaConf.structured(ModelConfig)
    merged = OmegaConf.merge(schema, OmegaConf.load(path), overrides)
    return OmegaConf.to_object(merged)
