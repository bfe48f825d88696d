"""Tool calls parsed from a model's turn, in the model's own chat-template format (#51).

Formats (``env.tool_call_format``):

* ``hermes`` -- Hermes / Qwen2.5 / Qwen3 (their chat templates' tool prompt): each call is
  a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
  ``</tool_call>``; several blocks are several calls. (Qwen's templates also write
  ``arguments`` as a JSON string when the tool history holds one: a string that parses to an
  object is accepted.)
* ``llama3`` -- Llama 3.1/3.2/3.3's JSON tool calling (Meta's prompt format for
  user-defined tools): the turn is a JSON object ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>`` and before ``<|eom_id|>`` / ``<|eot_id|>``; several
  calls are separated by ``;``. A turn that does not start with ``{`` (after the tag) is a
  plain answer, unless it carries ``<|python_tag|>`` (Llama's built-in code-interpreter
  form, Python code, not supported here: an error).

A malformed call (JSON that does not parse, no ``name``, arguments that are not an object,
an unclosed ``<tool_call>``) is not dropped silently: it is returned in
:attr:`ParsedTurn.errors`, which the environment answers with an error observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from nemo_rlhf.config import check_choice

__all__ = ["TOOL_CALL_FORMATS", "ParsedTurn", "ToolCall", "parse_tool_calls"]

TOOL_CALL_FORMATS = ("hermes", "llama3")
"""The tool-call formats :func:`parse_tool_calls` reads (module docstring)."""

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_LLAMA_TAG = "<|python_tag|>"
_LLAMA_END = ("<|eom_id|>", "<|eot_id|>")


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: a tool name and its arguments (a JSON object)."""

    name: str
    arguments: Dict[str, Any]


@dataclass
class ParsedTurn:
    """What a turn asked for: well-formed ``calls`` and ``errors`` (one text per malformed
    call). A turn with neither is a plain answer."""

    calls: List[ToolCall] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        """The turn tried to call a tool (well-formed or not)."""
        return bool(self.calls or self.errors)


def _to_call(raw: str, args_key: str, out: ParsedTurn, where: str) -> None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        out.errors.append(f"{where}: not valid JSON ({exc.msg} at character {exc.pos}): {raw.strip()[:80]!r}")
        return
    if not isinstance(obj, dict):
        out.errors.append(f"{where}: a tool call must be a JSON object, got {type(obj).__name__}")
        return
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        out.errors.append(f"{where}: no tool 'name' (a non-empty string) in {raw.strip()[:80]!r}")
        return
    args: Optional[Any] = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # arguments written as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        out.errors.append(f"{where}: the {args_key!r} of {name!r} must be a JSON object, got {args!r}"[:200])
        return
    out.calls.append(ToolCall(name, args))


def _split_json_objects(text: str) -> List[str]:
    """``text`` cut into top-level JSON objects separated by ``;`` (braces inside strings
    do not count)."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            esc = (ch == "\\") and not esc
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (x.strip() for x in parts) if p]


def parse_tool_calls(text: str, fmt: str) -> ParsedTurn:
    """The tool calls in a model's turn ``text`` (decoded, special tokens kept).

    Args:
        text: the policy's turn.
        fmt: one of :data:`TOOL_CALL_FORMATS`.

    Returns:
        :class:`ParsedTurn`: the well-formed calls in order, and one error text per
        malformed one.

    Raises:
        ValueError: an unknown ``fmt`` (naming ``env.tool_call_format`` and the choices).
    """
    check_choice("env.tool_call_format", fmt, TOOL_CALL_FORMATS)
    out = ParsedTurn()
    if fmt == "hermes":
        blocks = list(_HERMES_BLOCK.finditer(text))
        for i, m in enumerate(blocks):
            _to_call(m.group(1), "arguments", out, f"tool call {i + 1}")
        tail = text[blocks[-1].end():] if blocks else text
        if "<tool_call>" in tail:
            out.errors.append(f"tool call {len(blocks) + 1}: <tool_call> without </tool_call>")
        return out
    body = text
    for end in _LLAMA_END:
        body = body.replace(end, "")
    tagged = _LLAMA_TAG in body
    body = body.replace(_LLAMA_TAG, "").strip()
    if not body.startswith("{"):
        if tagged:
            out.errors.append("tool call 1: <|python_tag|> must be followed by a JSON tool call "
                              "{\"name\": ..., \"parameters\": {...}} (built-in Python tools are not supported)")
        return out
    for i, raw in enumerate(_split_json_objects(body)):
        _to_call(raw, "parameters", out, f"tool call {i + 1}")
    return out
