"""``rollout.mode=async`` resumed with another layout (#50): the trainer's
:class:`~nemo_rlhf.trainers.ppo.async_rollout.RemoteRolloutSource` and its controller on one process
(world size 1, the DP size and rank given by fake dims: rank 0 holds every DP rank's items),
a worker in a thread with the fake model of ``tests/unit/rollout/test_remote.py`` over the
real TCPStore and gloo group. A checkpoint after step 1 carries step 2's samples (made by
version 0); resumed with the same layout they are kept, resumed at another DP size,
``ppo.num_rollout_samples`` or ``rollout.n_samples_per_prompt`` they are dropped (logged
naming the change) and regenerated from the checkpoint's weights (version 1), and the
resumed run ends instead of waiting forever or failing on a prompt mismatch. Also the
async ``generated_tokens_per_s``: the step's tokens over the worker-reported seconds."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from nemo_rlhf.data.sampler import ResumableSampler
from nemo_rlhf.envs.config import EnvConfig
from nemo_rlhf.rollout.config import RolloutConfig
from nemo_rlhf.trainers.ppo import async_rollout
from nemo_rlhf.metrics.timers import Timers
from nemo_rlhf.trainers.ppo.async_rollout import RemoteRolloutSource
from nemo_rlhf.trainers.ppo.state import dp_group_slice
from tests.unit.rollout.test_remote import FakeWorker, _weights

PROMPTS = 64
STEPS = 4


def _cfg(exp_dir, samples=8, n=1, k=1) -> SimpleNamespace:
    return SimpleNamespace(
        rollout=RolloutConfig(mode="async", max_staleness=k, num_workers=1, worker_timeout_s=20.0,
                              n_samples_per_prompt=n),
        ppo=SimpleNamespace(num_rollout_samples=samples), trainer=SimpleNamespace(max_steps=STEPS),
        exp_manager=SimpleNamespace(exp_dir=exp_dir),
        model=SimpleNamespace(lora=SimpleNamespace(enabled=False, scale=1.0)), env=EnvConfig())


def _raise_together(failure, what, error=RuntimeError):
    if failure is not None:
        raise failure


class _Trainer:
    """The parts the source is given: ``actor.model`` is the weights version it holds."""

    def __init__(self, step: int = 0, sampler_sd: dict | None = None):
        self.step = step
        self.actor = SimpleNamespace(model=step, weights_version=step)
        self.sampler = ResumableSampler(PROMPTS, seed=7, shuffle=True)
        if sampler_sd:
            self.sampler.load_state_dict(sampler_sd)
        self.encoded = [[i, i + 1, 2] for i in range(PROMPTS)]
        self.collectives = SimpleNamespace(raise_together=_raise_together)


def _run(tmp_path, name: str, cfg_kw: dict, dp: int, until: int, sd: dict | None = None, trainer=None,
         delay_s: float = 0.0):
    """A RemoteRolloutSource at DP ``dp`` (this process is DP rank 0) trained to step ``until``;
    returns (the state after the last step, the sampler's state, the worker's log of
    (step, dp_rank, version), each step's metrics)."""
    exp = tmp_path / name
    cfg = _cfg(exp, **cfg_kw)
    dims = SimpleNamespace(dp=dp, dp_rank=0, rank=0, world_size=1, tp=1, pp=1, device=torch.device("cpu"))
    trainer = trainer or _Trainer()
    ar = RemoteRolloutSource(cfg, dims, trainer.actor, trainer.encoded, trainer.sampler, trainer.collectives,
                             Timers(), eval_engine=SimpleNamespace(metrics=dict, close=lambda: None))
    worker = FakeWorker(0, exp, delay_s)
    metrics = []
    try:
        if sd is not None:
            ar.load_state_dict(sd)
        ar.begin(trainer.step)
        n = cfg.rollout.n_samples_per_prompt
        while trainer.step < until:
            idx = dp_group_slice(trainer.sampler.next_global_batch(cfg.ppo.num_rollout_samples // n), 0, dp, n)
            batch = ar.rollout(trainer.step + 1, idx)  # (raises when the item's prompts are not idx)
            metrics.append((ar.metrics(), float(batch.response_mask.sum())))
            trainer.step = trainer.actor.model = trainer.step + 1
            ar.after_update(trainer.step)
        state = ar.state_dict()
    finally:
        ar.close()
        worker.thread.join(10)
    return state, trainer.sampler.state_dict(), worker.log, metrics


@pytest.fixture(autouse=True)
def _fake_weights(monkeypatch):
    monkeypatch.setattr(async_rollout, "full_weights", lambda model, dims, scale: _weights(model))


CHANGES = [  # (before, after, what the log names)
    (dict(dp=1), dict(dp=2), "DP size 1 -> 2"),
    (dict(dp=2), dict(dp=1), "DP size 2 -> 1"),
    (dict(dp=1), dict(dp=1, samples=16), "ppo.num_rollout_samples 8 -> 16"),
    (dict(dp=1), dict(dp=1, n=2), "rollout.n_samples_per_prompt 1 -> 2"),
    (dict(dp=2, n=2), dict(dp=1, samples=4, n=2), "DP size 2 -> 1, ppo.num_rollout_samples 8 -> 4"),
    (dict(dp=1), dict(dp=1, k=2), "rollout.max_staleness 1 -> 2"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("before,after,logged", CHANGES, ids=["dp1to2", "dp2to1", "samples", "n", "dp_and_samples",
                                                                      "staleness"])
def test_a_resume_with_another_layout_regenerates_the_buffered_steps(tmp_path, caplog, before, after, logged):
    kw = lambda d: {k: v for k, v in d.items() if k != "dp"}  # noqa: E731
    sd, sampler_sd, log1, _ = _run(tmp_path, "first", kw(before), before["dp"], until=2)
    assert sorted(b["step"] for b in sd["buffered"]) == [3] * before["dp"]  # version 1's step 3
    assert {(b["step"], b["version"]) for b in sd["buffered"]} == {(3, 1)}
    with caplog.at_level(logging.WARNING, logger="nemo_rlhf.ppo"):
        _, _, log2, _ = _run(tmp_path, "resumed", kw(after), after["dp"], until=STEPS, sd=sd,
                             trainer=_Trainer(2, sampler_sd))
    assert any(logged in r.getMessage() and "dropped and regenerated" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    # step 3 regenerated from the checkpoint's weights (version 2), step 4 from version 2 too
    assert sorted(log2) == [(s, r, 2) for s in (3, 4) for r in range(after["dp"])]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dp", [1, 2])
def test_a_resume_with_the_same_layout_keeps_the_buffered_steps(tmp_path, caplog, dp):
    sd, sampler_sd, _, _ = _run(tmp_path, "first", {}, dp, until=2)
    with caplog.at_level(logging.WARNING, logger="nemo_rlhf.ppo"):
        _, _, log2, metrics = _run(tmp_path, "resumed", {}, dp, until=STEPS, sd=sd, trainer=_Trainer(2, sampler_sd))
    assert not [r for r in caplog.records if "dropped" in r.getMessage()]
    assert sorted(log2) == [(4, r, 2) for r in range(dp)]  # step 3: the checkpoint's (version 1)
    assert metrics[0][0]["async/staleness_max"] == 1.0
    assert metrics[0][0]["async/step_generate_s"] > 0  # the seconds travel with the samples


@pytest.mark.timeout(120)
def test_a_buffered_step_whose_prompts_the_sampler_does_not_draw_is_regenerated(tmp_path, caplog):
    """The same layout, another order of prompts (here: the sampler's state moved on)."""
    sd, sampler_sd, _, _ = _run(tmp_path, "first", {}, 1, until=2)
    sampler_sd = {**sampler_sd, "consumed_samples": sampler_sd["consumed_samples"] + 8}
    with caplog.at_level(logging.WARNING, logger="nemo_rlhf.ppo"):
        _, _, log2, _ = _run(tmp_path, "resumed", {}, 1, until=STEPS, sd=sd, trainer=_Trainer(2, sampler_sd))
    assert any("not the prompts this run's sampler draws" in r.getMessage() for r in caplog.records)
    assert sorted(log2) == [(3, 0, 2), (4, 0, 2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [0, 1])
def test_a_resume_that_generates_its_next_step_itself_is_not_held_back(tmp_path, k):
    """Resumed at step 2 from a checkpoint without buffered samples (written in sync mode,
    or whose samples were dropped): the new controller's back-pressure counts from step 2,
    so step 3's items are dispatched (on 7fb6bc5 they waited for a step 0 + max_staleness + 1
    that was never taken)."""
    _, sampler_sd, _, _ = _run(tmp_path, "first", {"k": k}, 1, until=2)
    _, _, log2, _ = _run(tmp_path, "resumed", {"k": k}, 1, until=STEPS, sd={}, trainer=_Trainer(2, sampler_sd))
    assert sorted(log2) == [(3, 0, 2), (4, 0, 2 if k else 3)]


@pytest.mark.timeout(120)
def test_async_generated_tokens_per_s_is_over_the_workers_generation_seconds(tmp_path):
    """The step's response tokens over the seconds the workers reported generating its
    items (summed), not over the trainer's wait (each fake generation sleeps 0.3 s)."""
    _, _, _, metrics = _run(tmp_path, "run", {}, 2, until=STEPS, delay_s=0.3)
    for m, mine in metrics:
        assert m["async/step_generate_s"] >= 2 * 0.3  # two DP items of >= 0.3 s each
        # both DP ranks' items have the same rows, one response token each (the fake model)
        assert m["generated_tokens_per_s"] == pytest.approx(2 * mine / m["async/step_generate_s"], rel=1e-12)
        assert m["generated_tokens_per_s"] <= 2 * mine / 0.6
