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
can map an actor in memory (:mod:`nemo_rlhf.rollout.vllm_engine`). The HF ``config.json``
side is :mod:`nemo_rlhf.models.hf_config`; a live model's full tensors (gathered over TP and
EP, or filled back) are :mod:`nemo_rlhf.models.full_tensors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

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


# --------------------------------------------------------------------------- weights
def hf_to_megatron(hf: dict, cfg: ModelConfig, arch: str) -> dict:
    """HF causal-LM tensors -> megatron full tensors (dist-checkpoint keys, no ``model.``).

    Args:
        hf: ``{name: tensor}`` as ``save_pretrained`` writes it.
        cfg: the model config (:func:`~nemo_rlhf.models.hf_config.model_config_from_hf`); its ``padded_vocab_size``
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
