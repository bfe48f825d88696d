"""The multi-turn rollout source without a model (#51): the episode metrics by hand, the
final answer's text, the episode reward for the reward functions, the batch
:class:`EpisodeRolloutSource` hands the trainer (over a stand-in ``run_episodes``), the
choice in :func:`build_rollout_source`, and the built-in calculator environment."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_rlhf.data.datasets import PromptSample
from nemo_rlhf.envs.builtin import answer_reward, calculator_env, env_reward
from nemo_rlhf.envs.config import EnvConfig, get_env_factory
from nemo_rlhf.metrics.timers import Timers
from nemo_rlhf.rollout.config import RolloutConfig
from nemo_rlhf.rollout.episodes import Episode
from nemo_rlhf.rollout.trajectory import Trajectory
from nemo_rlhf.trainers.ppo import episode_source, rollout_source
from nemo_rlhf.trainers.ppo.episode_source import (EpisodeRolloutBatch, EpisodeRolloutSource, episode_extras,
                                                   episode_metric_sums, episode_metrics_from_sums)
from nemo_rlhf.trainers.ppo.rollout_source import build_rollout_source
from nemo_rlhf.trainers.ppo.step_data import ForwardResults
from nemo_rlhf.trainers.ppo.step_tensors import step_advantages
from tests.conf_helpers import typed_job
from tests.unit.trainers.ppo.test_rollout_source import RecordingEngine

EOS = 2


def _episode(prompt, turns, rewards, infos, truncated=False):
    """``turns``: a list of ("policy", ids) / ("env", ids)."""
    tr = Trajectory(prompt)
    for kind, ids in turns:
        if kind == "policy":
            tr.append_policy(ids, [-0.5] * len(ids))
        else:
            tr.append_env(ids)
    if truncated:
        tr.mark_truncated()
    return Episode(tr, turn_rewards=rewards, infos=infos)


def _episodes():
    # A: 2 policy turns (2 + 1 tokens) around a 3-token observation, reward 0.5 then 1.0,
    #    2 tool calls, 1 malformed; B: one turn of 2 tokens, truncated, no reward, no info
    a = _episode([1, 5, 6], [("policy", [7, 8]), ("env", [9, 9, 9]), ("policy", [4, EOS])],
                 [0.5, 1.0], [{"tool_calls": 1, "malformed_calls": 1}, {"tool_calls": 2, "malformed_calls": 1}])
    b = _episode([1, 5], [("policy", [3, 3])], [None], [{}], truncated=True)
    return [a, b]


def test_episode_metrics_by_hand():
    sums = episode_metric_sums(_episodes())
    # episodes 2, turns 2 + 1, tool calls 2 + 0 (the last info's totals), 1 episode with a
    # malformed call, 1 truncated, policy tokens 4 + 2, tokens after the prompt 7 + 2, reward 1.5 + 0
    assert sums == [2.0, 3.0, 2.0, 1.0, 1.0, 6.0, 9.0, 1.5]
    other_rank = [2.0, 2.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.5]  # a second DP rank's sums
    m = episode_metrics_from_sums([x + y for x, y in zip(sums, other_rank)])
    assert m == {"episode/turns_mean": 5 / 4, "episode/tool_calls_mean": 2 / 4,
                 "episode/malformed_call_rate": 1 / 4, "episode/truncated_rate": 1 / 4,
                 "episode/policy_tokens_mean": 8 / 4, "episode/total_tokens_mean": 11 / 4,
                 "episode/env_reward_mean": 2.0 / 4}


def test_extras_carry_the_summed_episode_reward_and_the_env_reward_function_reads_it():
    a, b = _episodes()
    assert episode_extras(a) == {"env_reward": 1.5, "env_turn_rewards": [0.5, 1.0], "turns": 2,
                                 "conversation": {"messages": a.messages, "prompt_ids": a.trajectory.prompt_ids,
                                                  "response_ids": a.trajectory.token_ids[3:]}}
    assert a.trajectory.prompt_ids == [1, 5, 6] and a.trajectory.token_ids[3:] == [7, 8, 9, 9, 9, 4, 2]
    assert episode_extras(b)["env_reward"] == 0.0
    assert env_reward(["p", "q"], ["x", "y"], [episode_extras(a), episode_extras(b)]) == [1.5, 0.0]
    with pytest.raises(ValueError, match="row 0 has no episode reward.*set env.name"):
        env_reward(["p"], ["x"], [{"answer": "3"}])


def _fake_source(monkeypatch, episodes, other_rank_sums=None):
    calls = []

    def fake_run_episodes(model, dims, envs, problems, cfg, limits, **kw):
        calls.append({"problems": problems, "envs": envs, "limits": limits, "greedy": cfg.greedy, **kw})
        return episodes

    monkeypatch.setattr(episode_source, "run_episodes", fake_run_episodes)
    tok = SimpleNamespace(eos_id=EOS, pad_id=0, bos_id=1, bos_token="<bos>", decode=lambda ids: " ".join(map(str, ids)),
                          encode=lambda text: [int(c) for c in text if c.isdigit()])
    cfg = SimpleNamespace(env=EnvConfig(name="tests.ppo_helpers:two_turn_env", max_total_tokens=64,
                                        observation_template="={observation}="),
                          rollout=RolloutConfig(), model=SimpleNamespace(vocab_size=11, max_position_embeddings=128),
                          data=SimpleNamespace(chat_template=None, system_prompt=None))
    prompts = [PromptSample([1, 5, 6], "56", {"answer": "11"}), PromptSample([1, 5], "5", {})]
    extra = other_rank_sums or [0.0] * 8
    collectives = SimpleNamespace(dp_sum=lambda t: t + torch.tensor(extra, dtype=t.dtype, device=t.device))
    dims = SimpleNamespace(device=torch.device("cpu"))
    src = EpisodeRolloutSource(cfg, dims, SimpleNamespace(model="actor", weights_version=3), tok, prompts,
                               RecordingEngine(), collectives)
    return src, calls


def test_the_rollout_is_to_padded_batchs_layout_with_holes_and_the_episodes(monkeypatch):
    episodes = _episodes()
    src, calls = _fake_source(monkeypatch, episodes)
    batch = src.rollout(4, [0, 1])
    assert calls[0]["problems"] == [{"prompt": "56", "answer": "11"}, {"prompt": "5"}]
    assert calls[0]["call_index"] == 3 and calls[0]["limits"].max_total_tokens == 64
    assert calls[0]["encode_observation"]("7") == [7]  # "=7=" tokenised alone
    assert len({id(e) for e in calls[0]["envs"]}) == 2  # a fresh environment per episode
    assert isinstance(batch, EpisodeRolloutBatch) and batch.episodes is episodes
    assert batch.prompt_length == 3
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 8, 9, 9, 9, 4, EOS], [0, 1, 5, 3, 3, 0, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 10, [0] + [1] * 4 + [0] * 5]
    assert batch.response_ids.tolist() == [[7, 8, 9, 9, 9, 4, EOS], [3, 3, 0, 0, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[True, True, False, False, False, True, True], [True, True] + [False] * 5]
    assert batch.response_lengths.tolist() == [7, 2]  # the extent, environment tokens included
    assert batch.logprobs.tolist() == [[-0.5, -0.5, 0, 0, 0, -0.5, -0.5], [-0.5, -0.5, 0, 0, 0, 0, 0]]
    assert batch.truncated.tolist() == [False, True] and batch.ended.tolist() == [True, False]
    # the final answer is the last policy turn only (EOS dropped), not every policy token
    assert batch.final_texts(lambda ids: " ".join(map(str, ids)), EOS) == ["4", "3 3"]
    padded = batch.pad_response_to(9, 0)  # (the trainer's DP padding keeps the episodes)
    assert isinstance(padded, EpisodeRolloutBatch) and padded.episodes is episodes
    assert src.metrics()["episode/turns_mean"] == 1.5 and src.metrics()["engine/calls"] == 0.0


def test_the_metrics_are_summed_over_dp_before_the_means(monkeypatch):
    src, _ = _fake_source(monkeypatch, _episodes(), other_rank_sums=[2.0, 2.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.5])
    src.rollout(1, [0, 1])
    assert src.metrics()["episode/turns_mean"] == 5 / 4
    assert src.metrics()["episode/truncated_rate"] == 1 / 4


def test_the_evaluation_decodes_single_turn_with_the_engine(monkeypatch):
    src, _ = _fake_source(monkeypatch, _episodes())
    src.generate([[1, 2]], RolloutConfig(greedy=True), call_index=5)
    assert src.engine.calls == [{"model": "actor", "prompts": [[1, 2]], "greedy": True, "call_index": 5,
                                 "weights_version": 3}]
    src.close()
    assert src.engine.closed


def test_the_evaluation_episodes_are_greedy_fresh_and_leave_the_step_metrics(monkeypatch):
    src, calls = _fake_source(monkeypatch, _episodes())
    src.rollout(4, [0, 1])
    step_metrics = src.metrics()
    batch = src.generate_episodes([{"prompt": "56", "answer": "11"}], RolloutConfig(greedy=True), call_index=7)
    assert calls[1]["problems"] == [{"prompt": "56", "answer": "11"}] and calls[1]["greedy"]
    assert calls[1]["call_index"] == 7 and not calls[0]["greedy"]
    assert not set(map(id, calls[1]["envs"])) & set(map(id, calls[0]["envs"]))  # fresh environments
    assert isinstance(batch, EpisodeRolloutBatch) and src.engine.calls == []  # no single-turn decoding
    # the whole episode after the prompt (policy turns and the observation), EOS dropped
    assert batch.episode_texts == ["7 8 9 9 9 4", "3 3"]
    assert src.metrics() == step_metrics


def _final_is_4(prompts, responses, extras):
    return [float(r == "4") for r in responses]


def test_a_multi_turn_evaluation_scores_the_final_answer_and_reports_the_episodes(monkeypatch, tmp_path):
    import json

    from nemo_rlhf.reward.functions import CombinedReward, RewardFunctionScorer, WeightedSource
    from nemo_rlhf.trainers.ppo import evaluation
    from nemo_rlhf.trainers.ppo.config import PPOTrainerConfig
    from nemo_rlhf.reward.config import RewardConfig
    from tests.single_rank import single_rank

    src, _ = _fake_source(monkeypatch, _episodes())
    seen = {}

    def generate(rows):
        seen["rows"] = rows
        return src.generate_episodes([{"prompt": r.prompt, **r.extras} for r in rows], RolloutConfig(greedy=True),
                                     call_index=0)

    def reward_fn(prompts, responses, extras):
        seen["scored"] = (list(responses), [dict(e) for e in extras])
        return [e["env_reward"] for e in extras]

    reward = CombinedReward([WeightedSource("f", RewardFunctionScorer(reward_fn))])
    cfg = SimpleNamespace(trainer=PPOTrainerConfig(max_eval_samples=2, eval_checker=f"{__name__}:_final_is_4"),
                          reward=RewardConfig(), exp_manager=SimpleNamespace(exp_dir=str(tmp_path)))
    state = evaluation.HeldOutEvaluation(cfg, has_prompts=True)
    decode = src.tok.decode
    with single_rank() as dims:
        m = evaluation.evaluate_policy(state, src.prompts, generate, lambda b: b.final_texts(decode, EOS), reward,
                                       dims, 3, True, lambda failure: None)
    # the final answers (last policy turns) are scored, with the episode reward in extras
    assert seen["scored"][0] == ["4", "3 3"]
    assert [e["env_reward"] for e in seen["scored"][1]] == [1.5, 0.0] and seen["scored"][1][0]["answer"] == "11"
    assert m["eval/accuracy"] == 0.5 and m["eval/reward"] == 0.75
    assert m["eval/episode/turns_mean"] == 1.5 and m["eval/episode/tool_calls_mean"] == 1.0
    assert m["eval/episode/malformed_call_rate"] == 0.5 and m["eval/episode/truncated_rate"] == 0.5
    assert m["eval/response_length"] == 3.0  # policy tokens: (4 + 2) / 2
    lines = [json.loads(x) for x in (tmp_path / "eval_samples" / "step_000003.jsonl").read_text().splitlines()]
    assert [(x["response"], x["episode"], x["turns"]) for x in lines] == [("4", "7 8 9 9 9 4", 2), ("3 3", "3 3", 1)]
    assert lines[0]["extras"] == {"answer": "11"}  # the prompt row's own fields


def test_build_picks_the_episode_source_when_env_name_is_set(monkeypatch):
    monkeypatch.setattr(rollout_source, "build_rollout_engine", lambda *a, **kw: RecordingEngine())
    monkeypatch.setattr(rollout_source, "unwrap",
                        lambda m: SimpleNamespace(config=SimpleNamespace(params_dtype=torch.float32)))
    tok = SimpleNamespace(eos_id=1, pad_id=0, decode=str)
    dims = SimpleNamespace(dp=1, dp_rank=0, rank=0, world_size=1, tp=1, pp=1, device=torch.device("cpu"))
    actor = SimpleNamespace(model=object(), weights_version=0)
    model = SimpleNamespace(vocab_size=11, max_position_embeddings=32)
    cfg = SimpleNamespace(rollout=RolloutConfig(), model=model, env=EnvConfig(name="calculator"),
                          moe=SimpleNamespace(routing_replay=False))
    src = build_rollout_source(cfg, dims, actor, tok, [[1]], None, None, Timers(), prompts=["row"])
    assert isinstance(src, EpisodeRolloutSource) and src.factory is calculator_env
    with pytest.raises(ValueError, match="needs the prompt rows"):
        build_rollout_source(cfg, dims, actor, tok, [[1]], None, None, Timers())
    cfg.env = EnvConfig()
    assert type(build_rollout_source(cfg, dims, actor, tok, [[1]], None, None, Timers())).__name__ == \
        "LocalRolloutSource"


def test_a_factory_path_that_does_not_resolve_names_env_name():
    with pytest.raises(AttributeError, match="env.name='tests.ppo_helpers:nope'.*no attribute 'nope'"):
        get_env_factory(EnvConfig(name="tests.ppo_helpers:nope"))
    with pytest.raises(ImportError, match="env.name='no_such_module:f': cannot import module"):
        get_env_factory(EnvConfig(name="no_such_module:f"))


def test_the_calculator_environment_answers_a_hermes_call_then_scores_the_final_answer():
    env = get_env_factory(EnvConfig(name="calculator"))(EnvConfig(name="calculator", max_turns=3))
    assert env.reset({"prompt": "12*34=", "answer": "408"}) == "12*34="
    tr = Trajectory([1, 2])
    tr.append_policy([3], [0.0])
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    first = env.step(tr, call)
    assert not first.done and "408" in first.observation and first.info["tool_calls"] == 1
    tr.append_env([4])
    tr.append_policy([5], [0.0])
    last = env.step(tr, "The answer is 408")
    assert last.done and last.reward == 1.0
    assert answer_reward({"answer": "408"}, "it is 407") == 0.0 and answer_reward({}, "408") is None


def test_each_turns_reward_is_placed_at_the_last_token_of_its_policy_segment(monkeypatch):
    # A: policy [7, 8] at columns 0-1 (reward 0.5), observation 2-4, policy [4, EOS] at 5-6
    # (reward 1.0); B: one turn rewarded None, so nothing placed
    src, _ = _fake_source(monkeypatch, _episodes())
    batch = src.rollout(1, [0, 1])
    assert batch.turn_reward_placements() == [[(1, 0.5), (6, 1.0)], []]
    assert batch.pad_response_to(9, 0).turn_reward_placements() == [[(1, 0.5), (6, 1.0)], []]


def _step_returns(monkeypatch, turn_rewards, scores=(2.0, 3.0), metrics=False):
    """The returns of ``step_advantages`` on the batch of :func:`_episodes`: no KL (beta 0, equal
    log-probs), V = 0, gamma = lam = 1, so the return of a policy token is the sum of the token
    rewards from it to the row's end (environment tokens skipped)."""
    src, _ = _fake_source(monkeypatch, _episodes())
    batch = src.rollout(1, [0, 1])
    cfg = typed_job("ppo_tiny", ["env.name=tests.ppo_helpers:two_turn_env", f"env.turn_rewards={turn_rewards}",
                                 "ppo.gamma=1.0", "ppo.lam=1.0"])
    zeros = torch.zeros(2, 7)
    fwd = ForwardResults(old_logprobs=zeros, ref_logprobs=zeros, kl_logprobs=zeros, values=zeros)
    one_rank = SimpleNamespace(dp_sum_named=lambda sums: sums, whiten_reduce=lambda s, sq, n: (s, sq, n),
                               dp_max=lambda t: t)
    adv, m = step_advantages(cfg, cfg.advantage_config(), 0.0, one_rank, batch, torch.tensor(scores), fwd)
    return m if metrics else adv.returns.tolist()


def test_per_turn_rewards_reach_the_returns_at_the_end_of_their_turns(monkeypatch):
    # per_turn: row A's token rewards are 0.5 at column 1 and 1.0 + score 2 at column 6, so
    # returns 3.5 on turn 1 and 3.0 on turn 2; row B holds only its score 3 at column 1
    assert _step_returns(monkeypatch, "per_turn") == [[3.5, 3.5, 0, 0, 0, 3.0, 3.0], [3.0, 3.0, 0, 0, 0, 0, 0]]
    # sum (the default): the environment's rewards reach the score only through the `env`
    # reward function (not named here), the score alone on the last policy token
    assert _step_returns(monkeypatch, "sum") == [[2.0, 2.0, 0, 0, 0, 2.0, 2.0], [3.0, 3.0, 0, 0, 0, 0, 0]]


def test_per_turn_rewards_count_when_telling_whether_the_rollouts_rewards_vary(monkeypatch):
    # equal scores 2 and 2: with per_turn, row A's task reward is 2 + 0.5 + 1.0 = 3.5 against
    # B's 2, so the advantages are whitened; with sum, both rows' task reward is 2: left raw
    assert _step_returns(monkeypatch, "per_turn", (2.0, 2.0), metrics=True)["advantages_whitened"] == 1.0
    assert _step_returns(monkeypatch, "sum", (2.0, 2.0), metrics=True)["advantages_whitened"] == 0.0


@pytest.mark.parametrize("overrides, needle", [
    (["env.turn_rewards=last"], r"env.turn_rewards.*'last'.*sum.*per_turn"),
    (["env.turn_rewards=per_turn"], "env.turn_rewards=per_turn with env.name=null"),
    (["env.name=calculator", "env.turn_rewards=per_turn", "ppo.advantage_estimator=grpo",
      "rollout.n_samples_per_prompt=2"], "env.turn_rewards=per_turn with ppo.advantage_estimator=grpo"),
    (["env.name=calculator", "env.turn_rewards=per_turn", "ppo.advantage_estimator=rloo",
      "rollout.n_samples_per_prompt=2"], "env.turn_rewards=per_turn with ppo.advantage_estimator=rloo"),
    (["env.name=calculator", "env.turn_rewards=per_turn", "reward.functions=[{name: env}]"],
     "env.turn_rewards=per_turn with reward.functions naming 'env'"),
])
def test_per_turn_placement_is_refused_where_it_means_nothing_naming_the_keys(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        typed_job("ppo_tiny", overrides)


def test_per_turn_placement_is_accepted_with_the_per_token_estimators():
    for est in ("gae", "reinforce_plus_plus"):
        cfg = typed_job("ppo_tiny", ["env.name=calculator", "env.turn_rewards=per_turn",
                                     f"ppo.advantage_estimator={est}"])
        assert cfg.env.turn_rewards == "per_turn"


def test_the_async_source_sends_each_rows_problem_and_runs_the_evaluations_episodes_itself(monkeypatch, tmp_path):
    """``rollout.mode=async`` with ``env.name`` (#51): each item carries its rows' problems
    (what the worker's environments reset with), and the held-out evaluation's episodes run
    on the trainer's ranks, on the path of the synchronous source (``run_episodes``)."""
    from nemo_rlhf.data.sampler import ResumableSampler
    from nemo_rlhf.trainers.ppo.async_rollout import RemoteRolloutSource

    src, calls = _fake_source(monkeypatch, _episodes())
    c = src.cfg
    cfg = SimpleNamespace(env=c.env, data=c.data, model=SimpleNamespace(**vars(c.model), lora=SimpleNamespace(enabled=False)),
                          rollout=RolloutConfig(mode="async", max_staleness=0, num_workers=1),
                          ppo=SimpleNamespace(num_rollout_samples=2), trainer=SimpleNamespace(max_steps=2),
                          exp_manager=SimpleNamespace(exp_dir=str(tmp_path)))
    dims = SimpleNamespace(rank=1, dp=1, dp_rank=0, world_size=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="env.name='tests.ppo_helpers:two_turn_env': RemoteRolloutSource needs"):
        RemoteRolloutSource(cfg, dims, src.actor, [[1, 5, 6], [1, 5]], None, None, None, RecordingEngine())
    remote = RemoteRolloutSource(cfg, dims, src.actor, [[1, 5, 6], [1, 5]], None, None, None, RecordingEngine(),
                                 tokenizer=src.tok, prompts=src.prompts)
    items = []
    remote.controller = SimpleNamespace(submit=items.append, retain_from=lambda version: None)
    remote.lookahead = ResumableSampler(2, seed=3, shuffle=False)
    remote._submit_until(1)
    assert [(it.step, it.prompt_indices) for it in items] == [(1, [0, 1])]
    assert items[0].problems == [{"prompt": "56", "answer": "11"}, {"prompt": "5"}]
    batch = remote.generate_episodes([{"prompt": "56", "answer": "11"}], RolloutConfig(greedy=True), call_index=7)
    assert calls[-1]["problems"] == [{"prompt": "56", "answer": "11"}] and calls[-1]["greedy"]
    assert calls[-1]["call_index"] == 7 and remote.eval_engine.calls == []  # no single-turn decoding
    assert isinstance(batch, EpisodeRolloutBatch) and batch.episode_texts == ["7 8 9 9 9 4", "3 3"]
