"""The rollout sources without a trainer (#50): one driver makes the trainer's calls
(``begin`` / ``rollout`` / ``after_update`` / ``metrics`` / ``state_dict``) on a
:class:`LocalRolloutSource` over a recording engine and on a :class:`RemoteRolloutSource`
over a controller and a fake worker thread (``tests/unit/rollout/test_remote.py``), and
:func:`build_rollout_source` (no rollout engine in ``rollout.mode=async``). Also
``run_state`` / ``restore_run_state`` from their parts alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_rlhf.algorithms.ppo import build_kl_controller
from nemo_rlhf.data.sampler import ResumableSampler
from nemo_rlhf.envs.config import EnvConfig
from nemo_rlhf.metrics.timers import Timers
from nemo_rlhf.rollout import engines
from nemo_rlhf.rollout.config import RolloutConfig
from nemo_rlhf.rollout.engines import MegatronRolloutEngine
from nemo_rlhf.rollout.generate import RolloutBatch
from nemo_rlhf.trainers.ppo import async_rollout, rollout_source
from nemo_rlhf.trainers.ppo.guards import RewardHackingGuard
from nemo_rlhf.trainers.ppo.rollout_source import LocalRolloutSource, RemoteRolloutSource, build_rollout_source
from nemo_rlhf.trainers.ppo.state import dp_group_slice, restore_run_state, run_state
from tests.unit.rollout.test_remote import FakeWorker, _weights

PROMPTS = 32
ENCODED = [[i, i + 1, 2] for i in range(PROMPTS)]


def _batch(prompts, fill: float) -> RolloutBatch:
    ids = torch.tensor(prompts, dtype=torch.int64)
    n = len(prompts)
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_length=ids.shape[1],
                        response_ids=ids[:, :1], response_mask=torch.ones(n, 1, dtype=torch.bool),
                        response_lengths=torch.ones(n, dtype=torch.int64), ended=torch.ones(n, dtype=torch.bool),
                        truncated=torch.zeros(n, dtype=torch.bool), logprobs=torch.full((n, 1), fill))


class RecordingEngine:
    """A rollout engine that records its calls; log-probs: the weights version."""

    name = "recording"

    def __init__(self):
        self.calls: list[dict] = []
        self.closed = False

    def generate(self, model, prompts, cfg, *, call_index, weights_version):
        self.calls.append({"model": model, "prompts": [list(p) for p in prompts], "greedy": cfg.greedy,
                           "call_index": call_index, "weights_version": weights_version})
        return _batch(prompts, float(weights_version))

    def metrics(self):
        return {"engine/calls": float(len(self.calls))}

    def close(self):
        self.closed = True


def _drive(source, actor, sampler, steps: int, dp: int = 1, n: int = 1, samples: int = 4) -> list:
    """The trainer's calls, per step: begin, draw this rank's prompts, rollout, 'update'
    (the actor's weights version moves on), after_update, metrics; the state at the end."""
    out, step = [], 0
    while step < steps:
        source.begin(step)
        idx = dp_group_slice(sampler.next_global_batch(samples // n), 0, dp, n)
        batch = source.rollout(step + 1, idx)
        step += 1
        actor.model = actor.weights_version = step
        source.after_update(step)
        out.append((idx, batch, source.metrics()))
    return out, source.state_dict()


def test_the_local_source_generates_with_the_actors_current_weights_and_the_steps_seeds():
    engine, actor = RecordingEngine(), SimpleNamespace(model=0, weights_version=0)
    cfg = RolloutConfig(temperature=0.7)
    source = LocalRolloutSource(engine, cfg, actor, ENCODED)
    sampler = ResumableSampler(PROMPTS, seed=3, shuffle=True)
    steps, state = _drive(source, actor, ResumableSampler(PROMPTS, seed=3, shuffle=True), 3)
    assert [c["call_index"] for c in engine.calls] == [0, 1, 2]  # step s samples with call index s - 1
    assert [c["weights_version"] for c in engine.calls] == [0, 1, 2]  # the actor's weights at the time
    assert [c["model"] for c in engine.calls] == [0, 1, 2]
    for (idx, batch, metrics), call in zip(steps, engine.calls):
        assert idx == sampler.next_global_batch(4)
        assert call["prompts"] == [ENCODED[i] for i in idx] and not call["greedy"]
        assert batch.logprobs[0, 0] == call["weights_version"]
    assert steps[-1][2] == {"engine/calls": 3.0}
    assert state == {}
    source.load_state_dict({})  # nothing to restore
    greedy = source.generate([[5, 6]], RolloutConfig(greedy=True), call_index=7)
    assert engine.calls[-1] == {"model": 3, "prompts": [[5, 6]], "greedy": True, "call_index": 7,
                                "weights_version": 3}
    assert greedy.input_ids.tolist() == [[5, 6]]
    source.close()
    assert engine.closed


def _remote_cfg(exp_dir, k: int, steps: int):
    return SimpleNamespace(
        rollout=RolloutConfig(mode="async", max_staleness=k, num_workers=1, worker_timeout_s=20.0),
        ppo=SimpleNamespace(num_rollout_samples=4), trainer=SimpleNamespace(max_steps=steps),
        exp_manager=SimpleNamespace(exp_dir=exp_dir), model=SimpleNamespace(lora=SimpleNamespace(enabled=False)),
        env=EnvConfig())


def _raise_together(failure, what, error=RuntimeError):
    if failure is not None:
        raise failure


@pytest.mark.timeout(120)
@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_remote_source_answers_the_same_calls_with_the_versions_the_schedule_names(tmp_path, monkeypatch, k):
    """The same driver as the local source's: step ``s``'s samples are the worker's, made
    by version ``max(s - 1 - k, 0)`` (the fake worker logs it), for the prompts the
    trainer's sampler drew; the state after the last step carries the samples of the steps
    older versions made ahead (none: the run ended)."""
    monkeypatch.setattr(async_rollout, "full_weights", lambda model, dims, scale: _weights(model))
    steps = 4
    actor = SimpleNamespace(model=0, weights_version=0)
    sampler = ResumableSampler(PROMPTS, seed=3, shuffle=True)
    dims = SimpleNamespace(dp=1, dp_rank=0, rank=0, world_size=1, tp=1, pp=1, device=torch.device("cpu"))
    timers, decode = Timers(), RecordingEngine()
    source = RemoteRolloutSource(_remote_cfg(tmp_path, k, steps), dims, actor, ENCODED, sampler,
                                 SimpleNamespace(raise_together=_raise_together), timers, decode)
    worker = FakeWorker(0, tmp_path)
    try:
        out, state = _drive(source, actor, sampler, steps)
        assert source.schedule.buffer_size == k + 1
        mid_state_step = source.step
        greedy = source.generate([[9, 9]], RolloutConfig(greedy=True), call_index=4)
    finally:
        source.close()
        worker.thread.join(10)
    assert sorted(worker.log) == [(s, 0, max(s - 1 - k, 0)) for s in range(1, steps + 1)]
    probe = ResumableSampler(PROMPTS, seed=3, shuffle=True)
    for s, (idx, batch, metrics) in enumerate(out, start=1):
        assert idx == probe.next_global_batch(4)
        assert batch.input_ids.tolist() == [ENCODED[i] for i in idx]  # the worker's rows, on dims.device
        assert metrics["async/staleness_max"] == min(s - 1, k)
        assert "engine/calls" in metrics
    assert "timing/publish_weights_s" in timers.pop()  # after_update publishes under the trainer's timer
    assert mid_state_step == steps and state == {"max_staleness": k, "layout": source.layout(), "buffered": []}
    # the evaluation decodes with the actor itself, at its current weights version
    assert decode.calls == [{"model": steps, "prompts": [[9, 9]], "greedy": True, "call_index": 4,
                             "weights_version": steps}]
    assert greedy.input_ids.tolist() == [[9, 9]] and decode.closed


@pytest.mark.parametrize("tp_rank, cp_rank, dp_rank, gathers", [(1, 0, 0, True), (0, 1, 0, False), (1, 1, 0, False),
                                                           (0, 0, 1, False)])
def test_only_cp_rank_0_of_dp_rank_0_gathers_the_weights_for_the_workers(tmp_path, monkeypatch, tp_rank, cp_rank,
                                                                          dp_rank, gathers):
    """Under context parallelism the CP ranks hold the same weights: the weights of a
    version are gathered (over TP) by CP rank 0 of DP rank 0 only, once per version (#52).
    Ranks other than global rank 0 hold no controller, so nothing is sent from here."""
    calls = []
    monkeypatch.setattr(async_rollout, "full_weights", lambda model, dims, scale: calls.append(model) or {})
    actor = SimpleNamespace(model=0, weights_version=0)
    dims = SimpleNamespace(dp=2, dp_rank=dp_rank, rank=1 + tp_rank + 2 * cp_rank, world_size=8, tp=2, pp=1, cp=2,
                           tp_rank=tp_rank, cp_rank=cp_rank, device=torch.device("cpu"))
    source = RemoteRolloutSource(_remote_cfg(tmp_path, 0, 2), dims, actor, ENCODED,
                                 ResumableSampler(PROMPTS, seed=3, shuffle=True),
                                 SimpleNamespace(raise_together=_raise_together), Timers(), RecordingEngine())
    assert source.controller is None
    source.begin(0)  # publishes version 0
    actor.model = 1
    source.after_update(1)
    assert calls == ([0, 1] if gathers else [])


def _build_cfg(mode: str):
    model = SimpleNamespace(vocab_size=11, max_position_embeddings=32, lora=SimpleNamespace(enabled=False))
    return SimpleNamespace(rollout=RolloutConfig(mode=mode, max_staleness=0, num_workers=1), model=model,
                           env=EnvConfig(), moe=SimpleNamespace(routing_replay=False),
                           ppo=SimpleNamespace(num_rollout_samples=4), trainer=SimpleNamespace(max_steps=2),
                           exp_manager=SimpleNamespace(exp_dir="unused"))


def test_build_picks_the_source_once_and_async_builds_no_rollout_engine(monkeypatch):
    built = []
    monkeypatch.setattr(rollout_source, "build_rollout_engine",
                        lambda *a, **kw: built.append(kw) or RecordingEngine())
    monkeypatch.setattr(rollout_source, "unwrap",
                        lambda m: SimpleNamespace(config=SimpleNamespace(params_dtype=torch.float32)))
    tok = SimpleNamespace(eos_id=1, pad_id=0, decode=str)
    dims = SimpleNamespace(dp=1, dp_rank=0, rank=1, world_size=2, tp=1, pp=1, device=torch.device("cpu"))
    actor = SimpleNamespace(model=object(), weights_version=0)
    local = build_rollout_source(_build_cfg("sync"), dims, actor, tok, ENCODED, None, None, Timers())
    assert isinstance(local, LocalRolloutSource) and isinstance(local.engine, RecordingEngine)
    assert built == [{"params_dtype": torch.float32, "with_values": False, "record_routes": False,
                      "eos_token_id": 1, "pad_token_id": 0, "decode_fn": str}]
    monkeypatch.setattr(engines, "build_rollout_engine", lambda *a, **kw: pytest.fail("an engine in async mode"))
    remote = build_rollout_source(_build_cfg("async"), dims, actor, tok, ENCODED, None, None, Timers())
    assert isinstance(remote, RemoteRolloutSource) and len(built) == 1
    assert isinstance(remote.eval_engine, MegatronRolloutEngine)  # the actor's own decode for the evaluation
    assert remote.controller is None  # (rank 1: the controller is rank 0's)


def _run_parts(reward=None):
    guard = RewardHackingGuard(2, 2.0, 0.5, 10.0)
    return dict(sampler=ResumableSampler(PROMPTS, seed=1, shuffle=True), kl_ctl=build_kl_controller("adaptive", 0.1,
                                                                                                     6.0, 100.0),
                reward=reward, guard=guard)


class _Source:
    def __init__(self):
        self.loaded = None

    def load_state_dict(self, sd):
        self.loaded = sd


def test_run_state_round_trips_from_its_parts_alone():
    parts = _run_parts()
    parts["sampler"].next_global_batch(8)
    parts["kl_ctl"].update(9.0, 8)
    parts["guard"].update(1, {"reward_raw_mean": 0.5, "response_length": 3.0, "repetition": 0.0, "kl_mean": 0.1})
    sd = run_state(step=5, nonfinite_in_a_row=2, initial_eval={"eval/reward": 0.25},
                   rollout_state={"buffered": [1]}, **parts)
    assert sd["async_rollout"] == {"buffered": [1]}
    assert "async_rollout" not in run_state(step=5, nonfinite_in_a_row=0, initial_eval=None, rollout_state={},
                                            **parts)
    fresh, source = _run_parts(), _Source()
    restored = restore_run_state(sd, rollout_source=source, **fresh)
    assert (restored.step, restored.nonfinite_in_a_row, restored.initial_eval, restored.reward_changed) == \
        (5, 2, {"eval/reward": 0.25}, None)
    assert fresh["sampler"].state_dict() == parts["sampler"].state_dict()
    assert fresh["kl_ctl"].value == parts["kl_ctl"].value != 0.1
    assert fresh["guard"].state_dict() == parts["guard"].state_dict() and fresh["guard"].history
    assert source.loaded == {"buffered": [1]}
    restore_run_state({**sd, "async_rollout": None}, rollout_source=source, **_run_parts())
    assert source.loaded == {}


class _Reward:
    def __init__(self, identity):
        self.identity, self.reset = identity, None

    def state_dict(self):
        return {"rm": {"mean": torch.tensor(0.5)}}

    def identities(self):
        return {"rm": self.identity}

    def changed_sources(self, recorded):
        return {k: (recorded.get(k), v) for k, v in self.identities().items() if recorded.get(k) != v}

    def load_state_dict(self, sd, reset):
        self.reset = reset


def test_a_changed_reward_source_is_reported_and_the_guard_starts_over():
    parts = _run_parts(_Reward({"url": "a"}))
    parts["guard"].update(1, {"reward_raw_mean": 0.5, "response_length": 3.0, "repetition": 0.0, "kl_mean": 0.1})
    sd = run_state(step=3, nonfinite_in_a_row=0, initial_eval=None, rollout_state={}, **parts)
    assert sd["reward"] == {"rm": {"mean": 0.5}}  # JSON-able
    fresh = _run_parts(_Reward({"url": "b"}))
    restored = restore_run_state(sd, rollout_source=_Source(), **fresh)
    assert "reward source 'rm' changed since the checkpoint (url=a -> url=b)" in restored.reward_changed
    assert fresh["reward"].reset == ["rm"] and not fresh["guard"].history


def test_the_trainer_has_no_branch_on_the_rollout_mode():
    """The trainer's and its run state's code (docstrings and comments aside) read no
    ``rollout.mode`` and name nothing async, and the trainer makes no ``isinstance`` test:
    the source is chosen once, at build time (on 1c4d49a: 15 hits in trainer.py, 4 in
    state.py)."""
    import ast
    import inspect

    from nemo_rlhf.trainers.ppo import state, trainer

    found = []
    for module, banned in ((trainer, {"mode", "isinstance"}), (state, {"mode"})):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name is not None and (name in banned or "async" in name.lower()):
                found.append((module.__name__, node.lineno, name))
            if isinstance(node, ast.Constant) and node.value == "async":
                found.append((module.__name__, node.lineno, "'async'"))
    assert found == []
