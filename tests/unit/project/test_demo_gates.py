"""launchers/gates.py (issue 53): the intervals against hand-computed values, the RM gate's
refusal and its message, the PPO verdict's fields, and the recipe driving them with its
stages faked (tests/unit/project/test_demo_recipe.py's FakeStages: no model runs)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

import launchers.demo as demo
import launchers.gates as gates
import launchers.stages as stages
from launchers.recipe import kl_target_for_task
from tests.unit.project.test_demo_recipe import FakeStages, _custom

Z2 = gates.Z95 ** 2  # 3.841459


@pytest.fixture(autouse=True)
def _forget_the_task_module():
    """_custom's task module is written to each test's tmp_path: drop the imported one after
    each test, so the next test (here or in test_demo_recipe.py) imports its own."""
    yield
    sys.modules.pop("pkg_upper_task", None)


# --- intervals ---------------------------------------------------------------------------

def test_wilson_interval_matches_the_hand_computed_values():
    # 0 of 10: low 0, high z^2 / (n + z^2) = 3.841459 / 13.841459
    assert gates.wilson_interval(0, 10) == pytest.approx((0.0, Z2 / (10 + Z2)), abs=1e-12)
    assert gates.wilson_interval(0, 10)[1] == pytest.approx(0.277533, abs=1e-6)
    # 5 of 10: centre 0.5, half width z sqrt(n/4 + z^2/4) / (n + z^2) = 1.959964 * 1.860224 / 13.841459
    lo, hi = gates.wilson_interval(5, 10)
    assert (lo, hi) == pytest.approx((0.236593, 0.763407), abs=1e-6)
    # 11 of 19 (issue 53's RM: 57.9%): includes 50%
    lo, hi = gates.wilson_interval(11, 19)
    assert lo < 0.5 < hi and (lo, hi) == pytest.approx((0.362759, 0.768581), abs=1e-6)
    # 10 of 10: symmetric to 0 of 10
    assert gates.wilson_interval(10, 10) == pytest.approx((1 - Z2 / (10 + Z2), 1.0), abs=1e-12)
    assert gates.wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="k=11, n=10"):
        gates.wilson_interval(11, 10)


def test_paired_difference_interval_matches_the_hand_computed_values():
    # 10 items, 5 right and 5 wrong both times (r=5, s=t=0, u=5): D=0, both Wilson intervals
    # [0.236593, 0.763407] (half width 0.263407); B = ru - st = 25 > n/2 = 5, so C = 20 and
    # phi = 20 / sqrt(5*5*5*5) = 0.8; half width = 0.263407 * sqrt(2 - 2*0.8) = 0.166593
    d, lo, hi = gates.paired_difference_interval([1] * 5 + [0] * 5, [1] * 5 + [0] * 5)
    assert (d, lo, hi) == pytest.approx((0.0, -0.166593, 0.166593), abs=1e-6)
    # all 10 wrong before and right after: D = 1, (t+u) = 0 so phi = 0;
    # low = 1 - sqrt(0.277533^2 + 0.277533^2) = 0.607509, high capped at 1
    d, lo, hi = gates.paired_difference_interval([0] * 10, [1] * 10)
    assert (d, lo, hi) == pytest.approx((1.0, 1 - math.sqrt(2) * Z2 / (10 + Z2), 1.0), abs=1e-12)
    assert lo == pytest.approx(0.607509, abs=1e-6)
    # 4 items: r=1 (both), s=2 (only after), t=0, u=1: p1=3/4, p2=1/4, D=0.5;
    # B = 1*1 - 0 = 1 <= n/2 = 2, so phi = 0 (the continuity correction)
    before, after = [1, 0, 0, 0], [1, 1, 1, 0]
    l1, u1 = gates.wilson_interval(3, 4)
    l2, u2 = gates.wilson_interval(1, 4)
    d, lo, hi = gates.paired_difference_interval(before, after)
    assert d == 0.5
    assert lo == pytest.approx(0.5 - math.hypot(0.75 - l1, u2 - 0.25), abs=1e-12)
    assert hi == pytest.approx(0.5 + math.hypot(0.25 - l2, u1 - 0.75), abs=1e-12)
    with pytest.raises(ValueError, match="3 items before and 2 after"):
        gates.paired_difference_interval([1, 0, 1], [1, 0])


# --- the RM gate -------------------------------------------------------------------------

def _flags_of_demo(capsys) -> str:
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    return capsys.readouterr().out


def test_the_rm_gate_refuses_an_rm_whose_interval_includes_chance_and_says_what_to_change(capsys):
    """Issue 53's run: 57.9% on 19 natural held-out pairs after SFT: refused, with a
    remedy per lever, each a flag the demo has."""
    g = gates.rm_gate(11 / 19, 19, 10, reward="rm", custom_task=True, has_edit_answer=True, sft_steps=50)
    assert not g.passed and g.fields["passed"] is False and g.fields["interval"] == "wilson"
    assert g.fields["ci95"] == pytest.approx([0.362759, 0.768581], abs=1e-6)
    assert "includes 50%" in g.message and "[36.3, 76.9]%" in g.message
    assert f"exit status {gates.RM_GATE_EXIT}" in g.message
    flags = ["--sft-steps", "--sft-rows", "--sft-more-rounds", "--rm-samples-per-prompt", "--rm-prompts", "--rm-val-prompts",
             "--rm-edit-pairs", "--reward checker", "--force"]
    for flag in flags:
        assert flag in g.message, flag
    help_text = _flags_of_demo(capsys)
    for flag in flags:
        assert flag.split()[0] in help_text, flag  # the message names only options that exist
    assert "{rm,checker,both}" in help_text


def test_the_rm_gate_refuses_too_few_natural_heldout_pairs_even_at_a_high_accuracy():
    g = gates.rm_gate(1.0, 8, 20, reward="rm", custom_task=False, has_edit_answer=False)
    assert not g.passed and "8 natural held-out pairs, fewer than the 20" in g.message
    assert "--rm-min-heldout-pairs" in g.message
    assert "--sft-steps" not in g.message  # no SFT ran (and the default task has no such flag)
    assert "Task.edit_answer" in g.message  # --rm-edit-pairs does nothing without it


def test_the_rm_gate_refuses_an_rm_that_logged_no_accuracy():
    g = gates.rm_gate(None, 40, 20, reward="both", custom_task=True, has_edit_answer=True)
    assert not g.passed and "logged no held-out pair accuracy" in g.message and g.fields["ci95"] is None


def test_the_rm_gate_passes_the_default_demos_rm_and_only_reports_with_the_checker_reward():
    # docs/demo.md: 27 of 28 natural held-out pairs (96.4%)
    g = gates.rm_gate(27 / 28, 28, 20, reward="rm", custom_task=False, has_edit_answer=True)
    assert g.passed and g.fields["ci95"][0] > 0.5 and "PPO may train against it" in g.message
    g = gates.rm_gate(0.5, 40, 20, reward="checker", custom_task=True, has_edit_answer=True)
    assert g.passed and g.fields["rm_passed"] is False and g.fields["applies"] is False
    assert "--reward checker" in g.message


def test_the_recipe_exits_with_the_gates_status_and_starts_no_ppo(tmp_path, monkeypatch, capsys):
    """The default task, its RM at 55% on its natural held-out pairs: no PPO stage, exit
    status 3, the message and the gate in summary.json; ``--force`` runs PPO."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5, rm_accuracy=0.55)
    argv = ["--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--precision", "32"]
    assert demo.main(argv) == gates.RM_GATE_EXIT
    assert fake.ppo == []
    text = capsys.readouterr().out
    assert "RM gate: held-out natural pair accuracy 55.0%" in text and "PPO is not started" in text
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["rm_gate"]["passed"] is False and s["exit_status"] == gates.RM_GATE_EXIT
    assert s["rm_gate"]["natural_heldout_pairs"] == s["rm_pairs"]["val"] >= 20
    assert s["rm_gate"]["ci95"][0] < 0.5 < s["rm_gate"]["ci95"][1]
    assert demo.main([*argv, "--force"]) == 0
    assert len(fake.ppo) == 1 and "--force: PPO trains against this RM anyway" in capsys.readouterr().out
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["rm_gate"]["forced"] is True and "verdict" in s


def test_after_sft_a_refused_run_reports_the_sft_models_heldout_exact_match(tmp_path, monkeypatch, capsys):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.0 if ckpt.endswith("/model/checkpoints/step_0") else 0.5,
                      rm_accuracy=0.5)
    argv = [a for a in _custom(tmp_path, monkeypatch) if a != "--force"]
    assert demo.main(argv) == gates.RM_GATE_EXIT and fake.ppo == []
    text = capsys.readouterr().out
    assert "--sft-steps (now 7)" in text  # SFT came first: more SFT is a remedy
    assert "after SFT: 12 of 24 sampled answers to the RM prompts right (50.0%, 95% Wilson interval" in text
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    held = s["sft_heldout"]
    assert (held["exact_match"], held["heldout_problems"], held["interval"]) == (0.5, 4, "wilson")
    assert held["ci95"] == pytest.approx(list(gates.wilson_interval(2, 4)))


# --- the PPO verdict ---------------------------------------------------------------------

def _eval_rows(exp: Path, step: int, correct: list) -> None:
    (exp / "eval_samples").mkdir(parents=True, exist_ok=True)
    (exp / "eval_samples" / f"step_{step:06d}.jsonl").write_text("".join(
        json.dumps({"prompt": f"p{i}", "response": "r", "correct": float(c), "length": 3}) + "\n"
        for i, c in enumerate(correct)))


def test_the_verdict_states_the_gain_with_its_paired_interval_the_kl_band_and_the_auc_trend(tmp_path):
    exp = tmp_path / "ppo"
    _eval_rows(exp, 0, [0] * 10)
    _eval_rows(exp, 10, [1] * 10)
    kl = {"final_kl_mean": 1.28, "kl_type": "pi", "kl_target": 6.0, "final_kl_to_target": 0.21}
    v = gates.ppo_verdict(gates.heldout_correct(exp, 0), gates.heldout_correct(exp, 10), kl, {0: 0.66, 10: 0.62})
    assert v["gain"] == "gain" and v["gain_points"] == 100.0 and v["heldout_problems"] == 10
    assert v["gain_ci95_points"] == pytest.approx([60.7509, 100.0], abs=1e-4)
    assert (v["kl_position"], v["kl_band"]) == ("below", [0.5, 1.5]) and v["kl_to_target"] == pytest.approx(1.28 / 6)
    assert (v["reward_auc_first"], v["reward_auc_last"], v["reward_auc_trend"]) == (0.66, 0.62, "falling")
    assert v["reward_auc_change"] == pytest.approx(-0.04)
    assert v["line"] == ("verdict: gain: held-out 0.0% -> 100.0% (+100.0 points, 95% CI [+60.8, +100.0], paired "
                         "over 10 problems); final kl_mean 1.28 = 0.21x kl.target 6, below the band 0.5-1.5x; "
                         "reward's right-vs-wrong AUC 0.66 -> 0.62 (falling)")
    # issue 53's outcome: a half-point gain is no measurable change; KL in band; AUC flat
    _eval_rows(exp, 10, [0] * 9 + [1])
    v = gates.ppo_verdict(gates.heldout_correct(exp, 0), gates.heldout_correct(exp, 10),
                          {**kl, "final_kl_mean": 6.3}, {0: 0.70, 10: 0.71})
    assert (v["gain"], v["kl_position"], v["reward_auc_trend"]) == ("no measurable change", "in", "flat")
    # the reward is the checker (--reward checker): its AUC is 1 by construction, not a trend;
    # the rollout reward's first / last 10 steps are averaged (at most half the steps each)
    rewards = {k: 0.4 + 0.01 * k for k in range(1, 25)}  # steps 1-10: 0.455; 15-24: 0.595
    v = gates.ppo_verdict(gates.heldout_correct(exp, 0), gates.heldout_correct(exp, 10), kl, {0: 1.0, 10: 1.0},
                          reward_by_step=rewards, reward_is_checker=True)
    assert (v["reward_auc_first"], v["reward_auc_trend"]) == (None, "n/a: the reward is the checker")
    assert (v["rollout_reward_first"], v["rollout_reward_last"], v["rollout_reward_window"]) == (
        pytest.approx(0.455), pytest.approx(0.595), 10)
    assert v["line"].endswith("reward AUC n/a (the reward is the checker: 1.00 by construction); "
                              "rollout reward 0.455 -> 0.595 (mean of the first / last 10 steps)")
    v = gates.ppo_verdict(None, None, {}, {}, before_accuracy=0.25, after_accuracy=0.5,
                          reward_by_step={1: 0.2, 2: 0.3, 3: 0.7})  # 3 steps: one at each end
    assert (v["rollout_reward_first"], v["rollout_reward_last"], v["rollout_reward_window"]) == (0.2, 0.7, 1)
    # no per-problem rows: the point gain, no interval
    v = gates.ppo_verdict(None, None, {}, {}, before_accuracy=0.25, after_accuracy=0.5)
    assert (v["gain"], v["gain_points"], v["gain_ci95_points"], v["kl_position"], v["reward_auc_trend"]) == (
        "unmeasured", 25.0, None, "n/a", "n/a")


def test_the_verdict_and_the_defaults_are_in_summary_json(tmp_path, monkeypatch, capsys):
    """The recipe on a custom task (stages faked; the PPO run's eval files written as the
    trainer writes them): summary.json's ``verdict`` has its machine-readable fields and
    the line printed; ``defaults`` each have a value and a reason, printed one a line."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    real_ppo = fake.ppo_stage

    def ppo_stage(ppo_args, rm, ppo_exp, config_name, nproc, max_steps):
        real_ppo(ppo_args, rm, ppo_exp, config_name, nproc, max_steps)
        _eval_rows(ppo_exp, 0, [0, 0, 1, 0])
        _eval_rows(ppo_exp, max_steps, [1, 1, 1, 0])
        with (ppo_exp / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": 0, "eval/reward_auc": 0.6}) + "\n")
            f.write(json.dumps({"step": max_steps, "eval/reward_auc": 0.8}) + "\n")
            for step in range(1, max_steps + 1):  # the trainer's rollout reward, one row a step
                f.write(json.dumps({"step": step, "reward_raw_mean": 0.5}) + "\n")

    monkeypatch.setattr(stages, "ppo_stage", ppo_stage)
    assert demo.main(_custom(tmp_path, monkeypatch)) == 0
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    v = s["verdict"]
    for key in ("gain", "gain_points", "gain_ci95_points", "gain_interval", "heldout_problems", "final_kl_mean",
                "kl_target", "kl_band", "kl_position", "reward_auc_first", "reward_auc_last", "reward_auc_trend",
                "rollout_reward_first", "rollout_reward_last", "rollout_reward_window", "line"):
        assert key in v, key
    assert (v["rollout_reward_first"], v["rollout_reward_last"]) == (0.5, 0.5)
    assert (v["gain_points"], v["heldout_problems"], v["reward_auc_trend"]) == (50.0, 4, "rising")
    assert v["gain"] == "no measurable change"  # 4 problems: the interval is wide
    assert (v["final_kl_mean"], v["kl_target"], v["kl_position"]) == (6.3012, 6.0, "in")
    text = capsys.readouterr().out
    assert v["line"] in text and v["line"].startswith("verdict: no measurable change: held-out 25.0% -> 75.0%")
    d = s["defaults"]
    assert {"precision", "rm_epochs", "max_new_tokens", "ppo_config", "rm_steps", "kl.target"} <= set(d)
    assert d["precision"] == {"value": "32", "reason": "the tiny model's default"}
    for key, entry in d.items():
        assert entry["reason"] and f"default: {key} = {entry['value']} ({entry['reason']})" in text


# --- the KL target scaled by the task's response length ----------------------------------

def test_kl_target_for_task_keeps_the_per_token_budget():
    assert kl_target_for_task(6.0, 14.385, 14.385) == 6.0
    assert kl_target_for_task(6.0, 3.0, 14.385) == 1.25  # 6 * 3 / 14.385 = 1.2513
    assert kl_target_for_task(1.0, 2.0, 5.05) == 0.4  # 2 / 5.05 = 0.396
    assert kl_target_for_task(1.0, 0.0, 5.05) == 0.2  # at least one token: 1 / 5.05
    with pytest.raises(ValueError, match="reference_length=0"):
        kl_target_for_task(6.0, 3.0, 0)


def test_a_custom_tasks_kl_target_scales_with_its_response_length_and_the_users_wins(tmp_path, monkeypatch, capsys):
    """FakeStages' samples are 2 tokens long; the tiny profile's target 1.0 was measured at
    5.05 tokens: kl.target=0.4 in the PPO job, before the user's overrides."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_custom(tmp_path, monkeypatch)) == 0
    args = fake.ppo[0]["args"]
    assert "kl.target=0.4" in args
    assert "mean length of the policy's 24 RM samples" in capsys.readouterr().out
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    argv = _custom(tmp_path, monkeypatch)
    argv[argv.index("--out") + 1] = str(tmp_path / "out2")
    assert demo.main([*argv, "kl.target=2.5"]) == 0
    args = fake.ppo[0]["args"]
    assert [a for a in args if a.startswith("kl.target=")] == ["kl.target=2.5"]
    s = json.loads((tmp_path / "out2" / "summary.json").read_text())
    assert s["defaults"]["kl.target"] == {"value": "2.5", "reason": "your override"}


def test_the_default_task_keeps_its_measured_kl_target(tmp_path, monkeypatch):
    """No kl.target override in the default demo's PPO job (conf/ppo_smollm2.yaml's 6, the
    schema's): the five-seed table's command line (test_demo_recipe's stage-command test)."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(["--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--precision", "32"]) == 0
    assert not [a for a in fake.ppo[0]["args"] if a.startswith("kl.")]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["defaults"]["kl.target"]["value"] == 6.0


# --- the prompt-length check (before any stage samples or trains) -------------------------

def test_prompt_token_lengths_lay_the_prompt_out_as_the_jobs_do(tmp_path):
    """The tiny profile's character tokenizer: [BOS] + one token a character, no template."""
    from launchers.tiny_model import write_tiny_tokenizer

    tok = write_tiny_tokenizer(tmp_path / "tokenizer")
    assert gates.prompt_token_lengths(tok, ["Upper: ant ->", "ab"], None, None) == [14, 3]


LONG_TASK_MODULE = '''
from nemo_rlhf.tasks.task import Task

PROBLEMS = [{"word": w, "answer": w.upper()} for w in ("ant bee cat dog eel fox gnu hen ibis jay kiwi "
                                                        "lark mole newt owl pig").split()]
TASK = Task(name="upper_long", train=PROBLEMS[4:], heldout=PROBLEMS[:4],
            prompt_template="Write the word {word} in capital letters, please. Answer with the word.",
            check=lambda p, r, ex: r == ex["answer"], demonstrate=lambda p, ex: ex["answer"])
'''


def test_a_task_whose_prompts_do_not_fit_is_refused_before_any_stage_naming_the_key(tmp_path, monkeypatch):
    """Issue 53: the docs' sorting task as written lost all 2000 SFT rows as overlong and
    stopped with SFT's `ValueError: the dataset is empty` after 107 s."""
    (tmp_path / "pkg_long_task.py").write_text(LONG_TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.0)
    argv = _custom(tmp_path, monkeypatch)
    argv[argv.index("--task") + 1] = "pkg_long_task:TASK"
    try:
        with pytest.raises(SystemExit) as err:
            demo.main(argv)
    finally:
        sys.modules.pop("pkg_long_task", None)
    msg = str(err.value)
    # the longest prompt: "ibis" (the longest word): [BOS] + 69 characters
    assert "the longest, line " in msg and "Write the word ibis in capital letters" in msg
    assert "is 70 tokens after the chat template (none)" in msg
    assert "with max_new_tokens 8 (the tiny profile's) needs 78 > data.max_seq_length 64" in msg
    assert "16 prompts are longer than 56 tokens" in msg and "Task.max_new_tokens" in msg
    assert fake.modules() == ["launchers.recipe"]  # only the model set-up: no sampling, SFT or RM
    assert fake.ppo == []


# --- the RM gate's AUC on the policy's held-out samples (what PPO will score) -------------

def test_auc_and_its_hanley_mcneil_interval_match_the_hand_computed_values():
    # right scores {1, 2}, wrong {1, 0}: 1 vs 1 a tie (1/2), 1 vs 0, 2 vs 1, 2 vs 0: 3.5 / 4
    assert gates.auc_from_scores([1.0, 1.0, 0.0, 2.0], [True, False, False, True]) == 0.875
    assert gates.auc_from_scores([3.0, 1.0], [False, True]) == 0.0
    assert gates.auc_from_scores([1.0, 2.0], [True, True]) is None
    # A = 0.75, 10 right, 20 wrong: Q1 = 0.75/1.25 = 0.6, Q2 = 2*0.5625/1.75 = 0.642857;
    # (0.1875 + 9*0.0375 + 19*0.080357) / 200 = 0.0102589, SE = 0.101286
    assert gates.hanley_mcneil_se(0.75, 10, 20) == pytest.approx(0.101286, abs=1e-6)
    assert gates.hanley_mcneil_se(0.5, 1, 1) == pytest.approx(math.sqrt(0.25), abs=1e-12)  # n1 = n2 = 1: A(1-A) alone
    with pytest.raises(ValueError, match="n_right=0"):
        gates.hanley_mcneil_se(0.7, 0, 5)
    rows = ([{"correct": 1.0, "rm_score": s} for s in (0.9, 0.8, 0.1)]
            + [{"correct": 0.0, "rm_score": s} for s in (0.5, 0.2, 0.0, float("nan"))] + [{"correct": 1.0}])
    r = gates.rm_auc(rows)  # the NaN and the unscored row are left out: 3 right, 3 wrong
    assert (r["n_right"], r["n_wrong"]) == (3, 3) and r["auc"] == pytest.approx(7 / 9)
    se = gates.hanley_mcneil_se(7 / 9, 3, 3)
    assert r["se"] == pytest.approx(se) and r["ci95"] == pytest.approx([7 / 9 - gates.Z95 * se, 1.0])


def test_the_rm_gate_refuses_an_rm_good_on_its_pairs_whose_auc_interval_includes_chance():
    """Issue 53's sorting RM: 64.4% on 59 natural held-out pairs passed the pair check, and
    its right-vs-wrong AUC on the SFT policy's answers was 0.47 at PPO's step 0."""
    auc = {"auc": 0.47, "n_right": 35, "n_wrong": 165, "se": gates.hanley_mcneil_se(0.47, 35, 165),
           "interval": "hanley-mcneil (Hanley & McNeil 1982)"}
    auc["ci95"] = [0.47 - gates.Z95 * auc["se"], 0.47 + gates.Z95 * auc["se"]]
    assert gates.rm_gate(38 / 59, 59, 20, reward="rm", custom_task=True, has_edit_answer=True).passed  # pairs only
    g = gates.rm_gate(38 / 59, 59, 20, reward="rm", custom_task=True, has_edit_answer=True, sft_steps=200, auc=auc)
    assert not g.passed and g.fields["passed"] is False and g.fields["reward_auc"] == auc
    assert "right-vs-wrong AUC on the policy's held-out samples is 0.47" in g.message
    assert "35 right and 165 wrong sampled answers" in g.message and "not above 0.5" in g.message
    assert f"exit status {gates.RM_GATE_EXIT}" in g.message
    for flag in ("--sft-steps", "--rm-edit-pairs", "--reward checker", "--force"):
        assert flag in g.message, flag
    unmeasurable = {**auc, "auc": None, "se": None, "ci95": None, "n_right": 0}
    g = gates.rm_gate(38 / 59, 59, 20, reward="rm", custom_task=True, has_edit_answer=True, auc=unmeasurable)
    assert not g.passed and "not measurable (0 right and 165 wrong" in g.message
    good = {**auc, "auc": 0.82, "se": 0.04, "ci95": [0.74, 0.90]}
    g = gates.rm_gate(38 / 59, 59, 20, reward="rm", custom_task=True, has_edit_answer=True, auc=good)
    assert g.passed and "is 0.82 (95% Hanley-McNeil interval [0.74, 0.90]" in g.message


def test_a_policy_already_mostly_right_is_not_told_to_do_more_sft(capsys):
    """Issue 53's sorting run (seed 1): SFT reached 97.0% held-out, 240 of 256 sampled
    held-out answers right, so 3 more sampling rounds found 6 natural held-out pairs: more
    SFT would make wrong answers, each pair's other half, rarer still. The remedy names the
    levers that add wrong answers or prompts (--rm-temperature, --rm-val-prompts,
    --rm-samples-per-prompt) and the headroom; with mostly wrong answers more SFT stays."""
    auc = {"auc": 0.41, "n_right": 240, "n_wrong": 16, "se": gates.hanley_mcneil_se(0.41, 240, 16),
           "interval": "hanley-mcneil (Hanley & McNeil 1982)"}
    auc["ci95"] = [0.41 - gates.Z95 * auc["se"], 0.41 + gates.Z95 * auc["se"]]
    g = gates.rm_gate(0.5, 6, 20, reward="rm", custom_task=True, has_edit_answer=True, sft_steps=600, auc=auc)
    assert not g.passed
    assert not any(r.startswith("more SFT") or "--sft-steps" in r for r in g.fields["remedies"])
    assert "not more SFT: 240 of 256 sampled held-out answers (93.8%) are already right" in g.message
    for flag in ("--rm-temperature", "--rm-val-prompts", "--rm-samples-per-prompt", "--reward checker"):
        assert flag in g.fields["remedies"][0], flag
    help_text = _flags_of_demo(capsys)
    assert "--rm-temperature" in help_text
    mostly_wrong = {**auc, "n_right": 103, "n_wrong": 153}  # precedence, seed 1
    g = gates.rm_gate(25 / 36, 36, 20, reward="rm", custom_task=True, has_edit_answer=True, sft_steps=600,
                      auc=mostly_wrong)
    assert g.fields["remedies"][0].startswith("more SFT first")


def test_the_recipe_refuses_ppo_against_an_rm_whose_auc_on_its_heldout_samples_is_not_above_chance(
        tmp_path, monkeypatch, capsys):
    """The default task's fake RM: 90% on its natural held-out pairs (the pair check passes)
    but it scores each prompt's wrong samples above its right ones (AUC 0): exit 3, no PPO;
    the AUC's draw is the held-out RM prompts' sampled as the RM's held-out samples, scored
    by the RM PPO would take; --force runs PPO with the gate recorded."""
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    fake.rm_score = lambda ok, k: float(k)  # samples 0, 1 right, 2, 3 wrong: the wrong score higher
    argv = ["--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--precision", "32"]
    assert demo.main(argv) == gates.RM_GATE_EXIT and fake.ppo == []
    (auc_cmd,) = [c for c in fake.cmds if any(x.startswith("rm_checkpoint=") for x in c)]
    assert f"rm_checkpoint={tmp_path}/out/rm/checkpoints/step_1" in auc_cmd
    assert f"data={tmp_path}/data/rm_val_prompts.jsonl" in auc_cmd and "temperature=0.7" in auc_cmd
    assert "num_samples=4" in auc_cmd and "checkpoint=/MODEL/step_0" in auc_cmd
    text = capsys.readouterr().out
    assert "RM gate: held-out natural pair accuracy 90.0%" in text and "is 0.00 (95% Hanley-McNeil" in text
    assert "PPO is not started" in text
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["rm_gate"]["passed"] is False and s["exit_status"] == gates.RM_GATE_EXIT
    assert s["rm_gate"]["reward_auc"]["auc"] == 0.0 and "not above 0.5" in s["rm_gate"]["reason"]
    assert s["rm_gate"]["reward_auc"]["n_right"] == s["rm_gate"]["reward_auc"]["n_wrong"] > 0
    n = len(fake.cmds)
    assert demo.main([*argv, "--force"]) == 0 and len(fake.ppo) == 1
    assert len(fake.cmds) == n  # the AUC's samples were scored by this RM: reused, not drawn again
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["rm_gate"]["forced"] is True and s["rm_gate"]["reward_auc"]["auc"] == 0.0


def test_with_the_checker_reward_the_rms_auc_is_not_measured(tmp_path, monkeypatch):
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    fake.rm_score = lambda ok, k: float(k)
    argv = ["--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--precision", "32",
            "--reward", "checker"]
    assert demo.main(argv) == 0 and len(fake.ppo) == 1
    assert not [c for c in fake.cmds if any(x.startswith("rm_checkpoint=") for x in c)]


def test_a_tiny_model_task_runs_ppo_with_the_pi_kl_controller_and_the_users_wins(tmp_path, monkeypatch):
    """conf/ppo_tiny.yaml's adaptive rule (horizon 2000) barely moves beta in a run: issue
    53's sorting run ended at kl_mean 2.89x its scaled target. The tiny profile's PPO job
    gets kl.type=pi, before the user's overrides; the choice is in summary.json's defaults."""
    from tests.conf_helpers import typed_job

    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    assert demo.main(_custom(tmp_path, monkeypatch)) == 0
    args = fake.ppo[0]["args"]
    assert [a for a in args if a.startswith("kl.type=")] == ["kl.type=pi"]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["defaults"]["kl.type"]["value"] == "pi" and "tiny profile's" in s["defaults"]["kl.type"]["reason"]
    cfg = typed_job("ppo_tiny", [a for a in args if a.startswith(("kl.", "reward.normalization", "guards."))])
    assert cfg.kl.type == "pi" and cfg.kl.target == 0.4  # the schema takes it with the scaled target
    fake = FakeStages(monkeypatch, right=lambda ckpt: 0.5)
    argv = _custom(tmp_path, monkeypatch)
    argv[argv.index("--out") + 1] = str(tmp_path / "out2")
    assert demo.main([*argv, "kl.type=adaptive"]) == 0
    args = fake.ppo[0]["args"]
    assert [a for a in args if a.startswith("kl.type=")] == ["kl.type=adaptive"]
    s = json.loads((tmp_path / "out2" / "summary.json").read_text())
    assert s["defaults"]["kl.type"] == {"value": "adaptive", "reason": "your override"}
