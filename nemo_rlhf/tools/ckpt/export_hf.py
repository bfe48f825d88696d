"""``nemo-rlhf-ckpt export-hf``: write a verified checkpoint's actor (or, with ``--rm``, its
reward model) as a Hugging Face folder: safetensors, ``config.json`` and the tokenizer.

All input checks (architecture, dtype, tokenizer, a reward bias HF cannot hold) run before
anything is written. Leaves out the tensor mapping itself (:mod:`nemo_rlhf.tools.hf_convert`)
and the value head (HF has no place for it).

A LoRA checkpoint (``model.lora``; adapters and heads only, on a recorded base) exports with
``--merge-lora`` (the base with ``(alpha / r) B A`` added: a plain HF model) or ``--peft``
(the adapter alone in PEFT's format, for ``peft.PeftModel.from_pretrained`` on the base's
export); ``--lora-base`` names a base that moved (its content hash must match).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from nemo_rlhf.checkpoint import checkpoint_content_hash, checkpoint_tokenizer_dir, read_metadata
from nemo_rlhf.models.lora_hf import merge_adapters, peft_adapter, split_adapters
from nemo_rlhf.tools.ckpt._common import (
    EXIT_OK,
    CLIError,
    check_out,
    discard_out,
    emit,
    empty_out,
    full_tensors,
    model_config,
    read_yaml,
    resolve_ckpt,
    verified,
)


def _with_lora_base(args, ckpt: Path, full: dict) -> tuple[dict, dict]:
    """``(full tensors with the base filled in, adapters)``; checks the LoRA flags."""
    base = read_metadata(ckpt).get("lora_base")
    rest, adapters = split_adapters(full)
    if adapters and not (args.merge_lora or args.peft):
        raise CLIError(f"{ckpt} holds LoRA adapters: pass --merge-lora (a plain HF model, the "
                       f"adapters merged into the base) or --peft (the adapter in PEFT's format)")
    if not adapters and (args.merge_lora or args.peft):
        raise CLIError(f"{ckpt} holds no LoRA adapters: drop --merge-lora / --peft")
    if args.merge_lora and args.peft:
        raise CLIError("--merge-lora and --peft: choose one (run export-hf twice for both)")
    if not base or args.peft:
        return rest, adapters
    where = Path(args.lora_base or base["path"])
    if not where.exists():
        raise CLIError(f"{ckpt}: its LoRA base {where} does not exist; pass --lora-base DIR")
    where = verified(resolve_ckpt(str(where)))
    if checkpoint_content_hash(where) != base["hash"]:
        raise CLIError(f"{ckpt}: the adapters were trained on a base with content hash "
                       f"{base['hash']}; {where} has {checkpoint_content_hash(where)}")
    base_full = {k[len("model."):]: v for k, v in full_tensors(where).items() if k.startswith("model.")}
    return {**base_full, **rest}, adapters  # the LoRA checkpoint's heads over the base's


def _export_peft(args, ckpt: Path, cfg: dict, model, arch: str, adapters: dict) -> int:
    """``adapter_config.json`` + ``adapter_model.safetensors`` into ``args.out``."""
    try:
        tensors, config = peft_adapter(adapters, model, arch, cfg["model"]["lora"])
    except ValueError as exc:
        raise CLIError(f"{ckpt}: {exc}") from None
    if args.dtype is not None:
        from nemo_rlhf.tools import hf_convert as hc  # lazy: megatron where needed
        tensors = {k: v.to(hc.DTYPES[args.dtype]) for k, v in tensors.items()}
    out, created = empty_out(args.out)
    try:
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    except BaseException:
        discard_out(out, created)
        raise
    emit(args, {"source": str(ckpt), "output": str(out), "arch": arch, "class": "PEFT LoRA",
                "tensors": len(tensors), "r": config["r"], "target_modules": config["target_modules"]},
         [f"exported the LoRA adapter of {ckpt} -> {out} (PEFT, r={config['r']}, "
          f"{len(tensors)} tensors; load it with peft.PeftModel.from_pretrained on the base's "
          f"HF export)"])
    return EXIT_OK


def cmd_export_hf(args) -> int:
    from nemo_rlhf.tools import hf_convert as hc  # lazy: megatron where needed
    ckpt = verified(resolve_ckpt(args.ckpt))
    cfg = read_yaml(ckpt)
    model = model_config(cfg, ckpt)
    try:
        arch = args.arch or hc.infer_arch(model)
        problems = hc.arch_problems(model, arch)
    except ValueError as exc:
        raise CLIError(f"{ckpt}: {exc}") from None
    if problems:
        raise CLIError(f"{ckpt}: cannot export as {arch}: {'; '.join(problems)}")
    if args.dtype is not None and args.dtype not in hc.DTYPES:
        raise CLIError(f"--dtype {args.dtype}: valid choices are {sorted(hc.DTYPES)}")
    tok_dir = None
    if not args.no_tokenizer:
        saved = (cfg.get("data") or {}).get("tokenizer_dir")
        tok_dir = Path(args.tokenizer_dir or checkpoint_tokenizer_dir(ckpt, saved) or saved or "")
        if not str(tok_dir) or not (tok_dir / "tokenizer.json").is_file():
            raise CLIError(f"tokenizer folder {str(tok_dir) or '(none in config.yaml)'} has no "
                           "tokenizer.json; pass --tokenizer-dir DIR or --no-tokenizer")
    check_out(args.out)
    full = {k[len("model."):]: v for k, v in full_tensors(ckpt).items() if k.startswith("model.")}
    full, adapters = _with_lora_base(args, ckpt, full)
    if args.peft:
        return _export_peft(args, ckpt, cfg, model, arch, adapters)
    if adapters:
        full = merge_adapters(full, adapters, model.lora.scale if model.lora.enabled else
                              float(cfg["model"]["lora"]["alpha"]) / int(cfg["model"]["lora"]["rank"]))
    if args.rm:
        if hc.REWARD_W not in full:
            raise CLIError(f"{ckpt}: no reward_head tensors (not a reward model); drop --rm to "
                           "export the actor")
        bias = float(full[hc.REWARD_B].reshape(-1)[0]) if hc.REWARD_B in full else 0.0
        if bias != 0.0 and not args.drop_rm_bias:
            raise CLIError(f"{ckpt}: reward_head.bias={bias:.6g} is non-zero and HF's "
                           f"{hc.get_arch(arch).seq_cls} has no bias; refusing (pass --drop-rm-bias "
                           f"to export anyway: every score shifts by {-bias:.6g}, preferences and "
                           "Bradley-Terry probabilities are unchanged)")
    try:
        tensors = hc.megatron_to_hf(full, model, arch, reward=args.rm)
    except ValueError as exc:
        raise CLIError(f"{ckpt}: {exc}") from None
    dtype = hc.DTYPES[args.dtype] if args.dtype else full[hc.WORD].dtype
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    out, created = empty_out(args.out)
    try:
        ids = hc.export_tokenizer(tok_dir, out, model.max_position_embeddings) if tok_dir else {}
        config = hc.hf_config(model, arch, dtype, reward=args.rm, token_ids=ids)
        hc.write_hf_folder(out, tensors, config)
    except BaseException:
        discard_out(out, created)
        raise
    cls = config["architectures"][0]
    emit(args, {"source": str(ckpt), "output": str(out), "arch": arch, "class": cls,
                "dtype": str(dtype).replace("torch.", ""), "tensors": len(tensors),
                "tokenizer": str(tok_dir) if tok_dir else None},
         [f"exported {ckpt} -> {out} as {cls} ({len(tensors)} tensors, "
          f"{str(dtype).replace('torch.', '')}; tokenizer: {tok_dir or 'not copied'})"])
    return EXIT_OK
