"""The SmolLM2 addition task: disjoint deterministic splits, idempotent writing, pairs
built from the model's own scored samples, and the ChatML prompt encoding."""

from __future__ import annotations

import json

import pytest

from nemo_rlhf.tasks.addition import (
    NEAR_MISS_OFFSETS,
    AdditionTaskConfig,
    answer_edit_pairs,
    build_preference_pairs,
    make_addition_dataset,
    two_digit_addition,
)


def _prompts(path):
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]


def test_splits_are_disjoint_deterministic_and_answers_are_checked_right(tmp_path):
    cfg = AdditionTaskConfig(n_eval=50, n_rm=40, n_rm_val=10, n_ppo=100)
    m1 = make_addition_dataset(tmp_path / "a", cfg)
    m2 = make_addition_dataset(tmp_path / "b", cfg)
    assert m1["files"] == m2["files"]  # same seed -> same bytes
    sets = {f: set(_prompts(tmp_path / "a" / f)) for f in m1["files"]}
    assert [len(v) for v in sets.values()] == [50, 10, 40, 100]
    names = list(sets)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not sets[a] & sets[b], (a, b)
    rows = [json.loads(line) for line in (tmp_path / "a" / "eval.jsonl").read_text().splitlines()]
    assert all(r["prompt"] == f"What is {r['a']}+{r['b']}? Answer with just the number." for r in rows)
    assert two_digit_addition([r["prompt"] for r in rows], [r["answer"] for r in rows], [{}] * 50) == [1.0] * 50
    other = make_addition_dataset(tmp_path / "c", AdditionTaskConfig(seed=1, n_eval=50, n_rm=40, n_rm_val=10, n_ppo=100))
    assert other["files"]["eval.jsonl"] != m1["files"]["eval.jsonl"]


def test_rewriting_is_skipped_when_settings_match_and_redone_when_they_change(tmp_path):
    cfg = AdditionTaskConfig(n_eval=5, n_rm=5, n_rm_val=5, n_ppo=5)
    make_addition_dataset(tmp_path, cfg)
    f = tmp_path / "eval.jsonl"
    stamp = f.stat().st_mtime_ns
    make_addition_dataset(tmp_path, cfg)
    assert f.stat().st_mtime_ns == stamp
    make_addition_dataset(tmp_path, AdditionTaskConfig(n_eval=6, n_rm=5, n_rm_val=5, n_ppo=5))
    assert len(_prompts(f)) == 6


def test_too_many_prompts_is_a_clear_error():
    with pytest.raises(ValueError, match="8100 problems"):
        AdditionTaskConfig(n_ppo=9000)


def test_pairs_are_correct_vs_wrong_of_the_same_prompt_deduplicated_and_capped():
    s = [{"prompt": "p1", "response": "5", "correct": 1.0, "answer": "5"},
         {"prompt": "p1", "response": "5", "correct": 1.0, "answer": "5"},  # duplicate text
         {"prompt": "p1", "response": "6", "correct": 0.0, "answer": "5"},
         {"prompt": "p1", "response": "7", "correct": 0.0, "answer": "5"},
         {"prompt": "p2", "response": "1", "correct": 0.0, "answer": "2"},  # no correct sample
         {"prompt": "p3", "response": "a", "correct": 1.0},
         {"prompt": "p3", "response": "b", "correct": 1.0},
         {"prompt": "p3", "response": "c", "correct": 0.0},
         {"prompt": "p3", "response": "d", "correct": 0.0},
         {"prompt": "p3", "response": "e", "correct": 0.0}]
    pairs = build_preference_pairs(s, max_pairs_per_prompt=3)
    p1 = [(p["chosen"], p["rejected"]) for p in pairs if p["prompt"] == "p1"]
    assert sorted(p1) == [("5", "6"), ("5", "7")]
    p3 = [p for p in pairs if p["prompt"] == "p3"]
    assert len(p3) == 3 and all(p["chosen"] in "ab" and p["rejected"] in "cde" for p in p3)
    assert not [p for p in pairs if p["prompt"] == "p2"]
    assert build_preference_pairs(s, 3, seed=0) == build_preference_pairs(s, 3, seed=0)


def test_answer_edit_pairs_change_only_the_number_the_checker_reads():
    q = "What is 26+28? Answer with just the number."
    s = [{"prompt": q, "response": "26 + 28 = 54", "correct": 1.0, "answer": "54"},
         {"prompt": q, "response": "26+28 is 64, I think.", "correct": 0.0, "answer": "54"},
         {"prompt": q, "response": "Twenty-six plus twenty-eight.", "correct": 0.0, "answer": "54"},
         {"prompt": q, "response": "26 + 28", "correct": 0.0, "answer": "54"}]
    pairs = answer_edit_pairs(s, per_prompt=4, seed=3)
    by_edit = {p["edit"]: p for p in pairs}
    assert len(pairs) == 2 and set(by_edit) == {"wrong_sum", "right_sum"}  # no number: no pair
    wrong = by_edit["wrong_sum"]
    assert wrong["chosen"] == "26 + 28 = 54" and wrong["rejected"].startswith("26 + 28 = ")
    assert int(wrong["rejected"].rsplit(" ", 1)[1]) - 54 in NEAR_MISS_OFFSETS
    right = by_edit["right_sum"]
    assert (right["chosen"], right["rejected"]) == ("26+28 is 54, I think.", "26+28 is 64, I think.")
    extras = [{"answer": "54"}] * len(pairs)
    prompts = [q] * len(pairs)
    assert two_digit_addition(prompts, [p["chosen"] for p in pairs], extras) == [1.0, 1.0]
    assert two_digit_addition(prompts, [p["rejected"] for p in pairs], extras) == [0.0, 0.0]
    assert len(answer_edit_pairs(s, per_prompt=1)) == 1
    assert answer_edit_pairs(s, 4, seed=3) == pairs


def test_chatml_prompt_does_not_get_a_second_bos_when_bos_is_im_start(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from nemo_rlhf.data.datasets import encode_prompt
    from nemo_rlhf.data.tokenizer import Tokenizer

    vocab = {t: i for i, t in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", "<bos>"])}
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>", "<bos>"])
    for bos, name in (("<|im_start|>", "chatml_bos"), ("<bos>", "plain_bos")):
        d = tmp_path / name
        d.mkdir()
        hf.save(str(d / "tokenizer.json"))
        (d / "special_tokens.json").write_text(json.dumps({"bos_token": bos, "eos_token": "<|im_end|>"}))
        ids = encode_prompt(Tokenizer(d), "hi", "chatml")
        tok = Tokenizer(d)
        if bos == "<|im_start|>":
            assert ids[0] == tok.bos_id and ids[1] != tok.bos_id  # the template's own <|im_start|>
        else:
            assert ids[:2] == [tok.bos_id, tok.hf.token_to_id("<|im_start|>")]
