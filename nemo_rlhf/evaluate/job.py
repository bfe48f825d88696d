"""The evaluation job: every checkpoint decoded on the prompts, scored by the checker and
measured (:mod:`~nemo_rlhf.evaluate.measures`), one result dict each; the files written
(:func:`evaluate`; the package docstring describes them)."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist
from omegaconf import OmegaConf

from nemo_rlhf.checkpoint import load_model_weights, read_metadata
from nemo_rlhf.data.datasets import DataConfig, load_prompt_dataset
from nemo_rlhf.data.sample_rows import sample_row
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.distributed.parallel import validate_parallel_layout
from nemo_rlhf.distributed.split import chunks, dp_shard
from nemo_rlhf.envs.config import get_env_factory
from nemo_rlhf.evaluate.checkpoints import (LazyReference, build_rm, checkpoint_config, checkpoint_paths,
                                            find_tokenizer_dir, policy_model_config)
from nemo_rlhf.evaluate.config import EvalConfig
from nemo_rlhf.evaluate.measures import (forward_response_logprobs, mean_or_nan, repetition_rates, rm_scores,
                                         sequence_kl, share_from_last_stage)
from nemo_rlhf.metrics.steps_table import markdown_table, plot_metrics, require_matplotlib, table_columns
from nemo_rlhf.models.actor_critic import build_model
from nemo_rlhf.models.config import ModelConfig, agree_on_precision
from nemo_rlhf.models.moe import refuse_expert_parallel
from nemo_rlhf.reward.functions import CONVERSATION_EXTRA, get_reward_function, rm_items
from nemo_rlhf.rollout import RolloutConfig, generate
from nemo_rlhf.trainers.common import setup_run
from nemo_rlhf.trainers.ppo.episode_source import episode_extras, episode_texts, run_episode_batch
from nemo_rlhf.trainers.ppo.scoring import policy_rendering, rm_reads_trajectory_ids


def steps_report_paths(out: str | Path) -> tuple[Path, Path]:
    """``(<out without .json>.md, <out without .json>.png)``."""
    s = str(out)
    base = s[:-len(".json")] if s.endswith(".json") else s
    return Path(base + ".md"), Path(base + ".png")



def _episode_results(cfg: EvalConfig, data_cfg: DataConfig, dims, model, tok, group: list, rollout: RolloutConfig,
                     call: int, factory, limit: int) -> list[tuple]:
    """``env.name`` set: one episode per row of ``group`` (``(index, sample, PromptSample)``)
    through the PPO trainer's :func:`run_episode_batch` (its encoders, limits and seeds:
    ``call`` is the call index); per row ``((index, sample), final answer, policy tokens,
    not truncated, repetition of the policy tokens, None, {"episode", "turns",
    "tool_calls", "malformed", "conversation"})``. The final answer is the last policy turn
    decoded, EOS dropped (what the checker scores, as in PPO); ``conversation`` is what PPO's
    reward sources get of the episode (:func:`episode_extras`: its messages, the
    trajectory's prompt and response ids)."""
    episode_cfg = SimpleNamespace(env=cfg.env, data=data_cfg,
                                  model=SimpleNamespace(vocab_size=tok.vocab_size, max_position_embeddings=limit))
    problems = [{"prompt": s.prompt, **s.extras} for *_, s in group]
    batch = run_episode_batch(episode_cfg, dims, model, tok, problems, rollout, call_index=call, factory=factory)
    finals, texts = batch.final_texts(tok.decode, tok.eos_id), episode_texts(batch, tok)
    reps = repetition_rates(batch.response_ids.tolist(), batch.response_mask.tolist())
    out = []
    for (i, k, _), ep, final, text, rep in zip(group, batch.episodes, finals, texts, reps):
        tr, last = ep.trajectory, (ep.infos[-1] if ep.infos else {})
        out.append(((i, k), final, tr.policy_tokens, not tr.truncated, rep, None,
                    {"episode": text, "turns": tr.turns, "tool_calls": int(last.get("tool_calls", 0)),
                     "malformed": int(last.get("malformed_calls", 0) > 0),
                     "conversation": episode_extras(ep)[CONVERSATION_EXTRA]}))
    return out


def episode_summary(episodes: list[dict]) -> dict:
    """Means over the episodes' records (:func:`_episode_results`' last field):
    ``turns_mean``, ``tool_calls_mean``, ``tool_call_rate`` (episodes with at least one
    evaluated call), ``malformed_call_rate`` (episodes with a malformed call)."""
    n = max(len(episodes), 1)
    return {"turns_mean": sum(e["turns"] for e in episodes) / n,
            "tool_calls_mean": sum(e["tool_calls"] for e in episodes) / n,
            "tool_call_rate": sum(e["tool_calls"] > 0 for e in episodes) / n,
            "malformed_call_rate": sum(e["malformed"] for e in episodes) / n}


def evaluate_checkpoint(cfg: EvalConfig, path: Path, dims, precision: str, rm, reference,
                         start: float, multi: bool) -> tuple[dict, list[dict]]:
    """One checkpoint's result dict (the package docstring lists its keys) and its
    ``samples_out`` rows (empty without ``samples_out``), on every rank; ``start`` is the
    ``time.perf_counter()`` its ``time_s`` counts from, ``multi`` says more than one
    checkpoint is evaluated (the printed line names the step)."""
    saved = checkpoint_config(path)
    d = saved.get("data", {})
    data_cfg = DataConfig(train_file=cfg.data, tokenizer_dir=cfg.tokenizer_dir or find_tokenizer_dir(path, d),
                          chat_template=cfg.chat_template or d.get("chat_template"),
                          system_prompt=cfg.system_prompt or d.get("system_prompt"))
    tok = Tokenizer(data_cfg.tokenizer_dir)
    model_cfg = policy_model_config(saved, tok, path)
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
    factory = get_env_factory(cfg.env) if cfg.env.enabled else None
    for call, group in enumerate(chunks(local, cfg.batch_size)):
        if factory is not None:  # multi-turn: episodes with the environment
            results += _episode_results(cfg, data_cfg, dims, model, tok, group, rollout, call, factory, limit)
            continue
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
            results.append(((i, k), tok.decode(content), int(n), bool(ended), rep, kl, None))
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
    kls = share_from_last_stage([r[5] for r in results], dims) if reference is not None else None
    rm_out = None
    if rm is not None:  # episodes: read as PPO's served RM reads them (reward.rm_input)
        items = None if not cfg.env.enabled else rm_items(
            *args[:2], [{CONVERSATION_EXTRA: r[6]["conversation"]} for r in results], cfg.rm_input,
            rm_reads_trajectory_ids(policy_rendering(tok, data_cfg), rm.metadata()))
        rm_out = rm_scores(rm, dims, args[0], args[1], "rm_checkpoint", items)
    n = len(results)
    measured = {}
    if rm is not None:
        measured["rm_reward"] = mean_or_nan(rm_out)
    if reference is not None:
        measured["kl_to_reference"] = mean_or_nan(kls)
    if cfg.env.enabled:
        measured["episode"] = episode_summary([r[6] for r in results])
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
        "repetition": mean_or_nan(r[4] for r in results),
        "ended_fraction": sum(r[3] for r in results) / n if n else float("nan"),
        "truncated_fraction": sum(not r[3] for r in results) / n if n else float("nan"),
        "max_new_tokens": cfg.max_new_tokens,
        "parallel": dims.describe(),
        "load_report": {"rows_read": ds.report.rows_read, "rows_kept": ds.report.rows_kept,
                        "invalid": ds.report.invalid, "dropped_overlong": ds.report.dropped_overlong},
        "time_s": time.perf_counter() - start,
        "examples": [{"prompt": samples[i].prompt, "response": r, "correct": scores[j], **samples[i].extras,
                      **({"rm_score": rm_out[j]} if rm is not None else {}),
                      **({"episode": ep["episode"], "turns": ep["turns"],
                          "messages": ep["conversation"]["messages"]} if ep is not None else {})}
                     for j, ((i, _), r, *_, ep) in enumerate(results[:cfg.num_examples])],
    }
    sample_rows = []
    if cfg.samples_out:
        for j, ((i, k), r, length, ended, _rep, _kl, ep) in enumerate(results):
            sample_rows.append(sample_row(
                samples[i].prompt, r, scores[j], length, samples[i].extras, sample=k, ended=ended,
                **({"episode": ep["episode"], "turns": ep["turns"],
                    "messages": ep["conversation"]["messages"]} if ep is not None else {}),
                **{name: v[j] for name, v in extra_scores.items()},
                **({"rm_score": float(rm_out[j])} if rm is not None else {}),
                **({"kl_to_reference": float(kls[j])} if reference is not None else {})))
    if dims.rank == 0:
        for ex in out["examples"]:
            rm_part = f"  rm={ex['rm_score']:.4f}" if "rm_score" in ex else ""
            print(f"  {ex['prompt']!r} -> {ex['response']!r}  correct={ex['correct']}{rm_part}")
        extra = "".join(f", {name} {out[name]:.4f}" for name in [*extra_scores, *measured, "repetition"]
                        if name != "episode")
        if "episode" in out:
            extra += "".join(f", {k} {v:.4f}" for k, v in out["episode"].items())
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
    first = checkpoint_config(paths[0])
    d = first.get("data", {})
    tok = Tokenizer(cfg.tokenizer_dir or find_tokenizer_dir(paths[0], d))
    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), first["model"]))
    refuse_expert_parallel(cfg.parallel, "evaluate")
    dims, model_cfg = setup_run(cfg.parallel, model_cfg, tok, cfg.seed)
    precision = agree_on_precision(str(cfg.precision), dims)
    reference = LazyReference(cfg.reference, dims, precision, cfg.seed) if cfg.reference else None
    rm = build_rm(cfg, dims) if cfg.rm_checkpoint else None

    results, samples = [], []
    for j, path in enumerate(paths):
        row, rows = evaluate_checkpoint(cfg, path, dims, precision, rm, reference,
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


