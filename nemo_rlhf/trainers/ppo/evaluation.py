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

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from nemo_rlhf.data.sample_rows import sample_row
from nemo_rlhf.distributed.split import chunk_slices
from nemo_rlhf.reward.client import RewardModelClient
from nemo_rlhf.reward.functions import get_reward_function
from nemo_rlhf.trainers.ppo.episode_source import (episode_extras, episode_metric_sums,
                                                   episode_metrics_from_sums, is_episode_batch)
from nemo_rlhf.trainers.ppo.step_metrics import response_repetition

log = logging.getLogger("nemo_rlhf.ppo")

EVAL_EPISODE_METRICS = ("episode/turns_mean", "episode/tool_calls_mean", "episode/malformed_call_rate",
                        "episode/truncated_rate")
"""The episode metrics a multi-turn held-out evaluation reports (as ``eval/<name>``; the
training step's of the same name, :data:`~nemo_rlhf.trainers.ppo.episode_source.EPISODE_METRICS`)."""


class HeldOutEvaluation:
    """The held-out evaluation's settings and its state across a run.

    Built from the PPO config (``trainer.max_eval_samples``, ``trainer.eval_checker``,
    ``trainer.eval_extra_checkers``, ``trainer.eval_judge``, the ``reward`` client settings
    for a judge URL, ``exp_manager.exp_dir``), read here once.

    Attributes:
        initial: the initial policy's per-prompt results (``text``, ``score``, ...), kept
            for the win rates and saved in checkpoints (None before the first evaluation).
        rescore_initial: the next evaluation re-scores ``initial``'s responses with the
            current reward (set when the reward changed on resume).
    """

    def __init__(self, cfg, has_prompts: bool) -> None:
        t = cfg.trainer
        self.max_samples: int = t.max_eval_samples
        self.checker: Optional[str] = t.eval_checker
        self.extra_checkers: list[str] = list(t.eval_extra_checkers)
        self.judge_spec: Optional[str] = t.eval_judge
        self.exp_dir = Path(cfg.exp_manager.exp_dir)
        self._reward_cfg = cfg.reward
        self.initial: Optional[list[dict]] = None
        self.rescore_initial = False
        self._judge = None
        self._checkers = None
        if has_prompts and t.val_check_interval:
            judge = self.judge_spec
            log.info("held-out win rate: eval/win_rate_vs_initial is self-judged (by the reward being "
                     "optimised); %s", f"eval/judge_win_rate_vs_initial by trainer.eval_judge={judge}"
                     if judge else "set trainer.eval_judge (a second RM's URL or a reward function) "
                                   "for an independent one")

    def judge(self):
        """``trainer.eval_judge`` as ``fn(prompts, responses, extras) -> scores`` (built
        once), or None when no judge is set."""
        spec = self.judge_spec
        if spec is None:
            return None
        if self._judge is None:
            if str(spec).startswith(("http://", "https://")):
                r = self._reward_cfg
                client = RewardModelClient(spec, timeout_s=r.timeout_s, max_retries=r.max_retries,
                                           max_wait_s=r.max_wait_s)
                self._judge = lambda prompts, responses, extras: client.score_texts(prompts, responses)
            else:
                self._judge = get_reward_function(spec, "trainer.eval_judge")
        return self._judge

    def checkers(self) -> tuple:
        """``(checker or None, {name: extra checker})``: ``trainer.eval_checker`` and
        ``trainer.eval_extra_checkers`` resolved (once; errors name the key,
        :func:`~nemo_rlhf.reward.functions.get_reward_function`)."""
        if self._checkers is None:
            checker = get_reward_function(self.checker, "trainer.eval_checker") if self.checker else None
            extra = {name: get_reward_function(name, f"trainer.eval_extra_checkers[{i}]")
                     for i, name in enumerate(self.extra_checkers)}
            self._checkers = (checker, extra)
        return self._checkers


def evaluate_policy(state: HeldOutEvaluation, prompts: Sequence, generate: Callable[[list], Any],
                    response_texts: Callable[[Any], list[str]], reward, dims, step: int, is_scorer: bool,
                    raise_if_failed: Callable[[Optional[BaseException]], None]) -> dict:
    """Greedy decoding on the held-out set (the first ``state.max_samples`` of ``prompts``,
    split over DP): accuracy by ``trainer.eval_checker``, the extra checkers, RM reward,
    length, repetition, the win rate vs the initial policy judged by the reward
    (self-judged) and, with ``trainer.eval_judge``, the judge's score and win rate; every
    rank returns the same metrics (``eval/*``). Global rank 0 also writes the responses,
    one JSON line per held-out prompt in file order, to
    ``<exp_dir>/eval_samples/step_<step>.jsonl`` (:func:`write_eval_samples`).

    Multi-turn (``generate`` returns an
    :class:`~nemo_rlhf.trainers.ppo.episode_source.EpisodeRolloutBatch`: ``env.name`` set):
    the checkers, judge and reward score each episode's final answer (``response_texts``:
    its last policy turn), the reward functions see the episode's reward in ``extras``
    (:func:`~nemo_rlhf.trainers.ppo.episode_source.episode_extras`, as in training),
    ``eval/response_length`` counts policy tokens, the metrics gain
    ``eval/episode/{turns_mean,tool_calls_mean,malformed_call_rate,truncated_rate}``
    (:data:`EVAL_EPISODE_METRICS`, means over the held-out episodes) and each samples row
    carries ``episode`` (the whole episode after the prompt) and ``turns``.

    Args:
        state: the evaluation's settings and state (``initial`` is set by the first call
            and updated when ``rescore_initial``).
        prompts: the held-out rows (``prompt_ids``, ``prompt``, ``extras``), the same on
            every rank; empty: nothing is evaluated (``{}``).
        generate: held-out rows (``prompt_ids``, ``prompt``, ``extras``) -> ``RolloutBatch``
            with greedy decoding, or an ``EpisodeRolloutBatch`` of greedy episodes (every
            rank calls it with its rows: it may hold collectives).
        response_texts: a batch's responses as text, one per row.
        reward: the :class:`~nemo_rlhf.reward.functions.CombinedReward` (``score``), called
            on the scoring ranks only.
        dims: the parallel layout (``dp_rank``, ``dp``, ``rank``, ``world_size``).
        step: the policy's step (names the samples file).
        is_scorer: this rank scores (the DP rank's model-parallel source).
        raise_if_failed: called on every rank with this rank's scoring failure (or None);
            raises on every rank if any failed.

    Returns:
        ``{"eval/...": float}``, the same on every rank.

    Raises:
        the reward source's error on its rank and ``RewardScoringError`` on the others
        (through ``raise_if_failed``).
    """
    if not prompts:
        return {}
    n = min(len(prompts), state.max_samples)
    mine = list(range(dims.dp_rank, n, dims.dp))
    # fewer held-out prompts than DP ranks: a rank without one decodes a copy of the first
    # (its decoding collectives, under expert parallelism or a rollout engine's, match the
    # other ranks') and leaves it out of the metrics
    batch = generate([prompts[i] for i in mine or [0]])
    texts = response_texts(batch)
    reps = response_repetition(batch)
    episodes = is_episode_batch(batch)
    result, failure = None, None
    if is_scorer and mine:
        try:
            rows = [prompts[i] for i in mine]
            if episodes:  # the reward functions see the episode's reward (the `env` one), as in training
                rows = [_with_extras(r, episode_extras(ep)) for r, ep in zip(rows, batch.episodes)]
            out = reward.score([r.prompt for r in rows], texts, [r.extras for r in rows],
                               update_stats=False, normalize=False)
            checker, extra_checkers = state.checkers()
            correct = [0.0] * len(rows)
            if checker is not None:
                correct = checker([r.prompt for r in rows], texts, [r.extras for r in rows])
            extra = {}
            for name, fn in extra_checkers.items():
                extra[name] = list(fn([r.prompt for r in rows], texts, [r.extras for r in rows]))
            judge = state.judge()
            judged = None if judge is None else [float(x) for x in judge(
                [r.prompt for r in rows], texts, [r.extras for r in rows])]
            initial_scores = initial_valid = None
            if state.rescore_initial and state.initial is not None:
                # the initial policy's responses, judged again by the new reward
                initial = reward.score([r.prompt for r in rows],
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
                      "lengths": ([ep.trajectory.policy_tokens for ep in batch.episodes] if episodes
                                  else batch.response_lengths.tolist()), "rep": reps}
            if episodes:
                result["episode"] = {"sums": episode_metric_sums(batch.episodes), "texts": batch.episode_texts,
                                     "turns": [ep.trajectory.turns for ep in batch.episodes]}
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            failure = exc
    raise_if_failed(failure)
    gathered = [None] * dims.world_size
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
            if r.get("episode") is not None:
                merged[i]["episode"] = r["episode"]["texts"][j]
                merged[i]["turns"] = r["episode"]["turns"][j]
    items = [merged[i] for i in sorted(merged)]
    if dims.rank == 0:
        write_eval_samples(state.exp_dir, step, [prompts[i] for i in sorted(merged)], items)
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
    if state.checker:
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
    if rows[0].get("episode") is not None:  # one row per DP rank: its episodes' sums
        sums = [sum(col) for col in zip(*(r["episode"]["sums"] for r in rows))]
        per_episode = episode_metrics_from_sums(sums)
        metrics.update({f"eval/{k}": per_episode[k] for k in EVAL_EPISODE_METRICS})
    if "judge" in items[0]:
        metrics["eval/judge_score"] = sum(x["judge"] for x in items) / len(items)
    if state.initial is None:
        state.initial = items
    else:
        metrics["eval/win_rate_vs_initial"] = win_rate(items, state.initial, "score")
        if "judge" in items[0] and "judge" in state.initial[0]:
            metrics["eval/judge_win_rate_vs_initial"] = win_rate(items, state.initial, "judge")
    return metrics


def _with_extras(row, extra: dict):
    """A copy of the held-out ``row`` whose ``extras`` also hold ``extra``."""
    out = copy.copy(row)
    out.extras = {**row.extras, **extra}
    return out


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
    extra checkers' and the reward sources' (``sources``) scores, ``judge``; of a multi-turn
    evaluation, ``episode`` (the whole episode after the prompt: policy turns and
    observations) and ``turns`` (``response`` is its final answer). Written to a temporary file and renamed, so a
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
                **({"judge": float(x["judge"])} if "judge" in x else {}),
                **({"episode": x["episode"], "turns": int(x["turns"])} if "episode" in x else {})),
                default=str) + "\n")
    os.replace(tmp, out)
    return out


__all__ = ["EVAL_EPISODE_METRICS", "HeldOutEvaluation", "evaluate_policy", "reward_auc", "win_rate",
           "write_eval_samples"]
