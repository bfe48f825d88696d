"""The reward-hacking guard inside the PPO loop (``nemo_rlhf.train_ppo.fit``), tiny model.

Real PPO steps on the tiny demo model; the metrics each step reports are then overridden
with a hacking pattern (reward up, response length up), so the guard's decision -- not the
tiny model's behaviour in 3 steps -- drives the test. ``guards.action=stop``: a checkpoint of
the step that fired is published and the run stops (exit code 3) with a message naming
the metric and its values; ``warn``: the same message is logged and the run goes on. The
gold-metric check: real held-out evaluations whose reward rises while the checker's accuracy
falls stop the run the same way.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

# (raw reward mean, response_length) reported at steps 1, 2, 3, ...: from one step to the
# next (guards.window=1) the reward rises 0.1 -> 0.5 while the length doubles 4 -> 8
# (limit x1.2)
HACKING = [(0.1, 4.0), (0.5, 8.0), (0.9, 16.0), (1.3, 32.0)]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _fit_recording(trainer) -> tuple[int, list]:
    """``trainer.fit()`` with the PPO logger's warnings and errors recorded."""
    handler = _Records()
    logging.getLogger("nemo_rlhf.ppo").addHandler(handler)
    try:
        return trainer.fit(), handler.lines
    finally:
        logging.getLogger("nemo_rlhf.ppo").removeHandler(handler)


def _run(tmp: Path, name: str, action: str) -> dict:
    from nemo_rlhf.train_ppo import build

    data = make_demo_data(tmp / "data")
    exp = tmp / name
    cfg = compose_ppo(data, exp, "trainer.max_steps=4", "exp_manager.save_interval=0",
                      f"guards.action={action}", "guards.window=1",
                      "guards.max_length_growth=1.2", "guards.kl_ceiling=1000")
    trainer = build(cfg)
    real_step = trainer.train_step

    def hacked_step():
        metrics = real_step()
        reward, length = HACKING[trainer.step]  # trainer.step: steps done before this one
        metrics.update(reward_raw_mean=reward, reward_mean=reward, response_length=length,
                       repetition=0.0)
        return metrics

    trainer.train_step = hacked_step
    code, lines = _fit_recording(trainer)
    ckpts = exp / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir()) if ckpts.exists() else []
    state = {}
    if "latest" in names:
        latest = (ckpts / "latest").read_text().strip()
        state = json.loads((ckpts / latest / "trainer_state.json").read_text())
        state["latest"] = latest
        state["complete"] = (ckpts / latest / "COMPLETE").is_file()
    return {"code": code, "step": trainer.step, "ckpts": names, "state": state, "log": lines}


# (eval/reward, eval/accuracy) of the held-out evaluations at steps 1, 2, 3, 4: the reward
# the policy is trained on keeps rising while the checker's accuracy falls from step 2 on
DIVERGING = [(0.2, 0.50), (0.4, 0.55), (0.6, 0.45), (0.8, 0.30)]


def _run_gold(tmp: Path) -> dict:
    """Real steps and real held-out evaluations (every step); the two compared eval metrics
    are then replaced by ``DIVERGING``: the gold-metric check must stop the run."""
    from nemo_rlhf.train_ppo import build

    data = make_demo_data(tmp / "data")
    exp = tmp / "gold"
    cfg = compose_ppo(data, exp, "trainer.max_steps=4", "exp_manager.save_interval=0",
                      "trainer.val_check_interval=1", "guards.action=stop", "guards.window=1",
                      "guards.max_length_growth=1000", "guards.max_repetition=1.0",
                      "guards.kl_ceiling=1000", "guards.gold_window=2", "guards.gold_min_drop=0.05")
    trainer = build(cfg)
    real_validate, seen, real = trainer.validate, [], {}

    def diverging_validate():
        metrics = real_validate()
        seen.append(sorted(metrics))
        real[trainer.step] = dict(metrics)
        reward, accuracy = DIVERGING[trainer.step - 1]  # trainer.step: this step, counted
        metrics.update({"eval/reward": reward, "eval/accuracy": accuracy})
        return metrics

    trainer.validate = diverging_validate
    code, lines = _fit_recording(trainer)
    ckpts = exp / "checkpoints"
    state = json.loads((ckpts / (ckpts / "latest").read_text().strip() / "trainer_state.json").read_text())
    samples = {int(f.stem.split("_")[1]): [json.loads(line) for line in f.read_text().splitlines()]
               for f in sorted((exp / "eval_samples").glob("step_*.jsonl"))}
    return {"code": code, "step": trainer.step, "state": state, "log": lines, "seen": seen,
            "real": real, "samples": samples, "n_eval": len(trainer.eval_prompts)}


def _worker(rank: int, tmp: str) -> dict:
    tmp = Path(tmp)
    return {"stop": _run(tmp, "stop", "stop"), "warn": _run(tmp, "warn", "warn"),
            "off": _run(tmp, "off", "off"), "gold": _run_gold(tmp)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_worker, world_size=1, tmp=str(tmp_path_factory.mktemp("guards")))[0]


EXPECTED = ("reward_raw_mean rose 0.100->0.500 while response_length grew 4.0->8.0 "
            "(x2.00 > guards.max_length_growth=1.2) over steps 1-2")


def test_stop_saves_a_checkpoint_of_the_step_and_stops_naming_metric_and_values(runs):
    res = runs["stop"]
    assert res["code"] == 3, res
    assert res["step"] == 2  # stopped at the step that fired, not at max_steps=4
    # save_interval=0 and max_steps not reached: the only checkpoint is the guard's
    assert res["ckpts"] == ["latest", "step_2"], res["ckpts"]
    assert res["state"]["latest"] == "step_2" and res["state"]["complete"]
    assert res["state"]["step"] == 2
    assert [h["step"] for h in res["state"]["guard"]["history"]] == [1, 2]
    errors = [msg for level, msg in res["log"] if level == "ERROR"]
    assert errors == [f"stopping: reward-hacking guard ({EXPECTED})"], res["log"]


def test_warn_logs_the_message_and_keeps_training(runs):
    res = runs["warn"]
    assert res["code"] == 0 and res["step"] == 4
    assert res["ckpts"] == ["latest", "step_4"]  # only the final save
    warnings = [msg for level, msg in res["log"] if "reward-hacking guard" in msg]
    assert warnings[0] == f"reward-hacking guard: {EXPECTED}"
    assert len(warnings) == 3  # steps 2, 3 and 4 all show the pattern
    assert all(level == "WARNING" for level, msg in res["log"] if "reward-hacking guard" in msg)


def test_off_says_nothing(runs):
    res = runs["off"]
    assert res["code"] == 0 and res["step"] == 4
    assert not [msg for _, msg in res["log"] if "reward-hacking guard" in msg]


def test_reward_rising_while_the_gold_metric_falls_stops_the_run(runs):
    """Evaluations at steps 1-4 (window 2, tolerance 0.05): step 3 compares 0.50 -> 0.45
    (a drop of 0.05, not more than the tolerance), step 4 compares 0.55 -> 0.30: stop."""
    res = runs["gold"]
    assert all("eval/reward" in keys and "eval/accuracy" in keys for keys in res["seen"]), res["seen"]
    assert res["code"] == 3 and res["step"] == 4, res
    assert [e["step"] for e in res["state"]["guard"]["evals"]] == [2, 3, 4]
    errors = [msg for level, msg in res["log"] if level == "ERROR"]
    assert errors == ["stopping: reward-hacking guard (eval/reward rose 0.4000->0.8000 while the "
                      "gold metric eval/accuracy fell 0.5500->0.3000 (more than "
                      "guards.gold_min_drop=0.05) between the evaluations at steps 2 and 4: the "
                      "reward no longer tracks the metric it stands for (reward hacking / RM "
                      "over-optimisation))"], res["log"]


def test_each_evaluation_writes_its_responses_and_they_give_the_logged_metrics(runs):
    """``<exp_dir>/eval_samples/step_<n>.jsonl``: one row per held-out prompt for the
    initial policy and every evaluated step; averaging its columns gives the step's
    ``eval/*`` metrics as logged (before this test's replacement of two of them)."""
    res = runs["gold"]
    assert sorted(res["samples"]) == [0, 1, 2, 3, 4]
    for step, metrics in res["real"].items():
        rows = res["samples"][step]
        assert len(rows) == min(res["n_eval"], 200) > 0
        assert all(isinstance(r["prompt"], str) and isinstance(r["response"], str) for r in rows)
        mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
        assert mean("correct") == pytest.approx(metrics["eval/accuracy"])
        assert mean("score") == pytest.approx(metrics["eval/reward"])
        assert mean("length") == pytest.approx(metrics["eval/response_length"])


# (eval/reward, eval/accuracy) of the two held-out evaluations of a 2-step run (steps 0 and
# 2): the issue-54 run's numbers, reward +1.006 (guards.proxy_min_rise=1.0) while accuracy
# moved +0.005 (guards.gold_min_gain=0.01)
FLAT = {0: (-0.770, 0.140), 2: (0.236, 0.145)}
FLAT_MESSAGE = ("eval/reward rose -0.7700->0.2360 (more than guards.proxy_min_rise=1.0) while the "
                "gold metric eval/accuracy went 0.1400->0.1450 (less than guards.gold_min_gain="
                "0.01) between the evaluations at steps 0 and 2: the reward rises without the "
                "quality it stands for (RM over-optimisation, or a reward that does not measure "
                "the task)")


def _run_two_evaluations(tmp: Path, action: str) -> dict:
    """Real steps and the real evaluations at steps 0 and 2 (the only two: the recipe's
    ``guards.gold_window=1`` compares the end with step 0); their reward and accuracy then
    replaced by ``FLAT``."""
    from nemo_rlhf.train_ppo import build

    data = make_demo_data(tmp / "data")
    exp = tmp / f"flat_{action}"
    cfg = compose_ppo(data, exp, "trainer.max_steps=2", "exp_manager.save_interval=0",
                      "trainer.val_check_interval=2", f"guards.action={action}",
                      "guards.window=1", "guards.max_length_growth=1000",
                      "guards.max_repetition=1.0", "guards.kl_ceiling=1000",
                      "guards.gold_window=1", "guards.gold_min_gain=0.01",
                      "guards.proxy_min_rise=1.0", "guards.gold_min_drop=1.0")
    trainer = build(cfg)
    real_evaluate, evaluated = trainer.evaluate, []

    def flat_evaluate():
        metrics = real_evaluate()
        evaluated.append(trainer.step)
        reward, accuracy = FLAT[trainer.step]
        metrics.update({"eval/reward": reward, "eval/accuracy": accuracy})
        return metrics

    trainer.evaluate = flat_evaluate
    code, lines = _fit_recording(trainer)
    ckpts = exp / "checkpoints"
    state = json.loads((ckpts / (ckpts / "latest").read_text().strip() / "trainer_state.json").read_text())
    return {"code": code, "step": trainer.step, "evaluated": evaluated, "state": state, "log": lines}


def _worker_two_evaluations(rank: int, tmp: str) -> dict:
    tmp = Path(tmp)
    return {action: _run_two_evaluations(tmp, action) for action in ("warn", "stop")}


@pytest.fixture(scope="module")
def two_evaluations(tmp_path_factory):
    return run_ranks(_worker_two_evaluations, world_size=1,
                     tmp=str(tmp_path_factory.mktemp("guards_flat")))[0]


def test_the_step_0_evaluation_reaches_the_guard_warn(two_evaluations):
    """Two evaluations a run (steps 0 and 2), reward up and accuracy flat: the guard,
    having seen step 0's, warns at step 2 and the run goes on to its end (issue 54: the
    step-0 evaluation was logged but never handed to the guard, which stayed silent)."""
    res = two_evaluations["warn"]
    assert res["evaluated"] == [0, 2]
    assert res["code"] == 0 and res["step"] == 2
    assert [e["step"] for e in res["state"]["guard"]["evals"]] == [0, 2]
    # the step-0 evaluation is not a training step of the window checks
    assert [h["step"] for h in res["state"]["guard"]["history"]] == [1, 2]
    assert res["log"] == [("WARNING", f"reward-hacking guard: {FLAT_MESSAGE}")], res["log"]


def test_the_step_0_evaluation_reaches_the_guard_stop(two_evaluations):
    res = two_evaluations["stop"]
    assert res["code"] == 3 and res["step"] == 2
    errors = [msg for level, msg in res["log"] if level == "ERROR"]
    assert errors == [f"stopping: reward-hacking guard ({FLAT_MESSAGE})"], res["log"]
