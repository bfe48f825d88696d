"""The integer parsing the checkers share (:mod:`nemo_rlhf.data.answers`)."""

from __future__ import annotations

from nemo_rlhf.data.answers import first_integer


def test_first_integer():
    assert first_integer("x = -12 and 3") == -12
    assert first_integer("x = -12 and 3", anchored=True) is None
    assert first_integer("  7 apples", anchored=True) == 7
    assert first_integer("1.25") is None and first_integer("") is None
