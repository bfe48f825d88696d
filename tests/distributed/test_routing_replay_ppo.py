"""MoE routing replay in the PPO trainer (``moe.routing_replay``, #52), one gloo rank.

The routers use megatron's expert-bias routing (:func:`tests.ppo_helpers.bias_routing`):
the bias moves the top-k choice only. Right after the rollout the bias is changed, so the
trainer's routers choose other experts than the rollout recorded while every other number is
the same (a stand-in for a rollout engine with other router numerics). Then:

* the old log-probs' forward replays the rollout's routes: it gives the rollout's behaviour
  log-probs (``rollout_train_logprob_diff_max`` < 1e-5, k3 ~ 0); without replay it does not;
* the reference pass routes by its own router (its log-probs are the plain forward's, not
  the replayed one's);
* the training forward replays: with ``ppo.old_logprobs_from_rollout`` the first
  mini-batch's ratio to the rollout's log-probs is 1 (fixed-row and token-budget
  micro-batches), without replay it is not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import bias_routing, compose_ppo, make_demo_data

MOE = ("model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
       "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "rollout.max_new_tokens=6",
       "trainer.max_steps=1")
EXPERTS = 4
RUNS = {  # name: overrides
    "replay": ("moe.routing_replay=true", "ppo.forward_micro_batch_size=2"),
    "no_replay": ("ppo.forward_micro_batch_size=2",),
    "replay_from_rollout": ("moe.routing_replay=true", "ppo.old_logprobs_from_rollout=true",
                            "ppo.global_batch_size=8"),
    "no_replay_from_rollout": ("ppo.old_logprobs_from_rollout=true", "ppo.global_batch_size=8"),
    "replay_from_rollout_budget": ("moe.routing_replay=true", "ppo.old_logprobs_from_rollout=true",
                                   "ppo.global_batch_size=8", "ppo.max_tokens_per_micro_batch=40"),
}


def _build(tmp: Path, name: str, *extra: str):
    from nemo_rlhf.train_ppo import build

    cfg = compose_ppo(make_demo_data(tmp / "data"), tmp / f"exp_{name}", *MOE, *RUNS[name], *extra)
    trainer = build(cfg)
    with torch.no_grad():  # sharper routers: top-2 choices that differ by token
        from nemo_rlhf.models.routing_replay import moe_routers
        for r in moe_routers(trainer.model):
            r.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    bias_routing(trainer.model, torch.zeros(EXPERTS))
    source_rollout = trainer.rollout_source.rollout

    def rollout(step, idx):  # the trainer's routers choose differently from here on
        batch = source_rollout(step, idx)
        bias_routing(trainer.model, torch.randn(EXPERTS, generator=torch.Generator().manual_seed(9)))
        return batch

    trainer.rollout_source.rollout = rollout
    return trainer


def _worker(rank: int, tmp: str) -> dict:
    tmp, out = Path(tmp), {}
    # the forward passes of one step, by hand: old log-probs and the reference's
    trainer = _build(tmp, "replay")
    batch = trainer.rollout(trainer.sample_prompts())
    fwd = trainer.compute_old_and_reference(batch)
    m = batch.response_mask
    with trainer.reference.swapped_in() as ref_model:
        own = trainer.actor.logprobs(batch, ref_model, temperature=trainer.cfg.kl_temperature)["logprobs"]
        replayed = trainer.actor.logprobs(batch, ref_model, temperature=trainer.cfg.kl_temperature,
                                          replay_routes=True)["logprobs"]
    out["passes"] = {"old_vs_rollout": float((fwd.old_logprobs - batch.logprobs).abs()[m].max()),
                     "ref_vs_own": float((fwd.ref_logprobs - own).abs()[m].max()),
                     "ref_vs_replayed": float((fwd.ref_logprobs - replayed).abs()[m].max()),
                     "routes_shape": list(batch.routes.shape), "ids_shape": list(batch.input_ids.shape)}
    trainer.close()
    for name in RUNS:  # whole steps
        trainer = _build(tmp, name)
        metrics = trainer.train_step()
        out[name] = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))}
        trainer.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_worker, world_size=1, tmp=str(tmp_path_factory.mktemp("r3_ppo")))


def test_the_old_logprobs_replay_the_rollout_s_routes_and_the_reference_does_not(ranks):
    p = ranks[0]["passes"]
    assert p["routes_shape"][:2] == p["ids_shape"] and p["routes_shape"][3] == 2  # [B, P+R, L, k]
    assert p["old_vs_rollout"] < 1e-5
    assert p["ref_vs_own"] < 1e-6  # the reference's own routing ...
    assert p["ref_vs_replayed"] > 1e-3  # ... which differs from the rollout's here


def test_the_mismatch_metrics_with_and_without_replay(ranks):
    on, off = ranks[0]["replay"], ranks[0]["no_replay"]
    assert on["rollout_train_logprob_diff_max"] < 1e-5 and on["rollout_train_k3_kl"] < 1e-9
    assert off["rollout_train_logprob_diff_max"] > 1e-3 and off["rollout_train_k3_kl"] > 1e-6
    for m in (on, off):
        assert m["grad_norm"] > 0 and m["skipped_updates"] == 0


@pytest.mark.parametrize("name", ["replay_from_rollout", "replay_from_rollout_budget"])
def test_the_training_forward_replays_the_rollout_s_routes(ranks, name):
    """One mini-batch against the rollout's own log-probs: the ratio is 1 where the training
    forward replays the routes."""
    m, off = ranks[0][name], ranks[0]["no_replay_from_rollout"]
    assert abs(m["first_minibatch/ratio_max"] - 1) < 1e-5 and abs(m["first_minibatch/ratio_min"] - 1) < 1e-5
    assert max(off["first_minibatch/ratio_max"] - 1, 1 - off["first_minibatch/ratio_min"]) > 1e-3
    assert m["grad_norm"] > 0 and m["skipped_updates"] == 0



PP2 = ("parallel.pipeline_model_parallel_size=2",)


def _worker_pp2(rank: int, tmp: str) -> dict:
    """PP=2 (each stage one MoE layer, its own routes recorded by its own decode)."""
    tmp, out = Path(tmp), {}
    trainer = _build(tmp, "replay", *PP2)
    batch = trainer.rollout(trainer.sample_prompts())
    out["routes_shape"] = list(batch.routes.shape)
    fwd = trainer.compute_old_and_reference(batch)
    if fwd is not None:
        out["old_vs_rollout"] = float((fwd.old_logprobs - batch.logprobs).abs()[batch.response_mask].max())
    trainer.close()
    trainer = _build(tmp, "replay_from_rollout", *PP2)
    metrics = trainer.train_step()
    out["step"] = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))}
    trainer.close()
    return out


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return run_ranks(_worker_pp2, world_size=2, tmp=str(tmp_path_factory.mktemp("r3_pp2")))


def test_replay_at_pp2_each_stage_replays_its_own_layer_s_routes(pp2):
    for r in pp2:
        assert r["routes_shape"][2] == 1  # [B, P+R, L=1 (this stage's layer), k]
    assert pp2[1]["old_vs_rollout"] < 1e-5  # the last stage holds the log-probs
    m = pp2[1]["step"]
    assert abs(m["first_minibatch/ratio_max"] - 1) < 1e-5 and abs(m["first_minibatch/ratio_min"] - 1) < 1e-5
    assert m["grad_norm"] > 0 and m["skipped_updates"] == 0
