"""The arithmetic demo task: precedence, mistakes, determinism, held-out disjointness,
idempotent writing, and the make_demo_data tool."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_rlhf.data.datasets import DataConfig, load_preference_dataset, load_prompt_dataset, load_sft_dataset
from nemo_rlhf.tasks.precedence import (
    DemoTaskConfig,
    build_demo_files,
    left_to_right,
    make_demo_dataset,
    mistake,
    parse_prompt,
    solve,
)
from nemo_rlhf.data.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[3]
SMALL = DemoTaskConfig(seed=3, n_sft=300, n_pref=300, n_ppo=100, n_eval=50, n_val=40)


def _rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_solve_applies_precedence_and_left_to_right_is_the_classic_mistake():
    assert solve(3, "+", 3, "*", 6) == 21 and left_to_right(3, "+", 3, "*", 6) == 36
    assert solve(2, "-", 5, "*", 1) == -3 and solve(8, "*", 4, "+", 4) == 36
    assert solve(9, "-", 4, "-", 4) == 1 and solve(9, "*", 9, "*", 9) == 729
    assert parse_prompt("3+3*6=") == (3, "+", 3, "*", 6)
    with pytest.raises(ValueError):
        parse_prompt("33+1=")


def test_mistakes_are_always_wrong_and_of_the_three_kinds():
    rng = random.Random(0)
    kinds = set()
    for a in range(10):
        for op in "+-*":
            for c in range(10):
                e = (a, op, 7, "*", c)
                wrong, kind = mistake(e, rng)
                assert wrong != solve(*e)
                kinds.add(kind)
                if kind == "left_to_right":
                    assert wrong == left_to_right(*e)
    assert kinds == {"left_to_right", "off_by_one", "digit_swap"}


def test_files_are_deterministic_in_the_seed_and_change_with_it():
    assert build_demo_files(SMALL) == build_demo_files(SMALL)
    other = build_demo_files(DemoTaskConfig(**{**SMALL.__dict__, "seed": 4}))
    assert other["sft.jsonl"] != build_demo_files(SMALL)["sft.jsonl"]


def test_eval_prompts_are_disjoint_from_every_training_and_validation_prompt():
    files = build_demo_files(SMALL)
    evals = {r["prompt"] for r in _rows(files["eval.jsonl"])}
    assert len(evals) == SMALL.n_eval
    others = set()
    for name in ("sft.jsonl", "preference.jsonl", "ppo_prompts.jsonl", "sft_val.jsonl"):
        others |= {r["prompt"] for r in _rows(files[name])}
    assert not evals & others
    val = {r["prompt"] for r in _rows(files["sft_val.jsonl"])}
    train = {r["prompt"] for n in ("sft.jsonl", "preference.jsonl", "ppo_prompts.jsonl")
             for r in _rows(files[n])}
    assert not val & train


def test_answers_chosen_and_noise_follow_the_config():
    files = build_demo_files(SMALL)
    for r in _rows(files["eval.jsonl"]) + _rows(files["ppo_prompts.jsonl"]):
        assert int(r["answer"]) == solve(*parse_prompt(r["prompt"]))
    for r in _rows(files["preference.jsonl"]):
        assert int(r["chosen"]) == solve(*parse_prompt(r["prompt"])) != int(r["rejected"])
    sft = _rows(files["sft.jsonl"])
    noisy = [r for r in sft if r["label_noise"]]
    assert noisy and all(int(r["response"]) == left_to_right(*parse_prompt(r["prompt"])) for r in noisy)
    clean = build_demo_files(DemoTaskConfig(**{**SMALL.__dict__, "sft_noise_rate": 0.0}))
    assert not any(r["label_noise"] for r in _rows(clean["sft.jsonl"]))
    assert all(not r["label_noise"] for r in _rows(files["sft_val.jsonl"]))
    prec = sum(parse_prompt(r["prompt"])[3] == "*" and parse_prompt(r["prompt"])[1] != "*" for r in sft)
    assert abs(prec / len(sft) - SMALL.precedence_fraction) < 0.02


def test_make_demo_dataset_is_idempotent_and_refuses_to_overwrite_a_different_one(tmp_path):
    status = make_demo_dataset(tmp_path, SMALL)
    assert set(status.values()) == {"written"}
    mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    assert set(make_demo_dataset(tmp_path, SMALL).values()) == {"unchanged"}
    assert mtimes == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    different = DemoTaskConfig(**{**SMALL.__dict__, "seed": 9})
    with pytest.raises(FileExistsError, match="--force"):
        make_demo_dataset(tmp_path, different)
    assert (tmp_path / "sft.jsonl").stat().st_mtime_ns == mtimes[tmp_path / "sft.jsonl"]
    assert "overwritten" in make_demo_dataset(tmp_path, different, force=True).values()


def test_generated_files_load_with_the_generated_tokenizer(tmp_path):
    make_demo_dataset(tmp_path, SMALL)
    tok = Tokenizer(tmp_path / "tokenizer")
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (17, 0, 1, 2)
    cfg = DataConfig(train_file="x", tokenizer_dir=str(tmp_path / "tokenizer"), max_seq_length=16)
    for ds in (load_sft_dataset(tmp_path / "sft.jsonl", tok, cfg),
               load_preference_dataset(tmp_path / "preference.jsonl", tok, cfg),
               load_prompt_dataset(tmp_path / "eval.jsonl", tok, cfg, max_prompt_length=8)):
        assert ds.report.clean and len(ds) == ds.report.rows_read


def test_make_demo_data_tool_cli(tmp_path):
    cmd = [sys.executable, str(ROOT / "launchers" / "make_demo_data.py"), "--task", "precedence", "--out", str(tmp_path / "d"),
           "--seed", "1", "--n-sft", "20", "--n-pref", "20", "--n-ppo", "10", "--n-eval", "10",
           "--n-val", "10"]
    first = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "written" in first.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "written" not in again.stdout and "unchanged" in again.stdout
    changed = subprocess.run(cmd[:-1] + ["11"], capture_output=True, text=True)
    assert changed.returncode == 1 and "--force" in changed.stderr
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["config"]["n_val"] == 10 and "tokenizer/tokenizer.json" in manifest["sha256"]


def _write_demo(out: str) -> dict:
    from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset

    return make_demo_dataset(out, DemoTaskConfig(n_sft=64, n_pref=64, n_ppo=64, n_eval=16, n_val=16))


def test_ranks_writing_the_same_folder_at_once_all_succeed(tmp_path):
    """The ranks of a job each write the (identical) dataset into one folder at the same time:
    none reads another's half-written file as a different dataset."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for attempt in range(25):
        out = str(tmp_path / f"d{attempt}")
        with ctx.Pool(6) as pool:
            results = pool.map(_write_demo, [out] * 6)
        assert all(set(r.values()) <= {"written", "unchanged"} for r in results)
        assert not [p for p in (tmp_path / f"d{attempt}").rglob(".*.tmp")]
    assert set(_write_demo(str(tmp_path / "d0")).values()) == {"unchanged"}
