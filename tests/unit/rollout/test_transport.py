"""What a buffered rollout item becomes in a checkpoint (JSON) and back, and what a worker
sends of a multi-turn batch (#51), bit for bit."""

from __future__ import annotations

import json
import pickle
import struct
from dataclasses import fields

import pytest
import torch

from nemo_rlhf.rollout.generate import RolloutBatch
from nemo_rlhf.rollout.transport import (RolloutItem, RolloutResult, batch_from_host, batch_from_json, batch_to_host,
                                         batch_to_json, dump_message, episode_from_json, episode_to_json,
                                         result_from_json, result_to_json)

ENCODED = [[i, i + 1, 2] for i in range(8)]


def _batch(prompts, fill: float) -> RolloutBatch:
    ids = torch.tensor(prompts, dtype=torch.int64)
    n = len(prompts)
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_length=ids.shape[1],
                        response_ids=ids[:, :1], response_mask=torch.ones(n, 1, dtype=torch.bool),
                        response_lengths=torch.ones(n, dtype=torch.int64), ended=torch.ones(n, dtype=torch.bool),
                        truncated=torch.zeros(n, dtype=torch.bool), logprobs=torch.full((n, 1), fill))


def test_a_buffered_item_survives_its_json_form_bit_for_bit():
    batch = _batch([[3, 4, 5], [6, 7, 8]], 0.0)
    batch.logprobs = torch.tensor([[-0.1234567], [-2.5e-8]], dtype=torch.float32)
    host = batch_to_host(batch)
    host["half"] = torch.tensor([1.5, -0.333], dtype=torch.bfloat16)
    back = batch_from_json(batch_to_json(host))
    assert back.keys() == host.keys()
    for k, v in host.items():
        if torch.is_tensor(v):
            assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k
        else:
            assert back[k] == v, k
    item = RolloutItem(step=3, dp_rank=1, prompt_indices=[2, 2, 5], prompts=[ENCODED[i] for i in (2, 2, 5)],
                       version=1)
    res = RolloutResult(item=item, version=1, batch=host, worker=0, generate_s=0.25)
    again = result_from_json(result_to_json(res), ENCODED)
    assert again.item == item and again.version == 1 and again.generate_s == 0.25 and again.worker == -1
    assert all(torch.equal(again.batch[k], v) for k, v in host.items() if torch.is_tensor(v))


def _episode_batch():
    """Two episodes laid out as EpisodeRolloutSource does: one with a tool turn between two
    policy turns (a hole in the loss mask), one cut after its only turn."""
    from nemo_rlhf.rollout.episodes import Episode
    from nemo_rlhf.rollout.trajectory import Trajectory, to_padded_batch
    from nemo_rlhf.trainers.ppo.episode_source import EpisodeRolloutBatch

    a = Trajectory([5, 6, 7])
    a.append_policy([11, 12], [-0.1234567, -1e-9])
    a.append_env([40, 41, 42])
    a.append_policy([13, 2], [-3.3333333333, -0.5])
    b = Trajectory([8])
    b.append_policy([14, 15, 16], [-2.5e-8, -7.0, -0.75])
    b.mark_truncated()
    eps = [Episode(trajectory=a, turn_rewards=[None, 1.0], infos=[{"tool_calls": 1, "malformed_calls": 0},
                                                                     {"tool_calls": 1, "truncated": False}],
                   stop_reason="done", env_time_s=0.0625,
                   messages=[{"role": "user", "content": "2*3?"}, {"role": "assistant", "content": "<c>2*3</c>"},
                             {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}]),
           Episode(trajectory=b, turn_rewards=[], infos=[], stop_reason="max_turns", env_time_s=0.0)]
    padded = to_padded_batch([ep.trajectory for ep in eps], 0, device=torch.device("cpu"))
    P = padded.prompt_length
    return EpisodeRolloutBatch(
        input_ids=padded.input_ids, attention_mask=padded.attention_mask, prompt_length=P,
        response_ids=padded.input_ids[:, P:].clone(), response_mask=padded.response_mask,
        response_lengths=padded.response_lengths, ended=~padded.truncated, truncated=padded.truncated,
        logprobs=padded.logprobs, vocab_size=64, episodes=eps)


def _assert_same_batch(back, batch):
    from nemo_rlhf.trainers.ppo.episode_source import EpisodeRolloutBatch

    assert type(back) is EpisodeRolloutBatch
    for f in fields(batch):
        v, w = getattr(batch, f.name), getattr(back, f.name)
        if torch.is_tensor(v):
            assert w.dtype == v.dtype and w.shape == v.shape and torch.equal(w, v), f.name
        else:
            assert w == v, f.name
    for ep, got in zip(batch.episodes, back.episodes):  # the log-probs' bits, not just their values
        assert [struct.pack("<d", x) for x in got.trajectory.logprobs] == \
            [struct.pack("<d", x) for x in ep.trajectory.logprobs]
        assert got.trajectory.loss_mask == ep.trajectory.loss_mask and got.trajectory.turns == ep.trajectory.turns


def test_an_episode_batch_crosses_from_a_worker_bit_for_bit():
    """#51: what a worker sends of a multi-turn batch (host form, pickled through the store)
    comes back as the same EpisodeRolloutBatch: tensors with the holed response_mask, and
    each episode's trajectory, env rewards, infos, stop reason."""
    batch = _episode_batch()
    assert batch.response_mask[0].tolist().count(False) >= 3  # the tool turn's hole
    host = pickle.loads(dump_message(batch_to_host(batch)))
    _assert_same_batch(batch_from_host(host, torch.device("cpu")), batch)


def test_a_buffered_episode_item_survives_its_json_form_bit_for_bit():
    """The item's problems (what the worker's environments reset with) are restored by
    index, as its prompts' ids are (the checkpoint keeps neither)."""
    batch = _episode_batch()
    problems = [{"prompt": f"q{i}", "answer": str(i)} for i in range(8)]
    item = RolloutItem(step=2, dp_rank=0, prompt_indices=[1, 4], prompts=[ENCODED[1], ENCODED[4]], version=1,
                       problems=[problems[1], problems[4]])
    res = RolloutResult(item=item, version=1, batch=batch_to_host(batch), worker=0, generate_s=0.5)
    form = json.loads(json.dumps(result_to_json(res)))
    assert "problems" not in form
    again = result_from_json(form, ENCODED, problems)
    _assert_same_batch(batch_from_host(again.batch, torch.device("cpu")), batch)
    assert again.item == item
    assert result_from_json(form, ENCODED).item.problems is None  # a single-turn run's items carry none


def test_an_episode_form_whose_segments_do_not_tile_its_tokens_is_refused():
    form = episode_to_json(_episode_batch().episodes[0])
    form["segments"][1][2] -= 1  # the tool segment ends one token early: a gap
    with pytest.raises(ValueError, match="does not follow"):
        episode_from_json(form)
    form = episode_to_json(_episode_batch().episodes[0])
    form["token_ids"].append(3)  # a token no segment covers
    with pytest.raises(ValueError, match="segments cover 10 of 11 tokens"):
        episode_from_json(form)
