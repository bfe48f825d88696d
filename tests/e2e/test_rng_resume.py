"""The global RNG streams survive a resume (python, numpy, torch, megatron's TP tracker).

The kill/resume tests of ``test_recovery.py`` cannot see a lost RNG state: rollout
sampling and mini-batch shuffling draw from generators seeded by ``(seed, dp_rank,
step)``, not from the global streams. Anything else that does (dropout, a user's reward
function calling ``random``, data augmentation) would silently change after a resume if
the checkpoint did not carry the streams. So here each PPO step first draws from every
global stream (which also moves the streams away from their seeded start, as real use
would), and:

* the checkpoint of step 2 holds states from which exactly the uninterrupted run's
  step-3 draws follow (read straight from ``rng/rank_0.pt``);
* a new process that resumes from that checkpoint draws, at step 3, exactly what the
  uninterrupted run drew at step 3. Without saving or without restoring the states it
  would start from the seeded states and draw step 1's numbers again (checked to differ).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

SOURCES = ("python", "numpy", "torch", "tracker")


def _draw() -> dict:
    """Three numbers from each global stream (the tracker's through its fork, as megatron's
    model-parallel dropout draws)."""
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker = torch.rand(3).tolist()
    return {"python": [random.random() for _ in range(3)], "numpy": np.random.rand(3).tolist(),
            "torch": torch.rand(3).tolist(), "tracker": tracker}


def _run_worker(rank: int, tmp: str, exp: str, max_steps: int) -> dict:
    from nemo_rlhf.train_ppo import build

    data = make_demo_data(Path(tmp) / "data")
    cfg = compose_ppo(data, Path(exp), f"trainer.max_steps={max_steps}",
                      "exp_manager.save_interval=1", "exp_manager.keep_last=5",
                      "exp_manager.resume=auto")
    trainer = build(cfg)
    draws = {}
    real_step = trainer.train_step

    def step_drawing_first():
        draws[trainer.step + 1] = _draw()
        return real_step()

    trainer.train_step = step_drawing_first
    code = trainer.fit()
    return {"code": code, "draws": draws, "step": trainer.step}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rng")
    full = run_ranks(_run_worker, world_size=1, tmp=str(tmp), exp=str(tmp / "full"), max_steps=3)[0]
    # the state a crash right after step 2's checkpoint leaves: step_1, step_2, latest=step_2
    ckpts = tmp / "resumed" / "checkpoints"
    shutil.copytree(tmp / "full" / "checkpoints", ckpts)
    shutil.rmtree(ckpts / "step_3")
    (ckpts / "latest").write_text("step_2\n")
    resumed = run_ranks(_run_worker, world_size=1, tmp=str(tmp), exp=str(tmp / "resumed"),
                        max_steps=3)[0]
    return {"full": full, "resumed": resumed, "ckpt": tmp / "full" / "checkpoints" / "step_2"}


def test_the_draws_change_from_step_to_step(runs):
    """Sanity: otherwise a run that lost its RNG state could not be told apart."""
    d = runs["full"]["draws"]
    assert runs["full"]["code"] == 0 and sorted(d) == [1, 2, 3]
    for src in SOURCES:
        assert d[3][src] != d[1][src] and d[3][src] != d[2][src], src


def test_checkpoint_holds_the_rng_states_the_next_step_continues_from(runs):
    saved = torch.load(runs["ckpt"] / "rng" / "rank_0.pt", weights_only=False)["rng"]
    assert set(SOURCES) <= set(saved), sorted(saved)
    nxt = runs["full"]["draws"][3]  # drawn first thing after step 2's checkpoint
    r = random.Random()
    r.setstate(saved["python"])
    assert [r.random() for _ in range(3)] == nxt["python"]
    rs = np.random.RandomState()
    rs.set_state(saved["numpy"])
    assert rs.rand(3).tolist() == nxt["numpy"]
    g = torch.Generator()
    g.set_state(saved["torch"])
    assert torch.rand(3, generator=g).tolist() == nxt["torch"]
    tracker = saved["tracker"]
    assert isinstance(tracker, dict) and tracker, tracker
    g = torch.Generator()
    g.set_state(tracker["model-parallel-rng"])
    assert torch.rand(3, generator=g).tolist() == nxt["tracker"]


def test_resumed_process_continues_every_rng_stream(runs):
    res = runs["resumed"]
    assert res["code"] == 0 and res["step"] == 3
    assert sorted(res["draws"]) == [3], "the run must have resumed from step_2"
    full = runs["full"]["draws"]
    lost = [f"{src} (= step 1's draws: {res['draws'][3][src] == full[1][src]})"
            for src in SOURCES if res["draws"][3][src] != full[3][src]]
    assert not lost, f"RNG streams that did not continue after the resume: {lost}"
