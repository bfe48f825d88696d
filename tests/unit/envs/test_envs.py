"""Environments and tools (#51): tool-call parsing (Hermes/Qwen, Llama 3.1), malformed calls
as error observations, the registry's schema checks and time limit, the calculator, the
limits' validation, ToolEnvironment's episode (sync and async)."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from nemo_rlhf.envs import (
    EnvLimits,
    Environment,
    StepResult,
    Tool,
    ToolCall,
    ToolEnvironment,
    ToolRegistry,
    calculator,
    calculator_tool,
    evaluate_arithmetic,
    parse_tool_calls,
)
from nemo_rlhf.rollout.trajectory import Trajectory

# --------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------


def test_hermes_calls():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n'
            '</tool_call>\n<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}'
            '</tool_call>')
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.calls == [ToolCall("calculator", {"expression": "12*34"}),
                            ToolCall("calculator", {"expression": "1+1"})]  # string arguments parsed
    assert parsed.errors == []
    plain = parse_tool_calls("The answer is 408.", "hermes")
    assert not plain.has_calls


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}</tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {"expression": "1"}}</tool_call>', "no tool 'name'"),
    ('<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>["calculator"]</tool_call>', "must be a JSON object, got list"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "without </tool_call>"),
])
def test_hermes_malformed_calls_are_errors(text, error):
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.calls == [] and len(parsed.errors) == 1 and error in parsed.errors[0]
    assert parsed.has_calls


def test_llama3_calls():
    one = parse_tool_calls('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2**10"}}<|eom_id|>',
                           "llama3")
    assert one.calls == [ToolCall("calculator", {"expression": "2**10"})] and one.errors == []
    untagged = parse_tool_calls('{"name": "calculator", "parameters": {"expression": "1;2"}}', "llama3")
    assert untagged.calls == [ToolCall("calculator", {"expression": "1;2"})]  # ';' in a string is kept
    two = parse_tool_calls('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', "llama3")
    assert two.calls == [ToolCall("a", {}), ToolCall("b", {"x": 1})]
    assert not parse_tool_calls("The answer is 408.<|eot_id|>", "llama3").has_calls


def test_llama3_malformed_calls_are_errors():
    bad_json = parse_tool_calls('{"name": "calculator", "parameters": {"expression": "1"}', "llama3")
    assert bad_json.calls == [] and "not valid JSON" in bad_json.errors[0]
    code = parse_tool_calls("<|python_tag|>brave_search.call(query='x')", "llama3")
    assert code.calls == [] and "must be followed by a JSON tool call" in code.errors[0]
    prose = parse_tool_calls('{"name": "calculator", "parameters": {"expression": "1"}} then more', "llama3")
    assert prose.calls == [] and "not valid JSON" in prose.errors[0]


def test_unknown_format_names_the_key():
    with pytest.raises(ValueError, match="env.tool_call_format"):
        parse_tool_calls("x", "mistral")


# --------------------------------------------------------------------------------------
# Tools and the registry
# --------------------------------------------------------------------------------------


def _sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return "woke"


def _boom(x: int) -> str:
    raise RuntimeError("tool crashed")


@pytest.fixture
def registry():
    reg = ToolRegistry()
    reg.register(calculator_tool())
    reg.register(Tool("sleep", _sleepy, {"type": "object", "required": ["seconds"],
                                         "properties": {"seconds": {"type": "number"}}}, time_limit_s=0.2))
    reg.register(Tool("boom", _boom, {"type": "object", "properties": {"x": {"type": "integer"}}}))
    reg.register(Tool("obj", lambda: {"not": "text"}, {"type": "object"}))
    return reg


def test_registry_runs_a_tool(registry):
    r = registry.call("calculator", {"expression": "123 * 456"})
    assert (r.ok, r.text, r.error) == (True, "56088", None)
    assert [s["function"]["name"] for s in registry.specs()] == ["calculator", "sleep", "boom", "obj"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(calculator_tool())


@pytest.mark.parametrize("name, args, error, text", [
    ("nope", {}, "unknown_tool", "unknown tool 'nope'"),
    ("calculator", {}, "bad_arguments", "missing required argument 'expression'"),
    ("calculator", {"expression": 12}, "bad_arguments", "must be of type string"),
    ("calculator", {"expression": "1", "x": 1}, "bad_arguments", "unknown argument 'x'"),
    ("boom", {"x": True}, "bad_arguments", "must be of type integer, got bool"),
    ("calculator", {"expression": "__import__('os')"}, "raised", "Call is not allowed"),
    ("boom", {"x": 1}, "raised", "RuntimeError: tool crashed"),
    ("obj", {}, "bad_output", "returned dict"),
])
def test_registry_answers_failures_with_an_error_text(registry, name, args, error, text):
    r = registry.call(name, args)
    assert not r.ok and r.error == error and text in r.text and r.text.startswith("Error:")


def test_a_tool_past_its_time_limit_times_out(registry):
    start = time.monotonic()
    r = registry.call("sleep", {"seconds": 3.0})
    waited = time.monotonic() - start
    assert (r.ok, r.error) == (False, "timeout") and "timed out after 0.2 s" in r.text
    assert waited < 1.5  # the 0.2 s limit, not the tool's 3 s
    short = registry.call("sleep", {"seconds": 3.0}, budget_s=0.05)  # the episode's budget is smaller
    assert short.error == "timeout" and "0.05 s" in short.text
    assert registry.call("sleep", {"seconds": 0.0}).text == "woke"
    assert registry.call("sleep", {"seconds": 0.0}, budget_s=0.0).error == "timeout"


def test_bad_tool_definitions_are_refused():
    with pytest.raises(ValueError, match="time_limit_s=0"):
        Tool("t", _sleepy, {"type": "object"}, time_limit_s=0)
    with pytest.raises(ValueError, match="property 'a' has type 'float'"):
        Tool("t", _sleepy, {"type": "object", "properties": {"a": {"type": "float"}}})
    with pytest.raises(ValueError, match=r"required \['b'\]"):
        Tool("t", _sleepy, {"type": "object", "properties": {}, "required": ["b"]})
    with pytest.raises(ValueError, match="type 'object'"):
        Tool("t", _sleepy, {"type": "array"})


@pytest.mark.parametrize("expr, value", [
    ("123*456", 56088), ("-(2+3)*4", -20), ("7/2", 3.5), ("7//2", 3), ("2**10", 1024), ("10 % 4", 2),
    ("1.5 + 1.5", 3.0), ("+3", 3),
])
def test_calculator_values(expr, value):
    assert evaluate_arithmetic(expr) == value


def test_calculator_writes_integral_floats_as_integers():
    assert calculator("6/2") == "3" and calculator("7/2") == "3.5"


@pytest.mark.parametrize("expr, error", [
    ("__import__('os').system('x')", "Call is not allowed"),
    ("a + 1", "Name is not allowed"),
    ("(1).real", "Attribute is not allowed"),
    ("[1, 2]", "List is not allowed"),
    ("'ab' * 3", "Constant is not allowed"),
    ("True + 1", "Constant is not allowed"),
    ("1 / 0", "division by zero"),
    ("2 ** 1000", "exponent 1000 exceeds"),
    ("10 ** 40", "exceeds"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 300, "longer than 200"),
])
def test_calculator_refuses(expr, error):
    with pytest.raises(ValueError, match=error):
        evaluate_arithmetic(expr)


# --------------------------------------------------------------------------------------
# Limits and the interface
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"max_turns": 0}, "env.max_turns=0"),
    ({"max_turns": 2.5}, "env.max_turns=2.5"),
    ({"max_total_tokens": -1}, "env.max_total_tokens=-1"),
    ({"max_tool_time_s": 0}, "env.max_tool_time_s=0"),
    ({"max_tool_time_s": float("inf")}, "env.max_tool_time_s=inf"),
])
def test_limits_validation_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EnvLimits(**kwargs)


def test_step_result_checks():
    with pytest.raises(ValueError, match="needs an observation"):
        StepResult(None, False)
    with pytest.raises(ValueError, match="finite"):
        StepResult(None, True, float("nan"))
    with pytest.raises(TypeError, match="str or None"):
        StepResult(b"x", False)


def test_default_astep_runs_step_in_a_thread():
    class Echo(Environment):
        def reset(self, problem):
            return str(problem)

        def step(self, trajectory_so_far, last_action_text):
            return StepResult(f"{last_action_text} from {threading.current_thread().name}", False)

    env = Echo()
    assert env.reset(3) == "3"
    out = asyncio.run(env.astep(None, "hi"))
    assert out.observation.startswith("hi from ") and threading.current_thread().name not in out.observation


# --------------------------------------------------------------------------------------
# ToolEnvironment: one episode
# --------------------------------------------------------------------------------------


def _traj(turns: int, tokens_per_turn: int = 3) -> Trajectory:
    tr = Trajectory([1, 2])
    for i in range(turns):
        if i:
            tr.append_env([9])
        tr.append_policy([5] * tokens_per_turn, [-1.0] * tokens_per_turn)
    return tr


def _env(registry, **limits):
    return ToolEnvironment(registry, "hermes", EnvLimits(**limits),
                           reward_fn=lambda problem, text: float(problem["answer"] in text))


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


def test_tool_episode(registry):
    env = _env(registry)
    assert env.reset({"prompt": "What is 12*34?", "answer": "408"}) == "What is 12*34?"
    first = env.step(_traj(1), "I will compute it. " + CALL)
    assert first == StepResult("<tool_response>\n408\n</tool_response>", False, None,
                               {"tool_calls": 1, "malformed_calls": 0, "tool_time_s": first.info["tool_time_s"],
                                "truncated": False})
    final = env.step(_traj(2), "The answer is 408.")
    assert (final.observation, final.done, final.reward) == (None, True, 1.0)
    assert final.info["tool_calls"] == 1 and not final.info["truncated"]
    # async form: the same answer
    env.reset({"prompt": "x", "answer": "408"})
    assert asyncio.run(env.astep(_traj(1), CALL)).observation == first.observation


def test_malformed_and_failing_calls_are_observations(registry):
    env = _env(registry)
    env.reset({"prompt": "x", "answer": "1"})
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": 12}}</tool_call>'
            '<tool_call>{"name": "calculator" "arguments": {}}</tool_call>'
            '<tool_call>{"name": "sleep", "arguments": {"seconds": 3}}</tool_call>')
    out = env.step(_traj(1), text)
    assert not out.done and out.reward is None
    obs = out.observation
    # the parse error first, then the calls in order
    assert obs.index("not valid JSON") < obs.index("must be of type string") < obs.index("timed out")
    assert out.info["malformed_calls"] == 2 and out.info["tool_calls"] == 2


def test_episode_tool_time_budget(registry):
    env = _env(registry, max_tool_time_s=0.3)
    env.reset({"prompt": "x", "answer": "1"})
    sleep = '<tool_call>{"name": "sleep", "arguments": {"seconds": 5}}</tool_call>'
    env.step(_traj(1), sleep)  # uses its 0.2 s limit
    second = env.step(_traj(2), sleep)  # about 0.1 s left of the episode's 0.3 s
    left = float(re.search(r"timed out after ([0-9.e-]+) s", second.observation).group(1))
    assert 0 < left <= 0.1 + 1e-9
    third = env.step(_traj(3), sleep)
    assert "tool time is used up" in third.observation


@pytest.mark.parametrize("limits, traj, reason", [
    ({"max_turns": 2}, _traj(2), "max_turns"),
    ({"max_total_tokens": 8}, _traj(2), "max_total_tokens"),  # 2 + 3 + 1 + 3 = 9 tokens
])
def test_limits_end_the_episode_truncated(registry, limits, traj, reason):
    env = _env(registry, **limits)
    env.reset({"prompt": "x", "answer": "1"})
    out = env.step(traj, CALL)
    assert (out.observation, out.done, out.reward) == (None, True, None)
    assert out.info["truncated"] and out.info["reason"] == reason
    assert not _env(registry, max_turns=3).step(_traj(2), CALL).done  # under the limit: goes on


def test_llama3_environment_and_bad_format(registry):
    env = ToolEnvironment(registry, "llama3", EnvLimits(), observation_format="plain")
    env.reset("What is 2**10?")
    out = env.step(_traj(1), '<|python_tag|>{"name": "calculator", "parameters": {"expression": "2**10"}}')
    assert out.observation == "1024"
    with pytest.raises(ValueError, match="env.tool_call_format"):
        ToolEnvironment(registry, "xml", EnvLimits())
    with pytest.raises(ValueError, match="env.observation_format"):
        ToolEnvironment(registry, "hermes", EnvLimits(), observation_format="json")
