"""Rollout generation on one rank: KV cache vs recompute, padding, stops, log-probs, errors."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.engine import model_forward
from nemo_rlhf.models.logprobs import response_logprobs, response_values
from nemo_rlhf.rollout import RolloutBatch, RolloutConfig, generate
from tests.single_rank import random_prompts, single_rank

VOCAB = 100
PAD = 0
MAX_SEQ = 64
LENGTHS = (5, 9, 3, 7)


@pytest.fixture(scope="module")
def dims():
    with single_rank(seed=0) as d:
        yield d


def _build(dims, **overrides):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset

    cfg = load_model_preset("tiny", vocab_size=VOCAB, **overrides)
    return build_model(cfg, dims, seed=11)


MODELS = {
    "rope_std0.02": dict(),
    "rope_std0.1": dict(init_method_std=0.1),
    # Llama 3.1's scaling, its context shrunk to 8 tokens: the decode runs past it
    "rope_llama3_scaling": dict(init_method_std=0.1, rope_scaling="llama3", rope_scaling_factor=8.0,
                                rope_original_max_position_embeddings=8),
    # Qwen3's per-head query / key norms with a head size of its own (24, not 64 / 4)
    "qk_norm_qwen3_like": dict(init_method_std=0.1, qk_layernorm=True, kv_channels=24),
    "learned_abs_gpt2_like": dict(init_method_std=0.1, position_embedding_type="learned_absolute",
                                  normalization="LayerNorm", activation="gelu",
                                  add_bias_linear=True),
}


@pytest.fixture(scope="module")
def models(dims):
    return {name: _build(dims, **kw) for name, kw in MODELS.items()}


def _prompts(lengths=LENGTHS, seed=5):
    return random_prompts(lengths, VOCAB, seed)


def _gen(model, dims, prompts=None, eos=VOCAB - 1, decode_fn=None, call_index=0, **cfg):
    cfg.setdefault("max_new_tokens", 12)
    return generate(model, dims, _prompts() if prompts is None else prompts, RolloutConfig(**cfg),
                    eos_token_id=eos, pad_token_id=PAD, vocab_size=VOCAB,
                    max_sequence_length=MAX_SEQ, decode_fn=decode_fn, call_index=call_index)


def _assert_same(a: RolloutBatch, b: RolloutBatch, atol=1e-5):
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(a.ended, b.ended)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


def _train_logprobs(model, batch, dims, temperature):
    from nemo_rlhf.models.engine import model_forward

    with torch.no_grad():
        logits, _values = model_forward(model, batch.input_ids, batch.attention_mask)
    return response_logprobs(logits, batch, dims, temperature)


# --------------------------------------------------------------------- KV cache vs recompute


@pytest.mark.parametrize("name", list(MODELS))
def test_kv_cache_greedy_equals_full_recompute_token_for_token(models, dims, name):
    kv = _gen(models[name], dims, greedy=True, max_new_tokens=16)
    full = _gen(models[name], dims, greedy=True, max_new_tokens=16, use_kv_cache=False)
    _assert_same(kv, full)
    generated = kv.response_ids[kv.response_mask]
    assert len(set(generated.tolist())) >= 8, "degenerate model output: the test would be weak"
    for row in kv.response_ids:  # tokens vary inside each row too
        assert len(set(row.tolist())) >= 3


def test_rope_scaling_reaches_the_forward(models, dims):
    """The same weights (same seed) with and without llama3 scaling: other logits (else the
    KV-cache test above would not be checking the scaled frequencies)."""
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain, _ = model_forward(models["rope_std0.1"], ids, torch.ones_like(ids))
        scaled, _ = model_forward(models["rope_llama3_scaling"], ids, torch.ones_like(ids))
    assert torch.equal(plain[:, 0], scaled[:, 0])  # position 0: no rotation either way
    assert (plain[:, 1:] - scaled[:, 1:]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["rope_std0.1", "rope_llama3_scaling", "qk_norm_qwen3_like",
                                  "learned_abs_gpt2_like"])
def test_kv_cache_sampling_equals_full_recompute_with_the_same_seed(models, dims, name):
    kw = dict(temperature=0.7, top_p=0.9, seed=3)
    _assert_same(_gen(models[name], dims, **kw), _gen(models[name], dims, use_kv_cache=False, **kw))


# --------------------------------------------------------------------- padding and positions


@pytest.mark.parametrize("name", ["rope_std0.1", "learned_abs_gpt2_like"])
def test_mixed_length_batch_gives_each_prompt_its_continuation_alone(models, dims, name):
    prompts = _prompts()
    batch = _gen(models[name], dims, prompts, greedy=True)
    for i, p in enumerate(prompts):
        alone = _gen(models[name], dims, [p], greedy=True)
        n = int(alone.response_lengths[0])
        assert batch.response_ids[i, :n].tolist() == alone.response_ids[0, :n].tolist(), i
        torch.testing.assert_close(batch.logprobs[i, :n], alone.logprobs[0, :n], atol=1e-5, rtol=0)


def test_rollout_batch_layout_is_the_trainer_contract(models, dims):
    prompts = _prompts()
    b = _gen(models["rope_std0.1"], dims, prompts, temperature=0.9, seed=1, max_new_tokens=8)
    P, R = b.prompt_length, b.response_length
    assert P == max(LENGTHS) and R == int(b.response_lengths.max()) <= 8
    assert b.input_ids.shape == b.attention_mask.shape == (4, P + R)
    assert b.input_ids.dtype == torch.long and b.attention_mask.dtype == torch.long
    assert b.response_mask.dtype == torch.bool and b.logprobs.dtype == torch.float32
    for i, p in enumerate(prompts):
        assert b.input_ids[i, P - len(p):P].tolist() == p
        assert (b.input_ids[i, :P - len(p)] == PAD).all()
        assert b.attention_mask[i, :P].tolist() == [0] * (P - len(p)) + [1] * len(p)
    assert torch.equal(b.response_ids, b.input_ids[:, P:])
    assert torch.equal(b.attention_mask[:, P:].bool(), b.response_mask)
    assert torch.equal(b.response_mask, torch.arange(R)[None] < b.response_lengths[:, None])
    assert (b.response_ids[~b.response_mask] == PAD).all()
    assert (b.logprobs[~b.response_mask] == 0).all() and (b.logprobs[b.response_mask] < 0).all()
    assert torch.equal(b.truncated, ~b.ended)
    padded = b.pad_response_to(R + 3, PAD)
    assert padded.input_ids.shape == (4, P + R + 3) and padded.response_mask.shape == (4, R + 3)
    assert torch.equal(padded.response_mask.sum(-1), b.response_lengths)


# --------------------------------------------------------------------- stopping


def test_eos_stops_one_row_while_the_others_continue(models, dims):
    model = models["rope_std0.1"]
    free = _gen(model, dims, greedy=True, max_new_tokens=12)
    assert not free.ended.any()
    row0 = free.response_ids[0].tolist()
    k = next(i for i in range(3, 12) if row0[i] not in row0[:i]
             and all(row0[i] not in r for r in free.response_ids[1:].tolist()))
    eos = row0[k]
    stopped = _gen(model, dims, eos=eos, greedy=True, max_new_tokens=12)
    assert stopped.ended.tolist() == [True, False, False, False]
    assert stopped.truncated.tolist() == [False, True, True, True]
    assert stopped.response_lengths.tolist() == [k + 1, 12, 12, 12]
    assert stopped.response_ids[0, :k + 1].tolist() == row0[:k + 1]  # EOS included
    assert stopped.response_mask[0].tolist() == [True] * (k + 1) + [False] * (11 - k)
    assert (stopped.response_ids[0, k + 1:] == PAD).all()
    assert torch.equal(stopped.response_ids[1:], free.response_ids[1:])  # others unaffected


def test_all_rows_finished_stops_the_loop_early(models, dims):
    model = models["rope_std0.1"]
    free = _gen(model, dims, [_prompts()[0]], greedy=True, max_new_tokens=12)
    eos = free.response_ids[0, 2].item()
    first = free.response_ids[0].tolist().index(eos)
    out = _gen(model, dims, [_prompts()[0]], eos=eos, greedy=True, max_new_tokens=12)
    assert out.response_length == first + 1 and bool(out.ended[0])


def test_stop_token_ids_end_rows_like_eos(models, dims):
    model = models["rope_std0.1"]
    free = _gen(model, dims, greedy=True, max_new_tokens=10)
    stop = free.response_ids[1, 4].item()
    out = _gen(model, dims, greedy=True, max_new_tokens=10, stop_token_ids=[stop])
    first = free.response_ids[1].tolist().index(stop)
    assert bool(out.ended[1]) and out.response_lengths[1] == first + 1


def test_min_new_tokens_suppresses_eos_and_stop_tokens(models, dims):
    model = models["rope_std0.1"]
    free = _gen(model, dims, greedy=True, max_new_tokens=10)
    eos, stop = free.response_ids[0, 0].item(), free.response_ids[2, 1].item()
    early = _gen(model, dims, eos=eos, stop_token_ids=[stop], greedy=True, max_new_tokens=10)
    assert early.response_lengths.min() <= 2
    late = _gen(model, dims, eos=eos, stop_token_ids=[stop], greedy=True, max_new_tokens=10,
                min_new_tokens=4)
    assert (late.response_lengths >= 4).all()
    assert not torch.isin(late.response_ids[:, :4], torch.tensor([eos, stop])).any()
    sampled = _gen(model, dims, eos=eos, stop_token_ids=[stop], temperature=1.0, seed=2,
                   max_new_tokens=10, min_new_tokens=4)
    assert not torch.isin(sampled.response_ids[:, :4], torch.tensor([eos, stop])).any()


def test_stop_strings_end_a_row_through_decode_fn(models, dims):
    model = models["rope_std0.1"]

    def decode(ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    free = _gen(model, dims, greedy=True, max_new_tokens=12)
    text = decode(free.response_ids[3].tolist())
    k = next(i for i in range(3, 12) if text[i - 1:i + 1] not in text[:i])
    out = _gen(model, dims, greedy=True, max_new_tokens=12, decode_fn=decode,
               stop_strings=[text[k - 1:k + 1]])
    assert bool(out.ended[3]) and out.response_lengths[3] == k + 1
    for b in range(4):  # a row ends exactly when its text first contains the string
        n = int(out.response_lengths[b])
        t = decode(out.response_ids[b, :n].tolist())
        assert (text[k - 1:k + 1] in t) == bool(out.ended[b])
        assert text[k - 1:k + 1] not in t[:-1]


# --------------------------------------------------------------------- sampling and log-probs


def test_sampling_logprobs_match_training_forward_logprobs(models, dims):
    for name in ("rope_std0.1", "learned_abs_gpt2_like"):
        model = models[name]
        cfg = RolloutConfig(temperature=0.7, top_p=0.9, max_new_tokens=12, seed=4)
        b = _gen(model, dims, temperature=0.7, top_p=0.9, seed=4)
        lp, ent = _train_logprobs(model, b, dims, cfg.logprob_temperature)
        diff = (b.logprobs - lp).abs()[b.response_mask].max().item()
        assert diff <= 1e-5, f"{name}: max |rollout - train| = {diff}"
        assert (lp[~b.response_mask] == 0).all() and (ent[b.response_mask] > 0).all()
        assert lp.requires_grad is False


def test_rollout_values_match_the_training_forward_values(models, dims):
    """``with_values``: the value head on the decode path's hidden states, as the full
    forward computes them (the old values of ``ppo.old_logprobs_from_rollout``)."""
    for name in ("rope_std0.1", "learned_abs_gpt2_like"):
        model = models[name]
        head = model.value_head
        saved = {k: v.clone() for k, v in head.state_dict().items()}
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # a head that reads the hidden states (the preset's starts at 0)
            head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.5)
            head.bias.fill_(0.1)
        try:
            cfg = dict(temperature=0.7, seed=4, stop_token_ids=[3, 4, 5])
            b = generate(model, dims, _prompts(), RolloutConfig(max_new_tokens=12, **cfg),
                         eos_token_id=VOCAB - 1, pad_token_id=PAD, vocab_size=VOCAB,
                         max_sequence_length=MAX_SEQ, call_index=0, with_values=True)
            plain = _gen(model, dims, **cfg)
            _assert_same(b, plain)  # asking for values changes nothing else
            assert plain.values is None and b.values.shape == b.logprobs.shape
            with torch.no_grad():
                _, v = model_forward(model.eval(), b.input_ids, b.attention_mask)
            expected = response_values(v, b.prompt_length, b.response_length)
            m = b.response_mask
            assert not m.all() and (b.values[~m] == 0).all() and b.values[m].abs().min() > 0
            diff = (b.values - expected).abs()[m].max().item()
            assert diff <= 1e-5, f"{name}: max |rollout - forward| value = {diff}"
        finally:
            head.load_state_dict(saved)
    with pytest.raises(ValueError, match="use_kv_cache"):
        generate(models["rope_std0.1"], dims, _prompts(), RolloutConfig(use_kv_cache=False),
                 eos_token_id=VOCAB - 1, pad_token_id=PAD, vocab_size=VOCAB,
                 max_sequence_length=MAX_SEQ, with_values=True)


def test_greedy_logprobs_are_at_temperature_one(models, dims):
    model = models["rope_std0.1"]
    b = _gen(model, dims, greedy=True, temperature=0.0)
    lp, _ = _train_logprobs(model, b, dims, RolloutConfig(greedy=True).logprob_temperature)
    assert (b.logprobs - lp).abs()[b.response_mask].max().item() <= 1e-5


def test_response_logprobs_tuple_form_is_unmasked_and_rejects_a_model_output_tuple(models, dims):
    from nemo_rlhf.models.engine import model_forward

    model = models["rope_std0.1"]
    b = _gen(model, dims, temperature=0.7, seed=4)
    with torch.no_grad():
        out = model_forward(model, b.input_ids, b.attention_mask)
    lp, _ = response_logprobs(out[0], (b.input_ids, b.prompt_length), dims, 0.7, vocab_size=VOCAB)
    assert lp.shape == b.logprobs.shape
    torch.testing.assert_close(lp[b.response_mask], b.logprobs[b.response_mask], atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="output\\[0\\]"):
        response_logprobs(out, b, dims, 0.7)


def test_same_seed_same_tokens_other_seed_or_call_index_different(models, dims):
    model = models["rope_std0.1"]
    a = _gen(model, dims, seed=7)
    assert torch.equal(a.input_ids, _gen(model, dims, seed=7).input_ids)
    assert not torch.equal(a.input_ids, _gen(model, dims, seed=8).input_ids)
    assert not torch.equal(a.input_ids, _gen(model, dims, seed=7, call_index=1).input_ids)


def test_padded_vocabulary_rows_are_never_generated(models, dims):
    model = models["rope_std0.1"]
    assert model.model_cfg.padded_vocab_size > VOCAB
    b = _gen(model, dims, temperature=20.0, seed=0, max_new_tokens=30)
    assert int(b.response_ids.max()) < VOCAB


def test_model_and_torch_function_modes_are_restored_after_generation(models, dims):
    from torch.overrides import _get_current_function_mode_stack

    model = models["rope_std0.1"]
    modes = _get_current_function_mode_stack()
    model.train()
    _gen(model, dims, greedy=True, max_new_tokens=2)
    assert model.training
    ids = torch.tensor([[1, 2, 3]])
    logits, values = model_forward(model, ids, torch.ones_like(ids))  # values by default again
    assert values.shape == (1, 3)
    assert _get_current_function_mode_stack() == modes  # the CPU shim's mode is back
    with pytest.raises(ValueError):
        _gen(model, dims, [[]])
    assert _get_current_function_mode_stack() == modes
    model.eval()


def test_zero_max_new_tokens_returns_empty_responses(models, dims):
    b = _gen(models["rope_std0.1"], dims, max_new_tokens=0)
    assert b.response_ids.shape == (4, 0) and b.input_ids.shape == (4, max(LENGTHS))
    assert b.truncated.all() and not b.ended.any()


# --------------------------------------------------------------------- errors before work


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([[1, 2], list(range(1, 60))], dict(max_new_tokens=8),
         r"prompt 1 has 59 tokens; with rollout.max_new_tokens=8 that is 67 > max_sequence_length=64"),
        ([], dict(), "prompt list is empty"),
        ([[1, 2], []], dict(), "prompt 1 is empty"),
        ([[1, 2], [3, VOCAB + 5]], dict(), r"prompt 1 has token id 105 outside the vocabulary"),
        ([[1, 2]], dict(stop_strings=["x"]), "needs a decode_fn"),
        ([[1, 2]], dict(stop_token_ids=[VOCAB]), r"rollout.stop_token_ids\[0\]=100"),
        ([[1, 2]], dict(eos=VOCAB), "eos_token_id=100 is outside the vocabulary"),
    ],
)
def test_bad_inputs_raise_before_any_forward(models, dims, prompts, kwargs, match):
    model = models["rope_std0.1"]
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            _gen(model, dims, prompts, **kwargs)
    finally:
        handle.remove()
    assert calls == []


def test_config_changed_after_construction_is_revalidated(models, dims):
    cfg = RolloutConfig()
    cfg.top_p = 0.0
    with pytest.raises(ValueError, match="rollout.top_p=0.0"):
        generate(models["rope_std0.1"], dims, [[1, 2]], cfg, eos_token_id=1, pad_token_id=0,
                 vocab_size=VOCAB, max_sequence_length=MAX_SEQ)
