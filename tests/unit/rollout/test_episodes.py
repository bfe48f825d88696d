"""Multi-turn episodes on the megatron actor (#51): the loss mask's holes, behaviour
log-probs vs the training forward, the limits, the kept KV cache vs recomputing the prefix,
episodes that end at different turns, a calculator tool call."""

from __future__ import annotations

import time

import pytest
import torch

from nemo_rlhf.envs import EnvLimits, Environment, StepResult, ToolEnvironment, ToolRegistry, calculator_tool
from nemo_rlhf.models.engine import model_forward
from nemo_rlhf.models.logprobs import response_logprobs
from nemo_rlhf.rollout import RolloutConfig
from nemo_rlhf.rollout import episodes as episodes_mod
from nemo_rlhf.rollout.episodes import run_episodes
from nemo_rlhf.rollout.trajectory import ENV, POLICY, to_padded_batch
from tests.single_rank import single_rank

VOCAB = 100
PAD = 0
EOS = VOCAB - 1
MAX_SEQ = 96


def encode(text: str) -> list[int]:
    """A byte tokenizer of the fake vocabulary: ids 3..92, never PAD or EOS."""
    return [3 + (b % 90) for b in text.encode()]


def decode(ids) -> str:
    return "".join(chr(33 + (int(i) % 90)) for i in ids)


class ScriptedEnv(Environment):
    """Answers turn ``k`` with ``f"o{k}:{problem}#" * k`` (observations of different lengths
    per episode, so some rows read their observation while others still generate); done
    after ``done_after`` turns (None: never), reward = the turn number at the end;
    optionally sleeps in each step."""

    def __init__(self, done_after=None, sleep_s: float = 0.0):
        self.done_after, self.sleep_s = done_after, sleep_s
        self.actions: list[str] = []

    def reset(self, problem) -> str:
        self.actions = []
        self.problem = problem
        return f"Q{problem}:"

    def step(self, trajectory_so_far, last_action_text) -> StepResult:
        time.sleep(self.sleep_s)
        self.actions.append(last_action_text)
        k = len(self.actions)
        if self.done_after is not None and k >= self.done_after:
            return StepResult(None, True, float(k), {"turn": k})
        return StepResult(f"o{k}:{self.problem}#" * k, False, None, {"turn": k})


@pytest.fixture(scope="module")
def dims():
    with single_rank(seed=0) as d:
        yield d


def _build(dims, **overrides):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset

    cfg = load_model_preset("tiny", vocab_size=VOCAB, max_position_embeddings=MAX_SEQ, **overrides)
    return build_model(cfg, dims, seed=11)


MODELS = {
    "rope": dict(init_method_std=0.1),
    "learned_abs": dict(init_method_std=0.1, position_embedding_type="learned_absolute",
                        normalization="LayerNorm", activation="gelu", add_bias_linear=True),
}


@pytest.fixture(scope="module")
def models(dims):
    return {name: _build(dims, **kw) for name, kw in MODELS.items()}


def _run(model, dims, envs, problems=None, limits=None, recompute=False, call_index=0, with_values=False,
         **cfg):
    cfg.setdefault("max_new_tokens", 5)
    problems = list(range(len(envs))) if problems is None else problems
    return run_episodes(model, dims, envs, problems, RolloutConfig(**cfg),
                        limits or EnvLimits(max_turns=4, max_total_tokens=80),
                        encode_prompt=encode, encode_observation=encode, decode_fn=decode,
                        eos_token_id=EOS, pad_token_id=PAD, vocab_size=VOCAB,
                        max_sequence_length=MAX_SEQ, call_index=call_index,
                        recompute_prefix=recompute, with_values=with_values)


def _mixed_envs():
    # episodes end after 1, 3, 2 and 3 turns; prompts of different lengths (problem ids)
    return [ScriptedEnv(1), ScriptedEnv(3), ScriptedEnv(2), ScriptedEnv(3)]


MIXED_PROBLEMS = [7, 12345, 42, 9999999]


def _train_logprobs(model, dims, eps, temperature):
    padded = to_padded_batch([e.trajectory for e in eps], PAD)
    with torch.no_grad():
        logits, _ = model_forward(model, padded.input_ids, padded.attention_mask)
    lp, _ = response_logprobs(logits, (padded.input_ids, padded.prompt_length), dims, temperature,
                              vocab_size=VOCAB, compute_entropy=False)
    return padded, lp


# --------------------------------------------------------------------- the trajectory


def test_loss_mask_has_holes_exactly_at_the_environment_tokens(models, dims):
    eps = _run(models["rope"], dims, _mixed_envs(), MIXED_PROBLEMS, greedy=True)
    assert [e.trajectory.turns for e in eps] == [1, 3, 2, 3]
    assert [e.stop_reason for e in eps] == ["done"] * 4
    assert [e.turn_rewards[-1] for e in eps] == [1.0, 3.0, 2.0, 3.0]
    for e, problem in zip(eps, MIXED_PROBLEMS):
        tr = e.trajectory
        assert tr.prompt_ids == encode(f"Q{problem}:")
        kinds = [s.kind for s in tr.segments]
        assert kinds == [POLICY, ENV] * (tr.turns - 1) + [POLICY]
        expect_mask = [0] * tr.prompt_length
        for k, seg in enumerate(tr.segments):
            if seg.kind == ENV:  # the observation tokenised alone, appended as is
                turn = k // 2 + 1
                assert tr.token_ids[seg.start:seg.end] == encode(f"o{turn}:{problem}#" * turn)
            expect_mask += [1 if seg.kind == POLICY else 0] * (seg.end - seg.start)
        assert tr.loss_mask == expect_mask
        # the conversation a served RM reads: the prompt, each turn as the environment read
        # it, each observation's text before encoding (ScriptedEnv's role: the default user)
        expect_msgs = [{"role": "user", "content": f"Q{problem}:"}]
        for k, seg in enumerate(tr.segments):
            expect_msgs.append({"role": "assistant", "content": decode(tr.token_ids[seg.start:seg.end])}
                               if seg.kind == POLICY else
                               {"role": "user", "content": f"o{k // 2 + 1}:{problem}#" * (k // 2 + 1)})
        assert e.messages == expect_msgs
        assert all(lp < 0 for lp, m in zip(tr.logprobs, tr.loss_mask) if m)
        assert all(lp == 0 for lp, m in zip(tr.logprobs, tr.loss_mask) if not m)
        assert not tr.truncated


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("sampling", [dict(greedy=True), dict(temperature=0.7, top_p=0.9, seed=3)])
def test_behaviour_logprobs_equal_the_training_forward(models, dims, name, sampling):
    eps = _run(models[name], dims, _mixed_envs(), MIXED_PROBLEMS, **sampling)
    assert sorted(e.trajectory.turns for e in eps) == [1, 2, 3, 3]
    padded, train_lp = _train_logprobs(models[name], dims, eps, sampling.get("temperature", 1.0))
    mask = padded.response_mask
    assert int(mask.sum()) == sum(e.trajectory.policy_tokens for e in eps) > 20
    diff = (train_lp - padded.logprobs)[mask].abs().max()
    assert diff < 1e-5, float(diff)
    generated = padded.input_ids[:, padded.prompt_length:][mask]
    assert len(set(generated.tolist())) >= 6, "degenerate model output: the test would be weak"


@pytest.mark.parametrize("sampling", [dict(greedy=True), dict(temperature=0.7, seed=3)])
def test_values_equal_the_training_forwards_on_the_policy_tokens(models, dims, sampling):
    """``with_values`` (the old values of ``ppo.old_logprobs_from_rollout``): the value head on
    the kept cache's decode equals the training forward's values (``response_values``) on
    every policy token within 1e-5; 0 on the environment's tokens; the same episodes as
    without it."""
    m = models["rope"]
    saved = {k: v.clone() for k, v in m.value_head.state_dict().items()}
    try:
        # the head starts at 0 (every value would be 0): random weights at the single-turn
        # test's scale (test_generate.py, randn * 0.5), values up to about 7-10. At randn * 1
        # (values to 14-19) the two paths differed by 1.05e-5 on an AVX2-only EPYC: ~5 ulps of
        # the largest value, the head's weights amplifying the hidden states' rounding
        with torch.no_grad():
            for p in m.value_head.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
        _check_values(m, dims, sampling)
    finally:
        m.value_head.load_state_dict(saved)


def _check_values(m, dims, sampling):
    from nemo_rlhf.models.logprobs import response_values

    eps = _run(m, dims, _mixed_envs(), MIXED_PROBLEMS, with_values=True, **sampling)
    plain = _run(m, dims, _mixed_envs(), MIXED_PROBLEMS, **sampling)
    assert [e.trajectory.token_ids for e in eps] == [e.trajectory.token_ids for e in plain]
    assert all(e.values is None for e in plain)
    padded = to_padded_batch([e.trajectory for e in eps], PAD)
    with torch.no_grad():
        _, train_v = model_forward(m, padded.input_ids, padded.attention_mask)
    R = padded.response_mask.shape[1]
    train_v = response_values(train_v.float(), padded.prompt_length, R)
    got = torch.zeros(len(eps), R)
    for b, e in enumerate(eps):
        assert len(e.values) == len(e.trajectory) - e.trajectory.prompt_length
        got[b, :len(e.values)] = torch.tensor(e.values)
    mask = padded.response_mask
    assert int(mask.sum()) > 20 and float(train_v[mask].abs().min()) > 0
    diff = (got - train_v)[mask].abs().max()
    assert diff < 1e-5, float(diff)  # AVX2 EPYC: 5.2e-06 greedy, 3.8e-06 sampled
    assert not got[~mask].any()  # environment tokens and padding
    with pytest.raises(ValueError, match="kept-cache path"):
        _run(m, dims, [ScriptedEnv(1)], with_values=True, recompute=True)


def test_kv_cache_kept_equals_recomputing_the_prefix_greedy(models, dims):
    for name in MODELS:
        kept = _run(models[name], dims, _mixed_envs(), MIXED_PROBLEMS, greedy=True)
        again = _run(models[name], dims, _mixed_envs(), MIXED_PROBLEMS, greedy=True, recompute=True)
        for a, b in zip(kept, again):
            assert a.trajectory.token_ids == b.trajectory.token_ids, name
            assert a.trajectory.loss_mask == b.trajectory.loss_mask
            assert a.trajectory.segments == b.trajectory.segments
            assert a.stop_reason == b.stop_reason and a.turn_rewards == b.turn_rewards
            torch.testing.assert_close(torch.tensor(a.trajectory.logprobs),
                                       torch.tensor(b.trajectory.logprobs), atol=1e-5, rtol=0)


def test_sampling_is_reproducible_with_the_same_call_index(models, dims):
    kw = dict(temperature=1.0, seed=5)
    a = _run(models["rope"], dims, _mixed_envs(), MIXED_PROBLEMS, call_index=3, **kw)
    b = _run(models["rope"], dims, _mixed_envs(), MIXED_PROBLEMS, call_index=3, **kw)
    c = _run(models["rope"], dims, _mixed_envs(), MIXED_PROBLEMS, call_index=4, **kw)
    assert [e.trajectory.token_ids for e in a] == [e.trajectory.token_ids for e in b]
    assert [e.trajectory.token_ids for e in a] != [e.trajectory.token_ids for e in c]


def test_every_turn_input_is_checked_as_a_prefix_extension(models, dims, monkeypatch):
    calls = []
    real = episodes_mod.check_prefix_extension

    def spy(prev, new, turn):
        calls.append((list(prev), list(new), turn))
        real(prev, new, turn)

    monkeypatch.setattr(episodes_mod, "check_prefix_extension", spy)
    eps = _run(models["rope"], dims, _mixed_envs(), MIXED_PROBLEMS, greedy=True)
    assert len(calls) == sum(e.trajectory.turns for e in eps)  # once per policy turn
    for e in eps:
        tr = e.trajectory
        starts = [s.start for s in tr.segments if s.kind == POLICY]
        mine = [c for c in calls if c[1][:tr.prompt_length] == tr.prompt_ids
                and c[1] == tr.token_ids[:len(c[1])]]
        assert [len(c[1]) for c in mine] == starts
        assert [c[2] for c in mine] == list(range(1, tr.turns + 1))


def test_a_finished_episode_stops_generating(models, dims):
    eps = _run(models["rope"], dims, _mixed_envs(), MIXED_PROBLEMS, greedy=True)
    alone = _run(models["rope"], dims, [ScriptedEnv(1)], [MIXED_PROBLEMS[0]], greedy=True)
    # the one-turn episode in the batch is the same episode run alone, nothing after it
    assert eps[0].trajectory.token_ids == alone[0].trajectory.token_ids
    assert len(eps[0].trajectory) < len(eps[1].trajectory)
    assert eps[0].trajectory.segments[-1].kind == POLICY


# --------------------------------------------------------------------- limits


def test_max_turns_ends_the_episode_truncated(models, dims):
    limits = EnvLimits(max_turns=2, max_total_tokens=80)
    eps = _run(models["rope"], dims, [ScriptedEnv(None), ScriptedEnv(1)], limits=limits, greedy=True)
    assert eps[0].trajectory.truncated and eps[0].stop_reason == "max_turns"
    assert eps[0].trajectory.turns == 2 and eps[0].trajectory.segments[-1].kind == POLICY
    assert not eps[1].trajectory.truncated and eps[1].stop_reason == "done"


def test_max_total_tokens_ends_the_episode_truncated(models, dims):
    limits = EnvLimits(max_turns=10, max_total_tokens=24)
    for recompute in (False, True):
        eps = _run(models["rope"], dims, [ScriptedEnv(None), ScriptedEnv(None)], [3, 123456],
                   limits=limits, greedy=True, recompute=recompute)
        for e in eps:
            assert e.trajectory.truncated and e.stop_reason == "max_total_tokens"
            assert len(e.trajectory) <= 24 and e.trajectory.turns >= 2
            assert e.trajectory.segments[-1].kind == POLICY


def test_max_tool_time_ends_the_episode_truncated(models, dims):
    limits = EnvLimits(max_turns=10, max_total_tokens=80, max_tool_time_s=0.05)
    eps = _run(models["rope"], dims, [ScriptedEnv(None, sleep_s=0.03)], limits=limits, greedy=True)
    assert eps[0].trajectory.truncated and eps[0].stop_reason == "max_tool_time_s"
    assert eps[0].trajectory.turns == 2 and eps[0].env_time_s > 0.05


def test_stop_token_ends_a_turn(models, dims):
    free = _run(models["rope"], dims, [ScriptedEnv(1)], greedy=True, max_new_tokens=8)
    turn = free[0].trajectory.token_ids[free[0].trajectory.prompt_length:]
    stop = turn[3]
    first = turn.index(stop)
    out = _run(models["rope"], dims, [ScriptedEnv(1)], greedy=True, max_new_tokens=8,
               stop_token_ids=[stop])
    assert out[0].trajectory.token_ids[out[0].trajectory.prompt_length:] == turn[:first + 1]


def _turns(ep) -> list[list[int]]:
    tr = ep.trajectory
    return [tr.token_ids[s.start:s.end] for s in tr.segments if s.kind == POLICY]


@pytest.mark.parametrize("stop_by", ["id", "string"])
def test_min_new_tokens_holds_for_every_policy_turn(models, dims, stop_by):
    """``rollout.min_new_tokens`` per turn: a stop id / stop string that ends turns after 1-2
    tokens ends none before 3; the kept cache equals each turn's :func:`generate` (recompute),
    whose min_new_tokens is single-turn's; the log-probs are the policy's own (unsuppressed)."""
    m = models["rope"]
    free = _run(m, dims, _mixed_envs(), MIXED_PROBLEMS, greedy=True, max_new_tokens=6)
    first = [t for ep in free for t in _turns(ep)]
    stop = first[0][1]  # turn 1 of episode 0 would end at its 2nd token
    kw = dict(stop_token_ids=[stop]) if stop_by == "id" else dict(stop_strings=[decode([stop])])
    short = _run(m, dims, _mixed_envs(), MIXED_PROBLEMS, greedy=True, max_new_tokens=6, **kw)
    assert min(len(t) for ep in short for t in _turns(ep)) < 3  # the stop does end turns early
    kept = _run(m, dims, _mixed_envs(), MIXED_PROBLEMS, greedy=True, max_new_tokens=6, min_new_tokens=3, **kw)
    again = _run(m, dims, _mixed_envs(), MIXED_PROBLEMS, greedy=True, max_new_tokens=6, min_new_tokens=3,
                 recompute=True, **kw)
    assert [e.trajectory.turns for e in kept] == [1, 3, 2, 3]
    for a, b in zip(kept, again):
        assert all(len(t) >= 3 for t in _turns(a)), _turns(a)
        if stop_by == "id":
            assert all(stop not in t[:3] for t in _turns(a))
        assert a.trajectory.token_ids == b.trajectory.token_ids
        assert a.trajectory.segments == b.trajectory.segments and a.stop_reason == b.stop_reason
        torch.testing.assert_close(torch.tensor(a.trajectory.logprobs), torch.tensor(b.trajectory.logprobs),
                                   atol=1e-5, rtol=0)
    assert any(stop in t for ep in kept for t in _turns(ep))  # turns still end at the stop after 3
    padded, train_lp = _train_logprobs(m, dims, kept, 1.0)
    diff = (train_lp - padded.logprobs)[padded.response_mask].abs().max()
    assert diff < 1e-5, float(diff)


# --------------------------------------------------------------------- a tool call


class ForcedCall(ToolEnvironment):
    """The calculator environment; the policy's first turn is read as a fixed tool call
    (the tiny random model cannot write one)."""

    CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'

    def step(self, trajectory_so_far, last_action_text):
        text = self.CALL if trajectory_so_far.turns == 1 else last_action_text
        return super().step(trajectory_so_far, text)


def test_calculator_tool_call_output_is_an_environment_segment(models, dims):
    registry = ToolRegistry()
    registry.register(calculator_tool())
    limits = EnvLimits(max_turns=3, max_total_tokens=80)
    envs = [ForcedCall(registry, "hermes", limits, reward_fn=lambda p, a: 0.5) for _ in range(2)]
    eps = _run(models["rope"], dims, envs, ["1+1", "3*4"], limits=limits, greedy=True)
    for e, problem in zip(eps, ["1+1", "3*4"]):
        tr = e.trajectory
        assert tr.prompt_ids == encode(problem)
        assert [s.kind for s in tr.segments] == [POLICY, ENV, POLICY]
        env = tr.segments[1]
        assert tr.token_ids[env.start:env.end] == encode("<tool_response>\n408\n</tool_response>")
        assert tr.loss_mask[env.start:env.end] == [0] * (env.end - env.start)
        assert e.infos[0]["tool_calls"] == 1 and e.infos[0]["malformed_calls"] == 0
        assert e.turn_rewards == [None, 0.5] and e.stop_reason == "done"
        assert [m["role"] for m in e.messages] == ["user", "assistant", "tool", "assistant"]
        assert e.messages[0]["content"] == problem
        assert e.messages[2]["content"] == "<tool_response>\n408\n</tool_response>"  # before encoding


# --------------------------------------------------------------------- errors


def test_bad_arguments_are_refused_naming_the_key(models, dims):
    m = models["rope"]
    with pytest.raises(ValueError, match="rollout.max_new_tokens=0"):
        _run(m, dims, [ScriptedEnv(1)], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"rollout.stop_token_ids\[1\]=100"):
        _run(m, dims, [ScriptedEnv(1)], stop_token_ids=[5, VOCAB])
    env = ScriptedEnv(1)
    with pytest.raises(ValueError, match="one instance per episode"):
        _run(m, dims, [env, env])
    with pytest.raises(ValueError, match="env.max_total_tokens=200"):
        _run(m, dims, [ScriptedEnv(1)], limits=EnvLimits(max_total_tokens=200))
    with pytest.raises(ValueError, match="2 environments for 1 problems"):
        _run(m, dims, [ScriptedEnv(1), ScriptedEnv(1)], problems=[1])
