"""The PPO trainer at ``parallel.context_parallel_size=2`` (2 gloo ranks) equals CP=1 (one
rank) on its first two steps, within 1e-5: the rollout (identical on both CP ranks), the old,
reference and KL log-probs and the values of the forward-only passes, the per-token KL of
the token rewards, the step's losses, entropy and KL metrics, every parameter's gradient
and the updated weights (of the first step; the second's actor is no longer the reference,
so its KL is not 0). One spawn per layout for all checks.

The shared value head (and, one step, a separate critic), a KL term in the loss at a KL temperature other than the sampling
one (``kl.temperature=unscaled``: the forward passes' ``kl_logprobs``), an entropy bonus,
sampled (not greedy) rollouts: CP rank 0 samples and broadcasts, and the seeds are the DP
rank's, so CP=2 draws CP=1's tokens. The rows' length is not a multiple of 2 * CP = 4, so
the micro-batch builder's CP padding is exercised.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

TOL = 1e-5
COMMON = ("ppo.num_rollout_samples=8", "ppo.global_batch_size=8", "ppo.micro_batch_size=2",
          "ppo.forward_micro_batch_size=4", "ppo.ppo_epochs=1", "ppo.shuffle=false",
          "ppo.logprob_chunk_size=0", "ppo.entropy_coef=0.01", "kl.loss_coef=0.1",
          "kl.temperature=unscaled", "rollout.temperature=0.8", "rollout.max_new_tokens=6",
          "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "optim.lr=1e-3",
          "model.value_head_init_std=0.05")
METRICS = ("policy_loss", "value_loss", "entropy", "kl_mean", "kl_per_token", "approx_kl",
           "clip_fraction", "grad_norm", "returns_mean", "advantages_mean", "reward_mean",
           "response_length", "kl_loss")


def _instrument(trainer) -> dict:
    """Record the step's rollout, forward-only results, KL, gradients (before the
    optimizer step) and updated weights of ``trainer``'s first step."""
    from nemo_rlhf.models.engine import unwrap

    rec: dict = {}
    compute_fwd, compute_adv, step = (trainer.compute_old_and_reference, trainer.compute_advantages,
                                      trainer.optimizer.step)

    def fwd(batch):
        out = compute_fwd(batch)
        rec.setdefault("batch", []).append({"input_ids": batch.input_ids.cpu(), "logprobs": batch.logprobs.cpu(),
                                            "response_mask": batch.response_mask.cpu()})
        rec.setdefault("fwd", []).append({k: getattr(out, k).cpu() for k in
                                          ("old_logprobs", "ref_logprobs", "kl_logprobs", "values")})
        return out

    def adv(batch, scores, f):
        a, metrics = compute_adv(batch, scores, f)
        rec.setdefault("adv", []).append({"kl": a.kl.cpu(), "advantages": a.advantages.cpu(),
                                          "returns": a.returns.cpu()})
        return a, metrics

    def opt_step(*args, **kwargs):
        rec.setdefault("grads", {n: p.main_grad.detach().float().cpu().clone()
                                 for n, p in unwrap(trainer.model).named_parameters() if p.requires_grad})
        return step(*args, **kwargs)

    trainer.compute_old_and_reference, trainer.compute_advantages = fwd, adv
    trainer.optimizer.step = opt_step
    return rec


def _run(trainer, save: bool = False) -> dict:
    from nemo_rlhf.models.engine import unwrap

    rec = _instrument(trainer)
    rec["metrics"] = [trainer.train_step()]
    trainer.step += 1  # (what the loop does after a step)
    rec["weights"] = {n: p.detach().float().cpu().clone() for n, p in unwrap(trainer.model).named_parameters()}
    if save:
        rec["checkpoint"] = str(trainer.save())
    rec["metrics"].append(trainer.train_step())  # the second: the actor no longer the reference
    trainer.step += 1
    trainer.eval_prompts = trainer.eval_prompts[:4]
    rec["eval"] = trainer.evaluate()  # greedy held-out decoding and scoring
    rec["layout"] = (trainer.dims.cp, trainer.dims.cp_rank, trainer.dims.dp)
    return rec


def _separate_critic_step(build, data: Path, exp_dir: Path, init: Path, *overrides: str) -> dict:
    """One step with ``critic.mode=separate`` from ``init``: metrics, the critic's values
    of the rollout, and the actor's and the critic's gradients."""
    from nemo_rlhf.models.engine import unwrap

    trainer = build(compose_ppo(data, exp_dir, *COMMON, f"exp_manager.init_from={init}",
                                "critic.mode=separate", *overrides))
    rec = _instrument(trainer)
    critic, critic_opt = trainer.critic.checkpoint
    critic_step = critic_opt.step

    def opt_step(*args, **kwargs):
        rec.setdefault("critic_grads", {n: p.main_grad.detach().float().cpu().clone()
                                        for n, p in unwrap(critic).named_parameters()})
        return critic_step(*args, **kwargs)

    critic_opt.step = opt_step
    rec["metrics"] = trainer.train_step()
    return rec


LORA = ("model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8")


def _lora_step(build, data: Path, exp_dir: Path, init: Path, *overrides: str) -> dict:
    """One LoRA step from ``init`` (the reference: the adapters switched off): metrics,
    forward passes and the trainable parameters' (adapters', value head's) gradients."""
    trainer = build(compose_ppo(data, exp_dir, *COMMON, f"exp_manager.init_from={init}", *LORA, *overrides))
    rec = _instrument(trainer)
    rec["metrics"] = trainer.train_step()
    trainer.step += 1
    rec["second"] = trainer.train_step()  # the adapters moved: KL to the base is not 0
    return rec


def _reference(rank: int, tmp: str):
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    trainer = build(compose_ppo(data, tmp / "cp1", *COMMON))
    save_checkpoint(tmp / "init", 0, trainer.model, dims=trainer.dims)
    out = _run(trainer)
    out["separate"] = _separate_critic_step(build, data, tmp / "cp1_sep", tmp / "init" / "step_0")
    out["lora"] = _lora_step(build, data, tmp / "cp1_lora", tmp / "init" / "step_0")
    return out


def _cp2(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    trainer = build(compose_ppo(data, tmp / "cp2", *COMMON, f"exp_manager.init_from={tmp}/init/step_0",
                                "parallel.context_parallel_size=2"))
    out = _run(trainer, save=True)
    out["separate"] = _separate_critic_step(build, data, tmp / "cp2_sep", tmp / "init" / "step_0",
                                            "parallel.context_parallel_size=2")
    out["lora"] = _lora_step(build, data, tmp / "cp2_lora", tmp / "init" / "step_0",
                             "parallel.context_parallel_size=2")
    # the fused output layer (5 tokens a chunk) on the CP rank's positions, first step
    fused = [o for o in COMMON if not o.startswith("ppo.logprob_chunk_size")] + ["ppo.logprob_chunk_size=5"]
    trainer = build(compose_ppo(data, tmp / "cp2_fused", *fused, f"exp_manager.init_from={tmp}/init/step_0",
                                "parallel.context_parallel_size=2"))
    out["fused"] = _instrument(trainer)
    import nemo_rlhf.models.actor_critic as ac

    calls, fused_fn = [], ac.cp_fused_logprobs
    ac.cp_fused_logprobs = lambda *a, **k: calls.append(1) or fused_fn(*a, **k)
    out["fused"]["metrics"] = trainer.train_step()
    ac.cp_fused_logprobs = fused_fn
    out["fused"]["calls"] = len(calls)
    # the CP=2 checkpoint after step 1 resumed at TP=2 (CP=1) on the same two ranks
    out["resumed_tp2"] = _resume(build, tmp, data, out["checkpoint"], "resumed_tp2",
                                 "parallel.tensor_model_parallel_size=2")
    return out


def _resume(build, tmp: Path, data: Path, checkpoint: str, name: str, *overrides: str) -> dict:
    """The CP=2 run's checkpoint after its first step, resumed in another layout: its next
    step (and the layout it ran in)."""
    trainer = build(compose_ppo(data, tmp / name, *COMMON, f"exp_manager.init_from={tmp}/init/step_0",
                                f"exp_manager.resume={checkpoint}", *overrides))
    trainer.resume()
    return {"step": trainer.step, "metrics": trainer.train_step(),
            "layout": (trainer.dims.cp, trainer.dims.tp, trainer.dims.dp)}


def _resume_at_cp1(rank: int, tmp: str, checkpoint: str):
    """The CP=2 run's checkpoint after its first step, resumed at CP=1: its next step."""
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    return _resume(build, tmp, make_demo_data(tmp / "data"), checkpoint, "resumed")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ppo_cp"))
    ref = run_ranks(_reference, world_size=1, tmp=tmp)[0]
    cp = run_ranks(_cp2, world_size=2, tmp=tmp)
    return ref, cp, tmp


@pytest.fixture(scope="module")
def resumed(results):
    _, cp, tmp = results
    return run_ranks(_resume_at_cp1, world_size=1, tmp=tmp, checkpoint=cp[0]["checkpoint"])[0]


def test_layout_and_padding_exercised(results):
    ref, cp, _ = results
    assert ref["layout"] == (1, 0, 1)
    assert [r["layout"] for r in cp] == [(2, 0, 1), (2, 1, 1)]
    S = ref["batch"][0]["input_ids"].shape[1]
    assert S % 4 != 0, f"rows of {S} columns: the CP padding (to a multiple of 4) is not exercised"


@pytest.mark.parametrize("step", [0, 1])
def test_cp_ranks_have_cp1s_rollout(results, step):
    ref, cp, _ = results
    want = ref["batch"][step]
    for r in cp:
        got = r["batch"][step]
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["response_mask"], want["response_mask"])
        assert torch.equal(got["logprobs"], cp[0]["batch"][step]["logprobs"])  # CP rank 0's, broadcast
        torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=TOL, rtol=0)
    assert want["response_mask"].sum() > 8  # sampled responses, not all one token


@pytest.mark.parametrize("step", [0, 1])
@pytest.mark.parametrize("key", ["old_logprobs", "ref_logprobs", "kl_logprobs", "values"])
def test_forward_passes_equal_cp1(results, key, step):
    ref, cp, _ = results
    mask = ref["batch"][step]["response_mask"]
    want = torch.where(mask, ref["fwd"][step][key], 0.0)
    for r in cp:
        torch.testing.assert_close(torch.where(mask, r["fwd"][step][key], 0.0), want, atol=TOL, rtol=0)
    assert want.abs().sum() > 0
    if key == "kl_logprobs":  # another temperature than the ratio's: a separate pass
        assert not torch.allclose(want, torch.where(mask, ref["fwd"][step]["old_logprobs"], 0.0))


@pytest.mark.parametrize("step", [0, 1])
@pytest.mark.parametrize("key", ["kl", "advantages", "returns"])
def test_token_kl_and_advantages_equal_cp1(results, key, step):
    ref, cp, _ = results
    for r in cp:
        torch.testing.assert_close(r["adv"][step][key], ref["adv"][step][key], atol=TOL, rtol=0)
    if key != "kl" or step == 1:  # (the first step's actor is the reference: KL 0)
        assert ref["adv"][step][key].abs().sum() > 0


@pytest.mark.parametrize("step", [0, 1])
@pytest.mark.parametrize("key", METRICS)
def test_step_metrics_equal_cp1(results, key, step):
    ref, cp, _ = results
    want, got = ref["metrics"][step][key], cp[0]["metrics"][step][key]  # rank 0 reports
    assert abs(got - want) <= TOL * max(1.0, abs(want)), f"step {step + 1} {key}: CP=2 {got} vs CP=1 {want}"


def test_the_compared_losses_are_not_vacuous(results):
    first, second = results[0]["metrics"]
    assert first["value_loss"] > 0 and first["entropy"] > 0 and first["grad_norm"] > 0
    assert second["kl_loss"] > 0 and second["kl_mean"] != 0  # the first step's actor is the reference


def test_first_step_gradients_and_updated_weights_equal_cp1(results):
    ref, cp, _ = results
    for r in cp:
        assert set(r["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, atol=TOL, rtol=0, msg=name)
        for name, w in ref["weights"].items():
            torch.testing.assert_close(r["weights"][name], w, atol=TOL, rtol=0, msg=name)
    assert sum(float(g.abs().sum()) for g in ref["grads"].values()) > 0
    assert any("value_head" in n and float(g.abs().sum()) > 0 for n, g in ref["grads"].items())


def test_a_cp2_checkpoint_resumed_at_cp1_gives_the_same_next_step(results, resumed):
    """CP does not shard the weights: the CP=2 run's checkpoint after step 1 loads at CP=1
    (one rank) and its step 2 is the CP=2 run's (and the CP=1 run's) step 2."""
    ref, cp, _ = results
    assert resumed["step"] == 1
    for key in ("policy_loss", "value_loss", "entropy", "kl_mean", "kl_loss", "grad_norm", "approx_kl",
                "reward_mean", "returns_mean"):
        want, got = cp[0]["metrics"][1][key], resumed["metrics"][key]
        assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{key}: resumed at CP=1 {got} vs CP=2 {want}"
        assert abs(got - ref["metrics"][1][key]) <= TOL * max(1.0, abs(want)), key


def test_a_cp2_checkpoint_resumed_at_tp2_gives_the_same_next_step(results):
    """The CP=2 run's checkpoint after step 1 loads at TP=2 x CP=1 on the same two ranks
    (megatron's distributed format reshards the weights and the optimizer state to the TP
    shards): its step 2 is the CP=2 run's (and the CP=1 run's) step 2 within 1e-5."""
    ref, cp, _ = results
    for r in cp:
        assert r["resumed_tp2"]["layout"] == (1, 2, 1) and r["resumed_tp2"]["step"] == 1
    got = cp[0]["resumed_tp2"]["metrics"]  # rank 0 reports
    for key in ("policy_loss", "value_loss", "entropy", "kl_mean", "kl_loss", "grad_norm", "approx_kl",
                "clip_fraction", "reward_mean", "returns_mean", "response_length"):
        want = cp[0]["metrics"][1][key]
        assert abs(got[key] - want) <= TOL * max(1.0, abs(want)), f"{key}: resumed at TP=2 {got[key]} vs CP=2 {want}"
        assert abs(got[key] - ref["metrics"][1][key]) <= TOL * max(1.0, abs(want)), key
    assert got["kl_loss"] > 0  # step 2: the resumed actor is not the reference


def test_a_separate_critic_at_cp2_equals_cp1(results):
    """``critic.mode=separate``: its values of the rollout, its loss and gradient norm, and
    the actor's and the critic's gradients of the first step."""
    ref, cp, _ = results
    want = ref["separate"]
    mask = want["batch"][0]["response_mask"]
    for r in cp:
        got = r["separate"]
        assert torch.equal(got["batch"][0]["input_ids"], want["batch"][0]["input_ids"])
        torch.testing.assert_close(torch.where(mask, got["fwd"][0]["values"], 0.0),
                                   torch.where(mask, want["fwd"][0]["values"], 0.0), atol=TOL, rtol=0)
        for key in ("grads", "critic_grads"):
            assert set(got[key]) == set(want[key]) and want[key]
            for name, g in want[key].items():
                torch.testing.assert_close(got[key][name], g, atol=TOL, rtol=0, msg=f"{key} {name}")
    for key in ("value_loss", "critic_grad_norm", "policy_loss", "grad_norm", "entropy"):
        a, b = cp[0]["separate"]["metrics"][key], want["metrics"][key]
        assert abs(a - b) <= TOL * max(1.0, abs(b)), f"separate critic {key}: CP=2 {a} vs CP=1 {b}"
    assert want["metrics"]["value_loss"] > 0 and want["metrics"]["critic_grad_norm"] > 0
    assert torch.where(mask, want["fwd"][0]["values"], 0.0).abs().sum() > 0
    assert not any("value_head" in n for n in want["grads"])  # the actor has no value head


def test_lora_at_cp2_equals_cp1(results):
    """``model.lora.enabled``: the forward passes (the reference is the base, adapters
    off), the adapters' and the value head's gradients of the first step, and the metrics
    of two steps (the second with a KL to the base)."""
    ref, cp, _ = results
    want = ref["lora"]
    mask = want["batch"][1]["response_mask"]
    for r in cp:
        got = r["lora"]
        assert set(got["grads"]) == set(want["grads"]) and any("lora" in n for n in want["grads"])
        for name, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, atol=TOL, rtol=0, msg=name)
        for key in ("old_logprobs", "ref_logprobs", "values"):
            torch.testing.assert_close(torch.where(mask, got["fwd"][1][key], 0.0),
                                       torch.where(mask, want["fwd"][1][key], 0.0), atol=TOL, rtol=0, msg=key)
    for step in ("metrics", "second"):
        for key in ("policy_loss", "value_loss", "entropy", "kl_mean", "kl_loss", "grad_norm"):
            a, b = cp[0]["lora"][step][key], want[step][key]
            assert abs(a - b) <= TOL * max(1.0, abs(b)), f"LoRA {step} {key}: CP=2 {a} vs CP=1 {b}"
    assert want["second"]["kl_mean"] != 0 and sum(float(g.abs().sum()) for n, g in want["grads"].items()
                                                   if "lora" in n) > 0


def test_the_fused_output_layer_at_cp2_equals_the_logits_at_cp1(results):
    """``ppo.logprob_chunk_size=5``: the CP rank's response positions through the fused,
    chunked output layer give CP=1's (logits path) first step: forward passes, losses and
    every gradient, within 1e-5."""
    ref, cp, _ = results
    mask = ref["batch"][0]["response_mask"]
    for r in cp:
        got = r["fused"]
        assert got["calls"] >= 3  # the fused layer ran (old + reference passes, the update)
        assert torch.equal(got["batch"][0]["input_ids"], ref["batch"][0]["input_ids"])
        for key in ("old_logprobs", "ref_logprobs", "kl_logprobs", "values"):
            torch.testing.assert_close(torch.where(mask, got["fwd"][0][key], 0.0),
                                       torch.where(mask, ref["fwd"][0][key], 0.0), atol=TOL, rtol=0, msg=key)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, atol=TOL, rtol=0, msg=name)
    for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "grad_norm"):
        a, b = cp[0]["fused"]["metrics"][key], ref["metrics"][0][key]
        assert abs(a - b) <= TOL * max(1.0, abs(b)), f"fused {key}: CP=2 {a} vs CP=1 {b}"


def test_the_held_out_evaluation_at_cp2_equals_cp1(results):
    ref, cp, _ = results
    want, got = ref["eval"], cp[0]["eval"]
    for key in ("eval/reward", "eval/response_length", "eval/accuracy"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key
    assert want["eval/response_length"] > 0
