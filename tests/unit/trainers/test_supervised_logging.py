"""SFT/RM loop logging: a validation step is written to metrics.jsonl even when it is not
a ``log_every_n_steps`` step (it used to be computed and then dropped); the RM's extra
held-out files (``rm.extra_val_files``) are evaluated and logged under their own names."""

from __future__ import annotations

import json

from tests.distributed.harness import run_ranks
from tests.rm_helpers import tiny_rm_config


def _worker(rank: int, data: str, exp: str, extra: dict | None = None):
    from nemo_rlhf.trainers.rm import RMTrainer

    RMTrainer(tiny_rm_config(data, exp, val_check_interval=2, checkpoints=False,
                             extra_val_files=extra or {})).fit()


def test_validation_steps_are_logged_whatever_the_log_interval(tmp_path):
    from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset

    data = tmp_path / "data"
    make_demo_dataset(data, DemoTaskConfig(n_sft=8, n_pref=16, n_ppo=4, n_eval=4, n_val=8))
    run_ranks(_worker, world_size=1, data=str(data), exp=str(tmp_path / "exp"))
    rows = [json.loads(line) for line in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()]
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], {}).update(r)
    assert "val/accuracy" in by_step[2]  # step 2: validation, not a log step (5)
    assert "val/accuracy" in by_step[3]  # the final validation
    assert 1 not in by_step


def test_rm_extra_validation_files_are_evaluated_under_their_names(tmp_path):
    """The extra file holds the validation pairs with chosen and rejected swapped: its
    accuracy must be exactly 1 - the validation accuracy and its margin the negated margin."""
    import pytest

    from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset

    data = tmp_path / "data"
    make_demo_dataset(data, DemoTaskConfig(n_sft=8, n_pref=16, n_ppo=4, n_eval=4, n_val=8))
    rows = [json.loads(line) for line in (data / "preference_val.jsonl").read_text().splitlines()]
    swapped = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in rows]
    (data / "swapped.jsonl").write_text("".join(json.dumps(r) + "\n" for r in swapped))
    run_ranks(_worker, world_size=1, data=str(data), exp=str(tmp_path / "exp"),
              extra={"swapped": str(data / "swapped.jsonl")})
    rows = [json.loads(line) for line in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()]
    last = {}
    for r in rows:
        if r["step"] == 3:
            last.update(r)
    assert last["val_swapped/accuracy"] == pytest.approx(1 - last["val/accuracy"])
    assert last["val_swapped/margin"] == pytest.approx(-last["val/margin"], abs=1e-6)


def test_rm_extra_validation_names_must_be_identifiers():
    import pytest

    from nemo_rlhf.trainers.rm import RMConfig

    with pytest.raises(ValueError, match="rm.extra_val_files: name 'same form'"):
        RMConfig(extra_val_files={"same form": "x.jsonl"})


def _start_worker(rank: int, data: str, exp: str, lr: float, val_at_start: bool):
    from nemo_rlhf.trainers.rm import RMTrainer

    cfg = tiny_rm_config(data, exp, val_check_interval=0, checkpoints=False)
    cfg.trainer.val_at_start, cfg.optim.lr = val_at_start, lr
    RMTrainer(cfg).fit()


def test_val_at_start_logs_the_starting_models_validation_at_step_0(tmp_path):
    """``trainer.val_at_start``: step 0 holds the validation of the weights before any
    update: the same numbers as the end's validation of a run whose updates are zero (lr 0),
    and not those of the trained end."""
    import pytest

    from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset

    data = tmp_path / "data"
    make_demo_dataset(data, DemoTaskConfig(n_sft=8, n_pref=16, n_ppo=4, n_eval=4, n_val=8))

    def by_step(exp):
        out = {}
        for line in (exp / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            out.setdefault(r["step"], {}).update(r)
        return out

    for name, lr, start in (("trained", 1e-2, True), ("frozen", 0.0, False)):
        run_ranks(_start_worker, world_size=1, data=str(data), exp=str(tmp_path / name), lr=lr, val_at_start=start)
    trained, frozen = by_step(tmp_path / "trained"), by_step(tmp_path / "frozen")
    assert 0 not in frozen  # off by default
    assert trained[0]["val/margin"] == pytest.approx(frozen[3]["val/margin"], abs=1e-6)
    assert trained[0]["val/accuracy"] == frozen[3]["val/accuracy"]
    assert abs(trained[3]["val/margin"] - trained[0]["val/margin"]) > 1e-3  # the end's is another model's


def _worker_console(rank: int, data: str, exp: str, extra: dict) -> str:
    """The RM job's console output (its progress lines: ``tqdm.write`` to stdout)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _worker(rank, data, exp, extra)
    return out.getvalue()


def test_the_rm_jobs_progress_line_keeps_the_metric_prefixes(tmp_path):
    """Issue 54: the line read ``val/accuracy=... accuracy=...``: the extra held-out file's
    metrics lost their ``val_<name>/`` prefix."""
    from nemo_rlhf.tasks.precedence import DemoTaskConfig, make_demo_dataset

    data = tmp_path / "data"
    make_demo_dataset(data, DemoTaskConfig(n_sft=8, n_pref=16, n_ppo=4, n_eval=4, n_val=8))
    text = run_ranks(_worker_console, world_size=1, data=str(data), exp=str(tmp_path / "exp"),
                     extra={"same_form": str(data / "preference_val.jsonl")})[0]
    (line,) = [ln for ln in text.splitlines() if ln.startswith("step 3: ")]  # the final validation
    names = [part.split("=")[0] for part in line[len("step 3: "):].split()]
    assert "val/accuracy" in names and "val_same_form/accuracy" in names, line
    assert "val_same_form/margin" in names, line
    assert "accuracy" not in names and "margin" not in names, line
