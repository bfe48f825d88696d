"""launchers.demo: an output folder made with other RM-stage settings is refused, not reused."""

from __future__ import annotations

import json

import pytest

from launchers.demo import _check_stage_settings


def test_stage_settings_are_recorded_then_a_change_is_refused_naming_the_flag(tmp_path):
    path = tmp_path / "exp" / "rm_data" / "settings.json"
    _check_stage_settings(path, {"rm_edit_pairs": 0, "rm_prompts": 256})
    assert json.loads(path.read_text()) == {"rm_edit_pairs": 0, "rm_prompts": 256}
    _check_stage_settings(path, {"rm_edit_pairs": 0, "rm_prompts": 256})  # same: continues
    with pytest.raises(SystemExit, match=r"--rm-edit-pairs 0 -> 2.*pass a new --out"):
        _check_stage_settings(path, {"rm_edit_pairs": 2, "rm_prompts": 256})
    assert json.loads(path.read_text())["rm_edit_pairs"] == 0  # not overwritten
