"""The PPO job's held-out evaluation: greedy rollouts of the current policy on the
evaluation prompts, scored by the reward sources and the task's checkers.

Two win rates against the initial policy's responses to the same prompts:
``eval/win_rate_vs_initial`` is self-judged (by the reward being optimised: a policy that
hacks the RM wins by it), ``eval/judge_win_rate_vs_initial`` is judged by
``trainer.eval_judge`` (a second RM server or a reward function) when one is set.

With a checker (``trainer.eval_checker``), ``eval/reward_auc`` says whether the reward still
tells right answers from wrong ones on the policy's own responses (:func:`reward_auc`): a
learned RM that separated them at step 0 can lose that on the answers PPO moved to, and
the steps after that optimise what the RM sees instead of what the checker scores.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from nemo_rlhf.data.sample_rows import sample_row
from nemo_rlhf.distributed.split import chunk_slices
from nemo_rlhf.reward.client import RewardModelClient
from nemo_rlhf.reward.functions import get_reward_function
from nemo_rlhf.trainers.ppo.step_metrics import response_repetition

log = logging.getLogger("nemo_rlhf.ppo")


class HeldOutEvaluation:
    """The held-out evaluation's state across a run.

    Attributes:
        initial: the initial policy's per-prompt results (``text``, ``score``, ...), kept
            for the win rates and saved in checkpoints (None before the first evaluation).
        rescore_initial: the next evaluation re-scores ``initial``'s responses with the
            current reward (set when the reward changed on resume).
    """

    def __init__(self, cfg, has_prompts: bool) -> None:
        self.cfg = cfg
        self.initial: Optional[list[dict]] = None
        self.rescore_initial = False
        self._judge = None
        if has_prompts and cfg.trainer.val_check_interval:
            judge = cfg.trainer.eval_judge
            log.info("held-out win rate: eval/win_rate_vs_initial is self-judged (by the reward being "
                     "optimised); %s", f"eval/judge_win_rate_vs_initial by trainer.eval_judge={judge}"
                     if judge else "set trainer.eval_judge (a second RM's URL or a reward function) "
                                   "for an independent one")

    def judge(self):
        """``trainer.eval_judge`` as ``fn(prompts, responses, extras) -> scores`` (built
        once), or None when no judge is set."""
        spec = self.cfg.trainer.eval_judge
        if spec is None:
            return None
        if self._judge is None:
            if str(spec).startswith(("http://", "https://")):
                r = self.cfg.reward
                client = RewardModelClient(spec, timeout_s=r.timeout_s, max_retries=r.max_retries,
                                           max_wait_s=r.max_wait_s)
                self._judge = lambda prompts, responses, extras: client.score_texts(prompts, responses)
            else:
                self._judge = get_reward_function(spec)
        return self._judge


def evaluate_policy(trainer) -> dict:
    """Greedy decoding on the held-out set (``trainer.max_eval_samples`` of
    ``data.val_file``, split over DP): accuracy by ``trainer.eval_checker``, the extra
    checkers, RM reward, length, repetition, the win rate vs the initial policy judged
    by the reward (self-judged) and, with ``trainer.eval_judge``, the judge's score and win
    rate; every rank returns the same metrics (``eval/*``). Global rank 0 also
    writes the responses, one JSON line per held-out prompt in file order, to
    ``<exp_dir>/eval_samples/step_<step>.jsonl`` (:func:`write_eval_samples`).

    Raises:
        the reward source's error on its rank and ``RewardScoringError`` on the others.
    """
    if not trainer.eval_prompts:
        return {}
    n = min(len(trainer.eval_prompts), trainer.cfg.trainer.max_eval_samples)
    mine = list(range(trainer.dims.dp_rank, n, trainer.dims.dp))
    # fewer held-out prompts than DP ranks: a rank without one decodes a copy of the first
    # (its decoding collectives, under expert parallelism or a rollout engine's, match the
    # other ranks') and leaves it out of the metrics
    batch = trainer.generate([trainer.eval_encoded[i] for i in mine or [0]], greedy=True)
    texts = trainer.response_texts(batch)
    reps = response_repetition(batch)
    state = trainer.evaluation
    result, failure = None, None
    if trainer.is_mp_src and mine:
        try:
            rows = [trainer.eval_prompts[i] for i in mine]
            out = trainer.reward.score([r.prompt for r in rows], texts, [r.extras for r in rows],
                                       update_stats=False, normalize=False)
            correct = [0.0] * len(rows)
            if trainer.cfg.trainer.eval_checker:
                correct = get_reward_function(trainer.cfg.trainer.eval_checker)(
                    [r.prompt for r in rows], texts, [r.extras for r in rows])
            extra = {}
            for name in trainer.cfg.trainer.eval_extra_checkers:
                extra[name] = list(get_reward_function(name)([r.prompt for r in rows], texts,
                                                             [r.extras for r in rows]))
            judge = state.judge()
            judged = None if judge is None else [float(x) for x in judge(
                [r.prompt for r in rows], texts, [r.extras for r in rows])]
            initial_scores = initial_valid = None
            if state.rescore_initial and state.initial is not None:
                # the initial policy's responses, judged again by the new reward
                initial = trainer.reward.score([r.prompt for r in rows],
                                               [state.initial[i]["text"] for i in mine],
                                               [r.extras for r in rows], update_stats=False,
                                               normalize=False)
                initial_scores = initial.scores.tolist()
                initial_valid = (initial.valid.tolist() if initial.valid is not None
                                 else [True] * len(rows))
            valid = out.valid.tolist() if out.valid is not None else [True] * len(rows)
            result = {"idx": mine, "texts": texts, "scores": out.scores.tolist(), "valid": valid,
                      "skipping": out.skipping,
                      "initial_scores": initial_scores, "initial_valid": initial_valid, "judge": judged,
                      "correct": list(correct), "extra": extra,
                      "per_source": {k: v.tolist() for k, v in out.per_source.items()},
                      "lengths": batch.response_lengths.tolist(), "rep": reps}
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            failure = exc
    trainer.raise_if_scoring_failed(failure)
    gathered = [None] * trainer.dims.world_size
    dist.all_gather_object(gathered, result)
    rows = [g for g in gathered if g is not None]
    # one copy per DP rank (the MP sources): merge in index order
    merged = {}
    for r in rows:
        for j, i in enumerate(r["idx"]):
            merged[i] = {"text": r["texts"][j], "score": r["scores"][j], "valid": r["valid"][j],
                         "correct": r["correct"][j],
                         "extra": {k: v[j] for k, v in r["extra"].items()},
                         "src": {k: v[j] for k, v in r["per_source"].items()},
                         "len": r["lengths"][j], "rep": r["rep"][j]}
            if r.get("judge") is not None:
                merged[i]["judge"] = r["judge"][j]
    items = [merged[i] for i in sorted(merged)]
    if trainer.dims.rank == 0:
        write_eval_samples(Path(trainer.cfg.exp_manager.exp_dir), trainer.step,
                           [trainer.eval_prompts[i] for i in sorted(merged)], items)
    for r in rows:  # re-scored initial responses (after a reward change), the same on every rank
        if r.get("initial_scores") is not None:
            for j, i in enumerate(r["idx"]):
                state.initial[i]["score"] = r["initial_scores"][j]
                state.initial[i]["valid"] = r["initial_valid"][j]
    state.rescore_initial = False
    scored = [x for x in items if x["valid"]]  # reward.invalid_scores=skip: the valid scores
    metrics = {
        "eval/reward": _mean([x["score"] for x in scored]),
        "eval/response_length": sum(x["len"] for x in items) / len(items),
        "eval/repetition": sum(x["rep"] for x in items) / len(items),
    }
    if trainer.cfg.trainer.eval_checker:
        metrics["eval/accuracy"] = sum(x["correct"] for x in items) / len(items)
        auc = reward_auc(scored)
        if auc is not None:  # None: every scored answer got the same checker score
            metrics["eval/reward_auc"] = auc
    for name in items[0]["extra"]:
        metrics[f"eval/{name}"] = sum(x["extra"][name] for x in items) / len(items)
    if rows[0]["skipping"]:
        metrics["eval/invalid_scores"] = float(len(items) - len(scored))
    for name in items[0]["src"]:
        metrics[f"eval/{name}"] = _mean([x["src"][name] for x in scored])
    if "judge" in items[0]:
        metrics["eval/judge_score"] = sum(x["judge"] for x in items) / len(items)
    if state.initial is None:
        state.initial = items
    else:
        metrics["eval/win_rate_vs_initial"] = win_rate(items, state.initial, "score")
        if "judge" in items[0] and "judge" in state.initial[0]:
            metrics["eval/judge_win_rate_vs_initial"] = win_rate(items, state.initial, "judge")
    return metrics


def _mean(values: list[float]) -> float:
    """The mean, NaN for no values (every held-out score invalid)."""
    return sum(values) / len(values) if values else float("nan")


def win_rate(items: list[dict], initial: list[dict], key: str) -> float:
    """Share of prompts whose response scores higher by ``key`` than the initial policy's
    response to the same prompt (a tie counts 1/2), over the prompts where both scores are
    valid (``"valid"``, default True; NaN when there is none)."""
    pairs = [(a[key], b[key]) for a, b in zip(items, initial) if a.get("valid", True) and b.get("valid", True)]
    return _mean([1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs])


def reward_auc(items: list[dict], score_key: str = "score", label_key: str = "correct",
               chunk: int = 2048) -> Optional[float]:
    """How often the reward orders two held-out answers as the checker does.

    Over every pair of items ``(i, j)`` whose checker scores differ (``label_i > label_j``),
    the share with ``score_i > score_j``; a tie in the reward counts 1/2. With a 0/1
    checker this is the ROC AUC of the reward as a detector of right answers (the
    Mann-Whitney U statistic divided by ``n_right * n_wrong``; Hanley & McNeil 1982), and
    graded checker scores give the concordance of the two orders. Pairs are formed across
    prompts (greedy evaluation has one answer per prompt), so the reward's offset between
    prompts counts against it. 1.0: every right answer outscores every wrong one; 0.5: the
    reward carries no information about correctness on these answers (what is left for PPO
    to climb is something else: over-optimisation, Gao et al. 2022). The demo's RM reads
    0.82 on the imported model's answers and 0.47-0.63 on the answers of its PPO policies
    ten steps later (docs/demo.md).

    Args:
        items: rows with a float ``score_key`` (the reward) and ``label_key`` (the checker's
            score); the caller leaves out rows whose reward is invalid.
        chunk: rows compared at once (memory: ``chunk * len(items)`` float64 pairs).

    Returns:
        The share in [0, 1], or None when no pair has different checker scores (every
        answer right, every one wrong, or fewer than two items).
    """
    if len(items) < 2:
        return None
    # host tensors on purpose: the gathered held-out rows are host metadata (Python floats
    # after all_gather_object), never model tensors or collective inputs
    scores = torch.tensor([float(x[score_key]) for x in items], dtype=torch.float64)
    labels = torch.tensor([float(x[label_key]) for x in items], dtype=torch.float64)
    agree = pairs = 0.0
    for rows in chunk_slices(len(items), chunk):
        s, lab = scores[rows, None], labels[rows, None]
        ordered = lab > labels[None, :]  # [chunk, n]: pairs the checker orders, row item better
        pairs += float(ordered.sum())
        agree += float(((s > scores[None, :]).double() + 0.5 * (s == scores[None, :]).double())[ordered].sum())
    return agree / pairs if pairs else None


def write_eval_samples(exp_dir: Path, step: int, prompts: list, items: list[dict]) -> Path:
    """Write one evaluation's responses to ``<exp_dir>/eval_samples/step_<step>.jsonl``.

    One line per held-out prompt, in the schema ``nemo_rlhf.evaluate``'s ``samples_out``
    uses too (:mod:`nemo_rlhf.data.sample_rows`): ``prompt``, ``response``, ``correct``
    (``trainer.eval_checker``'s score, 0 when none is set), ``length`` (response tokens),
    the row's own fields (``extras``); then ``score`` (the raw reward), ``repetition``, the
    extra checkers' and the reward sources' (``sources``) scores, ``judge``. Written to a temporary file and renamed, so a
    reader never sees half a file; a re-run of the same step (after a resume) replaces it.

    Args:
        exp_dir: the run's ``exp_manager.exp_dir``.
        step: the policy's step (0: the initial policy).
        prompts: the held-out rows (``.prompt``, ``.extras``), in the order of ``items``.
        items: per-row results of :func:`evaluate_policy`.

    Returns:
        the path written.
    """
    out = exp_dir / "eval_samples" / f"step_{step:06d}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w") as f:
        for row, x in zip(prompts, items):
            f.write(json.dumps(sample_row(
                row.prompt, x["text"], x["correct"], x["len"], row.extras, score=float(x["score"]),
                repetition=float(x["rep"]), **{k: float(v) for k, v in x["extra"].items()},
                sources={k: float(v) for k, v in x["src"].items()},
                **({"judge": float(x["judge"])} if "judge" in x else {})), default=str) + "\n")
    os.replace(tmp, out)
    return out


__all__ = ["HeldOutEvaluation", "evaluate_policy", "reward_auc", "win_rate", "write_eval_samples"]
