"""The PPO trainer at ``parallel.context_parallel_size=2`` (2 gloo ranks) with
``ppo.loss_agg_mode=seq-mean-token-mean`` and with token-budget micro-batches
(``ppo.max_tokens_per_micro_batch``) equals CP=1 (one rank) on its first step within 1e-5:
the forward passes, the losses, KL, entropy and grad norm, and every parameter's gradient.
One spawn per layout for all checks.

``seq-mean-token-mean`` divides each row's token losses by the row's own count ``n_b``; a
CP rank holds a shard of every row, so the count must be the whole row's
(``roles.cp_sequence_tokens``). The CP=2 run also takes the step with the shard's own
count (the patched helper returning None) and the test asserts that this differs from
CP=1: the comparison can fail.

The token budget cuts each micro-batch's columns to its rows' extent (widths vary and are
not all multiples of 2 * CP = 4, so the CP padding of a cut micro-batch runs), on the
logits path and on the fused output layer.
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
          "rollout.temperature=0.8", "rollout.max_new_tokens=8",
          "reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "optim.lr=1e-3",
          "model.value_head_init_std=0.05")
SEQ_MEAN = ("ppo.loss_agg_mode=seq-mean-token-mean",)
BUDGET = ("ppo.max_tokens_per_micro_batch=40",)
PACKED = ("ppo.max_tokens_per_micro_batch=64", "ppo.sequence_packing=true", "ppo.packed_row_length=32")
CONFIGS = {  # name -> overrides (each one first step from the same initial weights)
    "seq_mean": SEQ_MEAN,
    "seq_mean_separate": SEQ_MEAN + ("critic.mode=separate",),
    "budget": BUDGET,
    "budget_fused": BUDGET + ("ppo.logprob_chunk_size=5",),
    "budget_seq_mean": BUDGET + SEQ_MEAN,
    "packed": PACKED,
    "packed_fused": PACKED + ("ppo.logprob_chunk_size=5",),
    "packed_seq_mean_separate": PACKED + SEQ_MEAN + ("critic.mode=separate",),
}
METRICS = ("policy_loss", "value_loss", "entropy", "kl_mean", "kl_loss", "approx_kl", "clip_fraction",
           "grad_norm", "returns_mean", "reward_mean", "response_length")


def _step(trainer) -> dict:
    """The first step: rollout, forward passes, metrics, gradients (the actor's and a
    separate critic's, before the optimizer step) and the widths of the training
    micro-batches."""
    import nemo_rlhf.trainers.ppo.micro_batches as mbs
    from nemo_rlhf.models.engine import unwrap

    rec: dict = {"widths": []}
    compute_fwd, take = trainer.compute_old_and_reference, mbs.take

    def fwd(batch):
        out = compute_fwd(batch)
        rec["batch"] = {"input_ids": batch.input_ids.cpu(), "response_mask": batch.response_mask.cpu()}
        rec["fwd"] = {k: getattr(out, k).cpu() for k in ("old_logprobs", "ref_logprobs", "values")
                      if getattr(out, k) is not None}
        return out

    def record(name, opt):
        step = opt.step

        def opt_step(*args, **kwargs):
            model = trainer.model if name == "grads" else trainer.critic.checkpoint[0]
            rec.setdefault(name, {n: p.main_grad.detach().float().cpu().clone()
                                  for n, p in unwrap(model).named_parameters() if p.requires_grad})
            return step(*args, **kwargs)

        opt.step = opt_step

    def take_and_record(*args, **kwargs):
        mb = take(*args, **kwargs)
        rec["widths"].append(mb["input_ids"].shape[1])
        if "packed" in mb:  # sequences per packed row, and the rows' slots
            rec.setdefault("packed", []).append((int(mb["packed"].segment_ids.max()), mb["packed"].slots))
        return mb

    trainer.compute_old_and_reference = fwd
    record("grads", trainer.optimizer)
    if trainer.critic.checkpoint is not None:
        record("critic_grads", trainer.critic.checkpoint[1])
    mbs.take = take_and_record
    try:
        rec["metrics"] = trainer.train_step()
    finally:
        mbs.take = take
    return rec


def _run(tmp: Path, prefix: str, *overrides: str) -> dict:
    from nemo_rlhf.train_ppo import build

    data = make_demo_data(tmp / "data")
    out = {}
    for name, extra in CONFIGS.items():
        trainer = build(compose_ppo(data, tmp / f"{prefix}_{name}", *COMMON, f"exp_manager.init_from={tmp}/init/step_0",
                                    *extra, *overrides))
        out[name] = _step(trainer)
    out["layout"] = (trainer.dims.cp, trainer.dims.cp_rank)
    return out


def _reference(rank: int, tmp: str):
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    trainer = build(compose_ppo(make_demo_data(tmp / "data"), tmp / "init_run", *COMMON))
    save_checkpoint(tmp / "init", 0, trainer.model, dims=trainer.dims)
    return _run(tmp, "cp1")


def _cp2(rank: int, tmp: str):
    import nemo_rlhf.trainers.ppo.roles as roles
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    out = _run(tmp, "cp2", "parallel.context_parallel_size=2")
    # the same seq-mean-token-mean step with each row's count taken from the CP shard only
    whole = roles.cp_sequence_tokens
    roles.cp_sequence_tokens = lambda mask, index: None
    try:
        trainer = build(compose_ppo(make_demo_data(tmp / "data"), tmp / "cp2_shard_count", *COMMON,
                                    f"exp_manager.init_from={tmp}/init/step_0", *SEQ_MEAN,
                                    "parallel.context_parallel_size=2"))
        out["shard_count"] = trainer.train_step()
    finally:
        roles.cp_sequence_tokens = whole
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ppo_cp_budget"))
    ref = run_ranks(_reference, world_size=1, tmp=tmp)[0]
    return ref, run_ranks(_cp2, world_size=2, tmp=tmp)


def test_layout(results):
    ref, cp = results
    assert ref["layout"] == (1, 0) and [r["layout"] for r in cp] == [(2, 0), (2, 1)]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_first_step_equals_cp1(results, config):
    """Rollout, forward passes, metrics, and every gradient (actor's, separate critic's)."""
    ref, cp = results
    want = ref[config]
    mask = want["batch"]["response_mask"]
    for r in cp:
        got = r[config]
        assert torch.equal(got["batch"]["input_ids"], want["batch"]["input_ids"])
        assert set(got["fwd"]) == set(want["fwd"])
        for key in want["fwd"]:
            torch.testing.assert_close(torch.where(mask, got["fwd"][key], 0.0),
                                       torch.where(mask, want["fwd"][key], 0.0), atol=TOL, rtol=0,
                                       msg=f"{config} {key}")
        for key in ("grads", "critic_grads"):
            assert set(got.get(key, {})) == set(want.get(key, {}))
            for name, g in want.get(key, {}).items():
                torch.testing.assert_close(got[key][name], g, atol=TOL, rtol=0, msg=f"{config} {key} {name}")
    for key in METRICS + (("critic_grad_norm",) if config.endswith("separate") else ()):
        a, b = cp[0][config]["metrics"][key], want["metrics"][key]  # rank 0 reports
        assert abs(a - b) <= TOL * max(1.0, abs(b)), f"{config} {key}: CP=2 {a} vs CP=1 {b}"
    assert want["metrics"]["grad_norm"] > 0 and want["metrics"]["value_loss"] > 0
    assert sum(float(g.abs().sum()) for g in want["grads"].values()) > 0


def test_seq_mean_token_mean_differs_from_token_mean(results):
    """The mode changes the step (rows of different lengths): comparing it tests something."""
    ref, _ = results
    budget, seq_mean = ref["budget"]["metrics"], ref["budget_seq_mean"]["metrics"]
    assert abs(budget["policy_loss"] - seq_mean["policy_loss"]) > 1e-4
    lengths = ref["seq_mean"]["batch"]["response_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1


def test_the_shard_count_is_wrong(results):
    """With each row's count taken from the CP rank's shard, the step is not CP=1's (some
    rows' responses straddle the CP ranks' chunks: checked)."""
    from nemo_rlhf.models.context_parallel import pad_to_cp_multiple

    ref, cp = results
    batch = ref["seq_mean"]["batch"]
    S, R = batch["input_ids"].shape[1], batch["response_mask"].shape[1]
    chunk = pad_to_cp_multiple(batch["input_ids"], 2).shape[1] // 4
    # response token j is predicted at position S - R - 1 + j; rank 1 holds chunks 1 and 2
    on_rank1 = [chunk <= S - R - 1 + j < 3 * chunk for j in range(R)]
    split = [(m & torch.tensor(on_rank1)).any() and (m & ~torch.tensor(on_rank1)).any()
             for m in batch["response_mask"]]
    assert any(split), "no row's response is split across the CP ranks"
    want, got = ref["seq_mean"]["metrics"], cp[0]["shard_count"]
    assert abs(got["policy_loss"] - want["policy_loss"]) > 100 * TOL or \
        abs(got["grad_norm"] - want["grad_norm"]) > 100 * TOL, (got["policy_loss"], want["policy_loss"])


def test_the_budget_cuts_micro_batches_to_varied_widths(results):
    ref, cp = results
    widths = cp[0]["budget"]["widths"]
    full = ref["budget"]["batch"]["input_ids"].shape[1]
    assert len(widths) > 1 and min(widths) < full, widths  # cut, several micro-batches
    assert any(w % 4 for w in widths), widths  # the CP padding of a cut micro-batch runs
    assert widths == ref["budget"]["widths"]


def test_packed_equals_padded_under_cp(results):
    """``ppo.sequence_packing`` at CP=2 (megatron's THD layout: every sequence's slot cut
    into 4 chunks, attention within a sequence only) gives the padded micro-batches' step
    at CP=2 and at CP=1 (the same token budget's rows, not packed): forward passes,
    metrics and every gradient within 1e-5."""
    ref, cp = results
    mask = ref["budget"]["batch"]["response_mask"]
    for padded in (ref["budget"], cp[0]["budget"], cp[1]["budget"]):
        for r in cp:
            got = r["packed"]
            assert torch.equal(got["batch"]["input_ids"], padded["batch"]["input_ids"])
            for key in padded["fwd"]:
                torch.testing.assert_close(torch.where(mask, got["fwd"][key], 0.0),
                                           torch.where(mask, padded["fwd"][key], 0.0), atol=TOL, rtol=0, msg=key)
            for name, g in padded["grads"].items():
                torch.testing.assert_close(got["grads"][name], g, atol=TOL, rtol=0, msg=name)
        for key in METRICS:
            a, b = cp[0]["packed"]["metrics"][key], padded["metrics"][key]
            assert abs(a - b) <= TOL * max(1.0, abs(b)), f"packed {key}: CP=2 {a} vs padded {b}"


def test_packed_rows_hold_several_sequences_in_aligned_slots(results):
    ref, cp = results
    for config in ("packed", "packed_fused", "packed_seq_mean_separate"):
        packed = cp[0][config]["packed"]
        assert packed and max(n for n, _ in packed) >= 2, packed  # sequences share a row
        assert all(n % 4 == 0 for _, slots in packed for row in slots for n in row), packed  # 2 * CP
        assert any(n % 4 for _, slots in ref[config]["packed"] for row in slots for n in row), \
            ref[config]["packed"]  # CP=1: end to end, so the alignment padding runs at CP=2
