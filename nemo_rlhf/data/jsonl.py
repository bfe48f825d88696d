"""JSONL readers with per-row validation for the three dataset kinds.

Formats (one JSON object a line):

* ``sft``: ``{"prompt": str, "response": str, ...}``, or a multi-turn demonstration
  ``{"prompt": str, "segments": [{"kind": "policy" | "env", "text": str}, ...], ...}``
  (policy first and last, kinds alternating; the loss is on the policy segments only:
  :mod:`nemo_rlhf.data.datasets`)
* ``preference``: ``{"prompt": str, "chosen": str, "rejected": str, ...}``
* ``prompt`` (PPO): ``{"prompt": str, ...}``; the other fields (e.g. ``answer``) are passed
  through as the row's *extras* for reward functions.

Chat rows (the conversational format of TRL and OpenRLHF): a ``messages`` list of
``{"role": "system" | "user" | "assistant", "content": str}`` instead of ``prompt`` (and,
for SFT, ``response``). A prompt row's conversation ends with a user turn; an SFT row's
ends with the assistant turn that is the response (the loss is on that turn; earlier
assistant turns are context). A preference row's ``prompt`` may be such a list (ending
with a user turn) and ``chosen`` / ``rejected`` a list of one assistant message. Rows are
normalised on reading: ``prompt`` becomes the last user turn's text (what reward
functions see), ``messages`` keeps the conversation before the response (what the chat
template renders), ``response`` / ``chosen`` / ``rejected`` become strings.

A preference row may also compare two **whole conversations** (a multi-turn or
tool-calling episode, #51): ``{"chosen": [messages], "rejected": [messages]}`` without a
``prompt``, each list holding at least one message before its final assistant message
(roles ``system``, ``user``, ``assistant``, ``tool``). It is normalised to ``prompt`` (the
first user message's text), ``chosen`` / ``rejected`` (the final answers' texts) and the
whole lists under :data:`CONVERSATION_FIELDS`, which the RM trainer renders as the RM
server does (:func:`nemo_rlhf.data.datasets.encode_conversation`). Two identical
conversations are refused like ``chosen == rejected``.

Every row is checked: invalid UTF-8, invalid JSON, a non-object, a missing or non-string
field, an empty (whitespace-only) prompt, and ``chosen == rejected`` in a preference row
each raise :class:`DataError` naming the file, the 1-based line number and the field.
With ``skip_invalid=True`` such rows are skipped and counted in a :class:`LoadReport`,
whose summary the caller logs at the end of loading (a skip is never silent).
Whitespace-only lines are ignored (a trailing newline is not a row).

Field mapping (``data.fields``, e.g. ``{prompt: question, chosen: good, rejected: bad}``):
a file whose columns have other names is read as is; each row's mapped field is renamed
to the name above before the checks, and a missing one is named as the file has it
(``field 'question' (data.fields.prompt): missing``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

REQUIRED_FIELDS = {
    "sft": ("prompt", "response"),
    "preference": ("prompt", "chosen", "rejected"),
    "prompt": ("prompt",),
}
"""Required string fields per dataset kind."""

MAX_REPORTED_ERRORS = 5

MAPPABLE_FIELDS = ("prompt", "response", "chosen", "rejected", "messages")
"""The fields ``data.fields`` may map to another name in the file."""


def check_field_map(fields: dict, key: str = "data.fields") -> None:
    """Refuse a field mapping with an unknown field or a non-string column name.

    Raises:
        ValueError: naming ``key``, the entry and the valid fields.
    """
    for ours, theirs in fields.items():
        if ours not in MAPPABLE_FIELDS:
            raise ValueError(f"{key}.{ours}: not a dataset field; valid fields are {list(MAPPABLE_FIELDS)}")
        if not isinstance(theirs, str) or not theirs:
            raise ValueError(f"{key}.{ours}={theirs!r}: expected the file's column name (a string)")
    names = list(fields.values())
    if len(set(names)) != len(names):
        raise ValueError(f"{key}: two fields read the same column ({fields})")


def _rename_fields(obj: dict, fields: dict) -> dict:
    """The row with each mapped column renamed to its field (``{ours: theirs}``)."""
    obj = dict(obj)
    moved = {ours: obj.pop(theirs) for ours, theirs in fields.items() if theirs in obj and theirs != ours}
    obj.update(moved)
    return obj


class DataError(ValueError):
    """A bad dataset row or file: the message has ``<path>:<line>: field '<name>': ...``."""


@dataclass
class LoadReport:
    """What loading one file kept, skipped, truncated and dropped."""

    path: str
    """The file read."""
    kind: str
    """``sft``, ``preference`` or ``prompt``."""
    rows_read: int = 0
    """Non-blank lines seen."""
    rows_kept: int = 0
    """Rows in the returned dataset."""
    invalid: int = 0
    """Rows skipped as invalid (``skip_invalid=True``)."""
    truncated: int = 0
    """Rows kept with a truncated response (``overlong_policy=truncate``)."""
    dropped_overlong: int = 0
    """Rows dropped as longer than the maximum sequence length."""
    errors: list[str] = field(default_factory=list)
    """The first few invalid-row messages."""

    def add_error(self, message: str) -> None:
        """Count one skipped invalid row and keep its message if among the first few."""
        self.invalid += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(message)

    @property
    def clean(self) -> bool:
        """True when nothing was skipped, truncated or dropped."""
        return not (self.invalid or self.truncated or self.dropped_overlong)

    def summary(self) -> str:
        """One line (plus the first errors) for the console and the log."""
        line = (f"{self.path} ({self.kind}): {self.rows_kept} rows kept of {self.rows_read}; "
                f"invalid skipped {self.invalid}, truncated {self.truncated}, "
                f"dropped overlong {self.dropped_overlong}")
        if self.errors:
            more = f" (first {len(self.errors)})" if self.invalid > len(self.errors) else ""
            line += f"\n  invalid rows{more}:\n    " + "\n    ".join(self.errors)
        return line

    def log(self) -> None:
        """Log the summary: a warning when rows were skipped, truncated or dropped."""
        (logger.info if self.clean else logger.warning)(self.summary())


ROLES = ("system", "user", "assistant", "tool")

CONVERSATION_FIELDS = ("chosen_messages", "rejected_messages")
"""Where a preference row of two whole conversations keeps them after normalisation."""


def _check_messages(messages, where: str, name: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field {name!r}: expected a non-empty list of "
                        f"{{'role', 'content'}} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: field {name!r}[{i}]: expected {{'role': one of {list(ROLES)}, "
                            f"'content': str}}, got {m!r}")
    return messages


def _split_conversation(messages: list[dict], where: str, name: str, ends_with: str) -> list[dict]:
    if messages[-1]["role"] != ends_with:
        raise DataError(f"{where}: field {name!r}: the last message must be the {ends_with}'s, "
                        f"got {messages[-1]['role']!r}")
    return messages


def _normalise_chat(obj: dict, kind: str, where: str) -> dict:
    """A chat row in the plain form (module docstring); plain rows are returned as they are."""
    obj = dict(obj)
    if "messages" in obj:
        if "prompt" in obj:
            raise DataError(f"{where}: field 'messages': give 'messages' or 'prompt', not both")
        msgs = _check_messages(obj.pop("messages"), where, "messages")
        if kind == "sft" and "segments" not in obj:  # (a segmented row's conversation ends with the user)
            if "response" in obj:
                raise DataError(f"{where}: field 'messages': the response is its last assistant "
                                f"message; drop 'response'")
            _split_conversation(msgs, where, "messages", "assistant")
            obj["response"], msgs = msgs[-1]["content"], msgs[:-1]
            if not msgs:
                raise DataError(f"{where}: field 'messages': no user turn before the response")
        _split_conversation(msgs, where, "messages", "user")
        obj["prompt"], obj["messages"] = msgs[-1]["content"], msgs
    elif kind == "preference" and isinstance(obj.get("prompt"), list):
        msgs = _split_conversation(_check_messages(obj["prompt"], where, "prompt"), where, "prompt", "user")
        obj["prompt"], obj["messages"] = msgs[-1]["content"], msgs
    if kind == "preference" and _is_conversation_pair(obj):
        for name, key in zip(("chosen", "rejected"), CONVERSATION_FIELDS):
            value = obj.get(name)
            if not isinstance(value, list):
                raise DataError(f"{where}: field {name!r}: expected a conversation (a list of messages) "
                                f"like the other side, got {type(value).__name__}")
            msgs = _check_messages(value, where, name)
            if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
                raise DataError(f"{where}: field {name!r}: a whole conversation needs the prompt and at "
                                f"least one more message, the last the assistant's")
            obj[key], obj[name] = msgs, msgs[-1]["content"]
        first_user = next((m["content"] for m in obj[CONVERSATION_FIELDS[0]] if m["role"] == "user"),
                          obj[CONVERSATION_FIELDS[0]][0]["content"])
        obj["prompt"] = first_user
        return obj
    if kind == "preference":
        for name in ("chosen", "rejected"):
            value = obj.get(name)
            if isinstance(value, list):
                msgs = _check_messages(value, where, name)
                if len(msgs) != 1 or msgs[0]["role"] != "assistant":
                    raise DataError(f"{where}: field {name!r}: expected one assistant message after "
                                    f"'prompt' (or, without 'prompt', two whole conversations: 'chosen' "
                                    f"and 'rejected' each the prompt and every turn)")
                obj[name] = msgs[0]["content"]
    return obj


def _check_segments(obj: dict, where: str) -> None:
    """A multi-turn SFT row's ``segments`` (module docstring)."""
    segments = obj["segments"]
    if "response" in obj:
        raise DataError(f"{where}: field 'segments': give 'response' or 'segments', not both")
    if not isinstance(segments, list) or not segments:
        raise DataError(f"{where}: field 'segments': expected a non-empty list of "
                        f"{{'kind': 'policy' | 'env', 'text': str}}, got {segments!r}")
    for i, seg in enumerate(segments):
        if (not isinstance(seg, dict) or set(seg) != {"kind", "text"} or seg["kind"] not in ("policy", "env")
                or not isinstance(seg["text"], str)):
            raise DataError(f"{where}: field 'segments[{i}]': expected {{'kind': 'policy' | 'env', "
                            f"'text': str}}, got {seg!r}")
        if i and seg["kind"] == segments[i - 1]["kind"]:
            raise DataError(f"{where}: field 'segments[{i}]': two {seg['kind']!r} segments in a row; "
                            f"policy and env segments alternate (join the texts)")
    if segments[0]["kind"] != "policy" or segments[-1]["kind"] != "policy":
        raise DataError(f"{where}: field 'segments': the first and the last segment must be the "
                        f"policy's (the prompt is the first observation; the final answer ends it)")


def _is_conversation_pair(obj: dict) -> bool:
    """Whether a preference row compares whole conversations: no ``prompt`` / ``messages``,
    and a ``chosen`` or ``rejected`` list that is more than one assistant message."""
    def whole(value) -> bool:
        return isinstance(value, list) and not (
            len(value) == 1 and isinstance(value[0], dict) and value[0].get("role") == "assistant")
    return "prompt" not in obj and "messages" not in obj and (whole(obj.get("chosen")) or whole(obj.get("rejected")))


def _validate_row(obj, kind: str, where: str, fields: dict | None = None) -> dict:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    present = sorted(obj)
    if fields:
        for ours, theirs in fields.items():
            if theirs != ours and theirs not in obj and ours in obj:  # never read the wrong column
                raise DataError(f"{where}: field {theirs!r} (data.fields.{ours}): missing, but the row has "
                                f"{ours!r}; fix the column name or drop the mapping (keys present: {present})")
        obj = _rename_fields(obj, fields)
    obj = _normalise_chat(obj, kind, where)
    required = REQUIRED_FIELDS[kind]
    if kind == "sft" and "segments" in obj:
        _check_segments(obj, where)
        required = ("prompt",)
    for name in required:
        if name not in obj:
            label = f"{fields[name]!r} (data.fields.{name})" if fields and name in fields else repr(name)
            raise DataError(f"{where}: field {label}: missing (keys present: {present})")
        if not isinstance(obj[name], str):
            raise DataError(f"{where}: field {name!r}: expected a string, got "
                            f"{type(obj[name]).__name__}")
    if not obj["prompt"].strip():
        raise DataError(f"{where}: field 'prompt': empty")
    if kind == "preference" and obj["chosen"] == obj["rejected"] and \
            obj.get(CONVERSATION_FIELDS[0]) == obj.get(CONVERSATION_FIELDS[1]):
        raise DataError(f"{where}: field 'rejected': identical to 'chosen' (no preference)")
    return obj


def _jsonl_items(path: Path):
    """``(where, row)`` per non-blank line; ``row`` is a :class:`DataError` for a line that
    is not UTF-8 JSON (raised by the caller, so ``skip_invalid`` can count it)."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # BOM ok
            except UnicodeDecodeError as exc:
                yield where, DataError(f"{where}: invalid UTF-8 at byte {exc.start}")
                continue
            try:
                yield where, json.loads(text)
            except json.JSONDecodeError as exc:
                yield where, DataError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})")


def _collect(items, path: Path, kind: str, skip_invalid: bool, fields: dict | None):
    """Validate ``(where, row)`` items into ``(rows, wheres, report)`` (see :func:`read_rows`)."""
    if kind not in REQUIRED_FIELDS:
        raise ValueError(f"dataset kind {kind!r}: valid kinds are {sorted(REQUIRED_FIELDS)}")
    report = LoadReport(path=str(path), kind=kind)
    rows, wheres = [], []
    for where, obj in items:
        report.rows_read += 1
        try:
            if isinstance(obj, DataError):
                raise obj
            rows.append(_validate_row(obj, kind, where, fields))
            wheres.append(where)
        except DataError as exc:
            if not skip_invalid:
                raise
            report.add_error(str(exc))
    report.rows_kept = len(rows)
    return rows, wheres, report


def read_jsonl(path: str | Path, kind: str, skip_invalid: bool = False,
               fields: dict | None = None) -> tuple[list[dict], list[int], LoadReport]:
    """Read and validate a JSONL dataset.

    Args:
        path: the file.
        kind: ``sft``, ``preference`` or ``prompt`` (selects the required fields).
        skip_invalid: skip and count invalid rows instead of raising.
        fields: ``{field: the file's column}`` renames (``data.fields``; module docstring).

    Returns:
        ``(rows, line_numbers, report)``: the valid rows as dicts (all fields, extras
        included), the 1-based line number of each, and the report (not yet logged).

    Raises:
        DataError: a missing file, or (without ``skip_invalid``) the first invalid row.
        ValueError: unknown ``kind``.
    """
    path = Path(path)
    if kind not in REQUIRED_FIELDS:
        raise ValueError(f"dataset kind {kind!r}: valid kinds are {sorted(REQUIRED_FIELDS)}")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    rows, wheres, report = _collect(_jsonl_items(path), path, kind, skip_invalid, fields)
    return rows, [int(w.rsplit(":", 1)[1]) for w in wheres], report
