"""The reward-hacking guard (:mod:`nemo_rlhf.trainers.ppo.guards`) through its public API.

Each trigger of the stability toolbox -- reward rising while responses get much longer,
reward rising while responses get repetitive, kl_mean above its ceiling -- fires with a
message naming the metric and its values, and a healthy run never fires. The stop path
inside the training loop is tested in ``tests/e2e/test_guards_stop.py``.
"""

from __future__ import annotations

import pytest

from nemo_rlhf.trainers.ppo.config import GuardConfig
from nemo_rlhf.trainers.ppo.guards import RewardHackingGuard, ngram_repetition_rate


def _guard(window=4, max_length_growth=1.5, max_repetition=0.5, kl_ceiling=10.0):
    return RewardHackingGuard(window, max_length_growth, max_repetition, kl_ceiling)


def _feed(guard, rows, start=1):
    """Feed one metrics dict per step; return ``{step: message}`` of the steps that fired."""
    fired = {}
    for i, row in enumerate(rows, start=start):
        msg = guard.update(i, {"repetition": 0.0, "kl_mean": 0.1, **row})
        if msg is not None:
            fired[i] = msg
    return fired


def _feed_resumed(make, rows, split):
    """Feed ``rows[:split]`` to one guard, restore a new guard from its state and feed it the
    rest; return ``{step: message}`` of the restored guard's steps that fired."""
    g = make()
    _feed(g, rows[:split])
    restored = make()
    restored.load_state_dict(g.state_dict())
    return _feed(restored, rows[split:], start=split + 1)


def _healthy(n):
    """Reward slowly rising, length +-1 token around 10, low repetition, small KL."""
    return [{"reward_mean": 0.1 * i, "response_length": 10.0 + (i % 2), "repetition": 0.05,
             "kl_mean": 0.5 + 0.01 * i} for i in range(n)]


# --- length -----------------------------------------------------------------------------

def test_reward_rising_while_length_grows_past_the_limit_fires_naming_metric_and_values():
    g = _guard(window=3, max_length_growth=1.5)
    rows = [{"reward_mean": r, "response_length": n}
            for r, n in [(0.1, 10.0), (0.2, 12.0), (0.3, 14.0), (0.4, 16.0)]]
    fired = _feed(g, rows)
    assert list(fired) == [4], fired  # only once the window is full
    msg = fired[4]
    assert "reward_mean rose 0.100->0.400" in msg
    assert "response_length grew 10.0->16.0" in msg
    assert "x1.60 > guards.max_length_growth=1.5" in msg
    assert "steps 1-4" in msg


def test_length_growth_at_or_below_the_limit_does_not_fire():
    g = _guard(window=3, max_length_growth=1.5)
    rows = [{"reward_mean": 0.1 * i, "response_length": n} for i, n in enumerate([10, 12, 14, 15])]
    assert _feed(g, rows) == {}  # x1.5 is not > 1.5


def test_length_growth_without_rising_reward_does_not_fire():
    g = _guard(window=2, max_length_growth=1.2)
    rows = [{"reward_mean": r, "response_length": n} for r, n in [(0.5, 10), (0.5, 20), (0.5, 40)]]
    assert _feed(g, rows) == {}
    rows = [{"reward_mean": r, "response_length": n} for r, n in [(0.5, 40), (0.4, 80), (0.3, 90)]]
    assert _feed(_guard(window=2, max_length_growth=1.2), rows) == {}


def test_comparison_is_over_the_window_not_the_whole_run():
    """Slow growth: x1.1 per step is under the limit over any 3-step window (x1.21), although
    over the whole run the length has more than doubled."""
    g = _guard(window=2, max_length_growth=1.5)
    rows = [{"reward_mean": 0.1 * i, "response_length": 10.0 * 1.1 ** i} for i in range(10)]
    assert _feed(g, rows) == {}
    # and a jump inside the window fires at the step it completes
    g = _guard(window=2, max_length_growth=1.5)
    rows += [{"reward_mean": 2.0, "response_length": 60.0}]
    fired = _feed(g, rows)
    assert list(fired) == [11] and "steps 9-11" in fired[11]


# --- repetition -------------------------------------------------------------------------

def test_reward_rising_with_repetition_past_the_limit_fires_naming_the_metric():
    g = _guard(window=2, max_repetition=0.5)
    rows = [{"reward_mean": r, "response_length": 10.0, "repetition": rep}
            for r, rep in [(0.1, 0.1), (0.2, 0.3), (0.3, 0.7)]]
    fired = _feed(g, rows)
    assert list(fired) == [3], fired
    msg = fired[3]
    assert "reward_mean rose 0.100->0.300" in msg
    assert "n-gram repetition reached 0.700" in msg
    assert "guards.max_repetition=0.5" in msg and "at step 3" in msg


def test_high_repetition_without_rising_reward_does_not_fire():
    g = _guard(window=2, max_repetition=0.5)
    rows = [{"reward_mean": r, "response_length": 10.0, "repetition": 0.9}
            for r in (0.3, 0.2, 0.3)]
    assert _feed(g, rows) == {}


# --- KL ceiling -------------------------------------------------------------------------

def test_kl_mean_above_the_ceiling_fires_at_once_whatever_the_reward():
    g = _guard(window=5, kl_ceiling=10.0)
    fired = _feed(g, [{"reward_mean": 1.0, "response_length": 10.0, "kl_mean": 12.5}])
    assert list(fired) == [1]  # no full window needed
    assert "kl_mean=12.500 exceeds guards.kl_ceiling=10.0 at step 1" == fired[1]
    # falling reward: still fires
    g = _guard(window=2, kl_ceiling=10.0)
    fired = _feed(g, [{"reward_mean": 1.0, "response_length": 10.0, "kl_mean": 1.0},
                      {"reward_mean": 0.0, "response_length": 10.0, "kl_mean": 10.5}])
    assert list(fired) == [2] and "kl_mean=10.500" in fired[2]


def test_kl_mean_at_the_ceiling_does_not_fire():
    g = _guard(window=2, kl_ceiling=10.0)
    assert _feed(g, [{"reward_mean": 0.0, "response_length": 10.0, "kl_mean": 10.0}] * 3) == {}


# --- healthy run, state ---------------------------------------------------------------------

def test_healthy_run_never_fires():
    g = _guard(window=5, max_length_growth=1.5, max_repetition=0.5, kl_ceiling=10.0)
    assert _feed(g, _healthy(50)) == {}


def test_defaults_fire_on_doubling_length_and_not_on_a_healthy_run():
    cfg = GuardConfig()
    assert cfg.action == "warn"  # on by default, as a warning
    make = lambda: RewardHackingGuard(cfg.window, cfg.max_length_growth, cfg.max_repetition,  # noqa: E731
                                      cfg.kl_ceiling)
    assert _feed(make(), _healthy(30)) == {}
    rows = [{"reward_mean": 0.1 * i, "response_length": 10.0 * 2 ** (i / cfg.window)}
            for i in range(cfg.window + 1)]
    fired = _feed(make(), rows)
    last = cfg.window + 1  # step window+1 is compared with step 1
    assert list(fired) == [last] and "response_length grew 10.0->20.0" in fired[last]


def test_missing_metrics_count_as_zero_and_do_not_fire():
    g = _guard(window=1)
    assert g.update(1, {}) is None and g.update(2, {"reward_mean": 1.0}) is None


def test_state_dict_round_trip_keeps_the_window():
    """A resumed guard (history restored from the checkpoint) fires at the same step as
    the uninterrupted one; a fresh guard would need a full window first."""
    rows = [{"reward_mean": r, "response_length": n}
            for r, n in [(0.1, 10.0), (0.2, 11.0), (0.3, 13.0), (0.4, 20.0)]]
    full = _feed(_guard(window=3), rows)
    assert list(full) == [4]
    assert _feed_resumed(lambda: _guard(window=3), rows, 3) == full
    assert _feed(_guard(window=3), rows[3:], start=4) == {}


# --- n-gram repetition rate, config ------------------------------------------------------------

@pytest.mark.parametrize("tokens, n, rate", [
    ([1, 2, 3, 4, 5, 6], 3, 0.0),
    ([1, 2, 3], 3, 0.0),                      # shorter than n + 1: 0
    ([7, 7, 7, 7, 7, 7], 3, 1 - 1 / 4),       # one distinct trigram out of 4
    ([1, 2, 3, 1, 2, 3, 1, 2, 3], 3, 1 - 3 / 7),
    ([1, 2, 1, 2, 1], 2, 1 - 2 / 4),
])
def test_ngram_repetition_rate(tokens, n, rate):
    assert ngram_repetition_rate(tokens, n) == pytest.approx(rate)


def test_guard_action_is_validated():
    for ok in ("off", "warn", "stop"):
        GuardConfig(action=ok)
    with pytest.raises(ValueError, match="guards.action='halt'"):
        GuardConfig(action="halt")


# --- raw vs normalised reward, window span (issue 18) -------------------------------------

def test_raw_reward_and_length_rising_fire_while_the_normalised_reward_stays_flat():
    """Running normalisation keeps ``reward_mean`` near 0 by construction; the guard must
    see the raw score mean rise (``reward_raw_mean``) and fire on it."""
    g = _guard(window=3, max_length_growth=1.5)
    rows = [{"reward_mean": m, "reward_raw_mean": raw, "response_length": n}
            for m, raw, n in [(0.02, 1.0, 10.0), (-0.01, 2.0, 12.0), (0.0, 3.0, 14.0),
                              (-0.02, 4.0, 16.0)]]
    fired = _feed(g, rows)
    assert list(fired) == [4], fired
    assert "reward_raw_mean rose 1.000->4.000" in fired[4]
    assert "response_length grew 10.0->16.0" in fired[4] and "steps 1-4" in fired[4]


def test_falling_raw_reward_does_not_fire_even_if_the_normalised_reward_rises():
    g = _guard(window=2, max_length_growth=1.2)
    rows = [{"reward_mean": m, "reward_raw_mean": raw, "response_length": n}
            for m, raw, n in [(-0.5, 3.0, 10.0), (0.0, 2.0, 20.0), (0.5, 1.0, 40.0)]]
    assert _feed(g, rows) == {}


def test_window_compares_steps_window_apart():
    """window=2: step 3 is compared with step 1. x1.3 per step stays under the x1.5 limit
    step to step, but x1.69 over the two steps fires."""
    g = _guard(window=2, max_length_growth=1.5)
    rows = [{"reward_mean": 0.1 * i, "response_length": 10.0 * 1.3 ** i} for i in range(3)]
    fired = _feed(g, rows)
    assert list(fired) == [3], fired
    assert "steps 1-3" in fired[3] and "x1.69" in fired[3]


def test_window_must_be_at_least_one():
    with pytest.raises(ValueError, match="guards.window=0: must be >= 1"):
        GuardConfig(window=0)
    with pytest.raises(ValueError, match="guards.window=0: must be >= 1"):
        _guard(window=0)


# --- gold-metric divergence (issue 19) ------------------------------------------------------

def _gold(gold_window=1, gold_min_drop=0.0, gold_metric="eval/accuracy"):
    return RewardHackingGuard(4, 10.0, 1.0, 1e9, gold_metric, "eval/reward", gold_window,
                              gold_min_drop)


def _evals(rows, every=5):
    """``(eval/reward, eval/accuracy)`` at steps every, 2*every, ...; train steps between
    carry no eval metrics."""
    out = []
    for reward, accuracy in rows:
        out += [{"reward_mean": 0.0, "response_length": 10.0}] * (every - 1)
        out.append({"reward_mean": 0.0, "response_length": 10.0, "eval/reward": reward,
                    "eval/accuracy": accuracy})
    return out


def test_reward_rising_while_the_gold_metric_falls_fires_naming_both_metrics_and_values():
    fired = _feed(_gold(gold_window=2), _evals([(0.10, 0.40), (0.30, 0.45), (0.60, 0.30)]))
    assert list(fired) == [15], fired
    assert fired[15] == ("eval/reward rose 0.1000->0.6000 while the gold metric eval/accuracy "
                         "fell 0.4000->0.3000 (more than guards.gold_min_drop=0.0) between the "
                         "evaluations at steps 5 and 15: the reward no longer tracks the metric "
                         "it stands for (reward hacking / RM over-optimisation)")


@pytest.mark.parametrize("rows", [
    [(0.1, 0.40), (0.3, 0.50), (0.6, 0.58)],   # both rise: healthy
    [(0.6, 0.40), (0.3, 0.30), (0.1, 0.20)],   # both fall: a failing run, not a hacked one
    [(0.1, 0.40), (0.1, 0.30), (0.1, 0.20)],   # reward flat
])
def test_reward_and_gold_moving_together_or_a_flat_reward_do_not_fire(rows):
    assert _feed(_gold(gold_window=1), _evals(rows)) == {}


def test_gold_drop_within_the_tolerance_does_not_fire_and_beyond_it_does():
    rows = _evals([(0.1, 0.5), (0.2, 0.375)])                 # fell by exactly 0.125
    assert _feed(_gold(gold_min_drop=0.125), rows) == {}      # not more than the tolerance
    assert list(_feed(_gold(gold_min_drop=0.1), rows)) == [10]


def test_gold_check_off_or_without_the_metrics_never_fires():
    rows = _evals([(0.1, 0.5), (0.9, 0.1)])
    assert _feed(_gold(gold_metric=None), rows) == {}
    no_gold = [{k: v for k, v in r.items() if k != "eval/accuracy"} for r in rows]
    assert _feed(_gold(), no_gold) == {}


def test_gold_history_survives_a_resume():
    rows = _evals([(0.1, 0.5), (0.2, 0.5), (0.3, 0.4)])
    full = _feed(_gold(gold_window=2), rows)
    assert list(full) == [15]
    assert _feed_resumed(lambda: _gold(gold_window=2), rows, 10) == full


def test_gold_settings_are_validated():
    with pytest.raises(ValueError, match="guards.gold_window=0"):
        GuardConfig(gold_window=0)
    with pytest.raises(ValueError, match="guards.gold_min_drop=-0.1"):
        GuardConfig(gold_min_drop=-0.1)
    with pytest.raises(ValueError, match="guards.gold_window=0"):
        _gold(gold_window=0)


# --- "reward up, quality flat" and "KL over its target" (issue 40) -------------------------

def test_reward_up_with_the_gold_metric_flat_fires_only_when_asked():
    """The run of issue 40: the held-out RM reward rose 1.39 -> 6.11 while accuracy stayed
    at 0 (it did not *fall*, so the divergence check was silent)."""
    rows = _evals([(1.39, 0.0), (6.11, 0.0)])
    assert _feed(_gold(), rows) == {}  # off by default
    flat = lambda **kw: RewardHackingGuard(4, 10.0, 1.0, 1e9, "eval/accuracy", "eval/reward", 1,  # noqa: E731
                                           0.0, **kw)
    fired = _feed(flat(proxy_min_rise=1.0, gold_min_gain=0.01), rows)
    assert list(fired) == [10]
    assert "eval/reward rose 1.3900->6.1100" in fired[10] and "less than guards.gold_min_gain=0.01" in fired[10]
    assert _feed(flat(proxy_min_rise=5.0, gold_min_gain=0.01), rows) == {}  # the rise is too small
    assert _feed(flat(proxy_min_rise=1.0, gold_min_gain=0.01), _evals([(1.39, 0.0), (6.11, 0.2)])) == {}


def test_kl_held_above_its_target_over_a_window_fires_and_a_passing_excursion_does_not():
    """Seed 3 of issue 40: kl_mean 9.23 against an adaptive target of 6."""
    make = lambda: RewardHackingGuard(3, 10.0, 1.0, 1e9, kl_target=6.0, kl_over_target=1.25)  # noqa: E731
    high = [{"reward_mean": 0.0, "response_length": 10.0, "kl_mean": 9.23}] * 6
    fired = _feed(make(), high)
    assert list(fired)[0] == 4  # the first whole window: steps 1-4
    assert "kl.target=6.0 = 7.500 at every step 1-4" in fired[4]
    spike = [{"reward_mean": 0.0, "response_length": 10.0, "kl_mean": k} for k in (5, 9, 9, 6, 9, 9, 5)]
    assert _feed(make(), spike) == {}  # never above 7.5 for 4 steps in a row
    assert _feed(RewardHackingGuard(3, 10.0, 1.0, 1e9, kl_target=None, kl_over_target=1.25), high) == {}
    with pytest.raises(ValueError, match="guards.kl_over_target=0"):
        GuardConfig(kl_over_target=0)
    with pytest.raises(ValueError, match="guards.proxy_min_rise=-1"):
        GuardConfig(proxy_min_rise=-1)
