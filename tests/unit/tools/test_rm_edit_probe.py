"""python -m nemo_rlhf.tools.rm_edit_probe: each answer against its edit, the RM's share right
(ties 1/2) over all and by edit label, bad input named."""

from __future__ import annotations

import dataclasses
import json

import pytest

from nemo_rlhf.tasks.addition import TASK, addition_answer
from nemo_rlhf.tools import rm_edit_probe
from nemo_rlhf.tools.rm_edit_probe import edit_accuracy, main, probe

ROWS = [
    {"prompt": "What is 12+30? Answer with just the number.", "response": "12 + 30 = 42", "correct": 1.0,
     "length": 8, "extras": {"answer": "42"}},
    {"prompt": "What is 25+17? Answer with just the number.", "response": "25 + 17 = 32", "correct": 0.0,
     "length": 8, "extras": {"answer": "42"}},
    {"prompt": "What is 50+11? Answer with just the number.", "response": "I do not know.", "correct": 0.0,
     "length": 5, "extras": {"answer": "61"}},  # states no number: no edit, no pair
]


def _score(prompts, responses):
    """Right (1) or not (0) on the 12+30 prompt, 0 for everything else (a tie)."""
    return [float(addition_answer(r) == 42) if "12+30" in p else 0.0 for p, r in zip(prompts, responses)]


def test_each_answer_against_its_edit_scored_and_counted_by_label():
    scored = probe(TASK, ROWS, _score)
    assert [(p["edit"], p["chosen"]) for p in scored] == [("wrong_sum", "12 + 30 = 42"), ("right_sum", "25 + 17 = 42")]
    assert scored[0]["rejected"] != "12 + 30 = 42" and addition_answer(scored[0]["rejected"]) != 42
    assert scored[1]["rejected"] == "25 + 17 = 32"
    assert [(p["chosen_score"], p["rejected_score"]) for p in scored] == [(1.0, 0.0), (0.0, 0.0)]
    assert edit_accuracy(scored) == {"all": (2, 0.75), "wrong_sum": (1, 1.0), "right_sum": (1, 0.5)}
    reversed_scores = [{**p, "chosen_score": p["rejected_score"], "rejected_score": p["chosen_score"]} for p in scored]
    assert edit_accuracy(reversed_scores)["all"] == (2, 0.25)
    assert edit_accuracy([]) == {}
    with pytest.raises(ValueError, match="1 scores for 4 responses"):
        probe(TASK, ROWS, lambda p, r: [0.0])


class _Client:
    def __init__(self):
        self.calls = 0

    def score_texts(self, prompts, responses):
        self.calls += 1
        return _score(prompts, responses)


def test_the_command_prints_each_file_and_writes_the_pairs(tmp_path, monkeypatch, capsys):
    from nemo_rlhf.reward.client import RewardModelClient

    client = _Client()
    monkeypatch.setattr(RewardModelClient, "from_address_file", classmethod(lambda cls, path, **kw: client))
    samples = tmp_path / "step_000010.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    assert main([str(samples), "--task", "nemo_rlhf.tasks.addition:TASK", "--rm-address-file", "x",
                 "--out", str(tmp_path / "pairs")]) == 0
    assert f"{samples}: RM right on edited pairs: all 0.750 of 2, wrong_sum 1.000 of 1, right_sum 0.500 of 1" \
        in capsys.readouterr().out
    written = [json.loads(line) for line in (tmp_path / "pairs" / "step_000010.pairs.jsonl").read_text().splitlines()]
    assert [(p["edit"], p["chosen_score"]) for p in written] == [("wrong_sum", 1.0), ("right_sum", 0.0)]
    assert client.calls == 1


def test_bad_input_is_named_and_nothing_is_scored(tmp_path, monkeypatch, capsys):
    from nemo_rlhf.reward.client import RewardModelClient

    client = _Client()
    monkeypatch.setattr(RewardModelClient, "from_address_file", classmethod(lambda cls, path, **kw: client))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    args = ["--task", "nemo_rlhf.tasks.addition:TASK", "--rm-address-file", "x"]
    assert main([str(bad), *args]) == 2
    assert f"{bad}:2: not JSON" in capsys.readouterr().err
    bad.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    assert main([str(bad), *args]) == 2
    assert f"{bad}:1: a sample row needs ['correct']" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.jsonl"), *args]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    monkeypatch.setattr(rm_edit_probe, "load_task", lambda spec: (dataclasses.replace(TASK, edit_answer=None), ""))
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(ROWS[0]) + "\n")
    assert main([str(good), *args]) == 2
    assert "no Task.edit_answer" in capsys.readouterr().err
    assert client.calls == 0
