"""Chat rows (``messages`` lists, TRL's conversational preference format) through the SFT,
preference and prompt loaders: the same ids as the plain rows they stand for, the whole
conversation rendered, clear errors naming file, line and field."""

from __future__ import annotations

import json
import re

import pytest

from nemo_rlhf.data.datasets import (DataConfig, encode_prompt, load_preference_dataset, load_prompt_dataset,
                                     load_sft_dataset)
from nemo_rlhf.data.jsonl import DataError
from nemo_rlhf.data.tokenizer import Tokenizer
from tests.unit.data.test_templates import _tokenizer_dir

SYSTEM = {"role": "system", "content": "Be brief."}
Q1 = {"role": "user", "content": "What is 26+28?"}
A1 = {"role": "assistant", "content": "54"}
Q2 = {"role": "user", "content": "Reverse 4821 please"}
A2 = {"role": "assistant", "content": "1284"}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(params=["model", "chatml"])
def setup(request, tmp_path):
    d = _tokenizer_dir(tmp_path, "chatml", as_jinja_file=True)
    return Tokenizer(d), DataConfig(train_file="x", tokenizer_dir=str(d), chat_template=request.param,
                                    max_seq_length=256)


def test_chat_rows_equal_the_plain_rows_they_stand_for(tmp_path, setup):
    tok, cfg = setup
    plain = load_sft_dataset(_jsonl(tmp_path / "a.jsonl", [{"prompt": Q1["content"], "response": "54"}]), tok, cfg)
    chat = load_sft_dataset(_jsonl(tmp_path / "b.jsonl", [{"messages": [Q1, A1]}]), tok, cfg)
    assert chat[0] == plain[0]
    pref = load_preference_dataset(_jsonl(tmp_path / "c.jsonl", [
        {"prompt": [Q1], "chosen": [A1], "rejected": [{"role": "assistant", "content": "53"}]},
        {"prompt": Q1["content"], "chosen": "54", "rejected": "53"}]), tok, cfg)
    assert pref[0] == pref[1]
    prompts = load_prompt_dataset(_jsonl(tmp_path / "d.jsonl", [{"messages": [SYSTEM, Q1], "answer": "54"}]),
                                  tok, cfg, max_prompt_length=256)
    assert prompts[0].prompt == Q1["content"] and prompts[0].extras == {"answer": "54"}
    assert prompts[0].prompt_ids == encode_prompt(tok, Q1["content"], cfg.chat_template, "Be brief.")


def test_a_multi_turn_sft_row_trains_on_its_last_assistant_turn_with_the_rest_as_context(tmp_path, setup):
    tok, cfg = setup
    ds = load_sft_dataset(_jsonl(tmp_path / "a.jsonl", [{"messages": [SYSTEM, Q1, A1, Q2, A2]}]), tok, cfg)
    prompt_text = tok.decode(ds[0].prompt_ids, skip_special_tokens=False)
    for part in ("Be brief.", "What is 26+28?", "54", "Reverse 4821 please"):
        assert part in prompt_text
    assert prompt_text.index("54") < prompt_text.index("Reverse")
    assert tok.decode(ds[0].response_ids) == "1284" and ds[0].response_ids[-1] == tok.eos_id


@pytest.mark.parametrize("row, kind, message", [
    ({"messages": [Q1, A1]}, "prompt", "field 'messages': the last message must be the user's, got 'assistant'"),
    ({"messages": [Q1]}, "sft", "field 'messages': the last message must be the assistant's, got 'user'"),
    ({"messages": [A1]}, "sft", "no user turn before the response"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "prompt", "field 'messages'[0]: expected {'role': one of"),
    ({"messages": [Q1], "prompt": "x"}, "prompt", "give 'messages' or 'prompt', not both"),
    ({"messages": [], "answer": "1"}, "prompt", "expected a non-empty list"),
    ({"prompt": [Q1], "chosen": [A1, A2], "rejected": "x"}, "preference", "field 'chosen': expected one assistant"),
    ({"messages": [Q1, A1], "response": "54"}, "sft", "drop 'response'"),
])
def test_bad_chat_rows_name_file_line_and_field(tmp_path, setup, row, kind, message):
    tok, cfg = setup
    path = _jsonl(tmp_path / "bad.jsonl", [row])
    load = {"sft": load_sft_dataset, "preference": load_preference_dataset,
            "prompt": lambda p, t, c: load_prompt_dataset(p, t, c, max_prompt_length=256)}[kind]
    with pytest.raises(DataError, match="bad.jsonl:1: .*" + re.escape(message)):
        load(path, tok, cfg)


def test_a_conversation_without_a_template_is_refused(tmp_path):
    d = _tokenizer_dir(tmp_path, "chatml", as_jinja_file=True)
    cfg = DataConfig(train_file="x", tokenizer_dir=str(d), max_seq_length=256)
    path = _jsonl(tmp_path / "a.jsonl", [{"messages": [Q1, A1, Q2, A2]}])
    with pytest.raises(DataError, match="a.jsonl:1: field 'messages': .*needs a chat template"):
        load_sft_dataset(path, Tokenizer(d), cfg)
    one_turn = load_sft_dataset(_jsonl(tmp_path / "b.jsonl", [{"messages": [Q1, A1]}]), Tokenizer(d), cfg)
    assert one_turn[0].prompt_ids[1:] == Tokenizer(d).encode(Q1["content"])  # BOS + the raw prompt
