"""Bad-case replay pairs: the RM's disagreements with the labeller, counted by hand."""

from __future__ import annotations

import pytest

from nemo_rlhf.data.bad_cases import disagreement_pairs


def _row(prompt, response, score, rm, **extra):
    return {"prompt": prompt, "response": response, "correct": score, "rm_score": rm, **extra}


def test_disagreements_are_the_pairs_the_rm_ranks_against_the_labeller():
    rows = [
        # p1: right "5" (rm 0.1), wrong "6" (rm 0.9), wrong "7" (rm -1.0): 2 candidates, 1 disagreement
        _row("p1", "5", 1.0, 0.1, answer=5), _row("p1", "6", 0.0, 0.9, answer=5),
        _row("p1", "7", 0.0, -1.0, answer=5),
        _row("p1", "6", 0.0, 0.9, answer=5),  # a duplicate text: merged
        # p2: a tie counts as a disagreement: 1 candidate, 1 disagreement
        _row("p2", "a", 1.0, 0.5, answer=3), _row("p2", "b", 0.0, 0.5, answer=3),
        # p3: all right: no candidate
        _row("p3", "x", 1.0, 0.0), _row("p3", "y", 1.0, 2.0),
    ]
    pairs, stats = disagreement_pairs(rows, extra_keys=("answer",))
    assert stats.as_dict() == {"prompts": 3, "comparable_prompts": 2, "candidate_pairs": 3,
                               "disagreements": 2, "disagreement_rate": pytest.approx(2 / 3),
                               "kept_pairs": 2}
    assert sorted((p["prompt"], p["chosen"], p["rejected"], p["answer"]) for p in pairs) == [
        ("p1", "5", "6", 5), ("p2", "a", "b", 3)]
    p1 = next(p for p in pairs if p["prompt"] == "p1")
    assert (p1["chosen_rm_score"], p1["rejected_rm_score"]) == (0.1, 0.9)


def test_graded_labels_compare_every_ordered_pair_and_the_cap_applies():
    # labeller scores 0 < 0.5 < 1, the RM reversed: all 3 candidate pairs disagree
    rows = [_row("p", "lo", 0.0, 2.0), _row("p", "mid", 0.5, 1.0), _row("p", "hi", 1.0, 0.0)]
    pairs, stats = disagreement_pairs(rows, max_pairs_per_prompt=2)
    assert (stats.candidate_pairs, stats.disagreements, stats.kept_pairs) == (3, 3, 2)
    assert len(pairs) == 2 and all(p["chosen"] != p["rejected"] for p in pairs)
    _, none = disagreement_pairs([])
    assert none.disagreement_rate == 0.0 and none.candidate_pairs == 0


def test_a_row_without_an_rm_score_is_named():
    with pytest.raises(KeyError, match=r"samples\[1\]: missing \['rm_score'\]"):
        disagreement_pairs([_row("p", "a", 1.0, 0.0), {"prompt": "p", "response": "b", "correct": 0.0}])
    with pytest.raises(ValueError, match="max_pairs_per_prompt=0"):
        disagreement_pairs([], max_pairs_per_prompt=0)


def test_labelled_pairs_are_every_ordered_pair_whatever_the_rm_says_capped_per_prompt():
    from nemo_rlhf.data.bad_cases import labelled_pairs

    rows = [
        # p1: right "5", wrong "6" and "7" (a duplicate "6" merged): 2 ordered pairs, the RM's view ignored
        _row("p1", "5", 1.0, 9.0, answer=5), _row("p1", "6", 0.0, 0.9, answer=5),
        _row("p1", "7", 0.0, -1.0, answer=5), _row("p1", "6", 0.0, 0.9, answer=5),
        # p2: graded 0 < 0.5 < 1: 3 ordered pairs
        _row("p2", "lo", 0.0, 0.0), _row("p2", "mid", 0.5, 0.0), _row("p2", "hi", 1.0, 0.0),
        # p3: all right: none
        {"prompt": "p3", "response": "x", "correct": 1.0}, {"prompt": "p3", "response": "y", "correct": 1.0},
    ]
    pairs = labelled_pairs(rows, max_pairs_per_prompt=5, extra_keys=("answer",))
    assert sorted((p["prompt"], p["chosen"], p["rejected"]) for p in pairs) == [
        ("p1", "5", "6"), ("p1", "5", "7"), ("p2", "hi", "lo"), ("p2", "hi", "mid"), ("p2", "mid", "lo")]
    assert all(p["answer"] == 5 for p in pairs if p["prompt"] == "p1") and "rm_score" not in str(pairs)
    capped = labelled_pairs(rows, max_pairs_per_prompt=1, seed=3)
    assert [p["prompt"] for p in capped] == ["p1", "p2"]
    assert capped == labelled_pairs(rows, max_pairs_per_prompt=1, seed=3)  # seeded
    with pytest.raises(KeyError, match=r"samples\[0\]: missing \['correct'\]"):
        labelled_pairs([{"prompt": "p", "response": "a"}])
    with pytest.raises(ValueError, match="max_pairs_per_prompt=0"):
        labelled_pairs([], max_pairs_per_prompt=0)
