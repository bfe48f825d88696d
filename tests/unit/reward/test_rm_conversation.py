"""The served RM scores a whole conversation (#51, ``reward.rm_input=conversation``).

The tiny RM checkpoint of ``test_rm_scorer`` (character tokenizer, ChatML, system prompt):

* a ``messages`` item is rendered by ``encode_conversation``, the function the RM trainer
  renders conversation pairs with: a conversation pair's training ids are the served ids;
* a 2-turn episode scores differently from its final answer alone, and ``[user,
  assistant]`` scores exactly as the single-turn text item;
* over HTTP (the app of ``build_app`` on a loopback port, in a thread) the client's
  conversation items -- messages, or the trajectory's ids when the RM's ``/metadata``
  shows the policy's tokenizer, template and system prompt -- give the in-process scores,
  and ``build_reward`` decides that form from ``/metadata``;
* single-turn rows send the same request with either ``rm_input``;
* the server refuses malformed conversations, and conversations for a scorer that does
  not take them, naming the field.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.unit.reward.test_rm_scorer import SYSTEM, _make_tokenizer, _save_rm

EPISODE = [{"role": "user", "content": "What is 2+2?"},
           {"role": "assistant", "content": "<tool_call>2+2</tool_call>"},
           {"role": "tool", "content": "4"},
           {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    """``test_rm_scorer``'s tiny RM (the same tokenizer, template and system prompt) with
    512 positions: a ChatML episode of four messages is ~170 characters, one token each."""
    import nemo_rlhf.models.config as model_config
    from nemo_rlhf.data.tokenizer import Tokenizer
    from nemo_rlhf.distributed import LaunchEnv, ParallelConfig, destroy_distributed, initialize_distributed

    tmp = tmp_path_factory.mktemp("rm_conv")
    tok_dir = tmp / "tokenizer"
    _make_tokenizer(tok_dir)
    tok = Tokenizer(tok_dir)
    dims = initialize_distributed(ParallelConfig(), seed=7, launch_env=LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"))
    preset = model_config.load_model_preset
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(model_config, "load_model_preset",
                       lambda name, **kw: preset(name, max_position_embeddings=512, **kw))
            root, ref = _save_rm(tmp, tok, tok_dir, dims, 7, {"reward_mean": 0.25, "reward_std": 1.5,
                                                               "reward_stats_count": 8})
        yield {"root": root, "tok": tok, "tok_dir": tok_dir, "ref": ref, "dims": dims, "tmp": tmp}
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def scorer(rm):
    from nemo_rlhf.reward.rm_scorer import RMScorerConfig, RewardModelScorer

    s = RewardModelScorer(RMScorerConfig(checkpoint=str(rm["root"]), micro_batch_size=2), rm["dims"])
    yield s
    s.close()


def test_conversation_items_are_rendered_as_the_rm_trainer_renders_conversation_pairs(rm, scorer, tmp_path):
    from nemo_rlhf.data.datasets import DataConfig, load_preference_dataset
    from nemo_rlhf.reward.batching import ScoreItem

    rejected = EPISODE[:3] + [{"role": "assistant", "content": "5"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"chosen": EPISODE, "rejected": rejected}) + "\n")
    # the RM trainer's data section, as the checkpoint records it
    cfg = DataConfig(train_file=str(path), tokenizer_dir=str(rm["tok_dir"]), chat_template="chatml",
                     system_prompt=SYSTEM, max_seq_length=256)
    sample = load_preference_dataset(path, rm["tok"], cfg)[0]
    assert sample.prompt_ids + sample.chosen_ids == scorer.encode(ScoreItem(messages=EPISODE))
    assert sample.prompt_ids + sample.rejected_ids == scorer.encode(ScoreItem(messages=rejected))
    text = rm["tok"].decode(scorer.encode(ScoreItem(messages=EPISODE)), skip_special_tokens=False)
    assert text.endswith("<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n4<eos>")
    assert text.startswith(f"<bos><|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 2+2?")


def test_a_two_turn_episode_scores_differently_from_its_final_answer_and_one_turn_is_unchanged(rm, scorer):
    from nemo_rlhf.reward.batching import ScoreItem

    whole, final_only, one_turn, text = scorer.score_batch([
        ScoreItem(messages=EPISODE), ScoreItem(prompt=EPISODE[0]["content"], response="4"),
        ScoreItem(messages=[EPISODE[0], EPISODE[3]]), ScoreItem(prompt=EPISODE[0]["content"], response="4")])
    assert abs(whole - final_only) > 1e-3  # the RM read the tool call and its result
    assert one_turn == pytest.approx(text, abs=1e-6)  # [user, assistant]: the single-turn item
    assert rm["ref"][1] == pytest.approx(text, abs=1e-5)  # ("What is 2+2?", "4") of test_rm_scorer


@pytest.fixture(scope="module")
def served(scorer):
    """The RM behind build_app on a free loopback port (uvicorn in a thread)."""
    import uvicorn

    from nemo_rlhf.reward.batching import DynamicBatcher
    from nemo_rlhf.reward.server import RMServerConfig, build_app
    from tests.ports import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    batcher = DynamicBatcher(lambda: scorer, max_batch_size=8, max_wait_ms=5.0)
    batcher.start()
    server = uvicorn.Server(uvicorn.Config(build_app(batcher, RMServerConfig(), auth_token=None, address=url),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        batcher.stop()


def _extras(tok, messages):
    """A multi-turn row's extras as the PPO trainer sets them (``episode_extras``), with the
    trajectory ids the policy would have produced sharing the RM's rendering."""
    from nemo_rlhf.data.datasets import encode_conversation
    from nemo_rlhf.reward.functions import CONVERSATION_EXTRA

    prompt_ids, response_ids = encode_conversation(tok, messages, "chatml", SYSTEM)
    return {CONVERSATION_EXTRA: {"messages": messages, "prompt_ids": prompt_ids, "response_ids": response_ids}}


def test_round_trip_through_the_client_in_both_forms(rm, scorer, served):
    from nemo_rlhf.reward.batching import ScoreItem
    from nemo_rlhf.reward.client import RewardModelClient
    from nemo_rlhf.reward.functions import RemoteRewardModel

    expected = scorer.score_batch([ScoreItem(messages=EPISODE), ScoreItem(prompt="Say hi", response="hi there, friend")])
    prompts, finals = [EPISODE[0]["content"], "Say hi"], ["4", "hi there, friend"]
    extras = [_extras(rm["tok"], EPISODE), {}]  # a multi-turn row and a single-turn one
    with RewardModelClient(served, timeout_s=60) as client:
        assert client.score([{"messages": EPISODE}]) == pytest.approx(expected[:1], abs=1e-5)
        for send_ids in (False, True):
            got = RemoteRewardModel(client, "conversation", send_ids).score(prompts, finals, extras)
            assert got == pytest.approx(expected, abs=1e-5)
        final = RemoteRewardModel(client, "final_answer").score(prompts, finals, extras)
        assert final == pytest.approx(scorer.score_batch([ScoreItem(prompt=p, response=r)
                                                          for p, r in zip(prompts, finals)]), abs=1e-5)
        assert abs(final[0] - expected[0]) > 1e-3 and final[1] == pytest.approx(expected[1], abs=1e-5)
        # the server answers a malformed conversation 422 naming the field
        resp = httpx.post(f"{served}/score", json={"items": [{"messages": EPISODE[:3]}]}, timeout=30)
        assert resp.status_code == 422 and resp.json()["field"] == "items[0].messages"
        assert "last message must be the assistant's" in resp.json()["error"]


def test_build_reward_sends_trajectory_ids_only_to_an_rm_with_the_policys_rendering(rm, served):
    from nemo_rlhf.reward.config import RewardConfig
    from nemo_rlhf.trainers.ppo.scoring import build_reward, policy_rendering

    class Data:
        chat_template, system_prompt = "chatml", SYSTEM

    same = policy_rendering(rm["tok"], Data)
    cfg = RewardConfig(rm_url=served, normalization="none", wait_for_server_s=30)
    assert build_reward(cfg, rendering=same).sources[0].source.send_ids is True
    for change in ({"chat_template": "model"}, {"system_prompt": None}, {"tokenizer_fingerprint": "other"}):
        assert build_reward(cfg, rendering={**same, **change}).sources[0].source.send_ids is False
    assert build_reward(cfg).sources[0].source.send_ids is False  # no policy rendering given
    src = build_reward(cfg, rendering=same).sources[0].source
    assert src.rm_input == "conversation"  # the default: the whole episode


def test_single_turn_rows_send_the_same_request_with_either_rm_input():
    from nemo_rlhf.reward.client import RewardModelClient
    from nemo_rlhf.reward.functions import RemoteRewardModel

    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"scores": [1.5, 2.5]})

    client = RewardModelClient("http://rm:1", transport=httpx.MockTransport(handler))
    for rm_input in ("final_answer", "conversation"):
        for send_ids in (False, True):
            assert RemoteRewardModel(client, rm_input, send_ids).score(
                ["2+2=", "3+3="], ["4", "6"], [{"answer": "4"}, {}]) == [1.5, 2.5]
    assert bodies == [{"items": [{"prompt": "2+2=", "response": "4"}, {"prompt": "3+3=", "response": "6"}]}] * 4


def test_rm_input_is_validated_naming_the_key_and_choices():
    from nemo_rlhf.reward.config import RewardConfig
    from nemo_rlhf.reward.functions import RemoteRewardModel

    with pytest.raises(ValueError, match=r"reward.rm_input.*'conversation'.*'final_answer'"):
        RewardConfig(rm_input="episode")
    with pytest.raises(ValueError, match="reward.rm_input"):
        RemoteRewardModel(object(), "whole")


def test_a_scorer_without_conversations_gets_422_naming_the_item():
    from nemo_rlhf.reward.server import RequestError, RMServerConfig, parse_score_request

    body = json.dumps({"items": [{"prompt": "p", "response": "r"}, {"messages": EPISODE}]}).encode()
    with pytest.raises(RequestError, match=r"items\[1\]: this reward model does not take conversations") as e:
        parse_score_request(body, RMServerConfig(), 100)
    assert e.value.status == 422 and e.value.field == "items[1].messages"
    items = parse_score_request(body, RMServerConfig(), 100, takes_conversations=True)
    assert items[1].messages == EPISODE and items[1].to_json() == {"messages": EPISODE}
    for bad, field in (({"messages": EPISODE, "prompt": "p"}, "items[0]"),
                       ({"messages": [EPISODE[0], {"role": "assistant", "content": 4}]}, "items[0].messages[1]"),
                       ({"messages": [EPISODE[0], {"role": "assistant", "content": "x", "x": 1}]},
                        "items[0].messages[1]")):
        with pytest.raises(RequestError) as e:
            parse_score_request(json.dumps({"items": [bad]}).encode(), RMServerConfig(), 100, True)
        assert e.value.status == 422 and e.value.field == field, e.value.message
    over = {"items": [{"messages": [EPISODE[0], {"role": "assistant", "content": "x" * 70000}]}]}
    with pytest.raises(RequestError, match="max_text_chars") as e:
        parse_score_request(json.dumps(over).encode(), RMServerConfig(), 100, True)
    assert e.value.status == 413
