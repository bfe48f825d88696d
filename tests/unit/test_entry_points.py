"""Every Hydra entry point converts its config through the typed schema, so a key added
with ``+`` that the schema does not have fails at once, naming it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module,schema", [("nemo_rlhf.train_ppo", "PPOTrainerConfig"),
                                           ("nemo_rlhf.train_sft", "SupervisedTrainerConfig"),
                                           ("nemo_rlhf.train_rm", "SupervisedTrainerConfig")])
def test_plus_added_unknown_key_fails_naming_it(module, schema, tmp_path, entry_point_python):
    res = subprocess.run([entry_point_python, "-m", module, "+trainer.no_such_key=1",
                          f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0
    assert f"Key 'no_such_key' not in '{schema}'" in res.stderr + res.stdout
