"""The asynchronous rollout's controller and worker protocol (nemo_rlhf.rollout.remote), in
one process: the controller as the trainer's rank 0 uses it, and workers in threads with a
fake model (weights recorded, "generation" a batch that says which weights made it), over
the real TCPStore and gloo weights group. The schedule (each step's items from exactly
version ``max(step - 1 - max_staleness, 0)``), the staleness bound and back-pressure under
a slow trainer and a slow worker, the weights arriving bit-exact, and every failure
reported naming the worker."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from nemo_rlhf.rollout.generate import RolloutBatch
from nemo_rlhf.rollout.remote import RolloutController
from nemo_rlhf.rollout.staleness import StalenessSchedule
from nemo_rlhf.rollout.transport import (RolloutItem, RolloutWorkerError, batch_from_host, batch_to_host,
                                         bits_checksum, serve_rollout_worker)

DP = 2


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"embedding": torch.randn(7, 3, generator=g), "decoder.norm": torch.randn(3, generator=g),
            "half": torch.randn(5, generator=g).to(torch.bfloat16)}


class FakeWorker:
    """A worker thread: ``load_weights`` keeps the tensors, ``generate`` sleeps ``delay_s``
    and returns one row per prompt whose log-probs are its weights' checksum digits."""

    def __init__(self, index: int, exp_dir, delay_s: float = 0.0, fail_at: int | None = None):
        self.index, self.delay_s, self.fail_at = index, delay_s, fail_at
        self.loaded: dict = {}
        self.loads: list[int] = []
        self.log: list[tuple[int, int, int]] = []  # (step, dp_rank, version)
        self.code = None
        self.thread = threading.Thread(target=self._serve, args=(exp_dir,), daemon=True)
        self.thread.start()

    def _serve(self, exp_dir):
        def load(tensors):
            self.loaded = {k: v.clone() for k, v in tensors.items()}
            self.loads.append(len(self.loads))

        def generate(item: RolloutItem, version: int):
            if item.step == self.fail_at:
                raise ValueError("the engine ran out of memory")
            time.sleep(self.delay_s)
            self.log.append((item.step, item.dp_rank, version))
            n = len(item.prompts)
            ids = torch.tensor(item.prompts, dtype=torch.int64)
            return RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_length=ids.shape[1],
                                response_ids=ids[:, :1], response_mask=torch.ones(n, 1, dtype=torch.bool),
                                response_lengths=torch.ones(n, dtype=torch.int64),
                                ended=torch.ones(n, dtype=torch.bool), truncated=torch.zeros(n, dtype=torch.bool),
                                logprobs=torch.full((n, 1), float(bits_checksum(self.loaded) % 1000)))

        self.code = serve_rollout_worker(self.index, exp_dir, 20.0, torch.device("cpu"), load, generate)


def _controller(tmp_path, workers: int, k: int, timeout_s: float = 20.0,
                wait_timeout_s: float | None = None) -> RolloutController:
    kw = {} if wait_timeout_s is None else {"wait_timeout_s": wait_timeout_s}  # None: timeout_s
    ctl = RolloutController(tmp_path, workers, StalenessSchedule(k), timeout_s, torch.device("cpu"), **kw)
    return ctl


def _item(step: int, r: int, k: int) -> RolloutItem:
    return RolloutItem(step=step, dp_rank=r, prompt_indices=[step * 10 + r], prompts=[[step, r, 1]],
                       version=max(step - 1 - k, 0))


def _run_trainer(ctl: RolloutController, k: int, steps: int, train_s: float = 0.0, watch=None) -> list[dict]:
    """What AsyncRollout does per step: submit up to step + k, take the step, 'train',
    publish the next version."""
    ctl.publish(0, _weights(0))
    submitted, out = 0, []
    for step in range(1, steps + 1):
        while submitted < min(step + k, steps):
            submitted += 1
            for r in range(DP):
                ctl.submit(_item(submitted, r, k))
        ctl.retain_from(max(submitted - k, 0))
        results, metrics = ctl.take(step, DP)
        out.append({"step": step, "versions": [r.version for r in results], "metrics": metrics,
                    "lp": [float(r.batch["logprobs"][0, 0]) for r in results],
                    "prompts": [r.item.prompt_indices for r in results]})
        time.sleep(train_s)
        if watch is not None:
            watch(ctl)
        ctl.publish(step, _weights(step))
    return out


@pytest.fixture
def started(tmp_path):
    """``(controller, workers)`` after the start; closed afterwards."""
    made = []

    def make(workers=2, k=1, delay_s=0.0, fail_at=None, timeout_s=20.0, wait_timeout_s=None):
        ctl = _controller(tmp_path, workers, k, timeout_s, wait_timeout_s)
        fakes = [FakeWorker(i, tmp_path, delay_s, fail_at) for i in range(workers)]
        ctl.start()
        made.append((ctl, fakes))
        return ctl, fakes

    yield make
    for ctl, fakes in made:
        ctl.close()
        for f in fakes:
            f.thread.join(10)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_each_step_is_generated_by_exactly_the_version_the_bound_names(started, k):
    ctl, fakes = started(workers=2, k=k)
    steps = _run_trainer(ctl, k, steps=5)
    for s in steps:
        want = max(s["step"] - 1 - k, 0)
        assert s["versions"] == [want] * DP, s
        assert s["lp"] == [float(bits_checksum(_weights(want)) % 1000)] * DP  # generated by those weights
        assert s["prompts"] == [[s["step"] * 10 + r] for r in range(DP)]
        assert s["metrics"]["async/staleness_max"] == s["step"] - 1 - want <= k
    assert steps[-1]["metrics"]["async/staleness_mean"] == min(k, 4)
    generated = sorted((st, r) for f in fakes for st, r, _ in f.log)
    assert generated == [(st, r) for st in range(1, 6) for r in range(DP)]  # each item once


def test_the_weights_arrive_bit_exact_and_are_sent_only_when_a_worker_is_behind(started):
    ctl, fakes = started(workers=1, k=1)
    steps = _run_trainer(ctl, 1, steps=4)
    # versions 0, 0, 1, 2 generate steps 1..4: three syncs, none for step 2
    assert [s["metrics"]["async/weight_syncs"] for s in steps] == [1.0, 0.0, 1.0, 1.0]
    assert all(torch.equal(fakes[0].loaded[k], v) for k, v in _weights(2).items())
    assert fakes[0].loaded["half"].dtype == torch.bfloat16
    nbytes = sum(t.numel() * t.element_size() for t in _weights(0).values())
    assert steps[0]["metrics"]["async/weight_sync_bytes"] == nbytes


def test_a_slow_trainer_holds_the_workers_back_at_the_bound(started):
    """Back-pressure: however long the trainer takes, at most max_staleness + 1 steps are
    in flight or waiting, and the workers wait (idle time grows)."""
    k, seen = 1, []

    def watch(ctl):
        with ctl.cond:
            waiting = {s for s, _ in ctl.results} | {w.busy.step for w in ctl.workers if w.busy}
            queued_ready = [it.step for it in ctl.pending]
        seen.append((len(waiting), waiting, queued_ready))

    ctl, _ = started(workers=2, k=k)
    steps = _run_trainer(ctl, k, steps=5, train_s=0.3, watch=watch)
    assert max(n for n, _, _ in seen) <= k  # the step being trained was taken: k more at most
    assert all(s["metrics"]["async/buffer_depth"] <= k + 1 for s in steps)
    assert sum(s["metrics"]["async/worker_idle_s"] for s in steps) > 0.5


def test_a_slow_worker_makes_the_trainer_wait_and_keeps_the_bound(started):
    ctl, _ = started(workers=1, k=1, delay_s=0.2)
    steps = _run_trainer(ctl, 1, steps=4)
    assert all(s["metrics"]["async/staleness_max"] <= 1 for s in steps)
    assert sum(s["metrics"]["async/trainer_wait_s"] for s in steps) > 0.5


def test_a_failing_worker_is_reported_naming_it_and_the_step(started):
    ctl, _ = started(workers=1, k=0, fail_at=2)
    with pytest.raises(RolloutWorkerError, match=r"rollout worker 0 failed generating step 2 .*out of memory"):
        _run_trainer(ctl, 0, steps=3)


def test_corrupted_weights_are_refused(started, monkeypatch):
    monkeypatch.setenv("NEMO_RLHF_FAULT", "corrupt_weights:1")
    ctl, _ = started(workers=1, k=0)
    with pytest.raises(RolloutWorkerError, match=r"weights version 1 arrived corrupted \(checksum"):
        _run_trainer(ctl, 0, steps=3)


def test_workers_that_never_come_are_reported_with_the_timeout_and_how_to_start_them(tmp_path):
    ctl = _controller(tmp_path, 1, 1, timeout_s=0.5)
    with pytest.raises(RolloutWorkerError, match=r"1 of 1 rollout worker\(s\) did not connect within "
                                                  r"rollout.worker_start_timeout_s=0.5 s .*nemo_rlhf.rollout_worker"):
        ctl.start()


def test_a_silent_worker_is_reported_dead_within_the_timeout(started, monkeypatch):
    import nemo_rlhf.rollout.transport as transport

    ctl, fakes = started(workers=1, k=0, timeout_s=1.5, wait_timeout_s=60.0)
    ctl.publish(0, _weights(0))
    ctl.submit(_item(1, 0, 0))
    ctl.submit(_item(1, 1, 0))
    ctl.take(1, DP)
    for r in range(DP):  # version 1 is never published: the trainer waits on items in the queue
        ctl.submit(RolloutItem(step=2, dp_rank=r, prompt_indices=[20 + r], prompts=[[2, r, 1]], version=1))
    monkeypatch.setattr(transport, "HEARTBEAT_S", 1000.0)  # the next beat never comes
    t0 = time.monotonic()
    with pytest.raises(RolloutWorkerError, match=r"rollout worker 0 .* sent no heartbeat for \d+ s"):
        ctl.take(2, DP)
    assert time.monotonic() - t0 < 6


def test_the_checkpointed_samples_are_taken_as_if_generated(started):
    ctl, _ = started(workers=1, k=1)
    ctl.publish(0, _weights(0))
    for s in (1, 2):
        for r in range(DP):
            ctl.submit(_item(s, r, 1))
    ctl.take(1, DP)
    saved = ctl.results_for(range(2, 3), DP)  # the save after step 1: step 2 made by version 0
    assert [(r.item.step, r.version) for r in saved] == [(2, 0), (2, 0)]
    other = _controller(ctl.exp_dir / "other", 1, 1)
    other.preload(saved)
    results, metrics = other.take(2, DP)
    assert [r.version for r in results] == [0, 0] and metrics["async/staleness_max"] == 1


def test_batches_cross_the_host_boundary_unchanged_and_checksums_see_every_bit():
    ids = torch.tensor([[3, 4, 5]])
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_length=2,
                         response_ids=ids[:, 2:], response_mask=torch.ones(1, 1, dtype=torch.bool),
                         response_lengths=torch.ones(1, dtype=torch.int64), ended=torch.ones(1, dtype=torch.bool),
                         truncated=torch.zeros(1, dtype=torch.bool), logprobs=torch.tensor([[-0.25]]), vocab_size=9)
    back = batch_from_host(batch_to_host(batch), torch.device("cpu"))
    assert back.prompt_length == 2 and back.vocab_size == 9 and back.values is None
    assert torch.equal(back.logprobs, batch.logprobs) and torch.equal(back.input_ids, ids)
    w = _weights(3)
    base = bits_checksum(w)
    assert bits_checksum({k: v.clone() for k, v in w.items()}) == base
    moved = dict(w)
    moved["embedding"] = w["embedding"].flip(0)  # the same elements elsewhere
    flipped = dict(w)
    flipped["half"] = w["half"].clone()
    flipped["half"][2] = -flipped["half"][2]
    assert bits_checksum(moved) != base and bits_checksum(flipped) != base
    assert bits_checksum({k: v for k, v in w.items() if k != "half"}) != base


@pytest.mark.timeout(60)
def test_a_step_later_than_the_wait_timeout_is_reported_naming_it_and_the_workers(started):
    """Every wait has a deadline (rollout.wait_timeout_s): a live worker that takes too long
    stops the wait, naming the step, the DP ranks, what each worker does and the key (#50)."""
    ctl, _ = started(workers=1, k=0, delay_s=4.0, wait_timeout_s=0.5)
    ctl.publish(0, _weights(0))
    ctl.submit(_item(1, 0, 0))
    ctl.submit(_item(1, 1, 0))
    t0 = time.monotonic()
    with pytest.raises(RolloutWorkerError) as err:
        ctl.take(1, DP)
    assert time.monotonic() - t0 < 3
    msg = str(err.value)
    assert re.search(r"taking step 1 waited 0\.\d s for the items \(step, DP rank\) \[\(1, 0\), \(1, 1\)\] "
                     r"\(rollout.wait_timeout_s=0.5\)", msg), msg
    assert "worker 0: step 1 DP rank 0 (weights version 0)" in msg and "queued: step 1 DP rank 1" in msg, msg
    assert "raise rollout.wait_timeout_s" in msg
    with pytest.raises(RolloutWorkerError, match=r"saving the rollout buffer \(steps \[1\]\) waited 0\.\d s .*"
                                                  r"rollout.wait_timeout_s=0.5"):
        ctl.results_for(range(1, 2), DP)


@pytest.mark.timeout(60)
def test_waiting_for_an_item_never_submitted_fails_at_once_naming_it(started):
    """A take of a (step, DP rank) nobody submitted (a resume at another DP size before
    #50) would wait forever while the heartbeats go on: it fails at once."""
    ctl, _ = started(workers=1, k=1)
    ctl.publish(0, _weights(0))
    ctl.submit(_item(1, 0, 1))
    ctl.take(1, 1)  # one DP rank's item was made
    ctl.submit(_item(2, 0, 1))
    t0 = time.monotonic()
    with pytest.raises(RolloutWorkerError, match=r"taking step 2 needs the items \(step, DP rank\) \[\(2, 1\)\], "
                                                  r"which were never submitted .*DP size, ppo.num_rollout_samples, "
                                                  r"rollout.n_samples_per_prompt"):
        ctl.take(2, 2)
    assert time.monotonic() - t0 < 1
