"""A multi-turn PPO step (#51: ``env.name``, the two-turn environment whose first turn is
answered like a tool call) at DP=2, TP=2, PP=2 and CP=2 (#52: every CP rank decodes the
whole episodes, CP rank 0 samples and steps the environment; the policy mask with the
environment's hole is sharded with the sequence) on 2 gloo ranks equals one rank's.

Every layout starts from the one-rank run's initial weights (``exp_manager.init_from``): a
random initialisation depends on PP (docs/models.md), so a fresh PP=2 model is another
model. TP=2 and PP=2 sample (temperature 1): the rank that samples (TP rank 0 of the last
stage) draws from the same generator, seeded by ``(rollout.seed, dp_rank, call)``, over the
same logits, so the episodes are one rank's token for token. DP=2 rolls out greedily: DP
ranks sample from different seeds by design (``nemo_rlhf/rollout/generate.py``), so
sampled DP=2 episodes are not one rank's. ``pp2_from_rollout``: PP=2 with
``ppo.old_logprobs_from_rollout=true`` (the last stage's episode decode gives the old
log-probs and values) against one rank's recomputed ones. One spawn for the layouts, as
``test_ppo_parallel.py`` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

COMPARED = ("reward_mean", "response_length", "kl_mean", "policy_loss", "value_loss", "entropy",
            "approx_kl", "clip_fraction", "grad_norm", "returns_mean", "episode/turns_mean",
            "episode/tool_calls_mean", "episode/policy_tokens_mean", "episode/total_tokens_mean",
            "episode/env_reward_mean")
TOL = 1e-5
# one mini-batch per step: every layout sees the same episodes in the same update
COMMON = ("env.name=tests.ppo_helpers:two_turn_env", "env.max_total_tokens=64",
          "reward.functions=[{name: env}]", "ppo.num_rollout_samples=8", "ppo.global_batch_size=8",
          "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=2", "ppo.ppo_epochs=1",
          "ppo.shuffle=false", "optim.lr=1e-3")
LAYOUTS = {"dp2": (1, 1, "greedy"), "tp2": (2, 1, "sample"), "pp2": (1, 2, "sample"), "cp2": (1, 1, "sample"),
           "pp2_from_rollout": (1, 2, "sample")}
CP = {"cp2": 2}  # parallel.context_parallel_size (1 elsewhere)
# the old log-probs and values of the last stage's episode decode, against one rank's recomputed ones
EXTRA = {"pp2_from_rollout": ("ppo.old_logprobs_from_rollout=true",)}
MODE = {"greedy": ("rollout.greedy=true",), "sample": ()}


def _step(trainer) -> dict:
    """One PPO step: its metrics and this rank's episodes (real tokens, policy mask and
    behaviour log-probs on the policy tokens, per row)."""
    metrics = trainer.train_step()
    _, batch, _ = trainer._last_batch
    P, rows = batch.prompt_length, []
    for b in range(batch.batch_size):
        real = batch.attention_mask[b].bool()
        policy = batch.response_mask[b].bool()
        rows.append({"ids": batch.input_ids[b][real].tolist(),
                     "policy": policy[batch.attention_mask[b, P:].bool()].tolist(),
                     "logprobs": batch.logprobs[b][policy].tolist()})
    return {"metrics": metrics, "rows": rows, "cp": trainer.dims.cp,
            "recomputed": "timing/old_logprobs_values_s" in metrics}


def _reference(rank: int, tmp: str):
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    out = {}
    for mode, extra in MODE.items():
        trainer = build(compose_ppo(data, tmp / f"ref_{mode}", *COMMON, *extra))
        if mode == "greedy":
            save_checkpoint(tmp / "init", 0, trainer.model, dims=trainer.dims)
        out[mode] = _step(trainer)
    return out


def _layouts(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build
    from tests.ppo_helpers import TwoTurnEnv

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    out = {}
    step, steps = TwoTurnEnv.step, [0]

    def counted(self, *args):  # this rank's environment steps
        steps[0] += 1
        return step(self, *args)

    TwoTurnEnv.step = counted
    try:
        for name, (tp, pp, mode) in LAYOUTS.items():
            cfg = compose_ppo(data, tmp / name, *COMMON, *MODE[mode],
                              f"exp_manager.init_from={tmp}/init/step_0",
                              f"parallel.tensor_model_parallel_size={tp}",
                              f"parallel.pipeline_model_parallel_size={pp}",
                              f"parallel.context_parallel_size={CP.get(name, 1)}", *EXTRA.get(name, ()))
            steps[0] = 0
            out[name] = _step(build(cfg))
            out[name]["env_steps"] = steps[0]
    finally:
        TwoTurnEnv.step = step
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ppo_mt_par"))
    ref = run_ranks(_reference, world_size=1, tmp=tmp)[0]
    par = run_ranks(_layouts, world_size=2, tmp=tmp)
    return ref, par


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_multiturn_first_step_equals_one_rank(results, layout):
    ref, par = results
    mode = LAYOUTS[layout][2]
    want = ref[mode]
    got = par[0][layout]  # rank 0 reports (the metrics are reduced over DP)
    for key in COMPARED:
        a, b = got["metrics"][key], want["metrics"][key]
        assert abs(a - b) <= TOL * max(1.0, abs(b)), f"{layout} ({mode}) {key}: {a} vs one rank {b}"
    # not vacuous: two policy turns with an environment turn between them, an update
    assert want["metrics"]["episode/turns_mean"] == 2.0 and want["metrics"]["grad_norm"] > 0
    assert want["metrics"]["episode/total_tokens_mean"] > want["metrics"]["episode/policy_tokens_mean"]
    # the episodes themselves: token for token (DP: rank r holds rows [4r, 4r+4) of one rank's)
    rows = (par[0][layout]["rows"] + par[1][layout]["rows"]) if layout == "dp2" else got["rows"]
    assert len(rows) == len(want["rows"]) == 8
    for i, (g, w) in enumerate(zip(rows, want["rows"])):
        assert g["ids"] == w["ids"] and g["policy"] == w["policy"], f"{layout} row {i}"
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=TOL), f"{layout} row {i}"
    if layout != "dp2":  # every rank of the model-parallel (or CP) group holds the same episodes
        assert par[1][layout]["rows"] == got["rows"]
    assert [r[layout]["cp"] for r in par] == [CP.get(layout, 1)] * 2
    assert got["recomputed"] == (layout not in EXTRA)  # pp2_from_rollout: no forward-only pass of the actor
    if layout == "cp2":  # CP rank 0 alone steps the environments (a tool runs once)
        assert par[0][layout]["env_steps"] > 0 and par[1][layout]["env_steps"] == 0


def test_sampled_episodes_are_not_the_greedy_ones(results):
    """The TP/PP comparison above is of sampled episodes: they differ from greedy ones."""
    ref, _ = results
    assert [r["ids"] for r in ref["sample"]["rows"]] != [r["ids"] for r in ref["greedy"]["rows"]]
