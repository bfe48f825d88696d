"""Tools a policy may call: a Python callable with a name, a JSON argument schema and a time
limit, kept in a :class:`ToolRegistry` (#51).

:meth:`ToolRegistry.call` never raises for what a model can get wrong: an unknown tool,
arguments that do not match the schema, a tool that raises, one that runs past its time
limit or returns something that is not text: each comes back as a :class:`ToolResult`
with ``ok=False`` and an error text the model reads as the tool's output (its next turn
can correct the call).

Time limit: the call runs in a daemon worker thread and the registry waits at most the
limit (``min(tool.time_limit_s, budget)``); past it the call is answered with a timeout
error at once. Python cannot stop a thread: a timed-out call keeps its thread until it
returns (its result is dropped), so a tool that may never return should bound its own
work (the calculator does, by refusing large operands) or run its work in a subprocess.

The argument schema is the JSON-Schema subset tool definitions use (Hermes/Qwen and
Llama 3.1 tool prompts): ``{"type": "object", "properties": {name: {"type": ...,
"description": ...}}, "required": [...]}``, property types ``string``, ``number``,
``integer``, ``boolean``, ``array``, ``object``; unknown arguments are refused.
"""

from __future__ import annotations

import ast
import math
import operator
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

__all__ = ["Tool", "ToolRegistry", "ToolResult", "calculator", "calculator_tool", "evaluate_arithmetic"]

_JSON_TYPES = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def _check_schema(name: str, schema: Dict[str, Any]) -> None:
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ValueError(f"tool {name!r}: parameters must be a JSON schema of type 'object', got {schema!r}")
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise ValueError(f"tool {name!r}: 'properties' must be an object")
    for key, spec in props.items():
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind not in _JSON_TYPES:
            raise ValueError(f"tool {name!r}: property {key!r} has type {kind!r}; valid types are "
                             f"{sorted(_JSON_TYPES)}")
    missing = [k for k in schema.get("required", []) if k not in props]
    if missing:
        raise ValueError(f"tool {name!r}: required {missing} are not in its properties")


def _argument_errors(schema: Dict[str, Any], arguments: Any) -> List[str]:
    if not isinstance(arguments, dict):
        return [f"arguments must be a JSON object, got {type(arguments).__name__}"]
    props = schema.get("properties", {})
    errors = [f"missing required argument {k!r}" for k in schema.get("required", []) if k not in arguments]
    for key, value in arguments.items():
        if key not in props:
            errors.append(f"unknown argument {key!r} (valid: {sorted(props)})")
            continue
        kind = props[key]["type"]
        ok = isinstance(value, _JSON_TYPES[kind]) and not (kind in ("number", "integer") and isinstance(value, bool))
        if not ok:
            errors.append(f"argument {key!r} must be of type {kind}, got {type(value).__name__}")
    return errors


@dataclass(frozen=True)
class Tool:
    """A callable the policy may call by ``name`` with keyword ``arguments``.

    Raises (at construction):
        ValueError: an empty name, a schema outside the supported subset, a time limit
            that is not a finite number > 0.
    """

    name: str
    fn: Callable[..., Any]
    """Called as ``fn(**arguments)``; returns the text the model reads (a str, or a number
    or bool, written with ``str``)."""
    parameters: Dict[str, Any]
    """The JSON argument schema (see the module docstring)."""
    description: str = ""
    time_limit_s: float = 5.0
    """Seconds one call may take (> 0)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"tool name must be a non-empty string, got {self.name!r}")
        _check_schema(self.name, self.parameters)
        t = self.time_limit_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise ValueError(f"tool {self.name!r}: time_limit_s={t!r} must be a finite number > 0")

    def spec(self) -> Dict[str, Any]:
        """The OpenAI-style definition chat templates take (``tools=[...]``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolResult:
    """The outcome of one call: ``text`` is what the model reads either way."""

    ok: bool
    text: str
    error: Optional[str] = None
    """``unknown_tool``, ``bad_arguments``, ``raised``, ``timeout`` or ``bad_output``
    (None when ``ok``)."""
    seconds: float = 0.0


@dataclass
class ToolRegistry:
    """Tools by name."""

    tools: Dict[str, Tool] = field(default_factory=dict)

    def register(self, tool: Tool) -> None:
        """Add ``tool``.

        Raises:
            ValueError: a tool of that name is already registered.
        """
        if tool.name in self.tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self.tools[tool.name] = tool

    def specs(self) -> List[Dict[str, Any]]:
        """Every tool's definition (:meth:`Tool.spec`), for the chat template's ``tools``."""
        return [t.spec() for t in self.tools.values()]

    def call(self, name: str, arguments: Any, budget_s: Optional[float] = None) -> ToolResult:
        """Run tool ``name`` with ``arguments`` within ``min(tool.time_limit_s, budget_s)``
        seconds. Never raises for the model's mistakes or the tool's failures (see the
        module docstring); the error texts name the tool and what was wrong."""
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(False, f"Error: unknown tool {name!r}; available tools: {sorted(self.tools)}",
                              "unknown_tool")
        errors = _argument_errors(tool.parameters, arguments)
        if errors:
            return ToolResult(False, f"Error: bad arguments for {name!r}: " + "; ".join(errors), "bad_arguments")
        limit = tool.time_limit_s if budget_s is None else min(tool.time_limit_s, budget_s)
        if limit <= 0:
            return ToolResult(False, f"Error: {name!r} not run: the episode's tool time is used up", "timeout")
        box: Dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = tool.fn(**arguments)
            except Exception as exc:  # the tool's failure is the model's observation
                box["exc"] = exc

        start = time.monotonic()
        worker = threading.Thread(target=run, name=f"tool-{name}", daemon=True)
        worker.start()
        worker.join(limit)
        seconds = time.monotonic() - start
        if worker.is_alive():
            return ToolResult(False, f"Error: {name!r} timed out after {limit:.3g} s", "timeout", seconds)
        if "exc" in box:
            exc = box["exc"]
            return ToolResult(False, f"Error: {name!r} failed: {type(exc).__name__}: {exc}", "raised", seconds)
        value = box.get("value")
        if isinstance(value, (str, int, float, bool)):
            return ToolResult(True, str(value), None, seconds)
        return ToolResult(False, f"Error: {name!r} returned {type(value).__name__}, not text", "bad_output", seconds)


# --------------------------------------------------------------------------------------
# The calculator: arithmetic on an AST, no eval()
# --------------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10 ** 30
MAX_EXPONENT = 64


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, ``+ - * / // % **``, unary ``+ -``
    and parentheses, parsed with :mod:`ast` and evaluated node by node (no ``eval``: names,
    calls, attributes and every other node are refused).

    Bounds keep a call cheap: at most :data:`MAX_EXPRESSION_CHARS` characters, exponents
    of magnitude at most :data:`MAX_EXPONENT`, operands and results of magnitude at most
    :data:`MAX_MAGNITUDE`.

    Raises:
        ValueError: a syntax error, a refused construct (named), a bound exceeded,
            division by zero.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None

    def check(x):
        if isinstance(x, complex):
            raise ValueError("result is not a real number")
        if isinstance(x, float) and not math.isfinite(x):
            raise ValueError("result is not finite")
        if abs(x) > MAX_MAGNITUDE:
            raise ValueError(f"a value exceeds {MAX_MAGNITUDE:.0e} in magnitude")
        return x

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return check(_UNARY[type(node.op)](ev(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} exceeds {MAX_EXPONENT} in magnitude")
            try:
                return check(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
            except OverflowError:
                raise ValueError("result too large") from None
        raise ValueError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")

    return ev(tree)


def calculator(expression: str) -> str:
    """The calculator tool's function: the value of ``expression`` as text (an integral
    float is written without ``.0``). Raises ``ValueError`` like :func:`evaluate_arithmetic`
    (the registry turns it into an error observation)."""
    value = evaluate_arithmetic(expression)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def calculator_tool(time_limit_s: float = 1.0) -> Tool:
    """The calculator as a :class:`Tool` named ``calculator`` with one string argument
    ``expression``."""
    return Tool(
        name="calculator", fn=calculator, time_limit_s=time_limit_s,
        description="Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        parameters={"type": "object", "required": ["expression"],
                    "properties": {"expression": {"type": "string",
                                                  "description": "e.g. '123 * 456'"}}})
