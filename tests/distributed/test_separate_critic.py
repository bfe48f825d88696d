"""``critic.mode=separate``: the critic's own backbone and optimizer.

One 1-rank spawn runs, on the tiny demo task:

* a 3-step run saving every step, and a run resumed from its step-2 checkpoint: the
  resumed step 3 (metrics, actor and critic weights, both optimizers) is bit-identical;
* a run with one critic warm-up step: the actor is untouched, the critic trained;
* a critic started from a reward-model checkpoint: its backbone and value head are the
  RM's backbone and reward head.

(TP=2 / PP=2 first-step parity of the separate critic: ``test_ppo_estimators.py``.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

BASE = ("critic.mode=separate", "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]",
        "optim.lr=1e-3", "critic.lr=2e-3", "ppo.ppo_epochs=1")


def _weights(model) -> dict:
    from nemo_rlhf.models.engine import unwrap

    return {n: p.detach().clone() for n, p in unwrap(model).named_parameters()}


def _tensors(ckpt: Path) -> dict:
    from nemo_rlhf.checkpoint.io import load_full_tensors

    return {k: v for k, v in load_full_tensors(ckpt).items() if torch.is_tensor(v)}


def _worker(rank: int, tmp: str) -> dict:
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    out = {}

    def run(exp: Path, steps: int, *extra):
        cfg = compose_ppo(data, exp, *BASE, f"trainer.max_steps={steps}",
                          "exp_manager.save_interval=1", "exp_manager.keep_last=5",
                          "exp_manager.resume=auto", *extra)
        trainer = build(cfg)
        assert trainer.fit() == 0
        lines = [json.loads(x) for x in (exp / "metrics.jsonl").read_text().splitlines()]
        return {m["step"]: m for m in lines if "policy_loss" in m}

    out["full"] = run(tmp / "full", 3)
    ckpts = tmp / "resumed" / "checkpoints"
    shutil.copytree(tmp / "full" / "checkpoints", ckpts)
    shutil.rmtree(ckpts / "step_3")
    (ckpts / "latest").write_text("step_2\n")
    out["resumed"] = run(tmp / "resumed", 3)

    # one critic warm-up step: the actor must not move
    cfg = compose_ppo(data, tmp / "warmup", *BASE, "trainer.critic_warmup_steps=1")
    trainer = build(cfg)
    actor0, critic0 = _weights(trainer.model), _weights(trainer.critic.model)
    warm = trainer.train_step()
    trainer.step += 1
    actor1, critic1 = _weights(trainer.model), _weights(trainer.critic.model)
    out["warmup"] = {
        "actor_changed": [n for n in actor0 if not torch.equal(actor0[n], actor1[n])],
        "critic_changed": [n for n in critic0 if not torch.equal(critic0[n], critic1[n])],
        "actor_has_value_head": any(n.startswith("value_head.") for n in actor0),
        "metrics": warm,
    }
    after = trainer.train_step()  # the policy trains once the warm-up is over
    out["after_warmup_actor_changed"] = any(
        not torch.equal(actor1[n], w) for n, w in _weights(trainer.model).items())
    out["after_warmup_grad_norm"] = after["grad_norm"]

    # a critic started from an RM checkpoint
    rm = build_model(trainer.cfg.model, trainer.dims, kind="reward", seed=77)
    with torch.no_grad():
        rm.reward_head.weight.normal_(0.0, 0.5)
        rm.reward_head.bias.fill_(0.25)
    save_checkpoint(tmp / "rm", 0, rm, dims=trainer.dims)
    cfg = compose_ppo(data, tmp / "from_rm", *BASE, f"critic.init_from={tmp}/rm/step_0")
    critic = _weights(build(cfg).critic.model)
    rm_w = _weights(rm)
    out["from_rm"] = {
        "value_head_is_reward_head": torch.equal(critic["value_head.weight"], rm_w["reward_head.weight"])
        and torch.equal(critic["value_head.bias"], rm_w["reward_head.bias"]),
        "backbone_differs": [n for n in critic if not n.startswith("value_head.")
                             and not torch.equal(critic[n], rm_w[n])],
    }
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sep")
    out = run_ranks(_worker, world_size=1, tmp=str(tmp))[0]
    out["tmp"] = tmp
    return out


def test_resumed_separate_critic_run_is_bit_identical(results):
    assert sorted(results["resumed"]) == [3]  # resumed after step 2: only step 3 ran
    full, resumed = results["full"][3], results["resumed"][3]
    for key in ("policy_loss", "value_loss", "grad_norm", "critic_grad_norm", "kl_mean",
                "reward_mean", "explained_variance", "returns_mean"):
        assert resumed[key] == full[key], key
    tmp = results["tmp"]
    a = _tensors(tmp / "full" / "checkpoints" / "step_3")
    b = _tensors(tmp / "resumed" / "checkpoints" / "step_3")
    assert set(a) == set(b)
    assert any(k.startswith("critic.") for k in a) and any("critic.value_head" in k for k in a)
    assert not any(k.startswith("model.value_head") for k in a)  # the actor has no value head
    assert any(k.startswith("optimizer.state.exp_avg.critic.") for k in a)  # its own optimizer
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]


def test_separate_critic_trains_with_its_own_optimizer(results):
    for m in results["full"].values():
        assert m["critic_grad_norm"] > 0 and m["grad_norm"] > 0
    assert results["full"][3]["value_loss"] != results["full"][1]["value_loss"]


def test_separate_critic_warmup_leaves_the_actor_untouched(results):
    w = results["warmup"]
    assert w["actor_changed"] == [] and not w["actor_has_value_head"]
    assert "value_head.weight" in w["critic_changed"] and len(w["critic_changed"]) > 2
    assert w["metrics"]["grad_norm"] == 0.0 and w["metrics"]["critic_grad_norm"] > 0
    assert results["after_warmup_actor_changed"] and results["after_warmup_grad_norm"] > 0


def test_critic_starts_from_a_reward_model_checkpoint(results):
    assert results["from_rm"]["value_head_is_reward_head"]
    assert results["from_rm"]["backbone_differs"] == []


def test_reshard_tool_carries_the_separate_critic_and_its_optimizer(results, tmp_path):
    import subprocess
    import sys

    src = results["tmp"] / "full" / "checkpoints" / "step_3"
    out = tmp_path / "tp2"
    proc = subprocess.run([sys.executable, "-m", "nemo_rlhf.tools.ckpt", "reshard", str(src),
                           "--tp", "2", "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    a, b = _tensors(src), _tensors(out / "step_3")
    assert doc["optimizer"] and doc["tensors_verified"] == len(a) == len(b)
    assert {k for k in a if k.startswith("critic.")} == {k for k in b if k.startswith("critic.")}
    assert any(k.startswith("optimizer.state.exp_avg.critic.") for k in b)
    assert json.loads((out / "step_3" / "metadata.json").read_text())["parallel"]["tp"] == 2
