"""``nemo-rlhf-ckpt export-hf``: write a verified checkpoint's actor (or, with ``--rm``, its
reward model) as a Hugging Face folder: safetensors, ``config.json`` and the tokenizer.

All input checks (architecture, dtype, tokenizer, a reward bias HF cannot hold) run before
anything is written. Leaves out the tensor mapping itself (:mod:`nemo_rlhf.tools.hf_convert`)
and the value head (HF has no place for it).
"""

from __future__ import annotations

from pathlib import Path

from nemo_rlhf.checkpoint import checkpoint_tokenizer_dir
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
