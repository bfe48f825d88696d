"""python -m nemo_rlhf.tools.plot_metrics: a PNG of a run's metrics, lines of a step merged,
bad input named."""

from __future__ import annotations

import json

from nemo_rlhf.tools.plot_metrics import choose_metrics, main, read_metric_rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_png_of_the_chapters_metrics_and_the_eval_ones(tmp_path, capsys):
    _write(tmp_path / "metrics.jsonl", [
        {"step": 0, "eval/accuracy": 0.3, "eval/reward": -1.0},
        {"step": 1, "reward_mean": 0.1, "kl_mean": 0.0, "entropy": 0.5, "timing/step_s": 1.0},
        {"step": 2, "reward_mean": 0.2, "kl_mean": 0.4, "entropy": 0.45},
        {"step": 2, "eval/accuracy": 0.6, "eval/reward": 0.5},
    ])
    assert main([str(tmp_path)]) == 0
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = capsys.readouterr()
    assert "5 metrics over 3 steps" in out.out and "value_loss" in out.err  # not logged: named
    rows = read_metric_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["eval/accuracy"] == 0.6 and rows[2]["kl_mean"] == 0.4
    assert choose_metrics(rows, None)[0] == ["reward_mean", "kl_mean", "entropy", "eval/accuracy", "eval/reward"]


def test_bad_input_is_named(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kl_mean": 0.1}\n{"step": 2, "kl_\n')
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl:2: not JSON" in capsys.readouterr().err
    _write(tmp_path / "metrics.jsonl", [{"step": 1, "kl_mean": 0.1}])
    assert main([str(tmp_path), "--metrics", "kl_mean", "reward"]) == 2
    assert "--metrics reward: not in the run's metrics; logged: ['kl_mean']" in capsys.readouterr().err
    assert not (tmp_path / "metrics.png").exists()
