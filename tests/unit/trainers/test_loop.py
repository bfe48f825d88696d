"""The experiment folder every job shares: the resolved config is written and logged at the
start, every start appends its command line."""

from __future__ import annotations

import json
import logging

from nemo_rlhf.trainers.loop import Experiment


def test_the_resolved_config_is_written_and_logged_and_each_start_recorded(tmp_path, caplog):
    cfg = {"ppo": {"ppo_epochs": 4, "logprob_chunk_size": 1024}, "kl": {"target": 3.0}}
    with caplog.at_level(logging.INFO, logger="nemo_rlhf"):
        Experiment(tmp_path / "exp", writer=True, run_config=cfg)
    text = (tmp_path / "exp" / "config.yaml").read_text()
    assert "ppo_epochs: 4" in text and "target: 3.0" in text
    logged = [r.getMessage() for r in caplog.records if "resolved config" in r.getMessage()]
    assert len(logged) == 1 and text in logged[0] and str(tmp_path / "exp" / "config.yaml") in logged[0]
    Experiment(tmp_path / "exp", writer=True, run_config=cfg)
    starts = [json.loads(x) for x in (tmp_path / "exp" / "command_lines.txt").read_text().splitlines()]
    assert len(starts) == 2 and all("argv" in s for s in starts)
    caplog.clear()
    Experiment(tmp_path / "other", writer=False, run_config=cfg)  # not the writing rank
    assert not (tmp_path / "other").exists() and not caplog.records
