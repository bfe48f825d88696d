"""Datasets stored as tables: parquet files and Hugging Face ``datasets`` folders.

``data.train_file`` / ``data.val_file`` (and the evaluation's ``data``) may name

* a JSONL file (any other file name): :mod:`nemo_rlhf.data.jsonl`;
* a ``.parquet`` file, or a folder of ``*.parquet`` files (read in name order, as a
  sharded export is): needs ``pyarrow``;
* a folder written by ``datasets.Dataset.save_to_disk`` (it holds ``state.json`` and
  ``dataset_info.json``): needs ``datasets``; read with ``load_from_disk``, no hub access.
  A ``DatasetDict`` folder (``dataset_dict.json``) is refused, naming its splits: point the
  key at one split's folder (``<dir>/train``).

Both libraries come with the ``data`` extra (``pip install 'nemo_rlhf[data]'``; ``make``
installs it). Columns are the row's fields, as JSON keys are; nested columns (a
``messages`` list of ``{role, content}`` structs) arrive as Python lists and dicts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from nemo_rlhf.data.jsonl import REQUIRED_FIELDS, DataError, LoadReport, _collect, _jsonl_items

FORMATS = ("jsonl", "parquet", "hf_disk")
"""What :func:`dataset_format` returns."""

_EXTRA = "pip install 'nemo_rlhf[data]'"


def dataset_format(path: str | Path) -> str:
    """The format of a dataset path: ``jsonl``, ``parquet`` or ``hf_disk`` (module docstring).

    Raises:
        DataError: a missing path, a folder that is neither a ``save_to_disk`` folder nor
            holds parquet files, or a ``DatasetDict`` folder (its splits named).
    """
    path = Path(path)
    if path.is_file():
        return "parquet" if path.suffix == ".parquet" else "jsonl"
    if not path.is_dir():
        raise DataError(f"{path}: no such file")
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise DataError(f"{path}: a DatasetDict (splits {splits}); give one split's folder, "
                        f"e.g. {path / (splits[0] if splits else 'train')}")
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return "hf_disk"
    if any(path.glob("*.parquet")):
        return "parquet"
    raise DataError(f"{path}: a folder, but neither a datasets save_to_disk folder (no state.json) "
                    f"nor one holding *.parquet files")


def _need(module: str, path: Path, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{path}: reading {what} needs the {module.split('.')[0]!r} library "
                        f"({_EXTRA})") from None


def table_items(path: str | Path, fmt: str) -> Iterator[tuple[str, object]]:
    """``(where, row)`` for each row of a parquet file/folder or a ``save_to_disk`` folder,
    ``where`` being ``<file> row <i>`` (0-based within that file).

    Raises:
        DataError: the library missing, or a file it cannot read (named).
        ValueError: ``fmt`` not ``parquet`` / ``hf_disk``.
    """
    path = Path(path)
    if fmt == "parquet":
        pq = _need("pyarrow.parquet", path, "parquet")
        files = [path] if path.is_file() else sorted(path.glob("*.parquet"))
        for f in files:
            try:
                pf = pq.ParquetFile(f)
            except Exception as exc:  # pyarrow raises ArrowInvalid / OSError with its reason
                raise DataError(f"{f}: not a readable parquet file ({exc})") from None
            i = 0
            for batch in pf.iter_batches(batch_size=4096):
                for row in batch.to_pylist():
                    yield f"{f} row {i}", row
                    i += 1
    elif fmt == "hf_disk":
        datasets = _need("datasets", path, "a datasets save_to_disk folder")
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as exc:
            raise DataError(f"{path}: datasets.load_from_disk failed ({exc})") from None
        for i, row in enumerate(ds):
            yield f"{path} row {i}", row
    else:
        raise ValueError(f"table format {fmt!r}: valid formats are ['parquet', 'hf_disk']")


def read_rows(path: str | Path, kind: str, skip_invalid: bool = False,
              fields: dict | None = None) -> tuple[list[dict], list[str], LoadReport]:
    """Read and validate a dataset in any supported format (:func:`dataset_format`):
    JSONL, parquet, or a Hugging Face ``datasets`` folder written by ``save_to_disk``.

    Parquet and ``datasets`` rows are checked exactly as JSONL lines are; a row is named
    ``<file> row <i>`` (0-based, as ``dataset[i]`` and pandas number them).

    Returns:
        ``(rows, wheres, report)``: the valid rows, each one's location (``<file>:<line>``
        for JSONL, ``<file> row <i>`` otherwise) and the report (not yet logged).

    Raises:
        DataError: a missing path, a format whose library is not installed (naming the
            extra to install), a ``DatasetDict`` folder (naming its splits), or without
            ``skip_invalid`` the first invalid row.
        ValueError: unknown ``kind``.
    """
    path = Path(path)
    if kind not in REQUIRED_FIELDS:
        raise ValueError(f"dataset kind {kind!r}: valid kinds are {sorted(REQUIRED_FIELDS)}")
    fmt = dataset_format(path)
    items = _jsonl_items(path) if fmt == "jsonl" else table_items(path, fmt)
    return _collect(items, path, kind, skip_invalid, fields)
