"""The SmolLM2 calculator task (#51): its problems, checker, Hermes call, demonstrations
played against the real calculator environment, the overrides the recipe passes, and (slow,
with the SmolLM2 tokenizer set up) a demonstration's ids equal to the episode's."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rlhf.data.datasets import encode_prompt, encode_segments
from nemo_rlhf.envs.builtin import calculator_env
from nemo_rlhf.envs.config import EnvConfig
from nemo_rlhf.envs.parsing import parse_tool_calls
from nemo_rlhf.rollout.trajectory import Trajectory
from nemo_rlhf.tasks.addition import SMOLLM2_SYSTEM_PROMPT
from nemo_rlhf.tasks.calc_chat import (NO_TOOL, OBSERVATION_TEMPLATE, TASK, calc_chat_answer, calc_chat_problems,
                                       calc_chat_right, tool_call_text)
from nemo_rlhf.tasks.task import demonstration_rows, env_overrides

REPO = Path(__file__).resolve().parents[3]
PROBLEM = {"a": 347, "b": 28, "answer": "9716"}


def test_problems_are_disjoint_and_right():
    train, heldout = calc_chat_problems()
    assert len(train) + len(heldout) == 900 * 89 and len(heldout) == 200
    key = lambda p: (p["a"], p["b"])  # noqa: E731
    assert not {key(p) for p in train} & {key(p) for p in heldout}
    assert all(p["answer"] == str(p["a"] * p["b"]) and 100 <= p["a"] <= 999 and 11 <= p["b"] <= 99
               for p in train + heldout)
    assert TASK.heldout == NO_TOOL.heldout and TASK.train == NO_TOOL.train


@pytest.mark.parametrize("response,answer", [
    ("9716", "9716"), (" 9716\n", "9716"), ("347 * 28 = 9,716.", "9716"), ("The answer is 9716", "9716"),
    ("-12", "-12"), ("1,2", "2"), ("", None), ("I don't know", None),
    (tool_call_text("347*28"), None), ("9716 <tool_call>", None),
])
def test_calc_chat_answer(response, answer):
    assert calc_chat_answer(response) == answer


def test_checker():
    assert calc_chat_right("q", "9716", PROBLEM) and calc_chat_right("q", "347*28 = 9716", PROBLEM)
    assert not calc_chat_right("q", "9717", PROBLEM) and not calc_chat_right("q", "97160", PROBLEM)
    assert not calc_chat_right("q", tool_call_text("9716"), PROBLEM)  # a call is not an answer
    assert TASK.score(["q", "q"], ["9716", "1"], [PROBLEM, PROBLEM]) == [1.0, 0.0]


def test_the_prompts():
    row = TASK.prompt_row(PROBLEM)
    assert row["prompt"].startswith("What is 347*28? Answer with just the number.\nYou may call this tool:\n<tools>\n"
                                    '{"name": "calculator", ')
    assert row["prompt"].endswith('\n</tools>\nTo call it, write <tool_call>\n{"name": "calculator", "arguments": '
                                  '{"expression": ...}}\n</tool_call>')
    assert NO_TOOL.prompt_row(PROBLEM)["prompt"] == "What is 347*28? Answer with just the number."


def test_the_parser_accepts_the_demonstrations_call():
    call = TASK.demonstrate("q", PROBLEM)[0]["text"]
    assert call == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347*28"}}\n</tool_call>'
    parsed = parse_tool_calls(call, "hermes")
    assert parsed.errors == [] and [(c.name, c.arguments) for c in parsed.calls] == [
        ("calculator", {"expression": "347*28"})]


def _env_config() -> EnvConfig:
    return EnvConfig(name=TASK.env, max_turns=2, max_total_tokens=256, observation_template=OBSERVATION_TEMPLATE)


def test_env_overrides_parse_back_to_the_template():
    """The recipe passes ``Task.env_overrides`` as Hydra overrides (one argv item each): the
    observation template, newlines and ChatML tokens included, must come back unchanged."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = env_overrides(TASK)
    assert overrides[:3] == ["env.name='calculator'", "env.max_turns=2", "env.max_total_tokens=256"]
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(overrides)}
    assert parsed == {"env.name": "calculator", "env.max_turns": 2, "env.max_total_tokens": 256,
                      "env.observation_template": OBSERVATION_TEMPLATE}
    assert env_overrides(NO_TOOL) == [] and NO_TOOL.env is None


def test_the_demonstration_is_a_right_episode_of_the_calculator():
    """The demonstration's turns played against ``calculator_env``: the call is answered with
    the observation the env segment holds (``env.observation_template`` filled), the final
    turn ends the episode with reward 1, and the checker marks it right."""
    segs = TASK.demonstrate("q", PROBLEM)
    assert [s["kind"] for s in segs] == ["policy", "env", "policy"]
    cfg = _env_config()
    env = calculator_env(cfg)
    env.reset({"prompt": "q", **PROBLEM})
    tr = Trajectory([1, 2])
    tr.append_policy([5] * 4, [-1.0] * 4)
    r = env.step(tr, segs[0]["text"])
    assert not r.done and r.info["tool_calls"] == 1 and r.info["malformed_calls"] == 0
    assert cfg.encode_observation_text(r.observation) == segs[1]["text"] == (
        "\n<|im_start|>tool\n<tool_response>\n9716\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    tr.append_env([9] * 3)
    tr.append_policy([5] * 2, [-1.0] * 2)
    end = env.step(tr, segs[2]["text"])
    assert end.done and end.reward == 1.0 and not end.info["truncated"]
    assert demonstration_rows(TASK, [TASK.prompt_row(PROBLEM)])[0]["segments"] == segs
    assert demonstration_rows(NO_TOOL, [NO_TOOL.prompt_row(PROBLEM)])[0]["response"] == "9716"


def test_every_heldout_episode_fits_the_budgets():
    """The call turn fits ``Task.max_new_tokens`` with room (at most 2 tokens per character is
    far above BPE's rate: the slow test measures it) and two policy turns fit ``env.max_turns``."""
    for p in TASK.heldout:
        call = TASK.demonstrate("q", p)[0]["text"]
        assert len(call) <= 2 * TASK.max_new_tokens
    assert "env.max_turns=2" in TASK.env_overrides


_TOKENIZER = REPO / "models" / "smollm2" / "megatron_tp1_pp1" / "tokenizer"


@pytest.mark.slow
def test_demonstration_ids_equal_the_episode_ids_with_smollm2():
    """With SmolLM2's tokenizer (set up by ``python -m nemo_rlhf.tools.real_model --out
    models/smollm2``; skipped without it): the SFT row's ids (:func:`encode_segments`) are
    the episode's, built as the rollout builds it (each policy turn ``encode + EOS``, the
    environment's observation tokenised alone after ``env.observation_template``); the whole
    decodes to ChatML with a tool message; every turn fits the budgets."""
    if not (_TOKENIZER / "tokenizer.json").is_file() and not _TOKENIZER.is_dir():
        pytest.skip(f"no SmolLM2 tokenizer at {_TOKENIZER} (python -m nemo_rlhf.tools.real_model --out models/smollm2)")
    from nemo_rlhf.data.tokenizer import Tokenizer

    tok = Tokenizer(_TOKENIZER)
    assert tok.decode([tok.eos_id], skip_special_tokens=False) == "<|im_end|>"
    prompt = TASK.prompt_row(PROBLEM)["prompt"]
    segs = TASK.demonstrate(prompt, PROBLEM)
    ids, mask = encode_segments(tok, segs)

    cfg = _env_config()
    env = calculator_env(cfg)
    prompt_ids = encode_prompt(tok, env.reset({"prompt": prompt, **PROBLEM}), "chatml", SMOLLM2_SYSTEM_PROMPT)
    tr = Trajectory(prompt_ids)
    for turn in (segs[0]["text"], segs[2]["text"]):
        policy = tok.encode(turn) + [tok.eos_id]
        assert len(policy) <= TASK.max_new_tokens
        tr.append_policy(policy, [-1.0] * len(policy))
        r = env.step(tr, tok.decode(policy[:-1], skip_special_tokens=False))
        if r.done:
            break
        tr.append_env(tok.encode(cfg.encode_observation_text(r.observation)))
    assert r.done and r.reward == 1.0
    assert tr.token_ids == prompt_ids + ids
    assert tr.loss_mask[len(prompt_ids):] == mask and sum(mask) == len(tok.encode(segs[0]["text"])) + 6
    assert len(tr.token_ids) <= TASK.max_seq_length
    messages = [("system", SMOLLM2_SYSTEM_PROMPT), ("user", prompt), ("assistant", segs[0]["text"]),
                ("tool", "<tool_response>\n9716\n</tool_response>"), ("assistant", "9716")]
    chatml = "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in messages)
    assert tok.decode(tr.token_ids, skip_special_tokens=False) == chatml[:-1]


def test_task_max_seq_length_is_checked():
    assert TASK.max_seq_length == 256 and NO_TOOL.max_seq_length is None
    from nemo_rlhf.tasks.task import Task

    with pytest.raises(ValueError, match=r"Task.max_seq_length=1: must be >= 2"):
        Task(name="t", train=[{"x": 1}], heldout=[{"x": 2}], prompt_template="{x}=", check=lambda p, r, e: True,
             max_seq_length=1)
