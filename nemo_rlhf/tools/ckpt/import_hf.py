"""``nemo-rlhf-ckpt import-hf``: convert a local Hugging Face model folder into a ``step_0``
checkpoint (at ``--tp/--pp`` through the :mod:`.spawn` layout job), with its tokenizer, a
Hydra model preset ``conf/model/hf_<name>.yaml`` and, optionally, a chat template and
system prompt recorded in ``config.yaml``; every tensor is compared with the HF weights.

Leaves out downloading (the folder must be local), the value head (PPO initialises it) and
the tensor mapping itself (:mod:`nemo_rlhf.tools.hf_convert`).
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed import ParallelConfig
from nemo_rlhf.tools.ckpt._common import (
    EXIT_OK,
    CLIError,
    check_out,
    discard_out,
    emit,
    empty_out,
    existing,
)
from nemo_rlhf.tools.ckpt.spawn import check_layout, compare_checkpoints, layout_job, spawn_layout


def cmd_import_hf(args) -> int:
    from nemo_rlhf.tools import hf_convert as hc  # lazy: megatron where needed
    src = existing(args.hf_dir)
    if not src.is_dir():
        raise CLIError(f"{src}: not a folder (expected a Hugging Face model folder)")
    try:
        hf_cfg = hc.read_hf_config(src)
        model, arch = hc.model_config_from_hf(hf_cfg, args.model_name or src.resolve().name)
        hc.find_weight_files(src)
    except KeyError as exc:
        raise CLIError(f"{src}/config.json lacks {exc}") from None
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc) if str(src) in str(exc) else f"{src}: {exc}") from None
    tok_src = Path(args.tokenizer_dir) if args.tokenizer_dir else src
    if not tok_src.is_dir():
        raise CLIError(f"{tok_src}: no such tokenizer folder")
    if args.system_prompt and not args.chat_template:
        raise CLIError("--system-prompt needs --chat-template (a system message needs a chat template)")
    check_out(args.out)
    check_layout(model, args.tp, args.pp)
    hf = hc.read_hf_weights(src)
    try:
        tensors = hc.hf_to_megatron(hf, model, arch)
    except ValueError as exc:
        raise CLIError(f"{src}: {exc}") from None
    dtype = hc.hf_weights_dtype(hf)
    precision = {"bfloat16": "bf16-mixed", "float16": "fp16-mixed"}.get(str(dtype)[6:], "32")
    out, created = empty_out(args.out)
    try:
        tok_dest = out / "tokenizer"
        try:
            hc.import_tokenizer(tok_src, tok_dest)
        except (FileNotFoundError, ValueError) as exc:
            raise CLIError(str(exc)) from None
        warn = _vocab_warning(tok_dest, model.vocab_size)
        data = {"tokenizer_dir": str(tok_dest.resolve())}
        if args.chat_template:
            data.update(chat_template=args.chat_template, system_prompt=args.system_prompt)
        elif _has_chat_template(tok_dest):  # the model's own Jinja template, as transformers applies it
            data.update(chat_template="model")
        config = {"model": asdict(model), "data": data,
                  "parallel": asdict(ParallelConfig(args.tp, args.pp)),
                  "trainer": {"precision": precision}}
        state = {"step": 0, "source": {"hf_dir": str(src.resolve()), "model_type": arch,
                                       "architectures": hf_cfg.get("architectures")}}
        fingerprint = {"model": model.fingerprint(), "source": f"hf:{src.resolve()}"}
        single_root = out if args.tp * args.pp == 1 else out / ".import_tp1"
        single = hc.save_imported_checkpoint(single_root, model, tensors, precision, config, state,
                                             fingerprint)
        final = single
        if args.tp * args.pp > 1:
            job = layout_job(single, out, args.tp, args.pp, config, model, False)
            spawn_layout(job)
            final = out / "step_0"
        problems, _ = compare_checkpoints(None, final, {f"model.{k}": v for k, v in tensors.items()})
        if problems:
            raise RuntimeError(f"verification failed: {'; '.join(problems[:5])}")
        if single_root != out:
            shutil.rmtree(single_root)
        preset = _write_model_preset(out, model)
    except BaseException:
        discard_out(out, created)
        raise
    if warn:
        print(f"nemo-rlhf-ckpt import-hf: warning: {warn}", file=sys.stderr)
    # the jobs take the model, tokenizer and template from the checkpoint (checkpoint.source)
    hint = f"exp_manager.init_from={out.resolve()}"
    emit(args, {"source": str(src), "output": str(final), "arch": arch, "model": asdict(model),
                "precision": precision, "tokenizer_dir": str(tok_dest.resolve()),
                "model_preset": str(preset), "tp": args.tp, "pp": args.pp, "overrides": hint},
         [f"imported {src} ({arch}) -> {final} (tp={args.tp}, pp={args.pp}, precision {precision})",
          f"  tokenizer: {tok_dest}; model preset: {preset}; no value head (PPO initialises it)",
          f"  start from it with: {hint} (PPO), sft.init_from= or rm.init_from={out.resolve()} "
          f"(the model shape, tokenizer and chat template come from the checkpoint; the "
          f"preset for model= is {preset.stem} with --config-dir {preset.parents[1]})"])
    return EXIT_OK


def _has_chat_template(tok_dir: Path) -> bool:
    """Whether the imported tokenizer carries a Jinja chat template (``data.chat_template=model``)."""
    return Tokenizer(tok_dir).chat_template is not None


def _write_model_preset(out: Path, model) -> Path:
    """``<out>/conf/model/<name>.yaml``: the model section as a Hydra preset, for
    ``--config-dir <out>/conf model=hf_<name>`` on the training entry points (the ``hf_``
    prefix keeps it from being shadowed by a built-in preset of the same name)."""
    from omegaconf import OmegaConf

    stem = "hf_" + re.sub(r"[^A-Za-z0-9_.-]", "_", model.name)
    f = out / "conf" / "model" / f"{stem}.yaml"
    f.parent.mkdir(parents=True)
    f.write_text("# written by nemo-rlhf-ckpt import-hf\n" + OmegaConf.to_yaml(asdict(model)))
    return f


def _vocab_warning(tok_dir: Path, vocab_size: int) -> str | None:
    n = Tokenizer(tok_dir).vocab_size
    if n != vocab_size:
        return (f"the tokenizer has {n} tokens but the model's vocabulary is {vocab_size} rows; "
                f"SFT/RM runs check model.vocab_size against the tokenizer and will refuse it")
    return None
