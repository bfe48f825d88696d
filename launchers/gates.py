"""The recipe's gates and verdicts (issue 53): after each stage, whether the next stage can
work and why, with the number and its 95% interval.

* :func:`wilson_interval`: the Wilson score interval of a proportion (E. B. Wilson, "Probable
  inference, the law of succession, and statistical inference", JASA 22:209-212, 1927).
* :func:`paired_difference_interval`: the interval of the difference of two proportions
  measured on the same items, Newcombe's hybrid score interval for paired data, method 10
  of R. G. Newcombe, "Improved confidence intervals for the difference between binomial
  proportions based on paired data", Statistics in Medicine 17:2635-2650, 1998 (the two
  Wilson intervals combined through the continuity-corrected phi coefficient of the
  paired 2x2 table; worked example in Altman et al., "Statistics with Confidence", 2nd ed.,
  2000, p. 52).
* :func:`rm_gate`: after the RM stage, refuse PPO against an RM whose held-out pair accuracy
  is not measurably above chance (its interval includes 50%) or is measured on too few
  natural held-out pairs.
* :func:`check_prompt_lengths`: before any stage trains, refuse a task whose longest prompt
  plus its response budget does not fit the model profile's ``data.max_seq_length``.
* :func:`ppo_verdict`: after PPO, the held-out gain with its paired interval, the final KL
  against its band, and the reward's right-vs-wrong AUC trend, as one line and as fields.

Pure functions of numbers the stages already wrote (and, for the prompt lengths, of the
prompt files and the tokenizer); no model runs here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

Z95 = 1.959963984540054
"""The standard normal's 97.5% quantile: two-sided 95% intervals."""

RM_GATE_EXIT = 3
"""Exit status of the recipe when the RM gate refuses PPO (0: done; 1: a stage failed)."""

KL_BAND = (0.5, 1.5)
"""The final ``kl_mean`` is in band between these multiples of ``kl.target`` (issue #40's bar,
met by every seed of docs/demo.md's five-seed table: 0.70-1.13x)."""

AUC_FLAT = 0.02
"""A change of the reward's right-vs-wrong AUC (first to last evaluation) smaller than this
is called flat."""

REWARD_WINDOW = 10
"""Steps averaged at each end of the run for the verdict's rollout-reward first / last
(one step's mean over 32-64 rollouts is noisy)."""


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of ``k`` successes in ``n`` trials (Wilson 1927):
    ``(p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)`` with ``p = k/n``.

    Returns ``(low, high)`` in [0, 1]; ``(0.0, 1.0)`` when ``n == 0`` (nothing measured).
    Raises ``ValueError`` unless ``0 <= k <= n``.
    """
    if not 0 <= k <= n:
        raise ValueError(f"wilson_interval: k={k}, n={n}: need 0 <= k <= n")
    if n == 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference_interval(before: list, after: list, z: float = Z95) -> tuple[float, float, float]:
    """``after - before`` accuracy over the same items and its interval: Newcombe (1998)
    method 10 for paired proportions.

    Args:
        before, after: per-item correctness (bool or 0/1), the same items in the same order.

    Returns:
        ``(difference, low, high)`` as fractions (``after`` accuracy less ``before``'s).

    With ``r`` items right in both, ``s`` right only after, ``t`` right only before, ``u``
    wrong in both (``n`` items), ``p1 = (r+s)/n`` (after), ``p2 = (r+t)/n`` (before), their
    Wilson intervals ``[l1, u1]``, ``[l2, u2]`` and ``phi = C / sqrt((r+s)(t+u)(r+t)(s+u))``
    with ``B = ru - st`` and ``C = B - n/2`` if ``B > n/2``, ``0`` if ``0 <= B <= n/2``, ``B``
    if ``B < 0`` (0 when the denominator is 0):
    ``low = D - sqrt((p1-l1)^2 - 2 phi (p1-l1)(u2-p2) + (u2-p2)^2)``,
    ``high = D + sqrt((p2-l2)^2 - 2 phi (p2-l2)(u1-p1) + (u1-p1)^2)``, ``D = p1 - p2``.

    Raises ``ValueError`` when the lists differ in length or are empty.
    """
    if len(before) != len(after) or not before:
        raise ValueError(f"paired_difference_interval: {len(before)} items before and {len(after)} "
                         f"after: need the same, non-zero number of items")
    pairs = [(bool(b), bool(a)) for b, a in zip(before, after)]
    n = len(pairs)
    r = sum(1 for b, a in pairs if a and b)
    s = sum(1 for b, a in pairs if a and not b)
    t = sum(1 for b, a in pairs if b and not a)
    u = n - r - s - t
    p1, p2 = (r + s) / n, (r + t) / n
    l1, u1 = wilson_interval(r + s, n, z)
    l2, u2 = wilson_interval(r + t, n, z)
    denom = (r + s) * (t + u) * (r + t) * (s + u)
    phi = 0.0
    if denom > 0:
        b_ = r * u - s * t
        c_ = b_ - n / 2 if b_ > n / 2 else (b_ if b_ < 0 else 0.0)
        phi = c_ / math.sqrt(denom)
    d = p1 - p2
    low = d - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    high = d + math.sqrt(max(0.0, (p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2))
    return d, max(-1.0, low), min(1.0, high)


def pct_interval(lo: float, hi: float) -> str:
    """``[48.2, 67.1]%``."""
    return f"[{100 * lo:.1f}, {100 * hi:.1f}]%"


def auc_from_scores(scores: list, right: list) -> float | None:
    """The ROC AUC of ``scores`` as a detector of the ``right`` items: the Mann-Whitney U
    statistic over ``n_right * n_wrong`` (ties count 1/2), from mid-ranks; the same number as
    :func:`nemo_rlhf.trainers.ppo.evaluation.reward_auc` with 0/1 labels. None when every item
    is right or every one wrong. Raises ``ValueError`` when the lists differ in length."""
    if len(scores) != len(right):
        raise ValueError(f"auc_from_scores: {len(scores)} scores and {len(right)} labels: need as many")
    n1 = sum(1 for r in right if r)
    n2 = len(right) - n1
    if n1 == 0 or n2 == 0:
        return None
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):  # mid-ranks (1-based) over runs of equal scores
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    u = sum(rk for rk, r in zip(ranks, right) if r) - n1 * (n1 + 1) / 2
    return u / (n1 * n2)


def hanley_mcneil_se(auc: float, n_right: int, n_wrong: int) -> float:
    """The standard error of an AUC (J. A. Hanley and B. J. McNeil, "The meaning and use of
    the area under a receiver operating characteristic (ROC) curve", Radiology 143:29-36,
    1982, eq. 2): ``sqrt((A(1-A) + (n1-1)(Q1-A^2) + (n2-1)(Q2-A^2)) / (n1 n2))`` with
    ``Q1 = A/(2-A)``, ``Q2 = 2A^2/(1+A)``, ``n1`` the right (positive) and ``n2`` the wrong
    items. It is 0 at ``A`` = 0 or 1 whatever the counts (the formula's known limit; the RM
    gate's minimum of natural held-out pairs guards the counts). Raises ``ValueError``
    unless both counts are positive and ``0 <= A <= 1``."""
    if n_right < 1 or n_wrong < 1 or not 0.0 <= auc <= 1.0:
        raise ValueError(f"hanley_mcneil_se: auc={auc}, n_right={n_right}, n_wrong={n_wrong}: need "
                         f"0 <= auc <= 1 and both counts >= 1")
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    var = (auc * (1 - auc) + (n_right - 1) * (q1 - auc * auc) + (n_wrong - 1) * (q2 - auc * auc)) / (n_right * n_wrong)
    return math.sqrt(max(0.0, var))


def rm_auc(rows: list, z: float = Z95) -> dict:
    """The RM's right-vs-wrong AUC on sampled answers scored by it: ``rows`` of
    :mod:`nemo_rlhf.data.sample_rows` with ``rm_score`` (``nemo_rlhf.evaluate`` with
    ``rm_checkpoint``) and ``correct`` (the checker: right above 0.5, as the RM's pairs);
    rows without a finite ``rm_score`` are left out. Pairs are formed across prompts, as
    PPO's ``eval/reward_auc``. Returns ``{"auc", "n_right", "n_wrong", "se", "ci95",
    "interval"}``: ``auc`` / ``se`` / ``ci95`` None when no answer is right or none wrong;
    ``ci95 = auc -+ z se`` (:func:`hanley_mcneil_se`) clipped to [0, 1]."""
    kept = [r for r in rows if r.get("rm_score") is not None and math.isfinite(float(r["rm_score"]))]
    scores = [float(r["rm_score"]) for r in kept]
    right = [float(r["correct"]) > 0.5 for r in kept]
    n1 = sum(right)
    out = {"auc": None, "n_right": n1, "n_wrong": len(kept) - n1, "se": None, "ci95": None,
           "interval": "hanley-mcneil (Hanley & McNeil 1982)"}
    auc = auc_from_scores(scores, right)
    if auc is not None:
        se = hanley_mcneil_se(auc, n1, len(kept) - n1)
        out.update(auc=auc, se=se, ci95=[max(0.0, auc - z * se), min(1.0, auc + z * se)])
    return out


@dataclass
class GateResult:
    """A gate's decision: ``passed``; ``fields`` for ``summary.json``; ``message``: what
    was measured, why the next stage can or cannot work, and, on refusal, what to change."""

    passed: bool
    message: str
    fields: dict = field(default_factory=dict)


def refuse_rm_on_tool_task(task, reward: str, refresh_rounds: int = 0) -> None:
    """Refuse, before any stage, what the recipe cannot do on a task with an environment
    (``Task.env``, #51): ``--refresh-rounds`` (its disagreement pairs are single-turn texts).
    ``--reward rm|both`` is allowed: the RM is trained on pairs of whole conversations.

    Raises:
        SystemExit: naming the task, the flag and what to use instead.
    """
    if task.env is not None and refresh_rounds:
        raise SystemExit(f"task {task.name!r} (Task.env={task.env!r}): --refresh-rounds {refresh_rounds} is not "
                         f"supported on a tool task yet: a refresh round's disagreement pairs are single-turn "
                         f"texts, not whole conversations; run it with --refresh-rounds 0")


def rm_gate(accuracy, natural_pairs: int, min_pairs: int, *, reward: str, custom_task: bool,
            has_edit_answer: bool, sft_steps=None, a=None, auc=None) -> GateResult:
    """The RM gate: may PPO train against this RM?

    Args:
        accuracy: the RM's accuracy on the natural held-out pairs (``val/accuracy``), or None
            when it logged none.
        natural_pairs: how many natural held-out pairs it was measured on.
        min_pairs: ``--rm-min-heldout-pairs``.
        reward: ``--reward``; with ``checker`` the RM is not the reward and the gate only
            reports.
        custom_task: ``--task package.module:TASK`` (``--sft-steps`` applies there only).
        has_edit_answer: the task has ``Task.edit_answer`` (``--rm-edit-pairs`` applies).
        sft_steps: the SFT steps run (None: no SFT came first).
        a: the parsed demo arguments, to quote the current flag values (optional).
        auc: :func:`rm_auc` of the policy's sampled answers to the held-out RM prompts scored
            by this RM (None: not measured; the sizing loop's gate, or ``--reward checker``).
            When most of them are right, the remedies say not to run more SFT (it would make
            wrong answers, each pair's other half, rarer) and name the levers that add wrong
            answers or prompts instead (issue 53's sorting run: 240 of 256 right, 6 pairs).

    Passes when the Wilson 95% interval of ``round(accuracy * natural_pairs)`` right of
    ``natural_pairs`` lies above 50%, ``natural_pairs >= min_pairs`` and, when ``auc`` is
    given, its Hanley-McNeil 95% interval lies above 0.5: pair accuracy compares answers of
    one prompt, the AUC compares them across prompts as PPO's rewards are compared (issue
    53: an RM at 64.4% on its held-out pairs had an AUC of 0.47 on its policy's answers at
    PPO's step 0). The fields: ``passed``, ``applies`` (False with ``--reward checker``),
    ``heldout_pair_accuracy``, ``natural_heldout_pairs``, ``min_heldout_pairs``, ``ci95``
    ([low, high] or None), ``interval`` (the method), ``reward_auc`` (``auc`` or None),
    ``reason``.
    """
    applies = reward != "checker"
    n = int(natural_pairs)
    ci = None
    if accuracy is None:
        reason = "the RM logged no held-out pair accuracy (val/accuracy), so nothing says it ranks right above wrong"
        ok = False
    else:
        k = int(round(float(accuracy) * n))
        ci = wilson_interval(min(max(k, 0), n), n) if n else None
        if n < min_pairs:
            reason = (f"{n} natural held-out pairs, fewer than the {min_pairs} needed to measure it "
                      f"(--rm-min-heldout-pairs)")
            ok = False
        elif ci[0] <= 0.5:
            reason = (f"its 95% interval {pct_interval(*ci)} includes 50%: it is not measurably better "
                      f"than a coin at ranking a right answer above a wrong one")
            ok = False
        else:
            reason = f"its 95% interval {pct_interval(*ci)} lies above 50%"
            ok = True
    if auc is not None:
        counts = f"{auc['n_right']} right and {auc['n_wrong']} wrong sampled answers"
        if auc["auc"] is None:
            auc_reason = (f"its right-vs-wrong AUC on the policy's held-out samples is not measurable ({counts}): "
                          f"nothing says it ranks a right answer above a wrong one across prompts")
            auc_ok = False
        else:
            lo, hi = auc["ci95"]
            auc_ok = lo > 0.5
            auc_reason = (f"its right-vs-wrong AUC on the policy's held-out samples is {auc['auc']:.2f} "
                          f"(95% Hanley-McNeil interval [{lo:.2f}, {hi:.2f}], {counts}), "
                          + ("above 0.5" if auc_ok else "not above 0.5: across prompts, as PPO compares "
                             "rewards, it is not shown to rank a right answer above a wrong one"))
        reason = f"{reason}; {auc_reason}"
        ok = ok and auc_ok
    acc_text = "n/a" if accuracy is None else f"{100 * accuracy:.1f}%"
    head = (f"RM gate: held-out natural pair accuracy {acc_text} on {n} pairs"
            + (f" (95% Wilson interval {pct_interval(*ci)})" if ci else "") + f": {reason}")
    fields = {"passed": ok or not applies, "applies": applies, "rm_passed": ok,
              "heldout_pair_accuracy": accuracy, "natural_heldout_pairs": n, "min_heldout_pairs": min_pairs,
              "ci95": list(ci) if ci else None, "interval": "wilson", "reward_auc": auc, "reason": reason}
    if ok:
        return GateResult(True, head + ": PPO may train against it.", fields)
    if not applies:
        return GateResult(True, head + ". The reward is the checker (--reward checker): PPO does not "
                                       "train against the RM, so it goes on.", fields)

    def now(flag, attr):
        value = getattr(a, attr, None) if a is not None else None
        return f"{flag} (now {value})" if value is not None else flag

    remedies = []
    sampled = (auc["n_right"] + auc["n_wrong"]) if auc is not None else 0
    if sampled and auc["n_right"] > auc["n_wrong"]:  # wrong answers, each pair's other half, are the scarce ones
        remedies.append(f"not more SFT: {auc['n_right']} of {sampled} sampled held-out answers "
                        f"({100 * auc['n_right'] / sampled:.1f}%) are already right, so wrong answers are what the "
                        f"pairs lack (and what PPO could fix): a higher {now('--rm-temperature', 'rm_temperature')}, "
                        f"{now('--rm-val-prompts', 'rm_val_prompts')} or "
                        f"{now('--rm-samples-per-prompt', 'rm_samples_per_prompt')}; or, the RM not needed to tell "
                        f"right from wrong, --reward checker")
    elif sft_steps is not None and custom_task:
        remedies.append(f"more SFT first, so that more sampled answers are right and more prompts give a "
                        f"right-vs-wrong pair: {now('--sft-steps', 'sft_steps')}, "
                        f"{now('--sft-rows', 'sft_rows')} or {now('--sft-more-rounds', 'sft_more_rounds')}")
    if n < min_pairs:  # the held-out sizing loop stopped short (launchers/rm_heldout.py: its budget, rounds, problems)
        remedies.append(f"more new held-out RM prompts: {now('--rm-heldout-max-prompts', 'rm_heldout_max_prompts')}, "
                        f"{now('--rm-heldout-sample-rounds', 'rm_heldout_sample_rounds')}; a task whose train problems "
                        f"are used up needs Task.generate (summary.json's rm_heldout_sizing says why it stopped)")
    remedies.append(f"more samples per prompt or more prompts: {now('--rm-samples-per-prompt', 'rm_samples_per_prompt')}, "
                    f"{now('--rm-prompts', 'rm_prompts')} (training pairs), "
                    f"{now('--rm-val-prompts', 'rm_val_prompts')} (natural held-out pairs)")
    if has_edit_answer:
        remedies.append(f"more same-form edit pairs for the RM to learn the answer from: "
                        f"{now('--rm-edit-pairs', 'rm_edit_pairs')}")
    else:
        remedies.append("give the task Task.edit_answer so that --rm-edit-pairs can add same-form pairs")
    remedies.append("the task's checker as the reward instead of the RM: --reward checker")
    remedies.append("or train against this RM anyway: --force")
    text = (head + f".\nPPO is not started: an RM not shown to rank right above wrong may give PPO nothing "
            f"to climb (exit status {RM_GATE_EXIT}). What to change:\n" + "\n".join(f"  - {r}" for r in remedies))
    fields["remedies"] = remedies
    return GateResult(False, text, fields)


def no_pairs_gate(pair_counts: dict, right: int, sampled: int, a=None) -> GateResult:
    """The refusal when the policy's samples give no RM pairs to train or measure on (no RM
    is trained): ``pair_counts`` (``train``, ``val``, ``val_same_form``: pairs built),
    ``right`` of ``sampled`` answers to the RM prompts right, ``a`` the parsed demo
    arguments (to quote the flags' values). When most samples are right, wrong answers are
    what is missing and the SFT model may already do the task (issue 53's digit sum: 100%
    after 600 SFT steps): the remedies name the levers that add wrong answers or prompts,
    not more samples of the same kind. Fields as :func:`rm_gate`'s (``passed`` False,
    ``heldout_pair_accuracy`` None) plus ``sampled_right``, ``sampled``; exit status
    :data:`RM_GATE_EXIT`."""
    def now(flag, attr):
        value = getattr(a, attr, None) if a is not None else None
        return f"{flag} (now {value})" if value is not None else flag

    n_val = int(pair_counts.get("val", 0))
    share = right / sampled if sampled else 0.0
    reason = (f"{pair_counts.get('train', 0)} training and {n_val} natural held-out RM pairs: {right} of {sampled} "
              f"sampled answers to the RM prompts are right ({100 * share:.1f}%), and a pair needs a right and "
              f"a wrong answer to one prompt")
    if share > 0.5:
        remedies = [f"the policy is right on most samples, so wrong answers are what the pairs lack: a higher "
                    f"{now('--rm-temperature', 'rm_temperature')}, {now('--rm-val-prompts', 'rm_val_prompts')} or "
                    f"{now('--rm-samples-per-prompt', 'rm_samples_per_prompt')}",
                    "or nothing: the SFT model's held-out exact match (sft_heldout in summary.json) near 100% "
                    "leaves PPO nothing to gain"]
    else:
        remedies = [f"more samples per prompt or more prompts: "
                    f"{now('--rm-samples-per-prompt', 'rm_samples_per_prompt')}, {now('--rm-prompts', 'rm_prompts')}, "
                    f"{now('--rm-val-prompts', 'rm_val_prompts')}"]
    fields = {"passed": False, "applies": True, "rm_passed": False, "heldout_pair_accuracy": None,
              "natural_heldout_pairs": n_val, "min_heldout_pairs": getattr(a, "rm_min_heldout_pairs", None),
              "ci95": None, "interval": "wilson", "reward_auc": None, "sampled_right": right, "sampled": sampled,
              "reason": reason, "remedies": remedies}
    text = (f"RM data: {reason}.\nNo RM is trained and PPO is not started (exit status {RM_GATE_EXIT}). "
            f"What to change:\n" + "\n".join(f"  - {r}" for r in remedies))
    return GateResult(False, text, fields)


def heldout_correct(exp: Path, step: int):
    """``[(prompt, correct), ...]`` of the PPO run's greedy held-out evaluation of ``step``
    (``<exp>/eval_samples/step_<step>.jsonl``, :func:`launchers.stages.ppo_evaluation`),
    or None when that file is missing or empty."""
    path = Path(exp) / "eval_samples" / f"step_{step:06d}.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["prompt"], float(r["correct"]) > 0.5) for r in rows] or None


def ppo_verdict(before, after, kl: dict, auc_by_step: dict, *, before_accuracy=None,
                after_accuracy=None, reward_by_step: dict | None = None,
                reward_is_checker: bool = False) -> dict:
    """The verdict after PPO.

    Args:
        before, after: :func:`heldout_correct` of step 0 and of the last step (None: not
            available; then the gain has no interval and ``before_accuracy`` /
            ``after_accuracy`` give the point values).
        kl: :func:`launchers.stages.kl_summary`.
        auc_by_step: ``{step: eval/reward_auc}``.
        reward_by_step: ``{step: reward_raw_mean}``, the mean raw score of the step's
            rollouts (None or empty: not reported).
        reward_is_checker: the reward is the task's checker (``--reward checker``): its AUC
            against the checker's labels is 1 by construction, so the AUC trend is ``n/a``
            and the line says why.

    Returns the ``summary.json`` ``verdict`` fields: ``gain`` (``"gain"``: the interval lies
    above 0; ``"loss"``: below; ``"no measurable change"``; ``"unmeasured"``: no paired
    rows), ``gain_points``, ``gain_ci95_points`` ([low, high] or None), ``gain_interval``,
    ``heldout_problems``, ``baseline_accuracy``, ``ppo_accuracy``, ``final_kl_mean``,
    ``kl_target``, ``kl_band`` (multiples of the target), ``kl_to_target``, ``kl_position``
    (``below`` / ``in`` / ``above`` the band, or ``n/a`` without a target), ``reward_auc_first``,
    ``reward_auc_last`` (and their steps), ``reward_auc_change``, ``reward_auc_trend``
    (``rising`` / ``flat`` / ``falling``, flat within :data:`AUC_FLAT`, or ``n/a``),
    ``rollout_reward_first`` / ``rollout_reward_last`` (the mean of ``reward_by_step`` over
    the first and the last :data:`REWARD_WINDOW` steps, at most half the steps each;
    ``rollout_reward_window``: that count; None without rewards), and ``line``: the printed
    verdict.
    """
    v: dict = {"gain_interval": "newcombe-paired-wilson (Newcombe 1998, method 10)"}
    paired = before is not None and after is not None and len(before) == len(after) and \
        [p for p, _ in before] == [p for p, _ in after]
    if paired:
        d, lo, hi = paired_difference_interval([c for _, c in before], [c for _, c in after])
        v.update(heldout_problems=len(before), baseline_accuracy=sum(c for _, c in before) / len(before),
                 ppo_accuracy=sum(c for _, c in after) / len(after), gain_points=100 * d,
                 gain_ci95_points=[100 * lo, 100 * hi],
                 gain="gain" if lo > 0 else "loss" if hi < 0 else "no measurable change")
    else:
        gain = None if before_accuracy is None or after_accuracy is None else 100 * (after_accuracy - before_accuracy)
        v.update(heldout_problems=None, baseline_accuracy=before_accuracy, ppo_accuracy=after_accuracy,
                 gain_points=gain, gain_ci95_points=None, gain="unmeasured")
    target, final = kl.get("kl_target"), kl.get("final_kl_mean")
    ratio = final / target if final is not None and target else None
    v.update(final_kl_mean=final, kl_target=target, kl_band=list(KL_BAND), kl_to_target=ratio,
             kl_position="n/a" if ratio is None else "below" if ratio < KL_BAND[0]
             else "above" if ratio > KL_BAND[1] else "in")
    if auc_by_step and reward_is_checker:
        v.update(reward_auc_first=None, reward_auc_last=None, reward_auc_change=None,
                 reward_auc_trend="n/a: the reward is the checker")
    elif auc_by_step:
        first, last = min(auc_by_step), max(auc_by_step)
        change = auc_by_step[last] - auc_by_step[first]
        v.update(reward_auc_first=auc_by_step[first], reward_auc_first_step=first,
                 reward_auc_last=auc_by_step[last], reward_auc_last_step=last, reward_auc_change=change,
                 reward_auc_trend="flat" if first == last or abs(change) < AUC_FLAT
                 else "rising" if change > 0 else "falling")
    else:
        v.update(reward_auc_first=None, reward_auc_last=None, reward_auc_change=None, reward_auc_trend="n/a")
    steps = sorted(reward_by_step or {})
    window = min(REWARD_WINDOW, len(steps) // 2) or len(steps)
    if steps:
        mean = lambda ks: sum(reward_by_step[k] for k in ks) / len(ks)  # noqa: E731
        v.update(rollout_reward_first=mean(steps[:window]), rollout_reward_last=mean(steps[-window:]),
                 rollout_reward_window=window)
    else:
        v.update(rollout_reward_first=None, rollout_reward_last=None, rollout_reward_window=None)
    if v["gain_points"] is None:
        gain_text = "held-out gain n/a"
    elif v["gain_ci95_points"] is not None:
        lo, hi = v["gain_ci95_points"]
        gain_text = (f"held-out {100 * v['baseline_accuracy']:.1f}% -> {100 * v['ppo_accuracy']:.1f}% "
                     f"({v['gain_points']:+.1f} points, 95% CI [{lo:+.1f}, {hi:+.1f}], paired over "
                     f"{v['heldout_problems']} problems)")
    else:
        gain_text = f"held-out gain {v['gain_points']:+.1f} points (no per-problem rows: no interval)"
    kl_text = "final kl_mean n/a" if final is None else (
        f"final kl_mean {final:.2f}" + (f" = {ratio:.2f}x kl.target {target:g}, {v['kl_position']} the band "
                                        f"{KL_BAND[0]:g}-{KL_BAND[1]:g}x" if ratio is not None else " (no target)"))
    auc_text = "reward AUC n/a" if not auc_by_step else (
        "reward AUC n/a (the reward is the checker: 1.00 by construction)" if reward_is_checker else
        f"reward's right-vs-wrong AUC {v['reward_auc_first']:.2f} -> {v['reward_auc_last']:.2f} "
        f"({v['reward_auc_trend']})")
    reward_text = "" if not steps else (
        f"; rollout reward {v['rollout_reward_first']:.3f} -> {v['rollout_reward_last']:.3f} "
        f"(mean of the first / last {window} steps)")
    v["line"] = f"verdict: {v['gain']}: {gain_text}; {kl_text}; {auc_text}{reward_text}"
    return v


def sft_heldout(accuracy, n: int) -> dict:
    """The SFT model's greedy held-out exact match (``accuracy`` over ``n`` problems) with its
    Wilson 95% interval: ``{"exact_match", "heldout_problems", "ci95", "interval", "line"}``."""
    k = int(round(accuracy * n)) if n else 0
    ci = wilson_interval(k, n) if n else None
    line = (f"SFT model's held-out exact match (greedy, the task's checker): {100 * accuracy:.1f}% of {n}"
            + (f" (95% Wilson interval {pct_interval(*ci)})" if ci else ""))
    return {"exact_match": accuracy, "heldout_problems": n, "ci95": list(ci) if ci else None,
            "interval": "wilson", "line": line}


PROMPT_FILES = ("rm_prompts.jsonl", "rm_val_prompts.jsonl", "ppo_prompts.jsonl", "eval.jsonl")
"""The prompt files of :func:`nemo_rlhf.tasks.task.write_prompt_files` the stages read."""


def prompt_token_lengths(tokenizer_dir, prompts: list[str], chat_template: Optional[str],
                         system_prompt: Optional[str]) -> list[int]:
    """Token counts of ``prompts`` as the SFT, RM and PPO jobs lay them out:
    :func:`nemo_rlhf.data.datasets.encode_prompt` (``[BOS] + encode(format_prompt(...))``)
    with the tokenizer of ``tokenizer_dir``."""
    from nemo_rlhf.data.datasets import encode_prompt
    from nemo_rlhf.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    return [len(encode_prompt(tok, p, chat_template, system_prompt)) for p in prompts]


def check_prompt_lengths(data: Path, tokenizer_dir, profile, max_new_tokens: int,
                         budget_from: str) -> int:
    """Refuse, before any stage samples or trains (only the model set-up, which gives the
    tokenizer, has run), a task whose longest prompt (after the profile's chat
    template, :func:`prompt_token_lengths`) plus ``max_new_tokens`` exceeds the profile's
    ``data.max_seq_length`` (:attr:`launchers.recipe.ModelProfile.max_seq_length`, given to
    its SFT, RM and PPO jobs): SFT and the RM drop or cut every such row
    (``data.overlong_policy``), which once surfaced only as SFT's ``ValueError: the dataset
    is empty`` after minutes. The PPO job drops a prompt longer than
    ``model.max_position_embeddings`` less ``rollout.max_new_tokens``, a larger room for both
    profiles (tiny 128 positions for 64; SmolLM2 8192 for 96), so this check covers it.

    Args:
        data: the folder of :data:`PROMPT_FILES`.
        budget_from: where ``max_new_tokens`` came from (``Task.max_new_tokens`` or the
            profile's), for the message.

    Returns the longest prompt's token count. Raises ``SystemExit`` naming
    ``data.max_seq_length``, the longest prompt (file, line, text), the lengths and how many
    prompts do not fit.
    """
    template = profile.chat_template
    system = profile.system_prompt() if profile.system_prompt is not None else None
    room = profile.max_seq_length - max_new_tokens
    worst, over = None, 0
    for name in PROMPT_FILES:
        path = data / name
        if not path.is_file():
            continue
        prompts = [json.loads(x)["prompt"] for x in path.read_text().splitlines() if x.strip()]
        for i, n in enumerate(prompt_token_lengths(tokenizer_dir, prompts, template, system)):
            over += n > room
            if worst is None or n > worst[0]:
                worst = (n, name, i + 1, prompts[i])
    if worst is None:
        return 0
    n, name, line, prompt = worst
    if over:
        raise SystemExit(
            f"the task's prompts do not fit the {profile.name} model's sequence length: {over} prompts are longer "
            f"than {room} tokens; the longest, line {line} of {data / name} ({prompt!r}), is {n} tokens after the "
            f"chat template ({template or 'none'}), and with max_new_tokens {max_new_tokens} ({budget_from}) needs "
            f"{n + max_new_tokens} > data.max_seq_length {profile.max_seq_length} (the {profile.name} profile's "
            f"ModelProfile.max_seq_length, launchers/recipe.py: its SFT, RM and PPO jobs' data.max_seq_length). "
            f"SFT and the RM would drop or cut every such row. Shorten Task.prompt_template, lower "
            f"Task.max_new_tokens, or use a model with a longer data.max_seq_length (--model)")
    print(f"longest prompt: {n} tokens (line {line} of {name}) + max_new_tokens {max_new_tokens} <= "
          f"data.max_seq_length {profile.max_seq_length}", flush=True)
    return n
