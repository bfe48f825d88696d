"""PPO on multi-turn episodes against a served RM that reads the whole conversation (#51,
``reward.rm_input``). One rank, the tiny model, ``tests.ppo_helpers:two_turn_env``, the fake
RM server of ``tests/rm_server_proc.py`` (it logs every item it scores).

One PPO step with the default ``reward.rm_input=conversation``: the RM is sent each
episode's messages (the prompt, the first policy turn, the observation, the final answer),
and the step's scores and ``reward/rm`` are the RM's scores of those conversations. The
same batch scored again with ``final_answer`` sends the final answers as single-turn items;
with the trajectory-ids form (an RM that shares the policy's rendering) it sends each
trajectory's ids.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import TwoTurnEnv, compose_ppo, make_demo_data

REPO = Path(__file__).resolve().parents[2]


def _read(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _worker(rank: int, tmp: str, url: str, log: str):
    from nemo_rlhf.train_ppo import build

    tmp, log = Path(tmp), Path(log)
    data = make_demo_data(tmp / "data")
    cfg = compose_ppo(data, tmp / "exp", "env.name=tests.ppo_helpers:two_turn_env", "env.max_total_tokens=64",
                      f"reward.rm_url={url}", "reward.functions=[]", "trainer.max_steps=1")
    trainer = build(cfg)
    src = trainer.reward.sources[0].source
    out = {"metrics": trainer.train_step()}
    out.update(rm_input=getattr(src, "rm_input", None), send_ids=getattr(src, "send_ids", None))
    idx, batch, scores = trainer._last_batch
    out["scores"] = scores.tolist()
    out["logged"] = _read(log)
    out["episodes"] = [{"messages": getattr(ep, "messages", None), "prompt": trainer.prompts[i].prompt,
                        "first": trainer.tok.decode(ep.trajectory.token_ids[ep.trajectory.segments[0].start:
                                                                             ep.trajectory.segments[0].end]),
                        "prompt_ids": ep.trajectory.prompt_ids,
                        "response_ids": ep.trajectory.token_ids[ep.trajectory.prompt_length:]}
                       for i, ep in zip(idx, batch.episodes)]
    out["finals"] = trainer.response_texts(batch)
    for name, rm_input, send_ids in (("final_answer", "final_answer", False), ("ids", "conversation", True)):
        log.unlink()
        src.rm_input, src.send_ids = rm_input, send_ids
        again, _ = trainer.score(idx, batch)
        out[name] = {"scores": again.tolist(), "logged": _read(log)}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ppo_mt_rm")
    addr, log = tmp / "rm_address", tmp / "rm_items.jsonl"
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/rm_server_proc.py"), "--address-file", str(addr),
                             "--log-items", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not addr.exists() and time.time() < deadline:
            time.sleep(0.1)
        url = addr.read_text().strip()
        return run_ranks(_worker, world_size=1, tmp=str(tmp), url=url, log=str(log))[0]
    finally:
        proc.kill()
        proc.wait()


def test_the_served_rm_reads_each_episode_as_its_whole_conversation_and_the_step_uses_its_scores(results):
    logged, episodes = results["logged"], results["episodes"]
    assert len(logged) == len(episodes) == 8
    assert [set(x["item"]) for x in logged] == [{"messages"}] * 8, logged[0]["item"]
    assert results["rm_input"] == "conversation" and results["send_ids"] is False  # the fake RM has no fingerprint
    for item, ep, final in zip(logged, episodes, results["finals"]):
        msgs = item["item"]["messages"]
        assert msgs == ep["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        assert msgs[0]["content"] == ep["prompt"] and msgs[1]["content"] == ep["first"]
        assert msgs[2]["content"] == TwoTurnEnv.OBSERVATION and msgs[3]["content"] == final
    # the step's scores are the RM's scores of those conversations
    rm_scores = [x["score"] for x in logged]
    assert results["scores"] == pytest.approx(rm_scores, abs=1e-5)  # normalization none, one source
    assert results["metrics"]["reward/rm"] == pytest.approx(sum(rm_scores) / len(rm_scores), abs=1e-5)


def test_final_answer_sends_the_final_answers_and_ids_send_the_trajectories(results):
    fa = results["final_answer"]
    assert [x["item"] for x in fa["logged"]] == [{"prompt": ep["prompt"], "response": final}
                                                 for ep, final in zip(results["episodes"], results["finals"])]
    assert fa["scores"] == pytest.approx([x["score"] for x in fa["logged"]], abs=1e-5)
    assert any(abs(a - b) > 1e-3 for a, b in zip(fa["scores"], results["scores"]))  # another input, other scores
    ids = results["ids"]
    assert [x["item"] for x in ids["logged"]] == [{"prompt_ids": ep["prompt_ids"], "response_ids": ep["response_ids"]}
                                                  for ep in results["episodes"]]
    assert ids["scores"] == pytest.approx([x["score"] for x in ids["logged"]], abs=1e-5)
