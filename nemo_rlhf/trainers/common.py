"""Small helpers the training jobs share (the run skeleton itself is
:mod:`nemo_rlhf.trainers.loop`; SFT/RM's trainer :mod:`nemo_rlhf.trainers.supervised`).

* :func:`setup_run`: distributed init + seeds + the model config's vocabulary from the
  tokenizer, in one call at the start of a run;
* batching: :func:`forward_calls` (the chunker and the DP split are
  :mod:`nemo_rlhf.distributed.split`'s :func:`~nemo_rlhf.distributed.split.chunks` and
  :func:`~nemo_rlhf.distributed.split.dp_shard`);
* the collectives (:func:`~nemo_rlhf.trainers.collectives.reduce_from_last_stage` among
  them) are :mod:`nemo_rlhf.trainers.collectives`';
* :func:`to_plain`: a config as a plain dict (``config.yaml``, checkpoints).
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass, replace
from typing import Sequence


from nemo_rlhf.distributed import initialize_distributed
from nemo_rlhf.distributed.split import chunks
from nemo_rlhf.models.context_parallel import refuse_context_parallel


def to_plain(cfg) -> dict:
    """A dataclass config (or DictConfig) as a plain dict (for ``config.yaml``)."""
    if is_dataclass(cfg):
        return asdict(cfg)
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def setup_run(parallel, model_cfg, tokenizer, seed: int):
    """Initialise distributed state for a run; return ``(dims, model_cfg)``.

    ``model_cfg.vocab_size`` 0 is filled in from the tokenizer; a set value must agree.

    Raises:
        ValueError: ``model.vocab_size`` disagrees with the tokenizer, a bad layout, or
            ``parallel.context_parallel_size`` > 1 (not wired into these jobs yet).
    """
    refuse_context_parallel(parallel, "SFT / RM trainer or evaluate job")
    if model_cfg.vocab_size == 0:
        model_cfg = replace(model_cfg, vocab_size=tokenizer.vocab_size)
    elif model_cfg.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={model_cfg.vocab_size} but the tokenizer "
                         f"{tokenizer.path} has {tokenizer.vocab_size} tokens; set 0 to take it "
                         f"from the tokenizer")
    dims = initialize_distributed(parallel, seed=seed, num_layers=model_cfg.num_layers,
                                  num_attention_heads=model_cfg.num_attention_heads,
                                  num_query_groups=model_cfg.num_query_groups,
                                  num_moe_experts=model_cfg.num_moe_experts)
    return dims, model_cfg


# --------------------------------------------------------------------------- batching
def forward_calls(items: Sequence, micro_batch_size: int, expert_parallel: bool) -> list[tuple[list[list], bool]]:
    """This rank's items as ``forward_backward`` calls: ``(micro-batch groups, variable_shapes)``
    per call.

    Without expert parallelism: one call of the full micro-batches (one shape) and one call
    per shorter micro-batch (pipeline stages exchange fixed shapes within a call). With it
    (``parallel.expert_model_parallel_size`` > 1), every MoE layer call is a collective over
    the expert-parallel group, whose ranks hold different data, so every rank makes exactly
    one call, with variable shapes, even with no item (the engine then runs a filler: see
    :mod:`nemo_rlhf.models.engine`); data-parallel ranks of one job make the same calls.
    """
    groups = chunks(items, micro_batch_size)
    if expert_parallel:
        return [(groups, True)]
    full = [g for g in groups if len(g) == micro_batch_size]
    return [(c, False) for c in [full] + [[g] for g in groups if len(g) < micro_batch_size] if c]
