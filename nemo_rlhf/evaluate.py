"""Held-out evaluation of actor checkpoints: greedy decoding + the task's checker, and
optionally a reward model's score and the KL to a reference policy.

One checkpoint (as before)::

    python -m nemo_rlhf.evaluate checkpoint=experiments/sft/checkpoints \\
        data=data/reversal/eval.jsonl out=experiments/sft/eval.json

Every step of a run, with the RM's score and the KL to the initial policy::

    python -m nemo_rlhf.evaluate checkpoint=exp/ppo/checkpoints all_steps=true \\
        reference=experiments/sft/checkpoints rm_checkpoint=experiments/rm/checkpoints \\
        data=data/reversal/eval.jsonl out=exp/ppo/eval_steps.json

``checkpoint`` is a checkpoint folder or a ``checkpoints`` root (its newest complete
checkpoint); with ``all_steps=true`` it must be a root and every complete ``step_<N>``
under it is evaluated, in step order. ``checkpoints=[a,b,...]`` names folders (or roots:
their newest) explicitly; with ``checkpoint`` too, both sets are evaluated (duplicates
once), sorted by step. The model architecture, the tokenizer and the prompt formatting
(chat template, system prompt) of each checkpoint are read from its ``config.yaml``, so
evaluation formats prompts exactly as training did. Prompts are split across DP ranks; any
TP/PP layout works (checkpoints are resharded on load). The checker is a reward function
(``package.module:function`` or a built-in short name, ``nemo_rlhf.reward.functions``) called with the raw prompts, the decoded
responses (EOS excluded) and the rows' extra fields (e.g. ``answer``).

One checkpoint writes one JSON: ``accuracy`` (mean checker score), ``mean_response_length``
(generated tokens, EOS included, as in ``RolloutBatch.response_lengths``), ``repetition``
(mean 3-gram repetition rate of the generated tokens, the PPO trainer's
``eval/repetition``), the fractions that ended with EOS or hit ``max_new_tokens``, counts,
timing and the first examples; with ``rm_checkpoint`` also ``rm_reward`` (mean raw RM
score), with ``reference`` also ``kl_to_reference`` (see :func:`sequence_kl`). More than one
checkpoint writes ``{"rows": [one such dict per checkpoint]}`` to ``out``, a markdown table
``<out without .json>.md`` and a PNG ``<out without .json>.png`` of each metric across
steps (:mod:`nemo_rlhf.metrics.steps_table`; needs matplotlib, checked before any work).

Raises (bad input, naming the config key): ``ValueError`` for bad values,
``FileNotFoundError`` for a checkpoint that is not there, ``ImportError`` without
matplotlib when more than one checkpoint is evaluated.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import hydra
import torch
import torch.distributed as dist
from omegaconf import MISSING, DictConfig, OmegaConf

from nemo_rlhf.algorithms.ppo.kl import kl_penalty
from nemo_rlhf.checkpoint import (checkpoint_tokenizer_dir, is_complete, list_checkpoints, load_model_weights,
                                  read_metadata, resolve_checkpoint)
from nemo_rlhf.config import check_choice, to_typed
from nemo_rlhf.data.datasets import DataConfig, load_prompt_dataset
from nemo_rlhf.data.sample_rows import sample_row
from nemo_rlhf.data.templates import check_template
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed import destroy_distributed
from nemo_rlhf.distributed.parallel import ParallelConfig, validate_parallel_layout
from nemo_rlhf.distributed.split import chunks, dp_shard, dp_slice
from nemo_rlhf.metrics.steps_table import markdown_table, plot_metrics, require_matplotlib, table_columns
from nemo_rlhf.models.actor_critic import build_model
from nemo_rlhf.models.config import PRECISIONS, ModelConfig, agree_on_precision
from nemo_rlhf.models.moe import refuse_expert_parallel
from nemo_rlhf.reward.batching import ScoreItem
from nemo_rlhf.reward.functions import check_reward_function_spec, get_reward_function
from nemo_rlhf.reward.rm_scorer import RMScorerConfig, RewardModelScorer, read_rm_checkpoint
from nemo_rlhf.rollout import RolloutConfig, generate
from nemo_rlhf.trainers.common import setup_run
from nemo_rlhf.trainers.ppo.guards import ngram_repetition_rate
from nemo_rlhf.trainers.ppo.roles import ForwardPasses, PolicyRole


@dataclass
class EvalConfig:
    """Evaluation job (``conf/eval.yaml``)."""

    checkpoint: Optional[str] = None
    """Checkpoint folder, or a ``checkpoints`` root (its newest complete checkpoint; every
    complete step with ``all_steps``). Required unless ``checkpoints`` names some."""
    data: str = MISSING
    """Prompts ``{"prompt", ...extras such as "answer"}``: JSONL, parquet, or a ``datasets``
    save_to_disk folder (:mod:`nemo_rlhf.data.tables`)."""
    out: str = MISSING
    """Result JSON path (written by global rank 0)."""
    checkpoints: list[str] = field(default_factory=list)
    """More checkpoint folders (or roots: their newest) to evaluate, e.g. ``[sft/checkpoints,
    ppo/checkpoints]``; with ``checkpoint`` too both are evaluated. Rows are sorted by step."""
    all_steps: bool = False
    """Evaluate every complete ``step_<N>`` under the ``checkpoint`` root, in step order."""
    rm_checkpoint: Optional[str] = None
    """Reward-model checkpoint folder (or root: its newest); scores every response in process
    with the RM's own chat template and system prompt: ``rm_reward``, per-sample ``rm_score``."""
    reference: Optional[str] = None
    """Reference (initial policy) checkpoint folder (or root: its newest): ``kl_to_reference``."""
    forward_micro_batch_size: int = 8
    """Rows per forward micro-batch of the log-prob passes (``reference``) and the RM."""
    checker: str = ""
    """Reward function scoring each response: ``package.module:function`` or a short name of
    :data:`~nemo_rlhf.reward.functions.BUILTIN_REWARD_FUNCTIONS` (required;
    ``conf/eval.yaml`` names the tiny demo's ``arithmetic_exact_match``)."""
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
    """Also write every response as JSONL in the schema the trainer's ``eval_samples`` use
    (:mod:`nemo_rlhf.data.sample_rows`: ``prompt``, ``response``, ``correct`` (the checker's
    score), ``length``, ``extras`` (the row's fields); plus ``sample``, ``ended``, the extra
    checkers' scores, ``rm_score`` / ``kl_to_reference`` when measured; ``step`` and
    ``checkpoint`` when more than one checkpoint is evaluated: one file, rows in checkpoint
    order)."""
    extra_checkers: list[str] = field(default_factory=list)
    """More reward functions (as ``checker``) averaged into the result (e.g. ``just_the_number``)."""
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
        for key in ("max_new_tokens", "batch_size", "num_samples", "forward_micro_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"num_samples={self.num_samples} with temperature=0: greedy decoding gives "
                             f"one response per prompt; set temperature > 0")
        if not self.checkpoint and not self.checkpoints:
            raise ValueError("checkpoint is missing: set checkpoint=<checkpoint folder or checkpoints "
                             "root> (or checkpoints=[<folder>, ...])")
        if self.all_steps and not self.checkpoint:
            raise ValueError("all_steps=true needs checkpoint=<checkpoints root> (its steps are evaluated)")
        for i, c in enumerate(self.checkpoints):
            if not isinstance(c, str) or not c:
                raise ValueError(f"checkpoints[{i}]={c!r}: must be a checkpoint folder path")
        for key in ("rm_checkpoint", "reference"):
            if getattr(self, key) == "":
                raise ValueError(f"{key}='': give a checkpoint folder or null")


def _checkpoint_config(path: Path) -> dict:
    cfg_file = path / "config.yaml"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.yaml (the model and tokenizer come from it)")
    return OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=True)


def _tokenizer_dir(path: Path, data: dict) -> str:
    """The checkpoint's own tokenizer copy, else its config's ``data.tokenizer_dir``
    (:func:`~nemo_rlhf.checkpoint.layout.checkpoint_tokenizer_dir`).

    Raises:
        FileNotFoundError: neither exists (names both; ``tokenizer_dir=`` overrides).
    """
    found = checkpoint_tokenizer_dir(path, data.get("tokenizer_dir"))
    if found is None:
        raise FileNotFoundError(
            f"{path}: no tokenizer/ folder in the checkpoint and its config's data.tokenizer_dir="
            f"{data.get('tokenizer_dir')!r} is not a tokenizer folder here; pass tokenizer_dir=<folder>")
    return found


def checkpoint_paths(cfg: EvalConfig) -> list[Path]:
    """The checkpoint folders ``cfg`` asks for, each once, sorted by step (stable).

    ``checkpoint`` alone (no ``all_steps``, no ``checkpoints``) gives exactly
    ``[resolve_checkpoint(checkpoint)]``, as before.

    Raises:
        FileNotFoundError: ``checkpoint`` / ``checkpoints[i]`` holds no complete checkpoint
            (the message names the key).
        ValueError: ``all_steps=true`` with ``checkpoint`` a single checkpoint folder.
    """
    if cfg.checkpoint and not cfg.all_steps and not cfg.checkpoints:
        return [resolve_checkpoint(cfg.checkpoint)]
    found: list[Path] = []
    if cfg.checkpoint and cfg.all_steps:
        root = Path(cfg.checkpoint)
        if is_complete(root):
            raise ValueError(f"all_steps=true: checkpoint={cfg.checkpoint!r} is one checkpoint folder; "
                             f"pass the checkpoints root holding its step_<N> folders")
        found = [p for _, p, complete in list_checkpoints(root) if complete]
        if not found:
            raise FileNotFoundError(f"checkpoint={cfg.checkpoint!r} with all_steps=true: no complete "
                                    f"step_<N> checkpoint under it")
    elif cfg.checkpoint:
        found = [_resolve_named("checkpoint", cfg.checkpoint)]
    found += [_resolve_named(f"checkpoints[{i}]", c) for i, c in enumerate(cfg.checkpoints)]
    unique, seen = [], set()
    for p in found:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    steps = [read_metadata(p).get("step") for p in unique]
    order = sorted(range(len(unique)), key=lambda j: (steps[j] is None, steps[j] or 0))
    return [unique[j] for j in order]


def _resolve_named(key: str, value: str) -> Path:
    try:
        return resolve_checkpoint(value)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{key}={value!r}: {exc}") from None


def steps_report_paths(out: str | Path) -> tuple[Path, Path]:
    """``(<out without .json>.md, <out without .json>.png)``."""
    s = str(out)
    base = s[:-len(".json")] if s.endswith(".json") else s
    return Path(base + ".md"), Path(base + ".png")


def repetition_rates(response_ids: list[list[int]], response_mask: list[list[bool]]) -> list[float]:
    """Per-response n-gram repetition rate of the generated tokens (mask True: EOS included,
    pads excluded): :func:`nemo_rlhf.trainers.ppo.guards.ngram_repetition_rate` with its
    default ``n=3``, exactly as the PPO trainer's (:func:`~nemo_rlhf.trainers.ppo.step_metrics.response_repetition`) (``eval/repetition`` is
    their mean).

    Args:
        response_ids: ``[B][R]`` token ids.
        response_mask: ``[B][R]`` bools.

    Returns:
        ``[B]`` rates in ``[0, 1)``.
    """
    return [ngram_repetition_rate([t for t, m in zip(ids, mk) if m])
            for ids, mk in zip(response_ids, response_mask)]


def forward_response_logprobs(model, batch, dims, temperature: float, vocab_size: int,
                              micro_batch_size: int) -> Optional[torch.Tensor]:
    """Log-probs of a rollout's response tokens from a forward-only pass of ``model``: the
    PPO trainer's own pass (:meth:`nemo_rlhf.trainers.ppo.roles.PolicyRole.logprobs`,
    micro-batches of ``micro_batch_size`` rows, the last topped up with copies of its last
    row and dropped again; the logits path).

    Args:
        model: this rank's stage of an actor(-critic) model.
        batch: a :class:`~nemo_rlhf.rollout.RolloutBatch` (``input_ids [B, P+R]``).
        dims: this process's ``ParallelDims``.
        temperature: > 0, the logits' temperature (the rollout's ``logprob_temperature``).
        vocab_size: real vocabulary size.
        micro_batch_size: rows per forward, >= 1.

    Returns:
        ``[B, R]`` float32 on the last pipeline stage (0 where ``response_mask`` is False);
        None on the other stages.
    """
    passes = ForwardPasses(dims, vocab_size, micro_batch_size)
    out = PolicyRole(model, None, passes, dims, temperature, temperature, with_values=False).logprobs(batch)
    if out is None:
        return None
    lp = out["logprobs"]
    return torch.where(batch.response_mask, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                response_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence KL estimate of the policy to the reference, in nats.

    ``sum_t mask[b, t] * (logprobs[b, t] - ref_logprobs[b, t])``: the ``k1`` estimator of
    :func:`nemo_rlhf.algorithms.ppo.kl.kl_penalty` summed over the generated tokens (EOS
    included, pads excluded), in fp32. This is the PPO trainer's ``kl_mean`` per sequence
    (its default ``kl.estimator=k1``, ``kl.clamp=null``, ``kl.temperature=sampling``: both
    log-probs at the rollout's ``logprob_temperature``, i.e. 1.0 for greedy decoding);
    ``kl_to_reference`` is the mean of these over the responses.

    Args:
        logprobs: ``[B, R]`` policy log-probs of the generated tokens.
        ref_logprobs: ``[B, R]`` reference log-probs of the same tokens.
        response_mask: ``[B, R]`` bool.

    Returns:
        ``[B]`` float32.
    """
    kl = kl_penalty(logprobs, ref_logprobs, "k1")
    return torch.where(response_mask.bool(), kl, torch.zeros((), dtype=kl.dtype, device=kl.device)).sum(-1)


def _policy_model_config(saved: dict, tok: Tokenizer, path: Path) -> ModelConfig:
    """The checkpoint's ``model`` section with ``vocab_size`` 0 filled from ``tok`` (as
    :func:`~nemo_rlhf.trainers.common.setup_run` does)."""
    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved["model"]))
    if model_cfg.vocab_size == 0:
        return replace(model_cfg, vocab_size=tok.vocab_size)
    if model_cfg.vocab_size != tok.vocab_size:
        raise ValueError(f"{path}: model.vocab_size={model_cfg.vocab_size} but the tokenizer {tok.path} "
                         f"has {tok.vocab_size} tokens (tokenizer_dir override?)")
    return model_cfg


class _Reference:
    """The reference policy, built once on first use and reused for every checkpoint."""

    def __init__(self, spec: str, dims, precision: str, seed: int) -> None:
        self.path = _resolve_named("reference", spec)
        self.spec, self.dims, self.precision, self.seed = spec, dims, precision, seed
        self.model = None
        self.vocab_size: Optional[int] = None

    def get(self, vocab_size: int):
        """The model; raises ``ValueError`` (naming ``reference``) on another vocabulary."""
        if self.model is None:
            saved = _checkpoint_config(self.path)
            model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved["model"]))
            if model_cfg.vocab_size == 0:
                model_cfg = replace(model_cfg, vocab_size=vocab_size)
            m = self.dims
            validate_parallel_layout(ParallelConfig(tensor_model_parallel_size=m.tp,
                                                    pipeline_model_parallel_size=m.pp),
                                     m.world_size, model_cfg.num_layers, model_cfg.num_attention_heads,
                                     model_cfg.num_query_groups)
            self.vocab_size = model_cfg.vocab_size
            self._check(vocab_size)
            self.model = build_model(model_cfg, self.dims, self.precision, kind="actor_critic", seed=self.seed)
            load_model_weights(self.path, self.model, skip_heads=True)
            self.model.eval()
        self._check(vocab_size)
        return self.model

    def _check(self, vocab_size: int) -> None:
        if self.vocab_size != vocab_size:
            raise ValueError(f"reference={self.spec!r}: model.vocab_size={self.vocab_size} but the "
                             f"evaluated policy's is {vocab_size}; the KL needs one vocabulary")


def _build_rm(cfg: EvalConfig, dims):
    try:
        info = read_rm_checkpoint(cfg.rm_checkpoint)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"rm_checkpoint={cfg.rm_checkpoint!r}: {exc}") from None
    # the RM's own precision (as the RM server); this job's where the checkpoint names none
    scorer_cfg = RMScorerConfig(checkpoint=str(info.path), micro_batch_size=cfg.forward_micro_batch_size,
                                precision=None if info.precision else cfg.precision)
    return RewardModelScorer(scorer_cfg, dims, info)


def rm_scores(scorer, dims, prompts: list[str], responses: list[str], where: str) -> list[float]:
    """Raw RM scores of (prompt, response) text pairs, on every rank.

    Text items exactly as :meth:`RewardModelScorer.score_batch` lays them out (the RM
    checkpoint's chat template and system prompt, response + EOS), scored by
    :meth:`RewardModelScorer.forward_scores` in process: each DP replica scores a
    contiguous slice, the last stages' TP-rank-0 share theirs with every rank.

    Args:
        scorer: a :class:`~nemo_rlhf.reward.rm_scorer.RewardModelScorer` built on every rank.
        prompts, responses: ``[N]`` raw prompts and decoded responses (EOS excluded).
        where: the config key named in errors (``rm_checkpoint``).

    Returns:
        ``[N]`` floats.

    Raises:
        ValueError: a pair the RM refuses (too long for its ``max_position_embeddings``,
            untokenisable), raised on every rank before any forward.
    """
    try:
        seqs = [scorer.encode(ScoreItem(prompt=p, response=r), j)
                for j, (p, r) in enumerate(zip(prompts, responses))]
    except ValueError as exc:
        raise ValueError(f"{where}: the reward model refuses a response: {exc}") from None
    n = len(seqs)
    mine = dp_slice(n, dims.dp_rank, dims.dp)
    lo = mine.start
    local = scorer.forward_scores(seqs[mine])  # every stage of the replica: the same rows
    if dims.world_size == 1:
        return list(local)
    share = (lo, local) if local is not None and dims.tp_rank == 0 else None
    gathered = [None] * dims.world_size
    dist.all_gather_object(gathered, share)
    out: list[Optional[float]] = [None] * n
    for g in gathered:
        if g is not None:
            out[g[0]:g[0] + len(g[1])] = g[1]
    if any(s is None for s in out):
        raise RuntimeError(f"{where}: {sum(s is None for s in out)} of {n} RM scores missing after the gather")
    return out


def _share_from_last_stage(values: Optional[list], dims) -> list:
    """``values`` (held by the last pipeline stages) on every rank."""
    if dims.world_size == 1:
        return values
    gathered = [None] * dims.world_size
    dist.all_gather_object(gathered, values if dims.is_last_stage and dims.tp_rank == 0 else None)
    return next(g for g in gathered if g is not None)


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _evaluate_checkpoint(cfg: EvalConfig, path: Path, dims, precision: str, rm, reference,
                         start: float, multi: bool) -> tuple[dict, list[dict]]:
    """One checkpoint's result dict and its samples rows (every rank)."""
    saved = _checkpoint_config(path)
    d = saved.get("data", {})
    data_cfg = DataConfig(train_file=cfg.data, tokenizer_dir=cfg.tokenizer_dir or _tokenizer_dir(path, d),
                          chat_template=cfg.chat_template or d.get("chat_template"),
                          system_prompt=cfg.system_prompt or d.get("system_prompt"))
    tok = Tokenizer(data_cfg.tokenizer_dir)
    model_cfg = _policy_model_config(saved, tok, path)
    validate_parallel_layout(cfg.parallel, dims.world_size, model_cfg.num_layers,
                             model_cfg.num_attention_heads, model_cfg.num_query_groups)
    checker = get_reward_function(cfg.checker, "checker")
    extra_checkers = {name: get_reward_function(name, f"extra_checkers[{i}]")
                      for i, name in enumerate(cfg.extra_checkers)}
    ref_model = reference.get(model_cfg.vocab_size) if reference is not None else None
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
        ids_l, mask_l = batch.response_ids.tolist(), batch.response_mask.tolist()
        reps = repetition_rates(ids_l, mask_l)
        kls = [None] * len(group)
        if ref_model is not None:
            args = (dims, rollout.logprob_temperature, model_cfg.vocab_size, cfg.forward_micro_batch_size)
            lp = forward_response_logprobs(model, batch, *args)
            ref_lp = forward_response_logprobs(ref_model, batch, *args)
            if lp is not None:
                kls = sequence_kl(lp, ref_lp, batch.response_mask).tolist()
        for (i, k, s), ids, mask, n, ended, rep, kl in zip(group, ids_l, mask_l, batch.response_lengths.tolist(),
                                                           batch.ended.tolist(), reps, kls):
            content = [t for t, m in zip(ids, mask) if m]
            if ended and content and content[-1] == tok.eos_id:
                content = content[:-1]
            results.append(((i, k), tok.decode(content), int(n), bool(ended), rep, kl))
    if dims.dp > 1:
        gathered = [None] * dims.dp
        dist.all_gather_object(gathered, results, group=dims.dp_group)
        results = [r for part in gathered for r in part]
    results.sort(key=lambda r: r[0])
    del model
    gc.collect()
    samples = ds.samples
    args = ([samples[i].prompt for (i, _), *_ in results], [r for _, r, *_ in results],
            [samples[i].extras for (i, _), *_ in results])
    scores = checker(*args)
    extra_scores = {name: fn(*args) for name, fn in extra_checkers.items()}
    kls = _share_from_last_stage([r[5] for r in results], dims) if reference is not None else None
    rm_out = rm_scores(rm, dims, args[0], args[1], "rm_checkpoint") if rm is not None else None
    n = len(results)
    measured = {}
    if rm is not None:
        measured["rm_reward"] = _mean(rm_out)
    if reference is not None:
        measured["kl_to_reference"] = _mean(kls)
    out = {
        "checkpoint": str(path),
        "step": read_metadata(path).get("step"),
        "data": cfg.data,
        "checker": cfg.checker,
        **({"rm_checkpoint": str(rm.info.path)} if rm is not None else {}),
        **({"reference": str(reference.path)} if reference is not None else {}),
        "num_prompts": len(samples),
        "num_responses": n,
        "accuracy": sum(scores) / n if n else float("nan"),
        **{name: sum(v) / n if n else float("nan") for name, v in extra_scores.items()},
        **measured,
        "temperature": cfg.temperature,
        "num_samples": cfg.num_samples,
        "mean_response_length": sum(r[2] for r in results) / n if n else float("nan"),
        "repetition": _mean(r[4] for r in results),
        "ended_fraction": sum(r[3] for r in results) / n if n else float("nan"),
        "truncated_fraction": sum(not r[3] for r in results) / n if n else float("nan"),
        "max_new_tokens": cfg.max_new_tokens,
        "parallel": dims.describe(),
        "load_report": {"rows_read": ds.report.rows_read, "rows_kept": ds.report.rows_kept,
                        "invalid": ds.report.invalid, "dropped_overlong": ds.report.dropped_overlong},
        "time_s": time.perf_counter() - start,
        "examples": [{"prompt": samples[i].prompt, "response": r, "correct": scores[j], **samples[i].extras,
                      **({"rm_score": rm_out[j]} if rm is not None else {})}
                     for j, ((i, _), r, *_) in enumerate(results[:cfg.num_examples])],
    }
    sample_rows = []
    if cfg.samples_out:
        for j, ((i, k), r, length, ended, _rep, _kl) in enumerate(results):
            sample_rows.append(sample_row(
                samples[i].prompt, r, scores[j], length, samples[i].extras, sample=k, ended=ended,
                **{name: v[j] for name, v in extra_scores.items()},
                **({"rm_score": float(rm_out[j])} if rm is not None else {}),
                **({"kl_to_reference": float(kls[j])} if reference is not None else {})))
    if dims.rank == 0:
        for ex in out["examples"]:
            rm_part = f"  rm={ex['rm_score']:.4f}" if "rm_score" in ex else ""
            print(f"  {ex['prompt']!r} -> {ex['response']!r}  correct={ex['correct']}{rm_part}")
        extra = "".join(f", {name} {out[name]:.4f}" for name in [*extra_scores, *measured, "repetition"])
        prefix, suffix = (f"step {out['step']} ({path}): ", "") if multi else ("", f" -> {cfg.out}")
        print(f"{prefix}{cfg.checker}: accuracy {out['accuracy']:.4f}{extra} on {n} responses, mean response "
              f"length {out['mean_response_length']:.2f} tokens, {out['time_s']:.1f}s{suffix}", flush=True)
    return out, sample_rows


def evaluate(cfg: EvalConfig) -> dict:
    """Run the evaluation; return the result (on every rank; global rank 0 writes the files).

    Returns:
        One checkpoint: its result dict (the module docstring lists the keys). More than
        one: ``{"rows": [result dict per checkpoint, in step order]}``.

    Raises:
        FileNotFoundError: a checkpoint key (``checkpoint``, ``checkpoints[i]``,
            ``reference``, ``rm_checkpoint``) holds no complete checkpoint.
        ValueError: ``all_steps=true`` on a single checkpoint folder; a reference with
            another vocabulary; a response the RM refuses; a bad TP/PP layout.
        ImportError: more than one checkpoint and no matplotlib (before any model is built).
    """
    start = time.perf_counter()
    paths = checkpoint_paths(cfg)
    multi = len(paths) > 1
    if multi:
        require_matplotlib()
    first = _checkpoint_config(paths[0])
    d = first.get("data", {})
    tok = Tokenizer(cfg.tokenizer_dir or _tokenizer_dir(paths[0], d))
    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), first["model"]))
    refuse_expert_parallel(cfg.parallel, "evaluate")
    dims, model_cfg = setup_run(cfg.parallel, model_cfg, tok, cfg.seed)
    precision = agree_on_precision(str(cfg.precision), dims)
    reference = _Reference(cfg.reference, dims, precision, cfg.seed) if cfg.reference else None
    rm = _build_rm(cfg, dims) if cfg.rm_checkpoint else None

    results, samples = [], []
    for j, path in enumerate(paths):
        row, rows = _evaluate_checkpoint(cfg, path, dims, precision, rm, reference,
                                         start if j == 0 else time.perf_counter(), multi)
        results.append(row)
        if multi:
            rows = [{**r, "step": row["step"], "checkpoint": row["checkpoint"]} for r in rows]
        samples += rows
    if dims.rank == 0 and cfg.samples_out:
        Path(cfg.samples_out).parent.mkdir(parents=True, exist_ok=True)
        with open(cfg.samples_out, "w", encoding="utf-8") as f:
            for r in samples:
                f.write(json.dumps(r) + "\n")
    out = {"rows": results} if multi else results[0]
    if dims.rank == 0:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(out, indent=2) + "\n")
        if multi:
            md, png = steps_report_paths(cfg.out)
            columns = table_columns(cfg.extra_checkers)
            table = markdown_table(results, columns)
            md.write_text(table)
            plot_metrics(results, columns, png, title=f"{cfg.data} ({cfg.checker})")
            print(table, end="")
            print(f"{len(results)} checkpoints -> {cfg.out}, {md}, {png}", flush=True)
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
