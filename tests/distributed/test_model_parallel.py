"""TP=2, PP=2 and DP=2 on 2 gloo ranks agree with one rank (one spawn for all checks)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from tests.distributed.harness import run_ranks

VOCAB = 100
SEQ = 12
BATCH = 4
TEMP = 0.7


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    return ids, mask


def _cfg():
    from nemo_rlhf.models.config import load_model_preset

    return load_model_preset("tiny", vocab_size=VOCAB, value_head_init_std=0.05)


def _global_name(name: str, pp_rank: int, layers_per_stage: int) -> str:
    name = name.replace("module.", "")
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m:
        return f"decoder.layers.{int(m.group(1)) + pp_rank * layers_per_stage}.{m.group(2)}"
    return name


def _loss_fn(dims, n_tokens):
    from nemo_rlhf.models.vocab_parallel import vocab_parallel_logprobs

    def fn(output, mb):
        logits, values = output
        lp, ent = vocab_parallel_logprobs(logits[:, :-1], mb["input_ids"][:, 1:], dims.tp_group,
                                          dims.tp_rank, TEMP, VOCAB)
        m = mb["attention_mask"][:, 1:].bool()
        loss = (torch.where(m, -lp + 0.5 * values[:, :-1] ** 2 - 0.01 * ent, 0.0).sum()
                / n_tokens)
        return loss, {"loss": loss.detach()}

    return fn


def _forward_outputs(model, dims, ids, mask):
    from nemo_rlhf.models.vocab_parallel import gather_vocab_parallel, vocab_parallel_logprobs
    from nemo_rlhf.models.engine import model_forward

    with torch.no_grad():
        logits, values = model_forward(model, ids, mask)
        lp, ent = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], dims.tp_group, dims.tp_rank,
                                          TEMP, VOCAB)
        full = gather_vocab_parallel(logits, dims.tp_group)
    return {"logits": full, "values": values, "logprobs": lp, "entropy": ent}


PROMPT = 5  # the fused path's prompt length: response = columns 5..SEQ-1


def _fused_vs_unfused(model, dims, ids, mask):
    """Response log-probs, entropy and every parameter's gradient of one loss, through the
    fused chunked output layer (chunks of 5 tokens) and through the logits."""
    from nemo_rlhf.models.engine import model_forward
    from nemo_rlhf.models.logprobs import LogprobRequest, response_logprobs

    out = {}
    req = LogprobRequest(PROMPT, (TEMP, 1.0), VOCAB, chunk_size=5)
    for name, kwargs in (("fused", {"logprob_request": req}), ("unfused", {})):
        model.zero_grad()
        first, values = model_forward(model, ids, mask, **kwargs)
        lp, ent = response_logprobs(first, (ids, PROMPT), dims, TEMP, vocab_size=VOCAB)
        lp1, _ = response_logprobs(first, (ids, PROMPT), dims, 1.0, vocab_size=VOCAB, compute_entropy=False)
        m = mask[:, PROMPT:].bool()
        (torch.where(m, -lp - 0.3 * lp1 - 0.01 * ent + values[:, PROMPT - 1:-1] ** 2, 0.0).sum()).backward()
        out[name] = {"logprobs": lp.detach(), "logprobs_t1": lp1.detach(), "entropy": ent.detach(),
                     "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    model.zero_grad()
    return out


# packed vs padded: rows of varied spans (left-padded prompts, right-padded responses) in
# two micro-batches of two rows; each micro-batch packs its rows into one packed row
PACK_SPANS = [(0, 12), (2, 7), (3, 8), (1, 10)]


def _pack_batch():
    ids, _ = _batch()
    mask = torch.zeros_like(ids)
    for i, (a, b) in enumerate(PACK_SPANS):
        mask[i, a:b] = 1
    return ids * mask, mask


def _packed_vs_padded(ddp, dims, fused: bool):
    """Per-token response log-probs, entropy and values, the loss and every parameter's
    gradient of one forward/backward over two micro-batches (megatron's schedule, so PP=2
    runs 1F1B), padded and packed."""
    from nemo_rlhf.models.engine import finalize_grads, forward_backward, unwrap
    from nemo_rlhf.models.logprobs import LogprobRequest, response_logprobs
    from nemo_rlhf.models.packing import pack_rows

    ids, mask = _pack_batch()
    n_tokens = int(mask[:, PROMPT:].sum())
    request = LogprobRequest(PROMPT, (TEMP,), VOCAB, chunk_size=3) if fused else None

    def loss_fn(output, mb):
        first, values = output
        lp, ent = response_logprobs(first, (mb["input_ids"], PROMPT), dims, TEMP, vocab_size=VOCAB)
        m = mb["attention_mask"][:, PROMPT:].bool()
        v = values[:, PROMPT - 1:-1]
        loss = torch.where(m, -lp - 0.01 * ent + v ** 2, 0.0).sum() / n_tokens
        zero = torch.zeros((), dtype=lp.dtype)
        return loss, {"loss": loss.detach(), "logprobs": torch.where(m, lp, zero).detach(),
                      "entropy": torch.where(m, ent, zero).detach(), "values": torch.where(m, v, zero).detach()}

    out = {}
    for name in ("padded", "packed"):
        mbs = []
        for rows in ((0, 1), (2, 3)):
            mb = {"input_ids": ids[list(rows)], "attention_mask": mask[list(rows)]}
            if name == "packed":
                mb["packed"] = pack_rows(mb["input_ids"], [PACK_SPANS[r] for r in rows], [[0, 1]], PROMPT)
            mbs.append(mb)
        ddp.zero_grad_buffer()
        res = forward_backward(ddp, mbs, loss_fn, logprob_request=request, variable_shapes=name == "packed")
        finalize_grads(ddp)
        out[name] = {"grads": {n: p.main_grad.clone() for n, p in unwrap(ddp).named_parameters()}}
        if res:
            out[name].update({k: torch.cat([r[k] for r in res]) for k in ("logprobs", "entropy", "values")},
                             loss=float(sum(r["loss"] for r in res)))
    ddp.zero_grad_buffer()
    return out


def _replicated_params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if not getattr(p, "tensor_model_parallel", False)}


def _saved_bytes_and_grads(model, dims, ids, mask, n_tokens):
    """Bytes the training forward saves for the backward (not counting what a recomputing
    backward saves again), and the gradients (plain autograd)."""
    from nemo_rlhf.models.engine import model_forward

    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = model_forward(model, ids, mask)
        loss, _ = _loss_fn(dims, n_tokens)(output, {"input_ids": ids, "attention_mask": mask})
    loss.backward()
    return saved[0], {n: p.grad.clone() for n, p in model.named_parameters()}


RECOMPUTE = {"full": dict(recompute_granularity="full"),
             "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])}


def _worker(rank: int):
    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.engine import finalize_grads, forward_backward, unwrap, wrap_ddp
    from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig

    cfg = _cfg()
    ids, mask = _batch()
    n_tokens = int(mask[:, 1:].sum())
    out = {}

    # --- reference: TP=1, PP=1 (each rank alone holds the whole model) ---------------
    dims = initialize_distributed(ParallelConfig(), seed=3, num_layers=cfg.num_layers)
    model = build_model(cfg, dims, seed=11).eval()
    ref_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["ref"] = _forward_outputs(model, dims, ids, mask)
    out["ref_fused"] = _fused_vs_unfused(model, dims, ids, mask)
    model.train()
    res = forward_backward(model, [{"input_ids": ids, "attention_mask": mask}], _loss_fn(dims, n_tokens))
    out["ref_loss"] = float(res[0]["loss"])
    out["ref_grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # activation recompute: the same gradients, less saved for the backward
    out["recompute_tp1"] = {"none": _saved_bytes_and_grads(build_model(cfg, dims, seed=11), dims, ids, mask, n_tokens)}
    for name, rc in RECOMPUTE.items():
        rc_model = build_model(dataclasses.replace(cfg, **rc), dims, seed=11)
        out["recompute_tp1"][name] = _saved_bytes_and_grads(rc_model, dims, ids, mask, n_tokens)
    # whole batch, one rank, plain autograd, one optimizer step
    # adam_eps=1 makes the first AdamW step ~ lr * grad: well conditioned for comparison
    # (with a tiny eps the first step is lr * sign(grad), which flips on rounding noise).
    opt = MixedPrecisionOptimizer(model, OptimizerConfig(lr=1e-2, clip_grad=0.0, adam_eps=1.0))
    forward_backward(model, [{"input_ids": ids, "attention_mask": mask}], _loss_fn(dims, n_tokens))
    opt.step()
    out["ref_updated"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    pack_model = build_model(cfg, dims, seed=11)
    out["pack_tp1"] = {f: _packed_vs_padded(wrap_ddp(pack_model), dims, f) for f in (True, False)}
    del pack_model

    # --- bf16-mixed model with the same weights: fp32 log-probs, close to fp32's ------------
    bf16 = build_model(cfg, dims, precision="bf16-mixed", seed=11).eval()
    with torch.no_grad():
        for n, p in bf16.named_parameters():
            p.copy_(ref_weights[n])
    out["bf16"] = _forward_outputs(bf16, dims, ids, mask)
    del bf16

    # --- TP=2 -------------------------------------------------------------------------
    dims = initialize_distributed(ParallelConfig(tensor_model_parallel_size=2), seed=3)
    model = build_model(cfg, dims, seed=11).eval()
    out["tp2"] = _forward_outputs(model, dims, ids, mask)
    out["tp2_fused"] = _fused_vs_unfused(model, dims, ids, mask)
    out["tp2_replicated_init"] = _replicated_params(model)
    model.train()
    ddp = wrap_ddp(model)
    opt = MixedPrecisionOptimizer(ddp, OptimizerConfig(lr=1e-2), mp_group=dims.mp_group)
    forward_backward(ddp, [{"input_ids": ids, "attention_mask": mask}], _loss_fn(dims, n_tokens))
    finalize_grads(ddp)
    opt.step()
    out["tp2_replicated_after_step"] = _replicated_params(model)
    out["recompute_tp2"] = {
        name: _saved_bytes_and_grads(build_model(dataclasses.replace(cfg, **rc), dims, seed=11),
                                     dims, ids, mask, n_tokens)
        for name, rc in {"none": {}, **RECOMPUTE}.items()}
    pack_model = build_model(cfg, dims, seed=11)
    out["pack_tp2"] = {f: _packed_vs_padded(wrap_ddp(pack_model), dims, f) for f in (True, False)}
    del pack_model

    # --- PP=2 through the 1F1B schedule, 2 micro-batches -------------------------------
    dims = initialize_distributed(ParallelConfig(pipeline_model_parallel_size=2), seed=3,
                                  num_layers=cfg.num_layers)
    model = build_model(cfg, dims, seed=11)
    per_stage = cfg.num_layers // 2
    with torch.no_grad():  # PP stages draw init RNG differently: load the PP=1 weights
        for n, p in model.named_parameters():
            p.copy_(ref_weights[_global_name(n, dims.pp_rank, per_stage)])
    ddp = wrap_ddp(model)
    mbs = [{"input_ids": ids[i:i + 2], "attention_mask": mask[i:i + 2]} for i in (0, 2)]
    res = forward_backward(ddp, mbs, _loss_fn(dims, n_tokens))
    finalize_grads(ddp)
    out["pp2_loss"] = float(sum(r["loss"] for r in res)) if res else None
    out["pp2_grads"] = {_global_name(n, dims.pp_rank, per_stage): p.main_grad.clone()
                        for n, p in unwrap(ddp).named_parameters()}
    out["pack_pp2"] = {f: _packed_vs_padded(ddp, dims, f) for f in (True, False)}
    # the same schedule with the stage's one layer recomputed (block method)
    rc_cfg = dataclasses.replace(cfg, recompute_granularity="full", recompute_method="block")
    rc_ddp = wrap_ddp(build_model(rc_cfg, dims, seed=11))
    with torch.no_grad():
        for n, p in unwrap(rc_ddp).named_parameters():
            p.copy_(ref_weights[_global_name(n, dims.pp_rank, per_stage)])
    forward_backward(rc_ddp, mbs, _loss_fn(dims, n_tokens))
    finalize_grads(rc_ddp)
    out["recompute_pp2_grads"] = {_global_name(n, dims.pp_rank, per_stage): p.main_grad.clone()
                                  for n, p in unwrap(rc_ddp).named_parameters()}

    # --- DP=2: half the batch each, loss divided by the global token count -------------
    dims = initialize_distributed(ParallelConfig(), seed=3)
    model = build_model(cfg, dims, seed=11)
    ddp = wrap_ddp(model)
    opt = MixedPrecisionOptimizer(ddp, OptimizerConfig(lr=1e-2, clip_grad=0.0, adam_eps=1.0),
                                  mp_group=dims.mp_group)
    half = slice(0, 2) if dims.dp_rank == 0 else slice(2, 4)
    forward_backward(ddp, [{"input_ids": ids[half], "attention_mask": mask[half]}],
                     _loss_fn(dims, n_tokens))
    finalize_grads(ddp)
    opt.step()
    out["dp2_updated"] = {n.replace("module.", ""): p.detach().clone()
                          for n, p in ddp.named_parameters()}
    out["tp_rank_in_tp2"] = rank
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, world_size=2)


def test_tp2_logits_logprobs_entropy_values_match_tp1(results):
    for r in results:
        for key in ("logits", "values", "logprobs", "entropy"):
            ref, got = r["ref"][key], r["tp2"][key]
            assert got.shape == ref.shape, key
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0, msg=key)


def test_fused_chunked_output_layer_equals_the_logits_path_at_tp1_and_tp2(results):
    for r in results:
        torch.testing.assert_close(r["ref_fused"]["fused"]["logprobs"], r["ref"]["logprobs"][:, PROMPT - 1:],
                                   atol=1e-5, rtol=0)
        for layout in ("ref_fused", "tp2_fused"):
            fused, unfused = r[layout]["fused"], r[layout]["unfused"]
            for key in ("logprobs", "logprobs_t1", "entropy"):
                torch.testing.assert_close(fused[key], unfused[key], atol=1e-5, rtol=0, msg=f"{layout} {key}")
            assert fused["grads"].keys() == unfused["grads"].keys()
            for name, g in unfused["grads"].items():
                assert g.abs().sum() > 0 or "value_head" in name or name.startswith("embedding"), name
                torch.testing.assert_close(fused["grads"][name], g, atol=1e-5, rtol=1e-4, msg=f"{layout} {name}")
        torch.testing.assert_close(r["tp2_fused"]["fused"]["logprobs"], r["ref_fused"]["fused"]["logprobs"],
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["pack_tp1", "pack_tp2", "pack_pp2"])
def test_packed_micro_batches_give_the_padded_logprobs_values_and_gradients(results, layout):
    for fused in (True, False):  # the fused chunked output layer and the logits path
        seen_outputs = False
        for r in results:
            got, ref = r[layout][fused]["packed"], r[layout][fused]["padded"]
            if "logprobs" in ref:  # the last pipeline stage
                seen_outputs = True
                assert ref["logprobs"].abs().sum() > 0 and ref["values"].abs().sum() > 0
                for key in ("logprobs", "entropy", "values"):
                    torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=0, msg=f"{layout} {key}")
                assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
            assert got["grads"].keys() == ref["grads"].keys()
            for name, g in ref["grads"].items():
                assert g.abs().sum() > 0 or name.startswith("embedding"), name
                scale = max(1.0, g.abs().max().item())
                torch.testing.assert_close(got["grads"][name], g, atol=1e-5 * scale, rtol=0,
                                           msg=f"{layout} fused={fused} {name}")
        assert seen_outputs


@pytest.mark.parametrize("layout", ["recompute_tp1", "recompute_tp2"])
def test_activation_recompute_gives_the_same_gradients_and_saves_less(results, layout):
    for r in results:
        saved_none, grads_none = r[layout]["none"]
        for name in RECOMPUTE:
            saved, grads = r[layout][name]
            assert grads.keys() == grads_none.keys()
            for n, g in grads_none.items():
                assert g.abs().sum() > 0 or n.startswith("embedding"), n
                torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=1e-5, msg=f"{layout} {name} {n}")
            assert saved < saved_none, (layout, name, saved, saved_none)
        # full keeps each layer's input only: far less than every layer's activations
        assert r[layout]["full"][0] < 0.5 * saved_none, (layout, r[layout]["full"][0], saved_none)


def test_pp2_schedule_with_block_recompute_gives_the_pp1_gradients(results):
    for r in results:
        got = r["recompute_pp2_grads"]
        assert got.keys() == r["pp2_grads"].keys() and got
        for n, g in r["pp2_grads"].items():
            torch.testing.assert_close(got[n], g, atol=1e-6, rtol=1e-5, msg=n)


def test_tp2_replicated_params_identical_across_tp_ranks_after_init_and_step(results):
    for key in ("tp2_replicated_init", "tp2_replicated_after_step"):
        a, b = results[0][key], results[1][key]
        assert a.keys() == b.keys() and len(a) > 0
        for n in a:
            assert torch.equal(a[n], b[n]), f"{key}: {n} differs across TP ranks"
    # and the step changed something (the test can fail)
    init, after = results[0]["tp2_replicated_init"], results[0]["tp2_replicated_after_step"]
    assert any(not torch.equal(init[n], after[n]) for n in init)


def test_pp2_pipeline_schedule_loss_and_grads_match_pp1(results):
    last = results[1]
    assert last["pp2_loss"] == pytest.approx(last["ref_loss"], abs=1e-6)
    ref = results[0]["ref_grads"]
    seen = set()
    for r in results:
        for name, g in r["pp2_grads"].items():
            if name == "output_layer.weight" and name not in ref:
                continue
            torch.testing.assert_close(g, ref[name], atol=1e-6, rtol=1e-5, msg=name)
            seen.add(name)
    assert seen == set(ref), f"missing grads: {set(ref) - seen}"


def test_dp2_half_batches_give_same_update_as_one_rank_whole_batch(results):
    for r in results:
        ref = r["ref_updated"]
        for name, p in r["dp2_updated"].items():
            diff = (p - ref[name]).abs().max().item()
            assert diff <= 1e-7, f"{name}: max |diff| {diff}"



# bf16 keeps 8 mantissa bits: logits of this model (|z| < ~3) are rounded by up to ~1e-2,
# and a log-prob sums a few such errors. Measured max |diff| here: see the assertion message.
BF16_LOGPROB_TOL = 0.05


def test_bf16_mixed_logprobs_are_fp32_and_close_to_fp32_model(results):
    for r in results:
        lp, ref = r["bf16"]["logprobs"], r["ref"]["logprobs"]
        assert lp.dtype == torch.float32 and r["bf16"]["entropy"].dtype == torch.float32
        diff = (lp - ref).abs().max().item()
        assert 0 < diff <= BF16_LOGPROB_TOL, f"bf16 vs fp32 log-prob max |diff| = {diff}"
        print(f"bf16 vs fp32 log-prob max |diff| = {diff:.4f}")
