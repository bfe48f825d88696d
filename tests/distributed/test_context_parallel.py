"""Context parallelism: CP=2 on 2 gloo ranks agrees with CP=1 (one spawn for all checks).

The tiny model (RoPE, grouped-query attention) at CP=1 and at CP=2: per-token log-probs,
entropy and values of every position, and every parameter's gradient of one PPO-style
loss step (the clipped policy loss, a value term and an entropy bonus, token-means over
the global token count), within 1e-5. Also a learned-absolute-position variant's
log-probs, and the all-gather's backward (a reduce-scatter) against hand-computed sums.

Without CUDA the ranks run under the device guard (``NEMO_RLHF_DEVICE_GUARD=1``): a host
tensor meeting a device tensor, or handed to a backend without gloo, fails as on CUDA.
With two GPUs the same checks run on NCCL (the backward's ``reduce_scatter_tensor``).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.distributed.harness import run_ranks

VOCAB = 100
SEQ = 12  # divisible by 2 * CP = 4
BATCH = 3
TEMP = 0.7
TOL = 1e-5


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    g2 = torch.Generator().manual_seed(1)
    old_lp = -torch.rand(BATCH, SEQ, generator=g2) * 3 - 1.0
    adv = torch.randn(BATCH, SEQ, generator=g2)
    return ids, mask, old_lp, adv


def _cfg(**kw):
    from nemo_rlhf.models.config import load_model_preset

    return load_model_preset("tiny", vocab_size=VOCAB, value_head_init_std=0.05, **kw)


def _step(model, dims, ids, mask, old_lp, adv):
    """Per-token outputs (this rank's positions, then gathered to global order) and the
    gradients of one loss step, summed over the CP group."""
    import torch.distributed as dist

    from nemo_rlhf.algorithms.ppo.losses import policy_loss
    from nemo_rlhf.models.context_parallel import (cp_global_token_count, cp_next_token_targets,
                                                   gather_sequence, shard_sequence)
    from nemo_rlhf.models.engine import model_forward
    from nemo_rlhf.models.vocab_parallel import vocab_parallel_logprobs

    model.zero_grad()
    ids, mask, old_lp, adv = (t.to(dims.device) for t in (ids, mask, old_lp, adv))
    logits, values = model_forward(model, ids, mask)  # (this CP rank's positions)
    targets, has_target = cp_next_token_targets(ids, dims)
    lp, ent = vocab_parallel_logprobs(logits, targets, dims.tp_group, dims.tp_rank,
                                      temperature=TEMP, vocab_size=VOCAB)
    # a token counts when it and its target are real tokens
    target_real = shard_sequence(torch.cat([mask[:, 1:], mask.new_zeros(BATCH, 1)], 1).bool(), dims)
    m = has_target & shard_sequence(mask.bool(), dims) & target_real
    n = cp_global_token_count(m, dims)
    ploss, _ = policy_loss(lp, shard_sequence(old_lp, dims), shard_sequence(adv, dims), m, n)
    vloss = torch.where(m, values.float() ** 2, 0.0).sum() / n
    eloss = torch.where(m, ent, 0.0).sum() / n
    loss = ploss + 0.5 * vloss - 0.01 * eloss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if dims.cp > 1:  # megatron's DDP sums over its data-parallel-with-CP group
            dist.all_reduce(g, group=dims.cp_group)
        grads[name] = g.cpu()
    total = loss.detach().clone()
    if dims.cp > 1:
        dist.all_reduce(total, group=dims.cp_group)
    zero = torch.zeros((), device=dims.device)
    out = {name: gather_sequence(torch.where(m, t.detach().float(), zero), dims, dim=1).cpu()
           for name, t in (("logprobs", lp), ("entropy", ent), ("values", values))}
    out.update(grads=grads, loss=float(total), count=float(n),
               mask=gather_sequence(m.long(), dims, dim=1).bool().cpu())
    model.zero_grad()
    return out


def _gather_backward(dims):
    """The all-gather's gradient: rank r's input ``x_r`` (its positions of a length-8
    sequence, ``cp_positions``), loss ``sum(w * gathered)`` with ``w`` different on every
    rank: the gradient of ``x_r`` is the sum over ranks of ``w`` at r's positions."""
    from nemo_rlhf.models.context_parallel import cp_positions, gather_sequence

    pos = cp_positions(8, dims.cp, dims.cp_rank, dims.device)
    x = (pos.float() * 10).requires_grad_(True)
    full = gather_sequence(x, dims, dim=0)
    w = torch.arange(8, dtype=torch.float32, device=dims.device) + 100 * dims.cp_rank
    (full * w).sum().backward()
    return {"full": full.detach().cpu(), "grad": x.grad.cpu(), "pos": pos.cpu()}


def _worker(rank: int):
    if not torch.cuda.is_available():
        os.environ["NEMO_RLHF_DEVICE_GUARD"] = "1"
    from nemo_rlhf.distributed import ParallelConfig, device_guard, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model

    cfg = _cfg()
    ids, mask, old_lp, adv = _batch()
    out = {}
    # --- reference: CP=1 (each rank alone holds the whole sequence) --------------------
    dims = initialize_distributed(ParallelConfig(), seed=3, num_layers=cfg.num_layers)
    from nemo_rlhf.models.context_parallel import cp_global_token_count

    # DP=2 here: rank r counts r + 1 tokens, the global count is 1 + 2
    out["dp_count"] = float(cp_global_token_count(torch.ones(1, rank + 1, device=dims.device), dims))
    dims = dataclasses.replace(dims, dp=1)  # both ranks hold the same batch: no DP sums here
    model = build_model(cfg, dims, seed=11).train()
    out["guard"] = device_guard.is_active()
    out["ref_weights"] = {n: p.detach().cpu() for n, p in model.named_parameters()}
    out["ref"] = _step(model, dims, ids, mask, old_lp, adv)
    abs_cfg = _cfg(position_embedding_type="learned_absolute")
    out["ref_abs"] = _step(build_model(abs_cfg, dims, seed=11).train(), dims, ids, mask, old_lp, adv)

    # --- CP=2 on the same default group ---------------------------------------------------
    dims = initialize_distributed(ParallelConfig(context_parallel_size=2), seed=3,
                                  num_layers=cfg.num_layers)
    out["layout"] = (dims.cp, dims.cp_rank, dims.dp, dims.tp, dims.describe())
    model = build_model(cfg, dims, seed=11).train()
    out["cp_weights"] = {n: p.detach().cpu() for n, p in model.named_parameters()}
    out["attention"] = type(model.decoder.layers[0].self_attention.core_attention).__name__
    out["cp"] = _step(model, dims, ids, mask, old_lp, adv)
    out["cp_abs"] = _step(build_model(abs_cfg, dims, seed=11).train(), dims, ids, mask, old_lp, adv)
    out["gather"] = _gather_backward(dims)
    try:
        _step(model, dims, ids[:, :10], mask[:, :10], old_lp[:, :10], adv[:, :10])
    except ValueError as exc:
        out["bad_len"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 2)


def test_layout_and_attention_class(results):
    for rank, r in enumerate(results):
        assert r["layout"] == (2, rank, 1, 1, {"tp": 1, "pp": 1, "dp": 1, "world_size": 2, "cp": 2})
        assert r["attention"] == "AllGatherCPAttention"
        assert r["guard"] == (not torch.cuda.is_available())
        for name, w in r["ref_weights"].items():
            assert torch.equal(w, r["cp_weights"][name]), name


@pytest.mark.parametrize("variant", ["", "_abs"])
def test_cp2_per_token_outputs_equal_cp1(results, variant):
    for r in results:
        ref, cp = r["ref" + variant], r["cp" + variant]
        assert torch.equal(ref["mask"], cp["mask"])
        assert cp["count"] == ref["count"] == float(ref["mask"].sum())
        for key in ("logprobs", "entropy", "values"):
            torch.testing.assert_close(cp[key], ref[key], atol=TOL, rtol=0, msg=key)
        assert ref["logprobs"].abs().sum() > 0


@pytest.mark.parametrize("variant", ["", "_abs"])
def test_cp2_loss_and_gradients_equal_cp1(results, variant):
    for r in results:
        ref, cp = r["ref" + variant], r["cp" + variant]
        assert abs(cp["loss"] - ref["loss"]) < TOL
        assert set(cp["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            torch.testing.assert_close(cp["grads"][name], g, atol=TOL, rtol=0, msg=name)
        assert sum(float(g.abs().sum()) for g in ref["grads"].values()) > 0


def test_token_count_sums_over_data_parallel(results):
    assert [r["dp_count"] for r in results] == [3.0, 3.0]


def test_gather_backward_is_reduce_scatter(results):
    # rank 0 holds positions 0,1,6,7; rank 1 holds 2,3,4,5; w summed over ranks = 2*pos + 100
    for r in results:
        assert torch.equal(r["gather"]["full"], torch.arange(8, dtype=torch.float32) * 10)
        expect = 2 * r["gather"]["pos"].float() + 100
        assert torch.equal(r["gather"]["grad"], expect)


def test_sequence_not_divisible_by_2cp_is_refused(results):
    for r in results:
        assert "sequence length 10 is not divisible by 2 * parallel.context_parallel_size = 4" in r["bad_len"]
