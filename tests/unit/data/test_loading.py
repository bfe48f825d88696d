"""JSONL loaders: good rows, every kind of bad row (with its line number), skip_invalid,
over-long policies, prompt formatting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rlhf.data.datasets import (
    DataConfig,
    load_preference_dataset,
    load_prompt_dataset,
    load_sft_dataset,
)
from nemo_rlhf.tasks.precedence import SPECIAL_TOKENS, build_char_tokenizer_json
from nemo_rlhf.data.jsonl import DataError, read_jsonl
from nemo_rlhf.data.templates import format_prompt
from nemo_rlhf.data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    (d / "tokenizer.json").write_text(build_char_tokenizer_json())
    (d / "special_tokens.json").write_text(json.dumps(SPECIAL_TOKENS))
    return Tokenizer(d)


def _write(path: Path, lines: list) -> Path:
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else (json.dumps(line) if isinstance(line, dict) else line).encode())
            f.write(b"\n")
    return path


def _cfg(**kw) -> DataConfig:
    return DataConfig(train_file="unused", tokenizer_dir="unused", **kw)


GOOD_SFT = [{"prompt": "1+2*3=", "response": "7"}, {"prompt": "2*2-1=", "response": "3", "id": 9}]


def test_good_sft_file_loads_all_rows_with_prompt_and_response_ids(tmp_path, tok):
    path = _write(tmp_path / "sft.jsonl", GOOD_SFT + [""])  # trailing blank line ignored
    ds = load_sft_dataset(path, tok, _cfg())
    assert len(ds) == 2 and ds.report.clean and ds.report.rows_read == 2
    s = ds[0]
    assert s.prompt_ids[0] == tok.bos_id and tok.decode(s.prompt_ids) == "1+2*3="
    assert s.response_ids[-1] == tok.eos_id and tok.decode(s.response_ids) == "7"


def test_good_preference_and_prompt_files_load_and_pass_extras_through(tmp_path, tok):
    pref = _write(tmp_path / "p.jsonl", [{"prompt": "3+3*6=", "chosen": "21", "rejected": "36"}])
    ds = load_preference_dataset(pref, tok, _cfg())
    assert tok.decode(ds[0].chosen_ids) == "21" and tok.decode(ds[0].rejected_ids) == "36"
    prompts = _write(tmp_path / "q.jsonl", [{"prompt": "3+3*6=", "answer": "21", "level": 2}])
    ds = load_prompt_dataset(prompts, tok, _cfg(), max_prompt_length=16)
    assert ds[0].prompt == "3+3*6=" and ds[0].extras == {"answer": "21", "level": 2}


BAD_ROWS = [  # (line content, expected fragment of the message, field)
    (b"\xff\xfe{}", "invalid UTF-8", None),
    ('{"prompt": "1+1=", "response": "2"', "invalid JSON", None),
    ('["prompt", "response"]', "expected a JSON object", None),
    ({"response": "2"}, "field 'prompt': missing", "prompt"),
    ({"prompt": "1+1="}, "field 'response': missing", "response"),
    ({"prompt": 5, "response": "2"}, "field 'prompt': expected a string, got int", "prompt"),
    ({"prompt": "1+1=", "response": None}, "field 'response': expected a string, got NoneType", "response"),
    ({"prompt": "   ", "response": "2"}, "field 'prompt': empty", "prompt"),
    ({"prompt": "1+1=", "response": "x"}, "field 'response': cannot tokenize", "response"),
]


@pytest.mark.parametrize("bad,fragment,_field", BAD_ROWS, ids=[b[1] for b in BAD_ROWS])
def test_each_bad_sft_row_raises_data_error_with_path_line_and_field(tmp_path, tok, bad, fragment, _field):
    path = _write(tmp_path / "bad.jsonl", [GOOD_SFT[0], "", GOOD_SFT[1], bad])  # bad row on line 4
    with pytest.raises(DataError) as err:
        load_sft_dataset(path, tok, _cfg())
    assert f"{path}:4:" in str(err.value) and fragment in str(err.value)


def test_preference_row_with_missing_or_identical_fields_names_the_field(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "1=", "chosen": "1"}])
    with pytest.raises(DataError, match=r"p.jsonl:1: field 'rejected': missing"):
        read_jsonl(path, "preference")
    path = _write(tmp_path / "p2.jsonl", [{"prompt": "1=", "chosen": "1", "rejected": "1"}])
    with pytest.raises(DataError, match=r"p2.jsonl:1: field 'rejected': identical to 'chosen'"):
        read_jsonl(path, "preference")


def test_skip_invalid_skips_counts_and_reports_every_bad_row(tmp_path, tok, caplog):
    lines = [GOOD_SFT[0]] + [b for b, _, _ in BAD_ROWS] + [GOOD_SFT[1]]
    path = _write(tmp_path / "mixed.jsonl", lines)
    ds = load_sft_dataset(path, tok, _cfg(skip_invalid=True))
    assert len(ds) == 2
    r = ds.report
    assert r.invalid == len(BAD_ROWS) and r.rows_read == len(lines) and r.rows_kept == 2
    assert r.errors[0].startswith(f"{path}:2:")  # first few messages, with line numbers
    with caplog.at_level("WARNING"):
        r.log()
    assert f"invalid skipped {len(BAD_ROWS)}" in caplog.text and not r.clean


def test_a_utf8_byte_order_mark_on_the_first_line_is_accepted(tmp_path, tok):
    path = _write(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + json.dumps(GOOD_SFT[0]).encode()])
    assert len(load_sft_dataset(path, tok, _cfg())) == 1


def test_missing_file_is_a_data_error(tmp_path, tok):
    with pytest.raises(DataError, match="no such file"):
        load_sft_dataset(tmp_path / "nope.jsonl", tok, _cfg())


def test_overlong_truncate_cuts_the_response_and_drop_drops_the_row(tmp_path, tok):
    rows = [{"prompt": "1+2=", "response": "123456"},  # 5 + 7 tokens
            {"prompt": "1+2=", "response": "3"},       # 5 + 2 tokens
            {"prompt": "1+2+3+4+5+6=", "response": "21"}]  # prompt alone is 13 tokens
    path = _write(tmp_path / "long.jsonl", rows)
    ds = load_sft_dataset(path, tok, _cfg(max_seq_length=8, overlong_policy="truncate"))
    assert [len(s.prompt_ids) + len(s.response_ids) for s in ds.samples] == [8, 7]
    assert tok.decode(ds[0].response_ids) == "123" and tok.eos_id not in ds[0].response_ids
    assert ds.report.truncated == 1 and ds.report.dropped_overlong == 1
    ds = load_sft_dataset(path, tok, _cfg(max_seq_length=8, overlong_policy="drop"))
    assert len(ds) == 1 and ds.report.dropped_overlong == 2 and ds.report.truncated == 0


def test_overlong_preference_pair_identical_after_truncation_is_dropped(tmp_path, tok):
    rows = [{"prompt": "1+2=", "chosen": "12345", "rejected": "12346"}]
    path = _write(tmp_path / "p.jsonl", rows)
    ds = load_preference_dataset(path, tok, _cfg(max_seq_length=8))
    assert len(ds) == 0 and ds.report.dropped_overlong == 1


def test_overlong_prompt_rows_are_dropped_and_counted(tmp_path, tok):
    path = _write(tmp_path / "q.jsonl", [{"prompt": "1+2=", "answer": "3"},
                                         {"prompt": "1+2+3+4=", "answer": "10"}])
    ds = load_prompt_dataset(path, tok, _cfg(), max_prompt_length=6)
    assert [s.prompt for s in ds.samples] == ["1+2="] and ds.report.dropped_overlong == 1


def test_format_prompt_chatml_with_and_without_system_and_raw():
    assert format_prompt("3+3*6=", None) == "3+3*6="
    assert format_prompt("hi", "chatml") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with_sys = format_prompt("hi", "chatml", "Be brief.")
    assert with_sys.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")
    with pytest.raises(ValueError, match="valid choices"):
        format_prompt("hi", "llama3")
    with pytest.raises(ValueError, match="system prompt needs a chat template"):
        format_prompt("hi", None, "sys")


def test_data_config_rejects_bad_values_naming_the_key():
    with pytest.raises(ValueError, match="data.overlong_policy='cut'"):
        _cfg(overlong_policy="cut")
    with pytest.raises(ValueError, match="data.chat_template"):
        _cfg(chat_template="alpaca")
    with pytest.raises(ValueError, match="data.system_prompt"):
        _cfg(system_prompt="x")


def test_field_mapping_reads_other_column_names_and_names_them_when_missing(tmp_path, tok):
    """data.fields: the file's own column names; the ids equal those of the plain file, the
    unmapped columns stay extras, and a missing column is named as the file has it."""
    plain = load_sft_dataset(_write(tmp_path / "plain.jsonl", GOOD_SFT), tok, _cfg())
    renamed = [{"question": r["prompt"], "answer": r["response"], **({"id": 9} if "id" in r else {})}
               for r in GOOD_SFT]
    cfg = _cfg(fields={"prompt": "question", "response": "answer"})
    mapped = load_sft_dataset(_write(tmp_path / "qa.jsonl", renamed), tok, cfg)
    assert [(s.prompt_ids, s.response_ids) for s in mapped.samples] == \
        [(s.prompt_ids, s.response_ids) for s in plain.samples]
    prefs = _write(tmp_path / "prefs.jsonl", [{"q": "1+1=", "good": "2", "bad": "3"}])
    ds = load_preference_dataset(prefs, tok, _cfg(fields={"prompt": "q", "chosen": "good", "rejected": "bad"}))
    assert len(ds) == 1
    prompts = _write(tmp_path / "prompts.jsonl", [{"q": "1+1=", "answer": "2"}])
    (row,) = load_prompt_dataset(prompts, tok, _cfg(fields={"prompt": "q"}), 20).samples
    assert row.prompt == "1+1=" and row.extras == {"answer": "2"}
    with pytest.raises(DataError, match=r"qa.jsonl:1: field 'query' \(data.fields.prompt\): missing "
                                        r"\(keys present: \['answer', 'question'\]\)"):
        read_jsonl(tmp_path / "qa.jsonl", "sft", fields={"prompt": "query", "response": "answer"})
    with pytest.raises(ValueError, match=r"data.fields.answer: not a dataset field; valid fields are "
                                         r"\['prompt', 'response', 'chosen', 'rejected', 'messages'\]"):
        _cfg(fields={"answer": "a"})
    with pytest.raises(ValueError, match=r"data.fields: two fields read the same column"):
        _cfg(fields={"prompt": "x", "response": "x"})
