"""``nemo-rlhf-ckpt inspect``: one checkpoint's step, layout, model summary, matching
Hugging Face architecture, fingerprint, trainer state and every tensor's shape and dtype
(from the shards' metadata: no tensor is loaded).

Leaves out checksums and loadability (``validate``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict

from nemo_rlhf.checkpoint import read_metadata, read_trainer_state
from nemo_rlhf.tools.ckpt._common import (
    EXIT_OK,
    emit,
    layout_text,
    model_config,
    read_yaml,
    resolve_ckpt,
)


def _model_summary(m) -> str:
    groups = m.num_query_groups or m.num_attention_heads
    return (f"{m.name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
            f"heads / {groups} KV groups, ffn {m.ffn_hidden_size or 4 * m.hidden_size}, vocab "
            f"{m.vocab_size} (padded {m.padded_vocab_size}), {m.normalization}, {m.activation}, "
            f"{m.position_embedding_type}, "
            f"{'tied' if m.share_embeddings_and_output_weights else 'untied'} embeddings")


def cmd_inspect(args) -> int:
    from nemo_rlhf.tools.hf_convert import infer_arch  # lazy: megatron where needed
    ckpt = resolve_ckpt(args.ckpt)
    meta = read_metadata(ckpt)
    cfg = read_yaml(ckpt)
    model = model_config(cfg, ckpt)
    try:
        arch = infer_arch(model)
    except ValueError as exc:
        arch = f"none ({exc})"
    from megatron.core import dist_checkpointing

    tensors = []
    for key, sh in sorted(dist_checkpointing.load_tensors_metadata(str(ckpt / "dist")).items()):
        tensors.append({"key": key, "shape": list(sh.global_shape),
                        "dtype": str(sh.dtype).replace("torch.", "")})
    n_params = sum(math.prod(t["shape"]) for t in tensors if t["key"].startswith("model."))
    state = read_trainer_state(ckpt)
    data, trainer = cfg.get("data") or {}, cfg.get("trainer") or {}
    doc = {"path": str(ckpt), "step": meta.get("step"), "parallel": meta.get("parallel"),
           "has_optimizer": meta.get("has_optimizer"), "optimizer_step": meta.get("optimizer_step"),
           "fingerprint": meta.get("fingerprint"), "model": asdict(model), "hf_arch": arch,
           "tokenizer_dir": data.get("tokenizer_dir"), "precision": trainer.get("precision"),
           "trainer_state": state, "num_model_parameters": n_params, "tensors": tensors}
    lines = [f"checkpoint {ckpt}",
             f"  step {meta.get('step')}, saved at {layout_text(meta)}; optimizer state: "
             f"{'yes (step %s)' % meta.get('optimizer_step') if meta.get('has_optimizer') else 'no'}",
             f"  model: {_model_summary(model)}", f"  HF architecture: {arch}",
             f"  tokenizer_dir: {data.get('tokenizer_dir')}; precision: {trainer.get('precision')}",
             f"  fingerprint: {json.dumps(meta.get('fingerprint'), default=str)}",
             f"  trainer_state: {json.dumps(state, default=str)[:300]}",
             f"  tensors ({len(tensors)}; {n_params:,} model parameters incl. vocabulary padding):"]
    width = max((len(t["key"]) for t in tensors), default=0)
    lines += [f"    {t['key']:<{width}}  {str(t['shape']):<18} {t['dtype']}" for t in tensors]
    emit(args, doc, lines)
    return EXIT_OK
