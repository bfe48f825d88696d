"""The demo's closed loop on the tiny task (``launchers.demo --task tiny --refresh-rounds 1``):
the policy's samples on which the RM contradicts the checker are added to the RM's pairs,
the RM continues from its checkpoint (not from scratch), and the PPO run resumes from its
own checkpoint against the refreshed RM, which it notices."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path


def test_refresh_round_adds_pairs_continues_the_rm_and_resumes_ppo(tmp_path, forked_python):
    from launchers.demo import main

    out, data = tmp_path / "demo", tmp_path / "data"
    code = main(["--task", "tiny", "--out", str(out), "--data", str(data), "--refresh-rounds", "1",
                 "--refresh-ppo-steps", "1", "--refresh-rm-steps", "2", "--refresh-prompts", "32",
                 "--refresh-heldout-prompts", "32", "--refresh-min-gain", "-1",
                 "--sft-override", "trainer.max_steps=300", "--sft-override", "trainer.val_check_interval=300",
                 "--rm-override", "trainer.global_batch_size=16", "--rm-override", "trainer.micro_batch_size=16",
                 "--rm-override", "optim.warmup_steps=1",
                 "trainer.max_steps=3", "trainer.val_check_interval=2", "trainer.max_eval_samples=16",
                 "ppo.num_rollout_samples=16", "ppo.global_batch_size=8", "ppo.micro_batch_size=8",
                 "ppo.forward_micro_batch_size=16", "exp_manager.save_interval=1",
                 "--rm-override", "trainer.max_steps=6", "--rm-override", "trainer.val_check_interval=6"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    (r,) = summary["refresh_rounds"]
    base = sum(1 for _ in (data / "preference.jsonl").open())
    pool = out / "refresh" / "round_1" / "preference_pool.jsonl"
    assert r["rm_pool_pairs"] == base + r["pairs_added"] == sum(1 for _ in pool.open())
    d = r["disagreement"]
    assert d["candidate_pairs"] > 0 and r["pairs_added"] == d["kept_pairs"] > 0
    new = [json.loads(x) for x in pool.read_text().splitlines()[base:]]
    assert all(x["chosen"] != x["rejected"] for x in new)
    # the RM's refresh data: the new pairs and as many replayed old ones (--refresh-replay 1)
    refresh = [json.loads(x) for x in
               (out / "refresh" / "round_1" / "rm_refresh_train.jsonl").read_text().splitlines()]
    old = [json.loads(x) for x in (data / "preference.jsonl").read_text().splitlines()]
    key = lambda x: (x["prompt"], x["chosen"], x["rejected"])  # noqa: E731
    replayed = Counter(map(key, refresh)) - Counter(map(key, new))
    assert sum(replayed.values()) == len(new) and set(replayed) <= set(map(key, old))
    assert len(refresh) == 2 * len(new) == r["rm_refresh_pairs"]
    # the RM continued from the first RM's checkpoint, head included
    rm_log = (out / "logs" / "rm_round_1.log").read_text()
    assert "reward head included" in rm_log and summary["checkpoints"]["first_rm"] in rm_log
    assert r["rm_checkpoint"] == summary["checkpoints"]["rm"] != summary["checkpoints"]["first_rm"]
    # PPO: 2 steps, then resumed (not restarted) for 1 more against the new RM
    assert r["ppo_step"] == 3 and Path(summary["checkpoints"]["ppo"]).name == "step_3"
    steps = [json.loads(x) for x in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [x["step"] for x in steps if "kl_mean" in x]
    assert train_steps == [1, 2, 3]
    changed = [x for x in steps if "reward/source_changed" in x]
    assert [x["step"] for x in changed] == [3]
    assert r["ppo_heldout_accuracy"] == summary["heldout_accuracy_by_step"]["3"]
    # the round's check: the policy also answered 32 prompts no round trains on; the refresh
    # RM job validated their labelled pairs before its first step and after its last
    rdir = out / "refresh" / "round_1"
    assert len((rdir / "prompts.jsonl").read_text().splitlines()) == 64 and d["prompts"] == 32
    unseen = [json.loads(x) for x in (rdir / "policy_unseen_pairs.jsonl").read_text().splitlines()]
    trained = {json.loads(x)["prompt"] for x in (rdir / "prompts.jsonl").read_text().splitlines()[:32]}
    assert unseen and not {p["prompt"] for p in unseen} & trained
    check = r["rm_policy_unseen"]
    rm_rows = [json.loads(x) for x in (out / "rm_round_1" / "metrics.jsonl").read_text().splitlines()]
    by_step = {x["step"]: x["val_policy_unseen/accuracy"] for x in rm_rows if "val_policy_unseen/accuracy" in x}
    first, last = sorted(by_step)  # step 0 (trainer.val_at_start) and the job's end
    assert first == 0 < last and (check["before"], check["after"]) == (by_step[0], by_step[last])
    assert check["pairs"] == len(unseen) and check["kept_refreshed_rm"]  # --refresh-min-gain -1: unchecked
