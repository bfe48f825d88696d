"""The fused, chunked output layer + log-probs equals the output layer followed by the
vocab-parallel log-probs: values and gradients (hidden states and weight), any chunking."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.vocab_parallel import chunked_linear_logprobs, vocab_parallel_logprobs

N, H, V, REAL_V = 11, 16, 40, 37


def _inputs(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(device, dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(device, dtype)
    ids = torch.randint(0, REAL_V, (N,), generator=g).to(device)
    w_lp, w_ent = torch.randn(N, generator=g).to(device), torch.randn(N, generator=g).to(device)
    return hidden, weight, ids, w_lp, w_ent


def _unfused(hidden, weight, ids, temperature, entropy=True):
    logits = torch.nn.functional.linear(hidden, weight)
    lp, ent = vocab_parallel_logprobs(logits.unsqueeze(0), ids.unsqueeze(0), temperature=temperature,
                                      vocab_size=REAL_V, compute_entropy=entropy)
    return lp[0], ent[0]


def _grads(fn, hidden, weight, w_lp, w_ent):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = fn(h, w)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.device
@pytest.mark.parametrize("chunk", [1, 4, N, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_unfused_path(chunk, temperature, test_device):
    hidden, weight, ids, w_lp, w_ent = _inputs(test_device)
    got = _grads(lambda h, w: chunked_linear_logprobs(h, w, ids, temperature=temperature, vocab_size=REAL_V,
                                                      chunk_size=chunk), hidden, weight, w_lp, w_ent)
    ref = _grads(lambda h, w: _unfused(h, w, ids, temperature), hidden, weight, w_lp, w_ent)
    for name, a, b in zip(("logprobs", "entropy", "grad hidden", "grad weight"), got, ref):
        assert a.dtype == b.dtype and a.device == b.device, name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert got[3][REAL_V:].abs().max() == 0  # padded rows: no probability, no gradient


@pytest.mark.device
def test_without_entropy_the_logprob_gradient_is_unchanged_and_entropy_is_zero(test_device):
    hidden, weight, ids, w_lp, _ = _inputs(test_device)
    zero = torch.zeros_like(w_lp)
    got = _grads(lambda h, w: chunked_linear_logprobs(h, w, ids, vocab_size=REAL_V, compute_entropy=False,
                                                      chunk_size=3), hidden, weight, w_lp, zero)
    ref = _grads(lambda h, w: _unfused(h, w, ids, 1.0, entropy=False), hidden, weight, w_lp, zero)
    assert got[1].abs().max() == 0
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.device
def test_bf16_weights_give_fp32_logprobs_and_grads_in_the_inputs_dtypes(test_device):
    hidden, weight, ids, w_lp, w_ent = _inputs(test_device, torch.bfloat16)
    lp, ent, gh, gw = _grads(lambda h, w: chunked_linear_logprobs(h, w, ids, vocab_size=REAL_V, chunk_size=4),
                             hidden, weight, w_lp, w_ent)
    assert lp.dtype == ent.dtype == torch.float32
    assert gh.dtype == gw.dtype == torch.bfloat16
    ref_lp, ref_ent = _unfused(hidden.float(), weight.float(), ids, 1.0)
    torch.testing.assert_close(lp, ref_lp, atol=0.1, rtol=0.05)


@pytest.mark.device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_with_main_grad_gets_its_gradient_there_and_none_from_autograd(dtype, test_device):
    """Under megatron DDP the weight carries a persistent fp32 ``main_grad``: the weight's
    gradient is added into it (on top of what it holds) and autograd gets none, so no
    ``[vocab, hidden]`` gradient tensor is held; the hidden states' gradient is unchanged."""
    hidden, weight, ids, w_lp, w_ent = _inputs(test_device, dtype)
    ref = _grads(lambda h, w: chunked_linear_logprobs(h, w, ids, vocab_size=REAL_V, chunk_size=4),
                 hidden, weight, w_lp, w_ent)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    before = torch.randn(V, H, generator=torch.Generator().manual_seed(5)).to(test_device)
    w.main_grad = before.clone()
    lp, ent = chunked_linear_logprobs(h, w, ids, vocab_size=REAL_V, chunk_size=4)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    assert w.grad is None
    assert w.main_grad.dtype == torch.float32
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(w.main_grad - before, ref[3].float(), **tol)
    torch.testing.assert_close(h.grad, ref[2], atol=0, rtol=0)


def test_a_tied_embedding_gets_both_gradients_into_main_grad():
    """A tied embedding under megatron DDP: the output layer's gradient written into
    ``main_grad`` by the fused head plus the embedding lookup's gradient added by DDP's hook
    equal the whole gradient of the unfused model."""
    g = torch.Generator().manual_seed(1)
    table = torch.randn(V, H, generator=g) * 0.5
    tokens = torch.randint(0, REAL_V, (N,), generator=g)
    ids = torch.randint(0, REAL_V, (N,), generator=g)
    w_lp = torch.randn(N, generator=g)

    def loss(weight, fused):
        hidden = torch.tanh(torch.nn.functional.embedding(tokens, weight))
        lp, _ = (chunked_linear_logprobs(hidden, weight, ids, vocab_size=REAL_V, chunk_size=4) if fused
                 else _unfused(hidden, weight, ids, 1.0))
        return (lp * w_lp).sum()

    ref_w = table.clone().requires_grad_(True)
    loss(ref_w, fused=False).backward()

    w = table.clone().requires_grad_(True)
    w.main_grad = torch.zeros(V, H)

    def ddp_hook(param):  # megatron DDP's hook (overlap_grad_reduce=False): add, drop .grad
        if param.grad is not None:
            param.main_grad.add_(param.grad)
        param.grad = None

    w.register_post_accumulate_grad_hook(ddp_hook)
    loss(w, fused=True).backward()
    assert w.grad is None
    torch.testing.assert_close(w.main_grad, ref_w.grad, atol=1e-5, rtol=1e-5)


def test_bad_arguments_name_the_problem():
    h, w, ids = torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        chunked_linear_logprobs(h, w, ids, chunk_size=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_linear_logprobs(h, w, ids, temperature=0.0)
    with pytest.raises(ValueError, match="disagree"):
        chunked_linear_logprobs(h, torch.zeros(5, 3), ids)
