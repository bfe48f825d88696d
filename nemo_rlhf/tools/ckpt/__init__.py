"""``nemo-rlhf-ckpt``: list, inspect, validate, reshard, prune and convert checkpoints.

Usage (``python -m nemo_rlhf.tools.ckpt`` or the ``nemo-rlhf-ckpt`` console script)::

    nemo-rlhf-ckpt list <exp_dir | checkpoints_dir>
    nemo-rlhf-ckpt inspect <ckpt>
    nemo-rlhf-ckpt validate <ckpt>
    nemo-rlhf-ckpt resume-info <exp_dir> [--resume auto|none|<ckpt>]
    nemo-rlhf-ckpt reshard <ckpt> --tp N --pp M --out <new_checkpoints_dir> [--model-only]
    nemo-rlhf-ckpt prune <exp_dir> --keep N [--dry-run]
    nemo-rlhf-ckpt export-hf <ckpt> --out <dir> [--arch llama|qwen2|gpt2] [--rm] [--dtype D]
    nemo-rlhf-ckpt import-hf <hf_dir> --out <ckpt_dir> [--tp N --pp M] [--model-name NAME]
                                   [--chat-template chatml --system-prompt TEXT]

``<ckpt>`` is a ``step_<N>`` folder, or a checkpoint root / experiment folder (its newest
complete checkpoint). Every command takes ``--json`` (machine-readable stdout) and
``--debug`` (tracebacks). Exit codes: 0 ok, 1 problems found or a step failed, 2 bad input
(one line on stderr naming the path and the problem). Outputs are never written into a
non-empty folder.

``reshard`` and ``import-hf --tp/--pp`` spawn ``tp * pp`` gloo processes on this machine
(megatron builds the model at the new layout, dist_checkpointing reshards on load), then
compare every model and optimizer tensor of the result with the source. Simplified: the
RNG states a resharded checkpoint holds are those of the resharding processes (a layout
change cannot carry per-rank RNG streams over); ``config.yaml``'s ``parallel`` section is
updated to the new layout, everything else (step, trainer state, fingerprint) is copied.

Modules (each command's work in its own; the Hugging Face tensor mapping itself is
:mod:`nemo_rlhf.tools.hf_convert`):

================  ========================================================================
``cli``           the argument parser and :func:`~.cli.main` (console-script entry point)
``__main__``      ``python -m nemo_rlhf.tools.ckpt``
``_common``       what every command shares: exit codes and ``CLIError``, argument and
                  output-folder checks, ``config.yaml`` reading, output emission
``listing``       ``list``
``inspection``    ``inspect``
``validate``      ``validate``
``resume_info``   ``resume-info``
``prune``         ``prune`` (the plan: :func:`nemo_rlhf.checkpoint.policy.prune_plan`)
``reshard``       ``reshard``
``export_hf``     ``export-hf``
``import_hf``     ``import-hf``
``spawn``         the multi-process layout job of ``reshard`` and ``import-hf --tp/--pp``,
                  and the tensor-by-tensor comparison that verifies their outputs
================  ========================================================================
"""
