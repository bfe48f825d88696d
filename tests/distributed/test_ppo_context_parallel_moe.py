"""A mixture-of-experts PPO step at ``parallel.context_parallel_size=2`` (2 gloo ranks),
alone and with ``parallel.expert_model_parallel_size=2`` on the same 2 ranks (the expert
group is the CP group), equals one rank at CP=1 on its first step within 1e-5: the rollout,
the forward passes (old, reference log-probs, values), ``policy_loss``, ``value_loss``,
``entropy``, KL, ``grad_norm``, the router metrics (``moe/aux_loss``,
``moe/tokens_per_expert_*``) and every parameter's gradient (an EP rank's experts against the
same experts of the whole model). CP=2 runs every config below, CP=2 x EP=2 the replay with
token-budget micro-batches (CI time). The load-balancing loss is on
(``model.moe_aux_loss_coeff=0.1``); one spawn for every check.

Configs: routing replay (``moe.routing_replay``) with padded rows and with token-budget
micro-batches (cut widths that are not multiples of 2 * CP: the routes are padded and cut
to the CP shard like the ids, checked), with the routers changed right after the rollout so
that the trainer's own routing differs from the rollout's (as in
``test_routing_replay_ppo.py``: the replay then matters, checked at CP=1 without it); packed
micro-batches (``ppo.sequence_packing``; routing replay refuses packing).

The CP=2 run also takes the replay step with each CP rank replaying the wrong positions'
routes (``context_parallel.cp_routes`` patched to cut the first ``S / CP`` columns: the
shape the router expects) and the test asserts that its old log-probs are not the rollout's
and its step is not CP=1's: the replay checks can fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import bias_routing, compose_ppo, make_demo_data

TOL = 1e-5
EXPERTS = 4
COMMON = ("ppo.num_rollout_samples=8", "ppo.global_batch_size=8", "ppo.micro_batch_size=2",
          "ppo.forward_micro_batch_size=4", "ppo.ppo_epochs=1", "ppo.shuffle=false",
          "ppo.logprob_chunk_size=0", "ppo.entropy_coef=0.01", "kl.loss_coef=0.1",
          "rollout.temperature=0.8", "rollout.max_new_tokens=8",
          "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "optim.lr=1e-3",
          "model.value_head_init_std=0.05", f"model.num_moe_experts={EXPERTS}", "model.moe_router_topk=2",
          "model.moe_ffn_hidden_size=32", "model.moe_aux_loss_coeff=0.1")
REPLAY = ("moe.routing_replay=true",)
BUDGET = ("ppo.max_tokens_per_micro_batch=40",)
CONFIGS = {  # name -> (overrides, routers changed after the rollout)
    "replay": (REPLAY, True),
    "replay_budget": (REPLAY + BUDGET, True),
    "packed": (("ppo.max_tokens_per_micro_batch=64", "ppo.sequence_packing=true", "ppo.packed_row_length=32"),
               False),
}
CP1_ONLY = {"no_replay": ((), True)}  # the replay matters: without it CP=1's step differs
METRICS = ("policy_loss", "value_loss", "entropy", "kl_mean", "kl_loss", "approx_kl", "clip_fraction",
           "grad_norm", "returns_mean", "reward_mean", "response_length", "moe/aux_loss",
           "moe/tokens_per_expert_max_over_mean", "moe/tokens_per_expert_min_over_mean")
LAYOUTS = {"cp2": ("parallel.context_parallel_size=2",),
           "cp2_ep2": ("parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=2")}
LAYOUT_CONFIGS = {"cp2": list(CONFIGS), "cp2_ep2": ["replay_budget"]}  # (CI time: EP=2 on the cut widths)


def _global_name(name: str, ep: int, ep_rank: int) -> str:
    """A parameter's name with its local expert index made global (``ep_rank * E/ep + i``)."""
    local = EXPERTS // ep
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{ep_rank * local + int(m.group(1))}.",
                  name.replace("module.", ""))


def _step(trainer, change_routers: bool) -> dict:
    """The first step: rollout, forward passes, metrics, gradients by global name (before the
    optimizer step), the training micro-batches' widths."""
    import nemo_rlhf.trainers.ppo.micro_batches as mbs
    from nemo_rlhf.models.engine import unwrap
    from nemo_rlhf.models.routing_replay import moe_routers

    with torch.no_grad():  # sharper routers: top-2 choices that differ by token
        for r in moe_routers(trainer.model):
            r.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    bias_routing(trainer.model, torch.zeros(EXPERTS))
    rec: dict = {"widths": []}
    rollout, compute_fwd, take, step = (trainer.rollout_source.rollout, trainer.compute_old_and_reference,
                                        mbs.take, trainer.optimizer.step)

    def rollout_then_change(*args):  # the trainer's routers choose differently from here on
        batch = rollout(*args)
        if change_routers:
            bias_routing(trainer.model, torch.randn(EXPERTS, generator=torch.Generator().manual_seed(9)))
        return batch

    def fwd(batch):
        out = compute_fwd(batch)
        m = batch.response_mask
        rec["batch"] = {"input_ids": batch.input_ids.cpu(), "response_mask": m.cpu()}
        rec["fwd"] = {k: getattr(out, k).cpu() for k in ("old_logprobs", "ref_logprobs", "values")}
        rec["old_vs_rollout"] = float((out.old_logprobs - batch.logprobs).abs()[m].max())
        return out

    def opt_step(*args, **kwargs):
        d = trainer.dims
        rec.setdefault("grads", {_global_name(n, d.ep, d.ep_rank): p.main_grad.detach().float().cpu().clone()
                                 for n, p in unwrap(trainer.model).named_parameters() if p.requires_grad})
        return step(*args, **kwargs)

    def take_and_record(*args, **kwargs):
        mb = take(*args, **kwargs)
        rec["widths"].append(mb["input_ids"].shape[1])
        return mb

    trainer.rollout_source.rollout, trainer.compute_old_and_reference = rollout_then_change, fwd
    trainer.optimizer.step, mbs.take = opt_step, take_and_record
    try:
        rec["metrics"] = {k: float(v) for k, v in trainer.train_step().items()
                          if isinstance(v, (int, float, torch.Tensor))}
    finally:
        mbs.take = take
    rec["layout"] = (trainer.dims.cp, trainer.dims.cp_rank, trainer.dims.ep, trainer.dims.ep_rank)
    trainer.close()
    return rec


def _run(tmp: Path, prefix: str, configs: dict, *overrides: str) -> dict:
    from nemo_rlhf.train_ppo import build

    data = make_demo_data(tmp / "data")
    return {name: _step(build(compose_ppo(data, tmp / f"{prefix}_{name}", *COMMON,
                                          f"exp_manager.init_from={tmp}/init/step_0", *extra, *overrides)), change)
            for name, (extra, change) in configs.items()}


def _reference(rank: int, tmp: str):
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    trainer = build(compose_ppo(make_demo_data(tmp / "data"), tmp / "init_run", *COMMON))
    save_checkpoint(tmp / "init", 0, trainer.model, dims=trainer.dims)
    trainer.close()
    return _run(tmp, "cp1", {**CONFIGS, **CP1_ONLY})


def _cp2(rank: int, tmp: str):
    import nemo_rlhf.models.context_parallel as context_parallel

    tmp = Path(tmp)
    out = {layout: _run(tmp, layout, {c: CONFIGS[c] for c in LAYOUT_CONFIGS[layout]}, *overrides)
           for layout, overrides in LAYOUTS.items()}
    right = context_parallel.cp_routes

    def first_columns(routes, seq_len, cp, cp_rank):  # every rank the first S / CP columns' routes
        return right(routes, seq_len, 1, 0)[:, :seq_len // cp]

    context_parallel.cp_routes = first_columns
    try:
        out["wrong_routes"] = _run(tmp, "cp2_wrong", {"replay": CONFIGS["replay"]}, *LAYOUTS["cp2"])["replay"]
    finally:
        context_parallel.cp_routes = right
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ppo_cp_moe"))
    ref = run_ranks(_reference, world_size=1, tmp=tmp)[0]
    return ref, run_ranks(_cp2, world_size=2, tmp=tmp)


def test_layouts(results):
    ref, cp = results
    assert ref["replay"]["layout"] == (1, 0, 1, 0)
    assert [r["cp2"]["replay"]["layout"] for r in cp] == [(2, 0, 1, 0), (2, 1, 1, 0)]
    assert [r["cp2_ep2"]["replay_budget"]["layout"] for r in cp] == [(2, 0, 2, 0), (2, 1, 2, 1)]


@pytest.mark.parametrize("layout, config", [(lay, c) for lay, cs in LAYOUT_CONFIGS.items() for c in cs])
def test_first_step_equals_cp1(results, layout, config):
    """Rollout, forward passes, metrics (the router's included) and every gradient."""
    ref, cp = results
    want = ref[config]
    mask = want["batch"]["response_mask"]
    for r in cp:
        got = r[layout][config]
        assert torch.equal(got["batch"]["input_ids"], want["batch"]["input_ids"])
        for key in want["fwd"]:
            torch.testing.assert_close(torch.where(mask, got["fwd"][key], 0.0),
                                       torch.where(mask, want["fwd"][key], 0.0), atol=TOL, rtol=0,
                                       msg=f"{layout} {config} {key}")
        names = set(got["grads"])
        assert names <= set(want["grads"]), names - set(want["grads"])
        ep = got["layout"][2]
        assert len(names) == len(want["grads"]) - (len([n for n in want["grads"] if "local_experts" in n])
                                                   * (ep - 1) // ep)  # an EP rank holds 1/EP of the experts
        for name in names:
            torch.testing.assert_close(got["grads"][name], want["grads"][name], atol=TOL, rtol=0,
                                       msg=f"{layout} {config} {name}")
    for key in METRICS:
        a, b = cp[0][layout][config]["metrics"][key], want["metrics"][key]  # rank 0 reports
        assert abs(a - b) <= TOL * max(1.0, abs(b)), f"{layout} {config} {key}: CP=2 {a} vs CP=1 {b}"
    assert want["metrics"]["grad_norm"] > 0 and want["metrics"]["moe/aux_loss"] > 0


def test_the_replay_replays_the_rollout_s_routes_under_cp(results):
    """The old log-probs' forward replays the rollout's routes (they equal the rollout's
    behaviour log-probs), at CP=1 and on every CP rank; without replay they do not."""
    ref, cp = results
    assert ref["no_replay"]["old_vs_rollout"] > 1e-3
    for name in ("replay", "replay_budget"):
        assert ref[name]["old_vs_rollout"] < 1e-5
        for r in cp:
            for layout in LAYOUTS:
                if name in r[layout]:
                    assert r[layout][name]["old_vs_rollout"] < 1e-5, (layout, name)
    assert abs(ref["no_replay"]["metrics"]["grad_norm"] - ref["replay"]["metrics"]["grad_norm"]) > 100 * TOL


def test_budget_micro_batches_are_cut_to_widths_that_need_the_cp_padding(results):
    ref, cp = results
    widths = cp[0]["cp2"]["replay_budget"]["widths"]
    assert len(widths) > 1 and any(w % 4 for w in widths), widths
    assert widths == ref["replay_budget"]["widths"]


def test_routes_of_the_wrong_positions_are_caught(results):
    """Each CP rank replaying the first ``S / CP`` columns' routes instead of its own: the
    old log-probs are not the rollout's and the step is not CP=1's."""
    ref, cp = results
    for r in cp:
        assert r["wrong_routes"]["old_vs_rollout"] > 1e-3
    want, got = ref["replay"]["metrics"], cp[0]["wrong_routes"]["metrics"]
    assert abs(got["grad_norm"] - want["grad_norm"]) > 100 * TOL, (got["grad_norm"], want["grad_norm"])
