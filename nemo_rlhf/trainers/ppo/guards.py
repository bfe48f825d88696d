"""Stability toolbox: n-gram repetition and the reward-hacking guard.

The guard watches the signs the PPO-RLHF literature lists for reward hacking (the seed
chapter's failure table): over a window of steps the reward rises while responses get
much longer or more repetitive, the KL to the reference exceeds a ceiling, or (adaptive or pi KL)
stays above a multiple of its target over a whole window; and, over the held-out
evaluations, the reward rises while a trusted ("gold") metric falls, or rises clearly while
the gold metric does not (the chapter's check that the reward and the metric it stands for
move together: "reward up, KL up" and "reward up, quality flat" are its danger rows). It either warns or asks
the trainer to save and stop, with a message naming the metrics and values.
"""

from __future__ import annotations

from collections import deque
from typing import Optional


def ngram_repetition_rate(tokens: list[int], n: int = 3) -> float:
    """Fraction of the n-grams of ``tokens`` that repeat an earlier n-gram (0 = none).

    Sequences shorter than ``n + 1`` tokens have rate 0.
    """
    if len(tokens) < n + 1:
        return 0.0
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams)


class RewardHackingGuard:
    """Window check on the reward, ``response_length``, ``repetition`` and ``kl_mean``.

    The reward watched is the *raw* score mean, ``reward_raw_mean``, when the metrics hold
    it: the normalised ``reward_mean`` (running normalisation) drifts towards 0 by
    construction, so it would hide a rising score. Metrics without ``reward_raw_mean``
    (callers that log only ``reward_mean``) are judged on ``reward_mean``; the message
    names the metric used.

    Args:
        window: steps between the compared first and last entries (``>= 1``): the check
            at step ``s`` compares step ``s - window`` with step ``s``.
        max_length_growth: length ratio last/first that, with a rising reward, triggers.
        max_repetition: repetition rate that, with a rising reward, triggers.
        kl_ceiling: kl_mean above this triggers on its own.
        gold_metric: the trusted held-out metric (an ``eval/*`` key, e.g. ``eval/accuracy``
            by the task's checker or a judge's win rate; higher is better), or None to skip
            the divergence check.
        proxy_metric: the held-out reward compared with it (``eval/reward``: the raw score
            of the reward being optimised on the same greedy responses).
        gold_window: evaluations between the two compared ones (``>= 1``): the check at an
            evaluation compares it with the one ``gold_window`` evaluations earlier.
        gold_min_drop: how far (absolute) the gold metric must fall, with the proxy rising,
            to trigger (``>= 0``; e.g. 0.02 ignores one problem in 100 of noise).
        proxy_min_rise: with ``gold_min_gain``: how far (absolute) the proxy must rise
            between the compared evaluations for the "quality flat" check (``>= 0``).
        gold_min_gain: trigger when the proxy rose by more than ``proxy_min_rise`` while
            the gold metric rose by less than this (absolute; None: off).
        kl_target: the adaptive or pi KL controller's target (``kl.target``; None: a fixed
            coefficient, no target).
        kl_over_target: trigger when ``kl_mean`` exceeds ``kl_over_target * kl_target`` at
            every step of a whole window (``window + 1`` steps; None: off).

    Raises:
        ValueError: ``window < 1``, ``gold_window < 1``, ``gold_min_drop < 0``,
        ``proxy_min_rise < 0`` or ``kl_over_target <= 0``.
    """

    def __init__(self, window: int, max_length_growth: float, max_repetition: float,
                 kl_ceiling: float, gold_metric: Optional[str] = None,
                 proxy_metric: str = "eval/reward", gold_window: int = 2,
                 gold_min_drop: float = 0.0, proxy_min_rise: float = 0.0,
                 gold_min_gain: Optional[float] = None, kl_target: Optional[float] = None,
                 kl_over_target: Optional[float] = None):
        if window < 1:
            raise ValueError(f"guards.window={window}: must be >= 1")
        if gold_window < 1:
            raise ValueError(f"guards.gold_window={gold_window}: must be >= 1")
        if gold_min_drop < 0:
            raise ValueError(f"guards.gold_min_drop={gold_min_drop}: must be >= 0")
        if proxy_min_rise < 0:
            raise ValueError(f"guards.proxy_min_rise={proxy_min_rise}: must be >= 0")
        if kl_over_target is not None and kl_over_target <= 0:
            raise ValueError(f"guards.kl_over_target={kl_over_target}: must be > 0 (null: off)")
        self.window = window
        self.max_length_growth = max_length_growth
        self.max_repetition = max_repetition
        self.kl_ceiling = kl_ceiling
        self.gold_metric, self.proxy_metric = gold_metric, proxy_metric
        self.gold_min_drop = gold_min_drop
        self.proxy_min_rise, self.gold_min_gain = proxy_min_rise, gold_min_gain
        self.kl_target, self.kl_over_target = kl_target, kl_over_target
        self.history: deque = deque(maxlen=window + 1)
        self.evals: deque = deque(maxlen=gold_window + 1)

    def update(self, step: int, metrics: dict, evaluation_only: bool = False) -> Optional[str]:
        """Record a step; return a message if a trigger fired, else None.

        ``evaluation_only``: ``metrics`` are a held-out evaluation's alone (the step-0
        evaluation of the initial policy, before any update): record the evaluation for the
        gold-metric check, not a step of the window checks (no training metrics to record).
        """
        if evaluation_only:
            return self._gold_divergence(step, metrics)
        entry = {k: float(metrics.get(k, 0.0)) for k in
                 ("reward_mean", "response_length", "repetition", "kl_mean")}
        if "reward_raw_mean" in metrics:
            entry["reward_raw_mean"] = float(metrics["reward_raw_mean"])
        entry["step"] = step
        self.history.append(entry)
        gold = self._gold_divergence(step, metrics)
        if gold:
            return gold
        if entry["kl_mean"] > self.kl_ceiling:
            return (f"kl_mean={entry['kl_mean']:.3f} exceeds guards.kl_ceiling="
                    f"{self.kl_ceiling} at step {step}")
        if len(self.history) < self.history.maxlen:
            return None
        first, last = self.history[0], self.history[-1]
        if self.kl_over_target is not None and self.kl_target is not None:
            bound = self.kl_over_target * self.kl_target
            if all(h["kl_mean"] > bound for h in self.history):
                return (f"kl_mean stayed above guards.kl_over_target={self.kl_over_target} x "
                        f"kl.target={self.kl_target} = {bound:.3f} at every step "
                        f"{first['step']}-{last['step']} (last {last['kl_mean']:.3f}): the KL "
                        f"controller is not holding its target (raise kl.init_kl_coef, lower "
                        f"optim.lr, or with kl.type=adaptive lower kl.horizon or use kl.type=pi, "
                        f"which reacts within a few steps)")
        key = "reward_raw_mean" if "reward_raw_mean" in first and "reward_raw_mean" in last \
            else "reward_mean"
        if last[key] <= first[key]:
            return None
        rose = f"{key} rose {first[key]:.3f}->{last[key]:.3f}"
        length_ratio = last["response_length"] / max(first["response_length"], 1e-6)
        if length_ratio > self.max_length_growth:
            return (f"{rose} while response_length grew {first['response_length']:.1f}->"
                    f"{last['response_length']:.1f} (x{length_ratio:.2f} > "
                    f"guards.max_length_growth={self.max_length_growth}) over steps "
                    f"{first['step']}-{last['step']}")
        if last["repetition"] > self.max_repetition:
            return (f"{rose} while n-gram repetition reached {last['repetition']:.3f} (> "
                    f"guards.max_repetition={self.max_repetition}) at step {last['step']}")
        return None

    def _gold_divergence(self, step: int, metrics: dict) -> Optional[str]:
        """Record an evaluation (a step whose metrics hold both the gold and the proxy
        metric); the message if the proxy rose while the gold metric fell."""
        g, p = self.gold_metric, self.proxy_metric
        if g is None or g not in metrics or p not in metrics:
            return None
        self.evals.append({"step": step, "gold": float(metrics[g]), "proxy": float(metrics[p])})
        if len(self.evals) < self.evals.maxlen:
            return None
        first, last = self.evals[0], self.evals[-1]
        if last["proxy"] > first["proxy"] and first["gold"] - last["gold"] > self.gold_min_drop:
            return (f"{p} rose {first['proxy']:.4f}->{last['proxy']:.4f} while the gold metric "
                    f"{g} fell {first['gold']:.4f}->{last['gold']:.4f} (more than "
                    f"guards.gold_min_drop={self.gold_min_drop}) between the evaluations at "
                    f"steps {first['step']} and {last['step']}: the reward no longer tracks the "
                    f"metric it stands for (reward hacking / RM over-optimisation)")
        if (self.gold_min_gain is not None and last["proxy"] - first["proxy"] > self.proxy_min_rise
                and last["gold"] - first["gold"] < self.gold_min_gain):
            return (f"{p} rose {first['proxy']:.4f}->{last['proxy']:.4f} (more than "
                    f"guards.proxy_min_rise={self.proxy_min_rise}) while the gold metric {g} went "
                    f"{first['gold']:.4f}->{last['gold']:.4f} (less than guards.gold_min_gain="
                    f"{self.gold_min_gain}) between the evaluations at steps {first['step']} and "
                    f"{last['step']}: the reward rises without the quality it stands for (RM "
                    f"over-optimisation, or a reward that does not measure the task)")
        return None

    def reset(self) -> None:
        """Forget every recorded step and evaluation (the reward changed meaning, e.g. a
        refreshed RM: old and new rewards are not comparable)."""
        self.history.clear()
        self.evals.clear()

    def state_dict(self) -> dict:
        return {"history": list(self.history), "evals": list(self.evals)}

    def load_state_dict(self, sd: dict) -> None:
        self.history.clear()
        self.history.extend(sd.get("history", []))
        self.evals.clear()
        self.evals.extend(sd.get("evals", []))
