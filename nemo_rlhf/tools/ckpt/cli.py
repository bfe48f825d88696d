"""The ``nemo-rlhf-ckpt`` command line: the argument parser (every subcommand, option and
help text) and :func:`main`, which runs a command and turns its outcome into an exit code
and at most one line on stderr (see :mod:`nemo_rlhf.tools.ckpt` for usage).

Leaves out the commands' work: each is in its own module of this package.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from nemo_rlhf.tools.ckpt._common import EXIT_BAD_INPUT, EXIT_PROBLEMS, CLIError, first_line, quiet
from nemo_rlhf.tools.ckpt.export_hf import cmd_export_hf
from nemo_rlhf.tools.ckpt.import_hf import cmd_import_hf
from nemo_rlhf.tools.ckpt.inspection import cmd_inspect
from nemo_rlhf.tools.ckpt.listing import cmd_list
from nemo_rlhf.tools.ckpt.prune import cmd_prune
from nemo_rlhf.tools.ckpt.reshard import cmd_reshard
from nemo_rlhf.tools.ckpt.resume_info import cmd_resume_info
from nemo_rlhf.tools.ckpt.validate import cmd_validate


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + error
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    p = _Parser(prog="nemo-rlhf-ckpt",
                description="List, inspect, validate, reshard, prune and convert checkpoints.",
                epilog="Exit codes: 0 ok, 1 problems found or a step failed, 2 bad input.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def add(name, fn, help_):
        s = sub.add_parser(name, parents=[common], help=help_, description=help_)
        s.set_defaults(func=fn)
        return s

    s = add("list", cmd_list, "checkpoints of an experiment: step, status, size, layout, metrics")
    s.add_argument("path", help="experiment folder or its checkpoints/ folder")
    s = add("inspect", cmd_inspect, "config summary, fingerprint, tensor shapes and dtypes")
    s.add_argument("ckpt")
    s = add("validate", cmd_validate, "checksums, shard presence and loadability")
    s.add_argument("ckpt")
    s.add_argument("--deep", action="store_true",
                   help="also recompute every tensor's sha256 and compare it with the digest taken from memory at save")
    s = add("resume-info", cmd_resume_info, "what an auto-resume would load, and why")
    s.add_argument("exp_dir")
    s.add_argument("--resume", default="auto", help="exp_manager.resume: auto, none or a path")
    s = add("reshard", cmd_reshard, "rewrite a checkpoint at another TP/PP layout (verified)")
    s.add_argument("ckpt")
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--pp", type=int, default=1)
    s.add_argument("--out", required=True, help="new (empty) checkpoints folder")
    s.add_argument("--model-only", action="store_true", help="leave the optimizer state out")
    s = add("prune", cmd_prune, "delete old checkpoints and stale temporary saves")
    s.add_argument("exp_dir")
    s.add_argument("--keep", type=int, required=True, help="complete checkpoints to keep (>= 1)")
    s.add_argument("--dry-run", action="store_true")
    s = add("export-hf", cmd_export_hf, "write a Hugging Face folder (safetensors + config)")
    s.add_argument("ckpt")
    s.add_argument("--out", required=True)
    s.add_argument("--arch", default=None, help="llama, qwen2 or gpt2 (default: inferred)")
    s.add_argument("--rm", action="store_true", help="export the reward model (SequenceClassification)")
    s.add_argument("--drop-rm-bias", action="store_true", help="export an RM with a non-zero bias")
    s.add_argument("--dtype", default=None,
                   help="float32, bfloat16 or float16 (default: the checkpoint's)")
    s.add_argument("--tokenizer-dir", default=None, help="instead of config.yaml's data.tokenizer_dir")
    s.add_argument("--no-tokenizer", action="store_true")
    s.add_argument("--merge-lora", action="store_true",
                   help="a LoRA checkpoint: merge the adapters into the base's weights")
    s.add_argument("--peft", action="store_true",
                   help="a LoRA checkpoint: write the adapter alone in PEFT's format")
    s.add_argument("--lora-base", default=None,
                   help="a LoRA checkpoint's base checkpoint, if it moved (content hash checked)")
    s = add("import-hf", cmd_import_hf, "convert a local Hugging Face model into a step_0 checkpoint")
    s.add_argument("hf_dir")
    s.add_argument("--out", required=True)
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--pp", type=int, default=1)
    s.add_argument("--model-name", default=None, help="model.name (default: the folder's name)")
    s.add_argument("--tokenizer-dir", default=None, help="tokenizer files (default: hf_dir)")
    s.add_argument("--chat-template", default=None, choices=["chatml"],
                   help="prompt format recorded in the checkpoint's config (data.chat_template)")
    s.add_argument("--system-prompt", default=None,
                   help="system message recorded as data.system_prompt (needs --chat-template)")
    return p


def main(argv=None) -> int:
    """Entry point; returns the exit code (the console script exits with it)."""
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            quiet()
            return args.func(args)
    except CLIError as exc:
        print(f"nemo-rlhf-ckpt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - one line unless --debug
        if args.debug:
            raise
        print(f"nemo-rlhf-ckpt {args.command}: failed: {type(exc).__name__}: {first_line(exc)} "
              "(--debug shows the traceback)", file=sys.stderr)
        return EXIT_PROBLEMS


if __name__ == "__main__":
    sys.exit(main())
