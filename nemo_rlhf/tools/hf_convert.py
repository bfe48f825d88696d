"""Hugging Face <-> megatron-core conversion for Llama-, Qwen2- and GPT-2-style models:
the files (folders, tokenizers, imported checkpoints) around the tensor mapping of
:mod:`nemo_rlhf.models.hf_mapping` (re-exported here, described below).

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

Simplified / refused (a clear ``ValueError`` names the key): RoPE scaling and partial
rotary, sliding-window attention, Llama with ``attention_bias != mlp_bias``, GPT-2 with
``scale_attn_by_inverse_layer_idx`` or unscaled attention. Dropout values of the HF config
are not imported (this project trains RLHF with dropout 0). Exports write one
``model.safetensors`` file (no sharding of very large models).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from nemo_rlhf.checkpoint import save_checkpoint
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed import (
    LaunchEnv,
    ParallelConfig,
    destroy_distributed,
    initialize_distributed,
)
from nemo_rlhf.models.actor_critic import build_model
from nemo_rlhf.models.config import ModelConfig
from nemo_rlhf.models.hf_mapping import (  # noqa: F401 (the mapping, re-exported)
    ARCHS,
    ATTN_NORM_B,
    ATTN_NORM_W,
    Arch,
    DTYPES,
    FC1_B,
    FC1_W,
    FC2_B,
    FC2_W,
    FINAL_NORM_B,
    FINAL_NORM_W,
    L,
    MLP_NORM_B,
    MLP_NORM_W,
    OUTPUT,
    POS,
    PROJ_B,
    PROJ_W,
    QKV_B,
    QKV_W,
    REWARD_B,
    REWARD_W,
    WORD,
    arch_problems,
    check_shapes,
    ffn_size,
    fill_model,
    fuse_qkv,
    get_arch,
    head_dim,
    hf_config,
    hf_to_megatron,
    infer_arch,
    megatron_to_hf,
    model_config_from_hf,
    model_full_tensors,
    pad_rows,
    query_groups,
    split_qkv,
)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "vocab.txt", "chat_template.jinja", "chat_template.json")
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token")


def save_imported_checkpoint(root: Path, model_cfg: ModelConfig, tensors: dict, precision: str,
                             config: dict, state: dict, fingerprint: dict) -> Path:
    """Build the actor at TP=1/PP=1 in this (non-distributed) process, fill it with
    ``tensors``, drop its value head and save ``<root>/step_0``; returns that path."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("import-hf must run outside a distributed job")
    dims = initialize_distributed(ParallelConfig(), seed=0,
                                  launch_env=LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"))
    try:
        model = build_model(model_cfg, dims, precision)
        delattr(model, model.head_name)  # imported checkpoints carry no value head
        fill_model(model, tensors)
        return save_checkpoint(root, 0, model, None, state, config, dims, fingerprint)
    finally:
        destroy_distributed()


# --------------------------------------------------------------------------- files
def read_hf_config(hf_dir: Path) -> dict:
    """``<hf_dir>/config.json``.

    Raises:
        FileNotFoundError / ValueError: missing or not JSON (names the file).
    """
    f = Path(hf_dir) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json (not a Hugging Face model folder)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{f}: not valid JSON ({exc})") from None


def find_weight_files(hf_dir: Path) -> list[Path]:
    """The weight files of an HF folder (one file, or the shards an index names).

    Raises:
        FileNotFoundError: none of :data:`WEIGHT_FILES` (or a shard an index names) exists.
    """
    hf_dir = Path(hf_dir)
    for name in WEIGHT_FILES:
        f = hf_dir / name
        if not f.is_file():
            continue
        if name.endswith(".index.json"):
            shards = sorted(set(json.loads(f.read_text())["weight_map"].values()))
            missing = [s for s in shards if not (hf_dir / s).is_file()]
            if missing:
                raise FileNotFoundError(f"{f} names shards that do not exist: {missing[:4]}")
            return [hf_dir / s for s in shards]
        return [f]
    raise FileNotFoundError(f"{hf_dir}: no weights (expected one of {list(WEIGHT_FILES)})")


def read_hf_weights(hf_dir: Path) -> dict:
    """All tensors of an HF folder (safetensors or ``pytorch_model.bin``, sharded or not)."""
    out = {}
    for f in find_weight_files(hf_dir):
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            out.update(load_file(str(f)))
        else:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out


def hf_weights_dtype(tensors: dict) -> torch.dtype:
    """dtype of the floating-point tensors (the first one's)."""
    for t in tensors.values():
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def special_tokens_from_hf(directory: Path) -> dict:
    """``{"bos_token", "eos_token", "pad_token"}`` strings (None when unset) read from
    ``tokenizer_config.json`` then ``special_tokens_map.json`` (first one that names it)."""
    out = dict.fromkeys(SPECIAL_KEYS)
    for name in ("tokenizer_config.json", "special_tokens_map.json", "special_tokens.json"):
        f = Path(directory) / name
        if not f.is_file():
            continue
        data = json.loads(f.read_text())
        for k in SPECIAL_KEYS:
            v = data.get(k)
            if isinstance(v, dict):
                v = v.get("content")
            if out[k] is None and isinstance(v, str):
                out[k] = v
    return out


def import_tokenizer(src_dir: Path, dest: Path) -> dict:
    """Copy an HF tokenizer's files to ``dest`` and write ``special_tokens.json`` (what
    :class:`nemo_rlhf.data.tokenizer.Tokenizer` reads first). Returns the special tokens.

    Without ``tokenizer.json`` the fast tokenizer is built with transformers (if installed).

    Raises:
        FileNotFoundError: no tokenizer files.
        ValueError: no ``eos_token`` named anywhere (the project's tokenizer needs one).
    """
    src_dir = Path(src_dir)
    dest.mkdir(parents=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copy2(src_dir / name, dest / name)
            copied.append(name)
    if "tokenizer.json" not in copied:
        try:
            from transformers import AutoTokenizer

            fast = AutoTokenizer.from_pretrained(str(src_dir), use_fast=True)
            fast.backend_tokenizer.save(str(dest / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - any failure means: no usable tokenizer
            raise FileNotFoundError(
                f"{src_dir}: no tokenizer.json and transformers could not build one "
                f"({type(exc).__name__}); pass --tokenizer-dir with a folder holding tokenizer.json"
            ) from None
    specials = special_tokens_from_hf(src_dir)
    if specials["eos_token"] is None:
        raise ValueError(f"{src_dir}: no eos_token in tokenizer_config.json or "
                         "special_tokens_map.json (the project's tokenizer needs one)")
    (dest / "special_tokens.json").write_text(
        json.dumps({k: v for k, v in specials.items() if v is not None}, indent=2) + "\n")
    return specials


def export_tokenizer(tok_dir: Path, dest: Path, max_length: int) -> dict:
    """Copy a project tokenizer folder's files into an HF export and make sure a
    ``tokenizer_config.json`` exists (``PreTrainedTokenizerFast`` over ``tokenizer.json``).

    Returns:
        ``{"bos_token_id", "eos_token_id", "pad_token_id"}`` (None where unknown).
    """
    tok = Tokenizer(tok_dir)
    for f in sorted(Path(tok_dir).iterdir()):
        if f.is_file():
            shutil.copy2(f, dest / f.name)
    if not (dest / "tokenizer_config.json").is_file():
        specials = {k: getattr(tok, k) for k in SPECIAL_KEYS if getattr(tok, k) is not None}
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
               **specials}
        (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}


def write_hf_folder(out_dir: Path, tensors: dict, config: dict) -> None:
    """``model.safetensors`` + ``config.json`` into ``out_dir`` (which must exist)."""
    from safetensors.torch import save_file

    save_file(tensors, str(Path(out_dir) / "model.safetensors"), metadata={"format": "pt"})
    (Path(out_dir) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


__all__ = [
    "ARCHS", "Arch", "arch_problems", "check_shapes", "export_tokenizer", "fill_model",
    "find_weight_files", "fuse_qkv", "get_arch", "hf_config", "hf_to_megatron", "hf_weights_dtype", "import_tokenizer",
    "infer_arch", "megatron_to_hf", "model_config_from_hf", "model_full_tensors",
    "read_hf_config", "read_hf_weights", "save_imported_checkpoint", "special_tokens_from_hf",
    "split_qkv", "write_hf_folder",
]
