"""Held-out evaluation of an actor checkpoint: greedy decoding + the task's checker.

    python -m nemo_rlhf.evaluate checkpoint=experiments/sft/checkpoints \\
        data=data/demo/eval.jsonl out=experiments/sft/eval.json

``checkpoint`` is a checkpoint folder or a ``checkpoints`` root (its newest complete
checkpoint). The model architecture, the tokenizer and the prompt formatting (chat
template, system prompt) are read from the checkpoint's ``config.yaml``, so evaluation
formats prompts exactly as training did. Prompts are split across DP ranks; any TP/PP
layout works (the checkpoint is resharded on load). The checker is a registered reward
function (``nemo_rlhf.reward.functions``) called with the raw prompts, the decoded
responses (EOS excluded) and the rows' extra fields (e.g. ``answer``).

Writes one JSON: ``accuracy`` (mean checker score), ``mean_response_length`` (generated
tokens, EOS included, as in ``RolloutBatch.response_lengths``), the fractions that ended
with EOS or hit ``max_new_tokens``, counts, timing and the first examples.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import hydra
import torch
import torch.distributed as dist
from omegaconf import MISSING, DictConfig, OmegaConf

from nemo_rlhf.checkpoint import load_model_weights, read_metadata, resolve_checkpoint
from nemo_rlhf.config import check_choice, to_typed
from nemo_rlhf.data.datasets import DataConfig, load_prompt_dataset
from nemo_rlhf.data.templates import check_template
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed import destroy_distributed
from nemo_rlhf.distributed.parallel import ParallelConfig
from nemo_rlhf.models.actor_critic import build_model
from nemo_rlhf.models.config import PRECISIONS, ModelConfig, agree_on_precision
from nemo_rlhf.reward.functions import check_reward_function_spec, get_reward_function
from nemo_rlhf.rollout import RolloutConfig, generate
from nemo_rlhf.trainers.common import chunks, dp_shard, setup_run


@dataclass
class EvalConfig:
    """Evaluation job (``conf/eval.yaml``)."""

    checkpoint: str = MISSING
    """Checkpoint folder, or a ``checkpoints`` root (its newest complete checkpoint)."""
    data: str = MISSING
    """JSONL prompts ``{"prompt", ...extras such as "answer"}``."""
    out: str = MISSING
    """Result JSON path (written by global rank 0)."""
    checker: str = "arithmetic_exact_match"
    """Registered reward function name or ``package.module:function`` scoring each response."""
    max_new_tokens: int = 8
    """Longest response in tokens."""
    batch_size: int = 64
    """Prompts per generate call on one DP rank."""
    num_examples: int = 10
    """Examples (prompt, response, score) stored in the JSON and printed."""
    tokenizer_dir: Optional[str] = None
    """Override the checkpoint's ``data.tokenizer_dir``."""
    precision: str = "32"
    """``32``, ``bf16-mixed`` or ``fp16-mixed``."""
    seed: int = 1234
    """Seed of distributed init and of sampling (greedy decoding draws nothing)."""
    temperature: float = 0.0
    """0 = greedy decoding; > 0 samples at this temperature (e.g. to collect RM data)."""
    num_samples: int = 1
    """Responses per prompt (> 1 needs ``temperature > 0``)."""
    samples_out: Optional[str] = None
    """Also write every response as JSONL ``{"prompt", "response", "score", ...extras}``."""
    extra_checkers: list[str] = field(default_factory=list)
    """More registered reward functions averaged into the result (e.g. ``just_the_number``)."""
    chat_template: Optional[str] = None
    """Override the checkpoint's ``data.chat_template`` (e.g. ``chatml`` for an imported model)."""
    system_prompt: Optional[str] = None
    """Override the checkpoint's ``data.system_prompt``."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        self.precision = str(self.precision)
        check_choice("precision", self.precision, PRECISIONS)
        check_reward_function_spec("checker", self.checker)
        for i, name in enumerate(self.extra_checkers):
            check_reward_function_spec(f"extra_checkers[{i}]", name)
        if self.chat_template is not None:  # null: the checkpoint's
            check_template(self.chat_template, "chat_template")
        for key in ("max_new_tokens", "batch_size", "num_samples"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"num_samples={self.num_samples} with temperature=0: greedy decoding gives "
                             f"one response per prompt; set temperature > 0")


def _checkpoint_config(path: Path) -> dict:
    cfg_file = path / "config.yaml"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.yaml (the model and tokenizer come from it)")
    return OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=True)


def evaluate(cfg: EvalConfig) -> dict:
    """Run the evaluation; return the result dict (on every rank; rank 0 writes it)."""
    start = time.perf_counter()
    path = resolve_checkpoint(cfg.checkpoint)
    saved = _checkpoint_config(path)
    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved["model"]))
    d = saved.get("data", {})
    data_cfg = DataConfig(train_file=cfg.data, tokenizer_dir=cfg.tokenizer_dir or d["tokenizer_dir"],
                          chat_template=cfg.chat_template or d.get("chat_template"),
                          system_prompt=cfg.system_prompt or d.get("system_prompt"))
    tok = Tokenizer(data_cfg.tokenizer_dir)
    checker = get_reward_function(cfg.checker)
    extra_checkers = {name: get_reward_function(name) for name in cfg.extra_checkers}
    dims, model_cfg = setup_run(cfg.parallel, model_cfg, tok, cfg.seed)
    precision = agree_on_precision(str(cfg.precision), dims)
    model = build_model(model_cfg, dims, precision, kind="actor_critic", seed=cfg.seed)
    load_model_weights(path, model, skip_heads=True)
    model.eval()

    limit = model_cfg.max_position_embeddings
    ds = load_prompt_dataset(cfg.data, tok, data_cfg, limit - cfg.max_new_tokens)
    if dims.rank == 0:
        ds.report.log()
    rows = [(i, k, s) for i, s in enumerate(ds.samples) for k in range(cfg.num_samples)]
    local = dp_shard(rows, dims.dp_rank, dims.dp)
    greedy = cfg.temperature == 0
    rollout = RolloutConfig(max_new_tokens=cfg.max_new_tokens, greedy=greedy,
                            temperature=1.0 if greedy else cfg.temperature, seed=cfg.seed)
    results = []
    for call, group in enumerate(chunks(local, cfg.batch_size)):
        batch = generate(model, dims, [s.prompt_ids for *_, s in group], rollout,
                         eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, vocab_size=tok.vocab_size,
                         max_sequence_length=limit, call_index=call)
        for (i, k, s), ids, mask, n, ended in zip(group, batch.response_ids.tolist(), batch.response_mask.tolist(),
                                                  batch.response_lengths.tolist(), batch.ended.tolist()):
            content = [t for t, m in zip(ids, mask) if m]
            if ended and content and content[-1] == tok.eos_id:
                content = content[:-1]
            results.append(((i, k), tok.decode(content), int(n), bool(ended)))
    if dims.dp > 1:
        gathered = [None] * dims.dp
        dist.all_gather_object(gathered, results, group=dims.dp_group)
        results = [r for part in gathered for r in part]
    results.sort()
    samples = ds.samples
    args = ([samples[i].prompt for (i, _), *_ in results], [r for _, r, *_ in results],
            [samples[i].extras for (i, _), *_ in results])
    scores = checker(*args)
    extra_scores = {name: fn(*args) for name, fn in extra_checkers.items()}
    n = len(results)
    out = {
        "checkpoint": str(path),
        "step": read_metadata(path).get("step"),
        "data": cfg.data,
        "checker": cfg.checker,
        "num_prompts": len(samples),
        "num_responses": n,
        "accuracy": sum(scores) / n if n else float("nan"),
        **{name: sum(v) / n if n else float("nan") for name, v in extra_scores.items()},
        "temperature": cfg.temperature,
        "num_samples": cfg.num_samples,
        "mean_response_length": sum(r[2] for r in results) / n if n else float("nan"),
        "ended_fraction": sum(r[3] for r in results) / n if n else float("nan"),
        "truncated_fraction": sum(not r[3] for r in results) / n if n else float("nan"),
        "max_new_tokens": cfg.max_new_tokens,
        "parallel": dims.describe(),
        "load_report": {"rows_read": ds.report.rows_read, "rows_kept": ds.report.rows_kept,
                        "invalid": ds.report.invalid, "dropped_overlong": ds.report.dropped_overlong},
        "time_s": time.perf_counter() - start,
        "examples": [{"prompt": samples[i].prompt, "response": r, "score": sc, **samples[i].extras}
                     for ((i, _), r, *_), sc in list(zip(results, scores))[:cfg.num_examples]],
    }
    if dims.rank == 0 and cfg.samples_out:
        Path(cfg.samples_out).parent.mkdir(parents=True, exist_ok=True)
        with open(cfg.samples_out, "w", encoding="utf-8") as f:
            for j, ((i, k), r, length, ended) in enumerate(results):
                row = {"prompt": samples[i].prompt, "response": r, "score": scores[j], "sample": k,
                       "response_length": length, "ended": ended,
                       **{name: v[j] for name, v in extra_scores.items()}, **samples[i].extras}
                f.write(json.dumps(row) + "\n")
    if dims.rank == 0:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(out, indent=2) + "\n")
        for ex in out["examples"]:
            print(f"  {ex['prompt']!r} -> {ex['response']!r}  score={ex['score']}")
        extra = "".join(f", {name} {out[name]:.4f}" for name in extra_scores)
        print(f"{cfg.checker}: accuracy {out['accuracy']:.4f}{extra} on {n} responses, mean response "
              f"length {out['mean_response_length']:.2f} tokens, {out['time_s']:.1f}s -> {cfg.out}",
              flush=True)
    return out


def register_configs() -> None:
    """Store :class:`EvalConfig` in Hydra's ConfigStore as ``eval_schema``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="eval_schema", node=EvalConfig)


register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="eval")
def main(dcfg: DictConfig) -> None:
    cfg: EvalConfig = to_typed(dcfg, EvalConfig)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    torch.set_grad_enabled(False)
    try:
        evaluate(cfg)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
