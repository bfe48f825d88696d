"""Rollout generation under TP=2, PP=2 and DP=2 on 2 gloo ranks agrees with one rank.

One spawn: TP=1 reference (each rank its own DP replica), then TP=2, then PP=2 (the PP
stages load the PP=1 weights by global layer name, since PP stages draw init RNG
differently), re-initialising megatron's parallel state on the same process group.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.distributed.harness import run_ranks

VOCAB = 100
PAD = 0
PROMPT_LENGTHS = (5, 9, 3, 7)
MAX_NEW = 10
SAMPLING = dict(temperature=0.7, top_p=0.9, top_k=40)


def _model_cfg():
    from nemo_rlhf.models.config import load_model_preset

    return load_model_preset("tiny", vocab_size=VOCAB, init_method_std=0.1)


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _global_name(name: str, pp_rank: int, layers_per_stage: int) -> str:
    name = name.replace("module.", "")
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m:
        return f"decoder.layers.{int(m.group(1)) + pp_rank * layers_per_stage}.{m.group(2)}"
    return name


def _train_logprobs(model, dims, batch, temperature):
    """Training-side log-probs through the engine's schedule (last stage; else None)."""
    from nemo_rlhf.models.logprobs import response_logprobs
    from nemo_rlhf.models.engine import forward_backward

    with torch.no_grad():
        res = forward_backward(model, [{"input_ids": batch.input_ids,
                                        "attention_mask": batch.attention_mask}],
                               loss_fn=None, forward_only=True)
    if not res:
        return None
    logits, _values = res[0]["output"]
    return response_logprobs(logits, batch, dims, temperature)[0]


def _run_all(model, dims, eos):
    from nemo_rlhf.rollout import RolloutConfig, generate

    kw = dict(eos_token_id=eos, pad_token_id=PAD, vocab_size=VOCAB, max_sequence_length=64,
              call_index=0)
    greedy = RolloutConfig(max_new_tokens=MAX_NEW, greedy=True)
    # seed 20: one row samples the EOS early, the others run to max_new_tokens
    sample = RolloutConfig(max_new_tokens=MAX_NEW, seed=20, **SAMPLING)
    out = {
        "greedy_kv": generate(model, dims, _prompts(), greedy, **kw),
        "sample_kv": generate(model, dims, _prompts(), sample, **kw),
        "sample_full": generate(model, dims, _prompts(),
                                RolloutConfig(max_new_tokens=MAX_NEW, seed=20, use_kv_cache=False,
                                              **SAMPLING), **kw),
    }
    out["sample_train_logprobs"] = _train_logprobs(model, dims, out["sample_kv"],
                                                   sample.logprob_temperature)
    return out


def _worker(rank: int):
    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.rollout import RolloutConfig, generate

    cfg = _model_cfg()
    out = {}

    # --- reference: TP=1, PP=1; each rank is a DP replica with the same prompts ---------
    dims = initialize_distributed(ParallelConfig(), seed=3, num_layers=cfg.num_layers)
    model = build_model(cfg, dims, seed=11)
    ref_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    probe = generate(model, dims, _prompts(), RolloutConfig(max_new_tokens=MAX_NEW, greedy=True),
                     eos_token_id=VOCAB - 1, pad_token_id=PAD, vocab_size=VOCAB,
                     max_sequence_length=64, call_index=0)
    # EOS = the token row 0 emits greedily at step 3 and has not emitted before: row 0
    # must stop there in every layout while the others go on.
    row0 = probe.response_ids[0].tolist()
    k = next(i for i in range(3, MAX_NEW) if row0[i] not in row0[:i])
    eos = row0[k]
    out["eos"], out["eos_step"] = eos, k
    out["dp_rank_tp1"] = dims.dp_rank
    out["tp1"] = _run_all(model, dims, eos)

    # --- TP=2: same seed gives the same (sharded) weights ------------------------------
    dims = initialize_distributed(ParallelConfig(tensor_model_parallel_size=2), seed=3)
    model = build_model(cfg, dims, seed=11)
    out["tp2"] = _run_all(model, dims, eos)
    prompts = _prompts()
    if rank == 1:
        prompts[0] = prompts[0][:-1] + [(prompts[0][-1] + 1) % VOCAB]
    try:
        generate(model, dims, prompts, RolloutConfig(max_new_tokens=2, greedy=True),
                 eos_token_id=eos, pad_token_id=PAD, vocab_size=VOCAB, max_sequence_length=64)
        out["tp2_mismatch_error"] = None
    except ValueError as exc:
        out["tp2_mismatch_error"] = str(exc)

    # --- PP=2: load the PP=1 weights by global layer name ------------------------------
    dims = initialize_distributed(ParallelConfig(pipeline_model_parallel_size=2), seed=3,
                                  num_layers=cfg.num_layers)
    model = build_model(cfg, dims, seed=11)
    per_stage = cfg.num_layers // 2
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ref_weights[_global_name(n, dims.pp_rank, per_stage)])
    out["pp2"] = _run_all(model, dims, eos)
    out["pp_rank"] = dims.pp_rank
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, world_size=2)


def _same_rollout(a, b, logprob_atol=1e-5):
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.attention_mask, b.attention_mask)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.ended, b.ended) and torch.equal(a.truncated, b.truncated)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=logprob_atol, rtol=0)


def test_reference_run_is_not_degenerate(results):
    ref = results[0]["tp1"]
    g = ref["greedy_kv"]
    assert len(set(g.response_ids[g.response_mask].tolist())) > 10
    # the forced EOS stops row 0 at its step k, the others continue
    k = results[0]["eos_step"]
    assert g.response_lengths[0] == k + 1 and bool(g.ended[0])
    assert g.response_ids[0, k] == results[0]["eos"]
    assert int(g.response_lengths[1:].max()) > k + 1


def test_tp2_and_pp2_greedy_tokens_match_tp1(results):
    ref = results[0]["tp1"]["greedy_kv"]
    for r in results:
        for layout in ("tp2", "pp2"):
            _same_rollout(r[layout]["greedy_kv"], ref)


def test_tp2_and_pp2_sampled_tokens_match_tp1_same_seed(results):
    ref = results[0]["tp1"]  # DP rank 0 of the TP=1 layout: the same sampler seed
    assert results[0]["dp_rank_tp1"] == 0
    for r in results:
        for layout in ("tp2", "pp2"):
            for key in ("sample_kv", "sample_full"):
                _same_rollout(r[layout][key], ref["sample_kv"])
    ended = ref["sample_kv"].ended
    assert bool(ended.any()) and not bool(ended.all())  # early finish is exercised


def test_kv_cache_and_full_recompute_sample_the_same_tokens(results):
    for r in results:
        for layout in ("tp1", "tp2", "pp2"):
            _same_rollout(r[layout]["sample_full"], r[layout]["sample_kv"])


def test_dp_ranks_sample_differently_from_the_same_prompts(results):
    a, b = results[0]["tp1"]["sample_kv"], results[1]["tp1"]["sample_kv"]
    assert results[1]["dp_rank_tp1"] == 1
    assert not torch.equal(a.response_ids, b.response_ids)


def test_rollout_logprobs_match_training_forward_in_every_layout(results):
    for r in results:
        for layout in ("tp1", "tp2", "pp2"):
            train = r[layout]["sample_train_logprobs"]
            if layout == "pp2" and r["pp_rank"] == 0:
                assert train is None  # only the last stage has logits
                continue
            roll = r[layout]["sample_kv"]
            diff = (roll.logprobs - train).abs()[roll.response_mask].max().item()
            assert diff <= 1e-5, f"{layout}: max |rollout - train| = {diff}"


def test_model_parallel_ranks_with_different_prompts_raise(results):
    for r in results:
        assert r["tp2_mismatch_error"] is not None
        assert "model-parallel" in r["tp2_mismatch_error"]
