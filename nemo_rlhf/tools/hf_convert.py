"""Hugging Face <-> megatron-core conversion for Llama-, Qwen2- and GPT-2-style models:
the files around the tensor mapping of :mod:`nemo_rlhf.models.hf_mapping` (re-exported
here; its docstring gives both sides' tensor names and layouts, and what is refused).

Here: reading an HF folder's ``config.json`` and weights (safetensors or ``.bin``, sharded
or not), importing its tokenizer and chat template, writing an HF folder
(``config.json``, tokenizer files, one ``model.safetensors``: no sharding of very large
models), and saving an imported checkpoint (the actor built at TP=1/PP=1, value head
dropped; ``dist_checkpointing`` reshards it on load).
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
from nemo_rlhf.models.full_tensors import (  # noqa: F401 (the mapping, re-exported)
    fill_model,
    model_full_tensors,
)
from nemo_rlhf.models.hf_config import (  # noqa: F401 (the mapping, re-exported)
    hf_config,
    model_config_from_hf,
)
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
    fuse_qkv,
    get_arch,
    head_dim,
    hf_to_megatron,
    infer_arch,
    megatron_to_hf,
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
