"""A PPO run resumed against another reward model (a refreshed RM): the change is detected
from the RM's identity recorded in the checkpoint, its running normalisation starts over,
the reward-hacking guard forgets the old rewards, the initial policy's evaluation is
re-scored by the new RM, and the first step says so in its metrics. Resumed against the
same RM, nothing is reset."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

REPO = Path(__file__).resolve().parents[2]


def _ppo(rank: int, tmp: str, url: str, steps: int):
    from nemo_rlhf.checkpoint import find_latest_checkpoint, read_trainer_state
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    cfg = compose_ppo(data, tmp / "exp", f"reward.rm_url={url}", "reward.functions=[]",
                      "reward.normalization=running", f"trainer.max_steps={steps}",
                      "exp_manager.save_interval=1", "exp_manager.resume=auto",
                      "trainer.val_check_interval=2", "trainer.max_eval_samples=4")
    trainer = build(cfg)
    assert trainer.fit() == 0
    state = read_trainer_state(find_latest_checkpoint(tmp / "exp" / "checkpoints"))
    return {"state": state, "changed": trainer.reward_changed,
            "guard_steps": [h["step"] for h in trainer.guard.history]}


class _Server:
    def __init__(self, tmp: Path, name: str, scale: float):
        addr = tmp / f"addr_{name}"
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests/rm_server_proc.py"), "--address-file", str(addr),
             "--checkpoint-path", f"/fake/{name}", "--scale", str(scale)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while not addr.exists() and time.time() < deadline:
            time.sleep(0.1)
        self.url = addr.read_text().strip()

    def close(self):
        self.proc.kill()
        self.proc.wait()


def _steps(tmp: Path) -> dict[int, dict]:
    rows = {}
    for line in (tmp / "exp" / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["step"], {}).update(r)
    return rows


@pytest.mark.parametrize("same_rm", [False, True], ids=["refreshed_rm", "same_rm"])
def test_resume_against_a_refreshed_rm_resets_its_statistics(tmp_path, same_rm):
    a = _Server(tmp_path, "rm_a", 1.0)
    try:
        first = run_ranks(_ppo, world_size=1, tmp=str(tmp_path), url=a.url, steps=2)[0]
        b = a if same_rm else _Server(tmp_path, "rm_b", 10.0)
        try:
            second = run_ranks(_ppo, world_size=1, tmp=str(tmp_path), url=b.url, steps=3)[0]
        finally:
            b.close()
    finally:
        a.close()
    s1, s2 = first["state"], second["state"]
    assert s1["reward_sources"] == {"rm": {"checkpoint_path": "/fake/rm_a", "checkpoint_step": 7}}
    count1, count2 = s1["reward"]["rm"]["count"], s2["reward"]["rm"]["count"]
    assert count1 == 2 * 8  # two steps of 8 rollouts
    step3 = _steps(tmp_path)[3]
    if same_rm:
        assert second["changed"] is None and "reward/source_changed" not in step3
        assert count2 == 3 * 8  # the statistics went on
        assert second["guard_steps"] == [1, 2, 3]
        assert s2["initial_eval"] == s1["initial_eval"]
    else:
        assert s2["reward_sources"]["rm"]["checkpoint_path"] == "/fake/rm_b"
        assert "'rm' changed" in second["changed"] and "/fake/rm_a" in second["changed"]
        assert step3["reward/source_changed"] == 1.0
        assert count2 == 8  # only the step after the change
        assert second["guard_steps"] == [3]
        # the initial policy's responses, re-scored by the new RM (10x the old scores)
        before = [x["score"] for x in s1["initial_eval"]]
        after = [x["score"] for x in s2["initial_eval"]]
        assert [x["text"] for x in s1["initial_eval"]] == [x["text"] for x in s2["initial_eval"]]
        assert after == pytest.approx([10 * v for v in before], rel=1e-5)
