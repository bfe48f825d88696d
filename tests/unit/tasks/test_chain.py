"""The long chain task (#52): its problems, the written-out chain, the checker, the SFT
demonstrations and the response length on the tiny model's character tokenizer."""

from __future__ import annotations

import pytest

from nemo_rlhf.tasks.chain import (TASK, TASK_2K, chain_answer, chain_answer_right, chain_char_match,
                                   chain_overrides, chain_prefix_right, chain_problems, chain_response, chain_task,
                                   char_score, line_width, prefix_score, response_tokens)
from nemo_rlhf.tasks.task import demonstration_rows


def test_problems_are_every_start_and_step_once_with_the_closed_form_answer():
    train, heldout = chain_problems(47)
    assert len(train) == 800 and len(heldout) == 100
    keys = [(p["start"], p["step"]) for p in train + heldout]
    assert len(set(keys)) == 900 and not {k for k in keys[:800]} & {k for k in keys[800:]}
    # 07 + 47 * 3 = 148 -> 48 (mod 100), at two digits
    p = next(p for p in train + heldout if (p["start"], p["step"]) == ("07", 3))
    assert p == {"start": "07", "step": 3, "steps": 47, "answer": "48"}
    assert chain_problems(47, seed=1)[1] != heldout  # the seed shuffles
    with pytest.raises(ValueError, match="steps=0"):
        chain_problems(0)


def test_chain_by_hand():
    assert chain_response("07", 3, 2) == "1:07+3=10\n2:10+3=13"
    assert chain_response("98", 5, 3) == "1:98+5=03\n2:03+5=08\n3:08+5=13"  # mod 100, two digits
    lines = chain_response("07", 3, 47).split("\n")
    assert len(lines) == 47 and lines[0] == "01:07+3=10" and lines[-1] == "47:45+3=48"
    assert lines[9] == "10:34+3=37"  # the line number at its width: 01 .. 47


@pytest.mark.parametrize("response,answer", [
    ("1:07+3=10\n2:10+3=13", "13"), ("13", None), ("x=13 \n", "13"), ("47:45+3=", None), ("", None),
    ("1:07+3=1 3", None), ("=-3", None),
])
def test_chain_answer_is_the_number_after_the_last_equals(response, answer):
    assert chain_answer(response) == answer


def test_checker_compares_the_final_number_at_two_digits():
    ex = {"answer": "48"}
    right = chain_response("07", 3, 47)
    assert chain_answer_right("07+3=", right, ex)
    assert not chain_answer_right("07+3=", right[:-1] + "9", ex)
    assert not chain_answer_right("07+3=", right.rsplit("\n", 1)[0], ex)  # a line short: 45, wrong
    assert chain_answer_right("07+3=", "=48", ex)  # the final number only (documented: no line check)
    assert not chain_answer_right("02+3=", "...=8", {"answer": "08"})


def test_task_prompts_demonstrations_and_score():
    row = TASK.prompt_row({"start": "07", "step": 3, "steps": 47, "answer": "48"})
    assert row["prompt"] == "07+3="
    rows = demonstration_rows(TASK, [TASK.prompt_row(p) for p in TASK.train[:20]])
    assert all(r["response"] == chain_response(p["start"], p["step"], 47) for r, p in zip(rows, TASK.train))
    responses = [r["response"] for r in rows]
    extras = [dict(p) for p in TASK.train[:20]]
    assert TASK.score([r["prompt"] for r in rows], responses, extras) == [1.0] * 20
    j = next(j for j in range(1, 20) if extras[j]["answer"] != extras[0]["answer"])
    assert TASK.score([rows[0]["prompt"]], [responses[j]], [extras[0]]) == [0.0]  # another chain's end


@pytest.mark.parametrize("task,steps,tokens", [(TASK, 47, 517), (TASK_2K, 170, 2040)])
def test_response_length_on_the_tiny_tokenizer_is_in_the_512_2048_range(task, steps, tokens, tmp_path):
    from launchers.tiny_model import write_tiny_tokenizer
    from nemo_rlhf.data.tokenizer import Tokenizer

    tok = Tokenizer(write_tiny_tokenizer(tmp_path / "tok"))
    p = task.heldout[0]
    ids = tok.encode(chain_response(p["start"], p["step"], steps))
    assert len(ids) + 1 == tokens == response_tokens(steps)  # + EOS
    assert 512 <= tokens <= 2048
    assert task.max_new_tokens == tokens + line_width(steps)
    prompt = len(tok.encode(task.prompt_row(p)["prompt"])) + 1  # + BOS
    overrides = dict(o.split("=") for o in chain_overrides(task))
    assert int(overrides["data.max_seq_length"]) >= prompt + task.max_new_tokens
    assert overrides["model.max_position_embeddings"] == overrides["data.max_seq_length"]
    assert int(overrides["rollout.max_new_tokens"]) == task.max_new_tokens


def test_chain_task_names_and_budget():
    t = chain_task(4)
    assert t.name == "chain4" and t.max_new_tokens == 4 * 10 + 10
    # 8 prompt tokens + 50: 58, rounded up to 64
    assert chain_overrides(t) == ["model.max_position_embeddings=64", "data.max_seq_length=64",
                                  "rollout.max_new_tokens=50"]
    assert chain_overrides(chain_task(5))[:2] == ["model.max_position_embeddings=128", "data.max_seq_length=128"]


def test_prefix_score_is_the_share_of_lines_right_before_the_first_slip():
    ex = {"start": "07", "step": 3, "steps": 4, "answer": "19"}
    right = chain_response("07", 3, 4)  # 1:07+3=10 2:10+3=13 3:13+3=16 4:16+3=19
    assert chain_prefix_right("07+3=", right, ex) == 1.0
    assert chain_prefix_right("07+3=", right + "\n5:19+3=22", ex) == 1.0  # lines past the chain: not read
    slipped = right.replace("2:10+3=13", "2:10+3=14")
    assert chain_prefix_right("07+3=", slipped, ex) == 0.25  # line 3 right again, but after the slip
    assert chain_prefix_right("07+3=", right.rsplit("\n", 1)[0], ex) == 0.75  # a missing line
    assert chain_prefix_right("07+3=", "", ex) == 0.0
    assert prefix_score(["07+3="] * 2, [right, slipped], [ex, ex]) == [1.0, 0.25]
    with pytest.raises(ValueError, match="same length"):
        prefix_score(["07+3="], [], [ex])


def test_char_score_is_the_share_of_the_chains_characters_right_at_their_position():
    ex = {"start": "07", "step": 3, "steps": 2, "answer": "13"}
    right = chain_response("07", 3, 2)  # "1:07+3=10\n2:10+3=13": 19 characters
    assert chain_char_match("07+3=", right, ex) == 1.0
    assert chain_char_match("07+3=", right + "\n3:13+3=16", ex) == 1.0  # past the end: not read
    # every one of the 10 digits wrong, the 9 others (line numbers, ":+=", newline) right
    assert chain_char_match("07+3=", "1:99+9=99\n2:99+9=99", ex) == pytest.approx(9 / 19)
    assert chain_char_match("07+3=", "1:00+0=00\n2:00+0=00", ex) == pytest.approx(12 / 19)  # 3 zeros right
    assert chain_char_match("07+3=", "1:07", ex) == pytest.approx(4 / 19)  # the rest missing
    assert chain_char_match("07+3=", "", ex) == 0.0
    assert char_score(["07+3="] * 2, [right, "1:07"], [ex, ex]) == pytest.approx([1.0, 4 / 19])
    with pytest.raises(ValueError, match="same length"):
        char_score(["07+3="], [], [ex])
