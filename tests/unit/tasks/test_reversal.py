"""The tiny demo's reversal task: the sloppy demonstrator, correct comparisons, disjoint
held-out prompts, the integer checker on its answers, idempotent writing."""

from __future__ import annotations

import json
import random

import pytest

from nemo_rlhf.data.datasets import DataConfig, load_preference_dataset, load_prompt_dataset, load_sft_dataset
from nemo_rlhf.tasks.precedence import arithmetic_exact_match
from nemo_rlhf.tasks.reversal import (ReversalTaskConfig, build_reversal_files, make_reversal_dataset,
                                          reverse, wrong_answer)
from nemo_rlhf.data.tokenizer import Tokenizer

SMALL = ReversalTaskConfig(seed=3, n_sft=400, n_pref=400, n_ppo=100, n_eval=50, n_val=40)


def _rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_wrong_answers_are_wrong_and_half_of_them_the_copy():
    rng = random.Random(0)
    kinds = []
    for _ in range(400):
        s = "".join(rng.choice("123456789") for _ in range(rng.randint(3, 5)))
        if s == s[::-1]:
            continue
        wrong, kind = wrong_answer(s, rng)
        assert wrong != reverse(s) and len(wrong) == len(s) and "0" not in wrong
        assert (wrong == s) == (kind == "copy")
        kinds.append(kind)
    assert set(kinds) == {"copy", "digit_change", "adjacent_swap"}
    assert 0.4 < kinds.count("copy") / len(kinds) < 0.6


def test_the_demonstrator_copies_at_its_rate_and_the_comparisons_are_correct():
    files = build_reversal_files(SMALL)
    sft = _rows(files["sft.jsonl"])
    noisy = [r for r in sft if r["label_noise"]]
    assert all(r["response"] + "=" == r["prompt"] for r in noisy)
    assert all(r["response"] == reverse(r["prompt"][:-1]) for r in sft if not r["label_noise"])
    assert abs(len(noisy) / len(sft) - SMALL.sft_copy_rate) < 0.06
    assert not any(r["label_noise"] for r in _rows(files["sft_val.jsonl"]))
    for r in _rows(files["preference.jsonl"]) + _rows(files["preference_val.jsonl"]):
        assert r["chosen"] == reverse(r["prompt"][:-1]) != r["rejected"]
    for r in _rows(files["eval.jsonl"]) + _rows(files["ppo_prompts.jsonl"]):
        number = r["prompt"][:-1]
        assert r["answer"] == reverse(number) != number  # no palindromes
        assert SMALL.min_digits <= len(number) <= SMALL.max_digits and "0" not in number


def test_held_out_prompts_are_disjoint_and_the_files_deterministic():
    files = build_reversal_files(SMALL)
    assert files == build_reversal_files(SMALL)
    assert files["sft.jsonl"] != build_reversal_files(ReversalTaskConfig(**{**SMALL.__dict__, "seed": 4}))["sft.jsonl"]
    held = {r["prompt"] for n in ("eval.jsonl", "sft_val.jsonl") for r in _rows(files[n])}
    assert len(held) == SMALL.n_eval + SMALL.n_val
    train = {r["prompt"] for n in ("sft.jsonl", "preference.jsonl", "ppo_prompts.jsonl") for r in _rows(files[n])}
    assert not held & train


def test_the_integer_checker_scores_the_reversal_and_not_the_copy():
    rows = _rows(build_reversal_files(SMALL)["eval.jsonl"])
    prompts = [r["prompt"] for r in rows]
    extras = [{"answer": r["answer"]} for r in rows]
    assert arithmetic_exact_match(prompts, [r["answer"] for r in rows], extras) == [1.0] * len(rows)
    assert arithmetic_exact_match(prompts, [p[:-1] for p in prompts], extras) == [0.0] * len(rows)


def test_files_load_with_the_demo_configs_lengths_and_writing_is_idempotent(tmp_path):
    assert set(make_reversal_dataset(tmp_path, SMALL).values()) == {"written"}
    assert set(make_reversal_dataset(tmp_path, SMALL).values()) == {"unchanged"}
    with pytest.raises(FileExistsError, match="--force"):
        make_reversal_dataset(tmp_path, ReversalTaskConfig(**{**SMALL.__dict__, "seed": 9}))
    tok = Tokenizer(tmp_path / "tokenizer")
    cfg = DataConfig(train_file="x", tokenizer_dir=str(tmp_path / "tokenizer"), max_seq_length=16)
    for ds in (load_sft_dataset(tmp_path / "sft.jsonl", tok, cfg),
               load_preference_dataset(tmp_path / "preference.jsonl", tok, cfg),
               load_prompt_dataset(tmp_path / "eval.jsonl", tok, cfg, max_prompt_length=8)):
        assert ds.report.clean and len(ds) == ds.report.rows_read


def test_config_refusals_name_the_field():
    with pytest.raises(ValueError, match="sft_copy_rate"):
        ReversalTaskConfig(sft_copy_rate=1.5)
    with pytest.raises(ValueError, match="min_digits"):
        ReversalTaskConfig(min_digits=4, max_digits=3)
    with pytest.raises(ValueError, match="n_eval \\+ n_val"):
        ReversalTaskConfig(min_digits=2, max_digits=2, n_eval=60, n_val=20)


def test_make_demo_data_tool_writes_the_reversal_task_by_default_and_refuses_foreign_flags(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[3] / "launchers" / "make_demo_data.py"
    base = [sys.executable, str(tool), "--out", str(tmp_path / "d"), "--n-sft", "20", "--n-pref", "20",
            "--n-ppo", "10", "--n-eval", "10", "--n-val", "10"]
    done = subprocess.run(base + ["--sft-copy-rate", "0.5"], capture_output=True, text=True, check=True)
    assert "written" in done.stdout
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["generator"] == "nemo_rlhf.tasks.reversal"
    assert manifest["config"]["sft_copy_rate"] == 0.5 and manifest["config"]["n_val"] == 10
    foreign = subprocess.run(base + ["--sft-noise-rate", "0.1"], capture_output=True, text=True)
    assert foreign.returncode == 2 and "--sft-noise-rate: not a setting of --task reversal" in foreign.stderr
    bad = subprocess.run(base + ["--sft-copy-rate", "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "sft_copy_rate=2.0" in bad.stderr
