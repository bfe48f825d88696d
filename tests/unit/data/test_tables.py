"""Parquet files/folders and ``datasets`` save_to_disk folders as datasets: the same rows
(and token ids) as the JSONL they stand for, field mapping and chat ``messages`` columns,
errors naming the file and the row, and the PPO resume fingerprint of a folder."""

from __future__ import annotations

import json

import pytest

pa = pytest.importorskip("pyarrow")  # the `data` extra: make installs it
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from nemo_rlhf.data.datasets import (DataConfig, load_preference_dataset, load_prompt_dataset,  # noqa: E402
                                     load_sft_dataset)
from nemo_rlhf.data.jsonl import DataError  # noqa: E402
from nemo_rlhf.data.tables import dataset_format, read_rows  # noqa: E402
from nemo_rlhf.data.tokenizer import Tokenizer  # noqa: E402
from nemo_rlhf.trainers.ppo.state import file_hash as _file_hash  # noqa: E402
from tests.unit.data.test_templates import _tokenizer_dir  # noqa: E402

SFT = [{"prompt": "What is 26+28?", "response": "54"}, {"prompt": "What is 3+4?", "response": "7"},
       {"prompt": "Reverse 4821", "response": "1284"}]
PREF = [{"prompt": "What is 26+28?", "chosen": "54", "rejected": "53"},
        {"prompt": "What is 3+4?", "chosen": "7", "rejected": "8"}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _disk(path, rows):
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.fixture
def setup(tmp_path):
    d = _tokenizer_dir(tmp_path, "chatml", as_jinja_file=True)
    return Tokenizer(d), DataConfig(train_file="x", tokenizer_dir=str(d), chat_template="model",
                                    max_seq_length=256)


@pytest.mark.parametrize("write", [_parquet, _disk], ids=["parquet", "save_to_disk"])
def test_table_rows_tokenize_exactly_as_the_jsonl_rows(tmp_path, setup, write):
    tok, cfg = setup
    name = "t.parquet" if write is _parquet else "t_ds"
    ref = load_sft_dataset(_jsonl(tmp_path / "t.jsonl", SFT), tok, cfg)
    got = load_sft_dataset(write(tmp_path / name, SFT), tok, cfg)
    assert len(got) == 3 and [got[i] for i in range(3)] == [ref[i] for i in range(3)]
    pref_ref = load_preference_dataset(_jsonl(tmp_path / "p.jsonl", PREF), tok, cfg)
    pref = load_preference_dataset(write(tmp_path / f"p_{name}", PREF), tok, cfg)
    assert [pref[i] for i in range(2)] == [pref_ref[i] for i in range(2)]


def test_chat_messages_columns_and_field_mapping_from_parquet(tmp_path, setup):
    tok, cfg = setup
    chat = [{"conversation": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "What is 26+28?"}], "answer": "54"}]
    path = _parquet(tmp_path / "prompts.parquet", chat)
    cfg.fields = {"messages": "conversation"}
    ds = load_prompt_dataset(path, tok, cfg, max_prompt_length=256)
    ref = load_prompt_dataset(_jsonl(tmp_path / "prompts.jsonl", [{"messages": chat[0]["conversation"],
                                                                   "answer": "54"}]),
                              tok, DataConfig(train_file="x", tokenizer_dir=cfg.tokenizer_dir,
                                              chat_template="model", max_seq_length=256),
                              max_prompt_length=256)
    assert ds[0].prompt == "What is 26+28?" and ds[0].extras == {"answer": "54"}
    assert ds[0].prompt_ids == ref[0].prompt_ids


def test_a_parquet_folder_reads_its_shards_in_name_order_naming_each_file(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    _parquet(folder / "part-00001.parquet", SFT[2:])
    _parquet(folder / "part-00000.parquet", SFT[:2])
    assert dataset_format(folder) == "parquet"
    rows, wheres, report = read_rows(folder, "sft")
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in SFT]
    assert wheres == [f"{folder / 'part-00000.parquet'} row 0", f"{folder / 'part-00000.parquet'} row 1",
                      f"{folder / 'part-00001.parquet'} row 0"]
    assert report.rows_read == report.rows_kept == 3


@pytest.mark.parametrize("write", [_parquet, _disk], ids=["parquet", "save_to_disk"])
def test_a_missing_or_mistyped_field_names_the_file_and_the_row(tmp_path, write):
    name = "bad.parquet" if write is _parquet else "bad_ds"
    rows = [SFT[0], {"prompt": "What is 1+1?", "answer": "2"}]
    path = write(tmp_path / name, rows)
    # the column exists (the table's schema is shared), the value is null
    with pytest.raises(DataError, match=rf"{name} row 1: field 'response': expected a string, got NoneType"):
        read_rows(path, "sft")
    with pytest.raises(DataError, match=rf"{name} row 0: field 'chosen': missing \(keys present: "):
        read_rows(path, "preference")
    with pytest.raises(DataError, match=rf"{name} row 0: field 'question' \(data.fields.prompt\): missing"):
        read_rows(path, "prompt", fields={"prompt": "question"})
    kept, _, report = read_rows(path, "sft", skip_invalid=True)
    assert len(kept) == 1 and report.invalid == 1 and "row 1" in report.errors[0]


def test_a_datasetdict_folder_is_refused_naming_its_splits(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(SFT),
                               "test": datasets.Dataset.from_list(SFT[:1])})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"a DatasetDict \(splits \['test', 'train'\]\); give one split's folder"):
        read_rows(tmp_path / "dd", "sft")
    rows, _, _ = read_rows(tmp_path / "dd" / "train", "sft")
    assert len(rows) == 3


def test_paths_that_are_no_dataset_are_refused_clearly(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_rows(tmp_path / "absent.parquet", "sft")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="neither a datasets save_to_disk folder"):
        read_rows(tmp_path / "empty", "sft")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet file"):
        read_rows(tmp_path / "junk.parquet", "sft")


def test_the_resume_fingerprint_of_a_dataset_folder_follows_its_contents(tmp_path):
    a = _disk(tmp_path / "a", SFT)
    b = _disk(tmp_path / "b", SFT)
    c = _disk(tmp_path / "c", SFT[:2])
    assert _file_hash(a) == _file_hash(b) != _file_hash(c)
    f = _jsonl(tmp_path / "f.jsonl", SFT)
    import hashlib
    assert _file_hash(f) == hashlib.sha256(f.read_bytes()).hexdigest()[:16]  # files: as before
