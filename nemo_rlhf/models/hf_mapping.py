"""Hugging Face <-> megatron-core tensor mapping for Llama-, Qwen2/3-, GPT-2-style and
mixture-of-experts (Qwen3-MoE, Mixtral) models.

Both directions work on **full (unsharded) tensors** keyed like this project's
distributed checkpoints (``load_full_tensors`` without the ``model.`` prefix): layer
tensors are stacked on a leading layer axis, ``decoder.layers.<name>`` ``[num_layers,
...]``, and the pre-attention / pre-MLP norms are named as megatron's sharded state dict
names them (``self_attention.linear_qkv.layer_norm_weight`` and
``mlp.linear_fc1.layer_norm_weight``), whichever layer spec (local or TE) wrote them.
TP/PP never appear here: dist_checkpointing reshards.

megatron tensors (``h`` hidden, ``f`` ffn, ``d`` head dim, ``H`` query heads, ``G`` query
groups = KV heads, ``V'`` padded vocabulary, ``V`` real vocabulary, ``L`` layers):

* ``embedding.word_embeddings.weight`` ``[V', h]``; rows ``V..V'`` are padding (zeros on
  import, dropped on export); ``output_layer.weight`` ``[V', h]`` unless tied;
* ``decoder.layers.self_attention.linear_qkv.weight`` ``[L, (H + 2G) d, h]``, fused per query
  group: for each group ``g``, its ``H/G`` query heads, then its key head, then its value
  head (``.bias`` ``[L, (H + 2G) d]`` the same way);
* ``decoder.layers.self_attention.linear_proj.weight`` ``[L, h, H d]``;
* ``decoder.layers.mlp.linear_fc1.weight`` ``[L, 2f, h]`` = ``[gate; up]`` for SwiGLU,
  ``[L, f, h]`` for GELU; ``linear_fc2.weight`` ``[L, h, f]``;
* mixture of experts (``E`` experts, ``f_e`` expert width), instead of ``linear_fc1/2``:
  ``decoder.layers.mlp.router.weight`` ``[L, E, h]``,
  ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[L, E, 2 f_e, h]`` (each
  expert's ``[gate; up]``) and ``...linear_fc2.weight`` ``[L, E, h, f_e]`` (megatron's
  ``SequentialMLP`` keys: its local experts stacked on a second axis);
* norms ``[L, h]`` (``layer_norm_bias`` too for LayerNorm), ``decoder.final_layernorm.*``
  ``[h]``; ``embedding.position_embeddings.weight`` ``[max_pos, h]`` (GPT-2);
* ``value_head.*`` / ``reward_head.weight`` ``[1, h]`` float32, ``reward_head.bias`` ``[1]``.

Hugging Face names (transformers 4.57, ``models/<arch>/modeling_<arch>.py``):

* Llama / Qwen2 (``LlamaForCausalLM``, ``Qwen2ForCausalLM``): ``model.embed_tokens.weight``,
  ``model.layers.<i>.input_layernorm.weight``, ``self_attn.{q,k,v,o}_proj.weight``
  (``nn.Linear`` ``[out, in]``; q ``[H d, h]``, k/v ``[G d, h]``; KV head ``j`` serves query
  heads ``j H/G .. (j+1) H/G - 1`` as in ``repeat_kv``), Qwen2 adds ``{q,k,v}_proj.bias``,
  Llama's ``attention_bias`` / ``mlp_bias`` add biases to all four / all three,
  ``post_attention_layernorm.weight``, ``mlp.{gate,up,down}_proj.weight``,
  ``model.norm.weight``, ``lm_head.weight`` (absent when ``tie_word_embeddings``);
* Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention, then ``mlp.gate.weight``
  ``[E, h]`` (the router) and ``mlp.experts.<j>.{gate,up,down}_proj.weight``; Mixtral
  (``MixtralForCausalLM``): Mistral's attention, then ``block_sparse_moe.gate.weight`` and
  ``block_sparse_moe.experts.<j>.{w1,w3,w2}.weight`` (gate, up, down);
* GPT-2 (``GPT2LMHeadModel``): ``transformer.wte.weight``, ``transformer.wpe.weight``,
  ``transformer.h.<i>.ln_1.{weight,bias}``, ``attn.c_attn.{weight,bias}`` (``Conv1D``:
  weight ``[in, out]`` = ``[h, 3h]``, output columns ``[q | k | v]``, heads contiguous
  inside each), ``attn.c_proj``, ``ln_2``, ``mlp.c_fc`` ``[h, f]``, ``mlp.c_proj`` ``[f, h]``,
  ``transformer.ln_f``; checkpoints saved from ``GPT2Model`` lack the ``transformer.``
  prefix (accepted on import);
* reward models export as ``<Arch>ForSequenceClassification`` with ``num_labels=1``:
  the backbone under the same prefix plus ``score.weight`` ``[1, h]`` (no bias).

Every transform is a reshape, slice, concatenation or transpose, so import followed by
export returns bit-identical tensors (same names as ``save_pretrained`` writes).

Simplified / refused (a clear ``ValueError`` names the key): RoPE scaling other than
``llama3`` (Llama 3.1+) and partial
rotary, sliding-window attention, Qwen3-MoE with dense layers (``decoder_sparse_step != 1``
or ``mlp_only_layers``), Llama with ``attention_bias != mlp_bias``, GPT-2 with
``scale_attn_by_inverse_layer_idx`` or unscaled attention. Dropout values of the HF config
are not imported (this project trains RLHF with dropout 0). Exports write one
``model.safetensors`` file (no sharding of very large models).

The file side (reading and writing HF folders, tokenizers, importing a checkpoint) is
:mod:`nemo_rlhf.tools.hf_convert`; this module is pure tensor work, so the rollout engines
can map an actor in memory (:mod:`nemo_rlhf.rollout.vllm_engine`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from nemo_rlhf.models.config import ModelConfig

L = "decoder.layers."
ATTN_NORM_W = L + "self_attention.linear_qkv.layer_norm_weight"
ATTN_NORM_B = L + "self_attention.linear_qkv.layer_norm_bias"
QKV_W = L + "self_attention.linear_qkv.weight"
QKV_B = L + "self_attention.linear_qkv.bias"
Q_NORM_W = L + "self_attention.q_layernorm.weight"
K_NORM_W = L + "self_attention.k_layernorm.weight"
PROJ_W = L + "self_attention.linear_proj.weight"
PROJ_B = L + "self_attention.linear_proj.bias"
MLP_NORM_W = L + "mlp.linear_fc1.layer_norm_weight"
MLP_NORM_B = L + "mlp.linear_fc1.layer_norm_bias"
FC1_W = L + "mlp.linear_fc1.weight"
FC1_B = L + "mlp.linear_fc1.bias"
FC2_W = L + "mlp.linear_fc2.weight"
FC2_B = L + "mlp.linear_fc2.bias"
ROUTER_W = L + "mlp.router.weight"
EXPERT_FC1_W = L + "mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2_W = L + "mlp.experts.experts.linear_fc2.weight"
FINAL_NORM_W = "decoder.final_layernorm.weight"
FINAL_NORM_B = "decoder.final_layernorm.bias"
WORD = "embedding.word_embeddings.weight"
POS = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
REWARD_W = "reward_head.weight"
REWARD_B = "reward_head.bias"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- helpers
def head_dim(cfg: ModelConfig) -> int:
    """Per-head width ``d``."""
    return cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads


def query_groups(cfg: ModelConfig) -> int:
    """KV heads ``G``."""
    return cfg.num_query_groups or cfg.num_attention_heads


def ffn_size(cfg: ModelConfig) -> int:
    """MLP width ``f``."""
    return cfg.ffn_hidden_size or 4 * cfg.hidden_size


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """HF ``q [H d, ...]``, ``k``/``v`` ``[G d, ...]`` -> megatron ``[(H + 2G) d, ...]``
    (per group: its query heads, its key head, its value head)."""
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k = k.reshape(groups, -1, *rest)
    v = v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int, dim: int):
    """Inverse of :func:`fuse_qkv`: ``[(H + 2G) d, ...]`` -> ``(q, k, v)`` contiguous."""
    rest = qkv.shape[1:]
    per = heads // groups
    x = qkv.reshape(groups, (per + 2) * dim, *rest)
    q = x[:, :per * dim].reshape(heads * dim, *rest)
    k = x[:, per * dim:(per + 1) * dim].reshape(groups * dim, *rest)
    v = x[:, (per + 1) * dim:].reshape(groups * dim, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``[V, h]`` -> ``[rows, h]`` with zero rows appended (vocabulary padding)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


class _Source:
    """An HF state dict consumed key by key; names missing or left over are errors."""

    def __init__(self, tensors: dict, ignore: Callable[[str], bool]):
        self.tensors = tensors
        self.used: set[str] = set()
        self.ignore = ignore

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"HF checkpoint lacks tensor {name!r}")
        self.used.add(name)
        return self.tensors[name]

    def check_all_used(self) -> None:
        left = sorted(k for k in self.tensors if k not in self.used and not self.ignore(k))
        if left:
            raise ValueError(f"HF checkpoint has {len(left)} tensors this mapping does not know: "
                             f"{left[:6]}{' ...' if len(left) > 6 else ''}")


def _need(mg: dict, key: str) -> torch.Tensor:
    if key not in mg:
        raise ValueError(f"checkpoint lacks tensor model.{key}")
    return mg[key]


# --------------------------------------------------------------------------- architectures
@dataclass(frozen=True)
class Arch:
    """One supported Hugging Face architecture."""

    name: str
    """``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gpt2``, ``qwen3_moe`` or ``mixtral``
    (also the HF ``model_type``)."""
    causal_lm: str
    """transformers class of the actor export."""
    seq_cls: str
    """transformers class of the reward-model export."""
    prefix: str
    """Backbone prefix in HF state dicts (``model.`` / ``transformer.``)."""
    dense: str = ""
    """A mixture-of-experts architecture's dense counterpart, whose attention, norms and
    embeddings it shares (``qwen3`` for ``qwen3_moe``); empty for a dense architecture."""
    moe_names: tuple = ()
    """MoE: ``(block, gate, up, down)``, the HF names of a layer's MoE block and of an
    expert's three projections."""

    @property
    def base(self) -> str:
        """The dense architecture whose rules apply to everything but the MLP."""
        return self.dense or self.name


ARCHS = {
    "llama": Arch("llama", "LlamaForCausalLM", "LlamaForSequenceClassification", "model."),
    "mistral": Arch("mistral", "MistralForCausalLM", "MistralForSequenceClassification", "model."),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification", "model."),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification", "model."),
    "gpt2": Arch("gpt2", "GPT2LMHeadModel", "GPT2ForSequenceClassification", "transformer."),
    "qwen3_moe": Arch("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification", "model.",
                      dense="qwen3", moe_names=("mlp.", "gate_proj", "up_proj", "down_proj")),
    "mixtral": Arch("mixtral", "MixtralForCausalLM", "MixtralForSequenceClassification", "model.",
                    dense="mistral", moe_names=("block_sparse_moe.", "w1", "w3", "w2")),
}


def get_arch(name: str) -> Arch:
    """The :class:`Arch` named ``name``.

    Raises:
        ValueError: unknown name; lists the supported ones.
    """
    if name not in ARCHS:
        raise ValueError(f"architecture {name!r} is not supported; supported: {sorted(ARCHS)}")
    return ARCHS[name]


def arch_problems(cfg: ModelConfig, arch: str) -> list[str]:
    """Why ``cfg`` cannot be written as ``arch`` (empty: it can)."""
    a = get_arch(arch)
    p = []
    if a.moe_names and cfg.num_moe_experts is None:
        p.append(f"model.num_moe_experts=null ({arch} is a mixture of experts)")
    if not a.moe_names and cfg.num_moe_experts is not None:
        p.append(f"model.num_moe_experts={cfg.num_moe_experts} ({arch} is dense)")
    if arch == "mixtral" and cfg.moe_router_pre_softmax:
        p.append("model.moe_router_pre_softmax=true (mixtral renormalises the top-k weights)")
    arch = a.base
    if arch in ("llama", "mistral", "qwen2", "qwen3"):
        if cfg.qk_layernorm != (arch == "qwen3"):
            p.append(f"model.qk_layernorm={cfg.qk_layernorm} ({arch} {'needs' if arch == 'qwen3' else 'has no'} "
                     "query / key norms)")
        if cfg.normalization != "RMSNorm":
            p.append(f"model.normalization={cfg.normalization} (needs RMSNorm)")
        if cfg.activation != "swiglu":
            p.append(f"model.activation={cfg.activation} (needs swiglu)")
        if cfg.position_embedding_type != "rope":
            p.append(f"model.position_embedding_type={cfg.position_embedding_type} (needs rope)")
        if arch == "qwen2" and (not cfg.add_qkv_bias or cfg.add_bias_linear):
            p.append(f"model.add_qkv_bias={cfg.add_qkv_bias}, add_bias_linear={cfg.add_bias_linear} "
                     "(qwen2 needs QKV biases only)")
        if arch == "llama" and cfg.add_qkv_bias and not cfg.add_bias_linear:
            p.append("model.add_qkv_bias=true without add_bias_linear (that is qwen2)")
        if arch == "qwen3" and cfg.add_bias_linear != cfg.add_qkv_bias:
            p.append(f"model.add_qkv_bias={cfg.add_qkv_bias}, add_bias_linear={cfg.add_bias_linear} "
                     "(qwen3's attention_bias covers q, k, v and o together; its MLP has none)")
        if arch == "qwen3" and cfg.add_bias_linear:
            p.append("model.add_bias_linear=true (qwen3's MLP has no biases)")
        if arch == "mistral" and (cfg.add_qkv_bias or cfg.add_bias_linear):
            p.append(f"model.add_qkv_bias={cfg.add_qkv_bias}, add_bias_linear={cfg.add_bias_linear} "
                     "(mistral has no linear biases)")
    else:
        if cfg.normalization != "LayerNorm":
            p.append(f"model.normalization={cfg.normalization} (needs LayerNorm)")
        if cfg.activation not in ("gelu_tanh", "gelu"):
            p.append(f"model.activation={cfg.activation} (needs gelu_tanh or gelu)")
        if cfg.position_embedding_type != "learned_absolute":
            p.append(f"model.position_embedding_type={cfg.position_embedding_type} "
                     "(needs learned_absolute)")
        if not cfg.add_bias_linear:
            p.append("model.add_bias_linear=false (gpt2 has biases everywhere)")
        if query_groups(cfg) != cfg.num_attention_heads:
            p.append(f"model.num_query_groups={cfg.num_query_groups} (gpt2 has no GQA)")
        if head_dim(cfg) * cfg.num_attention_heads != cfg.hidden_size:
            p.append(f"model.kv_channels={cfg.kv_channels} (gpt2 needs hidden/heads)")
    return p


def infer_arch(cfg: ModelConfig) -> str:
    """``qwen3_moe`` / ``mixtral`` (the next two with MoE layers), ``qwen3`` (RMSNorm + SwiGLU
    + RoPE + query / key norms), ``qwen2`` (the same with a
    QKV bias and no query / key norms), ``llama`` (neither) or ``gpt2`` (LayerNorm + GELU +
    learned positions + biases). A Mistral-shaped model is ``llama`` (the same tensors and
    math; ``export-hf --arch mistral`` writes it as Mistral).

    Raises:
        ValueError: none fits; says what each would need.
    """
    for arch in ("qwen3_moe", "mixtral", "qwen3", "qwen2", "llama", "gpt2"):
        if not arch_problems(cfg, arch):
            return arch
    why = "; ".join(f"{a}: {', '.join(arch_problems(cfg, a))}"
                    for a in ("llama", "qwen2", "qwen3", "gpt2", "qwen3_moe", "mixtral"))
    raise ValueError(f"model {cfg.name!r} matches no supported HF architecture ({why})")


# --------------------------------------------------------------------------- configs
def _hf_get(hf: dict, key: str, default):
    """A field of an HF ``config.json`` with transformers' default when it is absent."""
    value = hf.get(key)
    return default if value is None else value


def model_config_from_hf(hf: dict, name: str) -> tuple[ModelConfig, str]:
    """``(ModelConfig, arch)`` of an HF ``config.json`` (a dict).

    Defaults for absent keys are those of transformers' ``LlamaConfig``, ``Qwen2Config``
    and ``GPT2Config``. ``vocab_size`` is the embedding's row count (the real vocabulary).

    Raises:
        ValueError: unsupported ``model_type`` (lists the supported ones) or a feature this
            project's model does not have (names the HF key).
    """
    mt = hf.get("model_type")
    if mt not in ARCHS:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {sorted(ARCHS)}")
    if mt == "gpt2":
        return _gpt2_config(hf, name), mt
    moe = _moe_config(hf, mt)
    base = ARCHS[mt].base
    act = _hf_get(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: only 'silu' (SwiGLU) is supported for {mt}")
    # transformers >= 5 writes one ``rope_parameters`` dict (theta, type and the scaling's
    # parameters); earlier versions (and most Hub files) ``rope_theta`` and ``rope_scaling``
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta_value, scaling = params.get("rope_theta", 10000.0), params
        partial = params.get("partial_rotary_factor", _hf_get(hf, "partial_rotary_factor", 1.0))
    else:
        theta_value, scaling = _hf_get(hf, "rope_theta", 1e6 if mt == "mixtral" else 10000.0), hf.get("rope_scaling")
        partial = _hf_get(hf, "partial_rotary_factor", 1.0)
    rope = _rope_scaling(scaling)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial}: only 1 (RoPE on the whole head) is supported")
    if base in ("qwen2", "qwen3") and _hf_get(hf, "use_sliding_window", False):
        raise ValueError("use_sliding_window=true: sliding-window attention is not supported")
    if base == "mistral":
        window = hf.get("sliding_window")
        positions = _hf_get(hf, "max_position_embeddings", 4096 * 32)
        if window is not None and window < positions:
            raise ValueError(
                f"sliding_window={window} (< max_position_embeddings={positions}): sliding-window "
                f"attention is not supported (attention here is full: past {window} tokens it would "
                f"see tokens the window hides); checkpoints with sliding_window null (Mistral-7B-v0.2 and "
                f"later) import, or set max_position_embeddings <= {window} in a copy of config.json")
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    dim = _hf_get(hf, "head_dim", hidden // heads)
    theta = float(theta_value)
    if theta != int(theta):
        raise ValueError(f"rope_theta={theta}: a non-integer RoPE base is not supported")
    if mt == "llama":
        attn_bias = bool(_hf_get(hf, "attention_bias", False))
        mlp_bias = bool(_hf_get(hf, "mlp_bias", False))
        if attn_bias != mlp_bias:
            raise ValueError(f"attention_bias={attn_bias} with mlp_bias={mlp_bias}: only both or "
                             "neither can be expressed (model.add_bias_linear)")
        bias_linear, qkv_bias = attn_bias, attn_bias
    elif base == "mistral":
        bias_linear, qkv_bias = False, False
    elif base == "qwen3":
        if _hf_get(hf, "attention_bias", False):
            raise ValueError("attention_bias=true: qwen3 with biases on q, k, v and o but not the MLP "
                             "cannot be expressed (model.add_bias_linear covers the MLP too)")
        bias_linear, qkv_bias = False, False
    else:
        bias_linear, qkv_bias = False, True
    cfg = ModelConfig(
        name=name,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=_hf_get(hf, "num_key_value_heads", heads),
        ffn_hidden_size=hf["intermediate_size"],
        kv_channels=None if dim * heads == hidden else dim,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=_hf_get(hf, "max_position_embeddings",
                                        {"llama": 2048, "mistral": 4096 * 32, "mixtral": 4096 * 32}.get(mt, 32768)),
        normalization="RMSNorm",
        layernorm_epsilon=float(_hf_get(hf, "rms_norm_eps", 1e-5 if mt == "mixtral" else 1e-6)),
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=int(theta),
        add_bias_linear=bias_linear,
        add_qkv_bias=qkv_bias,
        qk_layernorm=base == "qwen3",
        share_embeddings_and_output_weights=bool(_hf_get(hf, "tie_word_embeddings", False)),
        init_method_std=float(_hf_get(hf, "initializer_range", 0.02)),
        **rope,
        **moe,
    )
    return cfg, mt


def _moe_config(hf: dict, mt: str) -> dict:
    """:class:`ModelConfig` MoE keys of a ``qwen3_moe`` / ``mixtral`` ``config.json`` (empty
    for a dense ``model_type``). The routers' auxiliary-loss coefficient
    (``router_aux_loss_coef``) and Mixtral's ``router_jitter_noise`` are training settings,
    not imported (``model.moe_aux_loss_coeff`` stays 0, as dropout is not imported).

    Raises:
        ValueError: a Qwen3-MoE with dense layers (``decoder_sparse_step != 1``, a non-empty
            ``mlp_only_layers``) or no experts, naming the HF key.
    """
    if mt == "qwen3_moe":
        step = _hf_get(hf, "decoder_sparse_step", 1)
        dense_layers = list(_hf_get(hf, "mlp_only_layers", []))
        if step != 1 or dense_layers:
            raise ValueError(f"decoder_sparse_step={step}, mlp_only_layers={dense_layers}: only a "
                             "qwen3_moe whose every layer is MoE (decoder_sparse_step=1, mlp_only_layers=[]) "
                             "is supported; dense layers between MoE layers are not")
        experts = _hf_get(hf, "num_experts", 128)
        if experts < 1:
            raise ValueError(f"num_experts={experts}: a qwen3_moe without experts is dense; "
                             "set model_type to qwen3")
        return {"num_moe_experts": experts, "moe_router_topk": _hf_get(hf, "num_experts_per_tok", 8),
                "moe_ffn_hidden_size": _hf_get(hf, "moe_intermediate_size", 768),
                "moe_router_pre_softmax": not _hf_get(hf, "norm_topk_prob", False)}
    if mt == "mixtral":
        return {"num_moe_experts": _hf_get(hf, "num_local_experts", 8),
                "moe_router_topk": _hf_get(hf, "num_experts_per_tok", 2),
                "moe_ffn_hidden_size": _hf_get(hf, "intermediate_size", 14336),
                "moe_router_pre_softmax": False}
    return {}


ROPE_TYPES = ("default", "llama3")
"""HF ``rope_scaling.rope_type`` values imported (``default``: none)."""


def _rope_scaling(scaling) -> dict:
    """:class:`ModelConfig` ``rope_*`` keys of an HF ``rope_scaling`` or ``rope_parameters``
    (None or a dict).

    Raises:
        ValueError: a ``rope_type`` other than :data:`ROPE_TYPES` (``linear``, ``dynamic``,
            ``yarn``, ``longrope``, ...: names it and the supported ones), or a ``llama3``
            entry missing a parameter.
    """
    if not scaling:
        return {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return {}
    if kind != "llama3":
        raise ValueError(f"rope_scaling={scaling}: rope_type {kind!r} is not supported; supported: "
                         f"{list(ROPE_TYPES)}")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling={scaling}: rope_type 'llama3' needs {missing}")
    return {"rope_scaling": "llama3", "rope_scaling_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}


def hf_rope_scaling(cfg: ModelConfig) -> Optional[dict]:
    """The HF ``rope_scaling`` entry of ``cfg`` (None without scaling)."""
    if cfg.rope_scaling is None:
        return None
    return {"rope_type": cfg.rope_scaling, "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position_embeddings}


def _gpt2_config(hf: dict, name: str) -> ModelConfig:
    act = _hf_get(hf, "activation_function", "gelu_new")
    acts = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if act not in acts:
        raise ValueError(f"activation_function={act!r}: supported for gpt2: {sorted(acts)}")
    if (not _hf_get(hf, "scale_attn_weights", True)
            or _hf_get(hf, "scale_attn_by_inverse_layer_idx", False)):
        raise ValueError("scale_attn_weights=false or scale_attn_by_inverse_layer_idx=true: "
                         "attention scaling other than 1/sqrt(head_dim) is not supported")
    hidden = _hf_get(hf, "n_embd", 768)
    return ModelConfig(
        name=name,
        num_layers=_hf_get(hf, "n_layer", 12),
        hidden_size=hidden,
        num_attention_heads=_hf_get(hf, "n_head", 12),
        ffn_hidden_size=_hf_get(hf, "n_inner", 4 * hidden),
        vocab_size=_hf_get(hf, "vocab_size", 50257),
        max_position_embeddings=_hf_get(hf, "n_positions", 1024),
        normalization="LayerNorm",
        layernorm_epsilon=float(_hf_get(hf, "layer_norm_epsilon", 1e-5)),
        activation=acts[act],
        position_embedding_type="learned_absolute",
        add_bias_linear=True,
        share_embeddings_and_output_weights=bool(_hf_get(hf, "tie_word_embeddings", True)),
        init_method_std=float(_hf_get(hf, "initializer_range", 0.02)),
    )


def hf_config(cfg: ModelConfig, arch: str, dtype: torch.dtype, reward: bool = False,
              token_ids: Optional[dict] = None) -> dict:
    """The ``config.json`` dict of an export.

    Args:
        dtype: the exported tensors' dtype (``torch_dtype``).
        reward: a ``<Arch>ForSequenceClassification`` with ``num_labels=1``.
        token_ids: ``{"bos_token_id", "eos_token_id", "pad_token_id"}`` (None entries left out).

    Raises:
        ValueError: ``cfg`` cannot be written as ``arch`` (see :func:`arch_problems`).
    """
    problems = arch_problems(cfg, arch)
    if problems:
        raise ValueError(f"model {cfg.name!r} cannot be exported as {arch}: {'; '.join(problems)}")
    a = get_arch(arch)
    dtype_name = {v: k for k, v in DTYPES.items()}[dtype]
    tied = cfg.share_embeddings_and_output_weights and not reward
    if arch == "gpt2":
        out = {"model_type": "gpt2", "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
               "n_head": cfg.num_attention_heads, "n_inner": ffn_size(cfg),
               "n_positions": cfg.max_position_embeddings,
               "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
               "layer_norm_epsilon": cfg.layernorm_epsilon, "attn_pdrop": 0.0, "embd_pdrop": 0.0,
               "resid_pdrop": 0.0, "summary_first_dropout": 0.0, "scale_attn_weights": True,
               "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    else:
        base = a.base
        out = {"model_type": arch, "hidden_size": cfg.hidden_size,
               "intermediate_size": ffn_size(cfg), "num_hidden_layers": cfg.num_layers,
               "num_attention_heads": cfg.num_attention_heads,
               "num_key_value_heads": query_groups(cfg), "head_dim": head_dim(cfg),
               "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
               "rms_norm_eps": cfg.layernorm_epsilon, "rope_theta": float(cfg.rotary_base),
               "rope_scaling": hf_rope_scaling(cfg), "attention_dropout": 0.0}
        if base == "llama":
            out.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear,
                       pretraining_tp=1)
        elif base == "mistral":
            out.update(sliding_window=None)
        elif base == "qwen3":
            out.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                       max_window_layers=cfg.num_layers)
        else:
            out.update(use_sliding_window=False, sliding_window=None,
                       max_window_layers=cfg.num_layers)
        if arch == "qwen3_moe":
            out.update(num_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                       moe_intermediate_size=cfg.moe_expert_ffn_size, norm_topk_prob=not cfg.moe_router_pre_softmax,
                       decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                       router_aux_loss_coef=cfg.moe_aux_loss_coeff)
        elif arch == "mixtral":
            out.update(num_local_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                       intermediate_size=cfg.moe_expert_ffn_size, output_router_logits=False,
                       router_aux_loss_coef=cfg.moe_aux_loss_coeff, router_jitter_noise=0.0)
    out.update(architectures=[a.seq_cls if reward else a.causal_lm], vocab_size=cfg.vocab_size,
               tie_word_embeddings=tied, initializer_range=cfg.init_method_std,
               torch_dtype=dtype_name, use_cache=True)
    if reward:
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    out.update({k: v for k, v in (token_ids or {}).items() if v is not None})
    return out


# --------------------------------------------------------------------------- weights
def hf_to_megatron(hf: dict, cfg: ModelConfig, arch: str) -> dict:
    """HF causal-LM tensors -> megatron full tensors (dist-checkpoint keys, no ``model.``).

    Args:
        hf: ``{name: tensor}`` as ``save_pretrained`` writes it.
        cfg: the model config (:func:`model_config_from_hf`); its ``padded_vocab_size``
            sets the embedding rows.

    Raises:
        ValueError: a tensor missing, one left over, or a sequence-classification head.
    """
    a = get_arch(arch)
    if "score.weight" in hf:
        raise ValueError("the HF checkpoint has score.weight (a sequence classifier); import-hf "
                         "converts causal-LM checkpoints only")
    if arch == "gpt2":
        hf = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v
              for k, v in hf.items()}
        ignore = lambda k: k.endswith((".attn.bias", ".attn.masked_bias"))  # noqa: E731 - buffers
    else:
        ignore = lambda k: k.endswith("rotary_emb.inv_freq")  # noqa: E731 - buffer
    src = _Source(hf, ignore)
    per_layer: dict[str, list] = {}
    for i in range(cfg.num_layers):
        layer = _gpt2_layer_in(src, i, cfg, a.prefix) if arch == "gpt2" else _llama_layer_in(src, i, cfg, a)
        for k, t in layer.items():
            per_layer.setdefault(k, []).append(t)
    out = {k: torch.stack(v) for k, v in per_layer.items()}
    vp = cfg.padded_vocab_size
    if arch == "gpt2":
        out[WORD] = pad_rows(src.take("transformer.wte.weight"), vp)
        out[POS] = src.take("transformer.wpe.weight")
        out[FINAL_NORM_W] = src.take("transformer.ln_f.weight")
        out[FINAL_NORM_B] = src.take("transformer.ln_f.bias")
    else:
        out[WORD] = pad_rows(src.take("model.embed_tokens.weight"), vp)
        out[FINAL_NORM_W] = src.take("model.norm.weight")
    if cfg.share_embeddings_and_output_weights:
        if "lm_head.weight" in src:  # some tied checkpoints store the copy too
            src.take("lm_head.weight")
    else:
        out[OUTPUT] = pad_rows(src.take("lm_head.weight"), vp)
    src.check_all_used()
    if out[WORD].shape != (vp, cfg.hidden_size):
        raise ValueError(f"embedding has shape {tuple(out[WORD].shape)}, config says "
                         f"vocab_size={cfg.vocab_size} x hidden_size={cfg.hidden_size}")
    return {k: v.contiguous() for k, v in out.items()}


def _llama_layer_in(src: _Source, i: int, cfg: ModelConfig, a: Arch) -> dict:
    p = f"{a.prefix}layers.{i}."
    g = query_groups(cfg)
    attn = p + "self_attn."
    mlp = p + "mlp."
    out = {
        ATTN_NORM_W: src.take(p + "input_layernorm.weight"),
        QKV_W: fuse_qkv(src.take(attn + "q_proj.weight"), src.take(attn + "k_proj.weight"),
                        src.take(attn + "v_proj.weight"), g),
        PROJ_W: src.take(attn + "o_proj.weight"),
        MLP_NORM_W: src.take(p + "post_attention_layernorm.weight"),
    }
    if cfg.num_moe_experts is not None:
        block, gate, up, down = a.moe_names
        block = p + block
        experts = [f"{block}experts.{j}." for j in range(cfg.num_moe_experts)]
        out[ROUTER_W] = src.take(block + "gate.weight")  # [E, h]
        out[EXPERT_FC1_W] = torch.stack([torch.cat([src.take(e + gate + ".weight"), src.take(e + up + ".weight")])
                                         for e in experts])  # [E, 2 f_e, h]
        out[EXPERT_FC2_W] = torch.stack([src.take(e + down + ".weight") for e in experts])  # [E, h, f_e]
    else:
        out[FC1_W] = torch.cat([src.take(mlp + "gate_proj.weight"), src.take(mlp + "up_proj.weight")])
        out[FC2_W] = src.take(mlp + "down_proj.weight")
    if cfg.qk_layernorm:
        out[Q_NORM_W] = src.take(attn + "q_norm.weight")
        out[K_NORM_W] = src.take(attn + "k_norm.weight")
    if cfg.add_qkv_bias or cfg.add_bias_linear:
        out[QKV_B] = fuse_qkv(src.take(attn + "q_proj.bias"), src.take(attn + "k_proj.bias"),
                              src.take(attn + "v_proj.bias"), g)
    if cfg.add_bias_linear:
        out[PROJ_B] = src.take(attn + "o_proj.bias")
        out[FC1_B] = torch.cat([src.take(mlp + "gate_proj.bias"), src.take(mlp + "up_proj.bias")])
        out[FC2_B] = src.take(mlp + "down_proj.bias")
    return out


def _gpt2_layer_in(src: _Source, i: int, cfg: ModelConfig, prefix: str) -> dict:
    p = f"{prefix}h.{i}."
    heads = cfg.num_attention_heads
    w = src.take(p + "attn.c_attn.weight").t()  # Conv1D [h, 3h] -> [3h, h] = [q; k; v]
    b = src.take(p + "attn.c_attn.bias")
    return {
        ATTN_NORM_W: src.take(p + "ln_1.weight"),
        ATTN_NORM_B: src.take(p + "ln_1.bias"),
        QKV_W: fuse_qkv(*w.chunk(3, dim=0), heads),
        QKV_B: fuse_qkv(*b.chunk(3, dim=0), heads),
        PROJ_W: src.take(p + "attn.c_proj.weight").t(),
        PROJ_B: src.take(p + "attn.c_proj.bias"),
        MLP_NORM_W: src.take(p + "ln_2.weight"),
        MLP_NORM_B: src.take(p + "ln_2.bias"),
        FC1_W: src.take(p + "mlp.c_fc.weight").t(),
        FC1_B: src.take(p + "mlp.c_fc.bias"),
        FC2_W: src.take(p + "mlp.c_proj.weight").t(),
        FC2_B: src.take(p + "mlp.c_proj.bias"),
    }


def megatron_to_hf(mg: dict, cfg: ModelConfig, arch: str, reward: bool = False) -> dict:
    """megatron full tensors -> HF tensors (``<Arch>ForCausalLM`` / ``...ForSequenceClassification``).

    Args:
        mg: full checkpoint tensors; keys with or without the ``model.`` prefix. Value heads,
            optimizer state and (for ``reward``) the output layer are ignored.
        reward: export ``reward_head.weight`` as ``score.weight`` (the caller deals with
            the head's bias, which HF's classifier does not have).

    Returns:
        ``{name: tensor}``, contiguous, vocabulary un-padded to ``cfg.vocab_size``.

    Raises:
        ValueError: a tensor missing or with a shape the config does not predict.
    """
    a = get_arch(arch)
    mg = {k[len("model."):] if k.startswith("model.") else k: v for k, v in mg.items()
          if not k.startswith("optimizer.")}
    check_shapes(mg, cfg)
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        out.update(_gpt2_layer_out(mg, i, cfg, a.prefix) if arch == "gpt2" else _llama_layer_out(mg, i, cfg, a))
    v = cfg.vocab_size
    if arch == "gpt2":
        out["transformer.wte.weight"] = _need(mg, WORD)[:v]
        out["transformer.wpe.weight"] = _need(mg, POS)
        out["transformer.ln_f.weight"] = _need(mg, FINAL_NORM_W)
        out["transformer.ln_f.bias"] = _need(mg, FINAL_NORM_B)
    else:
        out["model.embed_tokens.weight"] = _need(mg, WORD)[:v]
        out["model.norm.weight"] = _need(mg, FINAL_NORM_W)
    if reward:
        out["score.weight"] = _need(mg, REWARD_W)
    elif not cfg.share_embeddings_and_output_weights:
        out["lm_head.weight"] = _need(mg, OUTPUT)[:v]
    return {k: t.contiguous().clone() for k, t in out.items()}


def check_shapes(mg: dict, cfg: ModelConfig) -> None:
    """Raise ValueError if a tensor (or a shape) of ``mg`` disagrees with ``cfg``."""
    h, n = cfg.hidden_size, cfg.num_layers
    qkv = (cfg.num_attention_heads + 2 * query_groups(cfg)) * head_dim(cfg)
    glu = 2 if cfg.activation == "swiglu" else 1
    expect = {WORD: (cfg.padded_vocab_size, h), QKV_W: (n, qkv, h)}
    if cfg.num_moe_experts is None:
        expect.update({FC1_W: (n, glu * ffn_size(cfg), h), FC2_W: (n, h, ffn_size(cfg))})
    else:
        e, fe = cfg.num_moe_experts, cfg.moe_expert_ffn_size
        expect.update({ROUTER_W: (n, e, h), EXPERT_FC1_W: (n, e, glu * fe, h), EXPERT_FC2_W: (n, e, h, fe)})
        for key in expect:
            if key not in mg:
                raise ValueError(f"checkpoint lacks tensor model.{key} (config.yaml's model section "
                                 f"has num_moe_experts={e})")
    for key, shape in expect.items():
        found = tuple(getattr(mg[key], "shape", mg[key])) if key in mg else shape
        if found != shape:
            raise ValueError(f"model.{key} has shape {found} but config.yaml's model "
                             f"section predicts {shape}")


def _llama_layer_out(mg: dict, i: int, cfg: ModelConfig, a: Arch) -> dict:
    p = f"{a.prefix}layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    heads, g, d = cfg.num_attention_heads, query_groups(cfg), head_dim(cfg)
    q, k, v = split_qkv(_need(mg, QKV_W)[i], heads, g, d)
    out = {
        p + "input_layernorm.weight": _need(mg, ATTN_NORM_W)[i],
        attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v,
        attn + "o_proj.weight": _need(mg, PROJ_W)[i],
        p + "post_attention_layernorm.weight": _need(mg, MLP_NORM_W)[i],
    }
    if cfg.num_moe_experts is not None:
        block, gate_name, up_name, down_name = a.moe_names
        block = p + block
        out[block + "gate.weight"] = _need(mg, ROUTER_W)[i]
        for j in range(cfg.num_moe_experts):
            e = f"{block}experts.{j}."
            gate, up = _need(mg, EXPERT_FC1_W)[i, j].chunk(2, dim=0)
            out.update({e + gate_name + ".weight": gate, e + up_name + ".weight": up,
                        e + down_name + ".weight": _need(mg, EXPERT_FC2_W)[i, j]})
    else:
        gate, up = _need(mg, FC1_W)[i].chunk(2, dim=0)
        out.update({mlp + "gate_proj.weight": gate, mlp + "up_proj.weight": up,
                    mlp + "down_proj.weight": _need(mg, FC2_W)[i]})
    if cfg.qk_layernorm:
        out[attn + "q_norm.weight"] = _need(mg, Q_NORM_W)[i]
        out[attn + "k_norm.weight"] = _need(mg, K_NORM_W)[i]
    if cfg.add_qkv_bias or cfg.add_bias_linear:
        qb, kb, vb = split_qkv(_need(mg, QKV_B)[i], heads, g, d)
        out.update({attn + "q_proj.bias": qb, attn + "k_proj.bias": kb, attn + "v_proj.bias": vb})
    if cfg.add_bias_linear:
        gb, ub = _need(mg, FC1_B)[i].chunk(2, dim=0)
        out.update({attn + "o_proj.bias": _need(mg, PROJ_B)[i], mlp + "gate_proj.bias": gb,
                    mlp + "up_proj.bias": ub, mlp + "down_proj.bias": _need(mg, FC2_B)[i]})
    return out


def _gpt2_layer_out(mg: dict, i: int, cfg: ModelConfig, prefix: str) -> dict:
    p = f"{prefix}h.{i}."
    heads, d = cfg.num_attention_heads, head_dim(cfg)
    w = torch.cat(split_qkv(_need(mg, QKV_W)[i], heads, heads, d))  # [3h, h] = [q; k; v]
    b = torch.cat(split_qkv(_need(mg, QKV_B)[i], heads, heads, d))
    return {
        p + "ln_1.weight": _need(mg, ATTN_NORM_W)[i], p + "ln_1.bias": _need(mg, ATTN_NORM_B)[i],
        p + "attn.c_attn.weight": w.t(), p + "attn.c_attn.bias": b,
        p + "attn.c_proj.weight": _need(mg, PROJ_W)[i].t(),
        p + "attn.c_proj.bias": _need(mg, PROJ_B)[i],
        p + "ln_2.weight": _need(mg, MLP_NORM_W)[i], p + "ln_2.bias": _need(mg, MLP_NORM_B)[i],
        p + "mlp.c_fc.weight": _need(mg, FC1_W)[i].t(), p + "mlp.c_fc.bias": _need(mg, FC1_B)[i],
        p + "mlp.c_proj.weight": _need(mg, FC2_W)[i].t(),
        p + "mlp.c_proj.bias": _need(mg, FC2_B)[i],
    }


# --------------------------------------------------------------------------- megatron model
_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(?:mlp\.experts\.local_experts\.(\d+)\.)?")


def _stack_index(name: str, key: str) -> tuple:
    """Where a state-dict entry goes in its full tensor: ``()`` (not stacked), ``(layer,)``
    or, for a MoE expert's weight, ``(layer, expert)`` (the local expert index: the global
    one at expert-parallel size 1; :func:`gather_full_tensors` maps it at EP > 1)."""
    m = _LAYER_RE.match(name) if key.startswith(L) else None
    if m is None:
        return ()
    return (int(m.group(1)),) if m.group(2) is None else (int(m.group(1)), int(m.group(2)))


def _stacked(parts: dict) -> torch.Tensor:
    """``{index tuple: tensor}`` -> one tensor, stacked along the index axes in order."""
    if list(parts) == [()]:
        return parts[()]
    heads = sorted({i[0] for i in parts})
    return torch.stack([_stacked({i[1:]: t for i, t in parts.items() if i[0] == h}) for h in heads])


def _model_entries(model):
    """``(state-dict name, dist key, stack index, tensor)`` of a TP=1, PP=1 model, read
    through its sharded state dict (so whichever layer spec built it, local or TE); the
    index is :func:`_stack_index`'s."""
    for name, sh in model.sharded_state_dict(prefix="").items():
        key, data = getattr(sh, "key", None), getattr(sh, "data", None)
        if key is None or not torch.is_tensor(data) or name.endswith("_extra_state"):
            continue
        yield name, key, _stack_index(name, key), data


def model_full_tensors(model) -> dict:
    """A TP=1, PP=1 model's weights as full tensors keyed like a dist checkpoint (layers,
    and a MoE layer's experts, stacked): the input of :func:`megatron_to_hf` for a model in
    memory."""
    parts: dict = {}
    for _, key, index, data in _model_entries(model):
        parts.setdefault(key, {})[index] = data.detach()
    return {k: _stacked(v) for k, v in parts.items()}


def _tp_gather(data: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(data) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, data.contiguous(), group=group)
    return parts


def gather_full_tensors(model, tp_group=None, skip: Callable[[str], bool] = lambda key: False,
                        ep_group=None) -> dict:
    """This model's weights as full tensors (like :func:`model_full_tensors`), its TP shards
    gathered over ``tp_group`` and, for a MoE model at expert-parallel size > 1, its experts
    over ``ep_group`` (EP rank ``r``'s local expert ``i`` is expert ``r * E / EP + i``):
    every rank of the groups returns the same dict.

    A tensor split across TP (vocab-parallel embedding and output layer, column-parallel
    QKV / fc1, row-parallel proj / fc2) is all-gathered along the axis its sharded state
    dict fragments; megatron's SwiGLU ``linear_fc1`` shard is ``[gate_r; up_r]`` per rank
    (its ``ShardedTensorFactory``), so the halves are regrouped to ``[gate; up]``.
    Replicated tensors (norms) are taken as they are. The tensors live where the model's
    do (a device all-gather under NCCL).

    Args:
        model: a megatron ``GPTModel`` / actor stage at PP=1 (unwrapped).
        tp_group: the TP group (None or size 1: no communication).
        skip: dist keys not to gather (e.g. the value head).
        ep_group: the expert-parallel group (``dims.ep_group``; None or size 1: the experts
            are all local).

    Raises:
        ValueError: a tensor fragmented along more than one axis (not a TP layout).
    """
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    if tp == 1 and ep == 1:
        return {k: v for k, v in model_full_tensors(model).items() if not skip(k)}
    entries = [(name, sh) for name, sh in model.sharded_state_dict(prefix="").items()
               if getattr(sh, "key", None) is not None and torch.is_tensor(getattr(sh, "data", None))
               and not name.endswith("_extra_state") and not skip(sh.key)]
    local_experts = 1 + max((_stack_index(n, sh.key)[1:] or (-1,))[0] for n, sh in entries)
    parts: dict = {}
    for name, sh in entries:
        key, data = sh.key, sh.data.detach()
        index = _stack_index(name, key)
        full = data if tp == 1 else _tp_full(sh, data, tp_group)
        if ep > 1 and len(index) == 2:  # (layer, local expert): every EP rank's
            for r, t in enumerate(_tp_gather(full, ep_group)):
                parts.setdefault(key, {})[(index[0], r * local_experts + index[1])] = t
        else:
            parts.setdefault(key, {})[index] = full
    return {k: _stacked(v) for k, v in parts.items()}


def _tp_full(sh, data: torch.Tensor, tp_group) -> torch.Tensor:
    """One sharded-state-dict entry's TP shards gathered into its full tensor.

    Raises:
        ValueError: fragmented along more than one axis (not a TP layout).
    """
    if type(sh).__name__ == "ShardedTensorFactory":  # SwiGLU fc1: [gate_r; up_r] per rank
        halves = [p.chunk(2, dim=0) for p in _tp_gather(data, tp_group)]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    pre = sh.prepend_axis_num
    axes = [i - pre for i, f in enumerate(sh.axis_fragmentations) if f > 1 and i >= pre]
    if len(axes) > 1:
        raise ValueError(f"{sh.key}: fragmented along axes {axes}; only one TP axis is expected")
    return torch.cat(_tp_gather(data, tp_group), dim=axes[0]) if axes else data


def fill_model(model, tensors: dict) -> None:
    """Copy full tensors (dist-checkpoint keys, see the module docstring) into a TP=1,
    PP=1 model (inverse of :func:`model_full_tensors`).

    Raises:
        ValueError: a tensor the model needs is missing, has the wrong shape, or is unused.
    """
    state, used = {}, set()
    for name, key, index, _ in _model_entries(model):
        if key not in tensors:
            raise ValueError(f"the conversion produced no {key} (needed by the model)")
        state[name] = tensors[key][index] if index else tensors[key]
        used.add(key)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        first = next((x for x in str(exc).splitlines() if "size mismatch" in x), str(exc))
        raise ValueError(f"HF weights do not fit config.json: {first.strip()}") from None
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected or set(tensors) - used:
        raise ValueError(f"state mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}, "
                         f"unused {sorted(set(tensors) - used)[:4]}")


