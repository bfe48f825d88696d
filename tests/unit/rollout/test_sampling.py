"""Next-token choice: greedy, temperature, top-k, top-p, suppression, padded vocabulary.

Tests marked ``device`` put the logits on the ``test_device`` fixture (a GPU under
``NEMO_RLHF_TEST_DEVICE=cuda``) and keep the sampler's generator on the host, as the
rollout does: tokens and log-probs must come back on the logits' device."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.rollout import choose_tokens, top_k_top_p_filter


def _logits(batch=4, vocab=16, padded=24, seed=0, device=None):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, padded, generator=g) * 2
    z[:, vocab:] = 50.0  # padded rows would win everything if they were not cut off
    return z.to(device) if device is not None else z


def _on(device, *tensors):
    for x in tensors:
        assert x.device == device, (x.device, device)


def _nucleus_loop(probs: list[float], top_p: float) -> set[int]:
    """Plain loop reference: most likely tokens until their mass reaches top_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return kept


@pytest.mark.device
def test_greedy_is_argmax_over_real_vocab_and_logprob_at_temperature_one(test_device):
    z = _logits(device=test_device)
    tok, lp = choose_tokens(z, vocab_size=16, greedy=True, temperature=0.3)
    _on(test_device, tok, lp)
    assert torch.equal(tok, z[:, :16].argmax(-1))
    ref = torch.log_softmax(z[:, :16], -1).gather(-1, tok[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref)
    assert lp.dtype == torch.float32


@pytest.mark.device
def test_padded_vocab_rows_are_never_sampled(test_device):
    z = _logits(batch=2000, seed=1, device=test_device)
    g = torch.Generator().manual_seed(0)
    tok, lp = choose_tokens(z, vocab_size=16, greedy=False, temperature=5.0, generator=g)
    _on(test_device, tok, lp)
    assert int(tok.max()) < 16 and int(tok.min()) >= 0


@pytest.mark.device
def test_recorded_logprob_is_temperature_scaled_and_before_filtering(test_device):
    z = _logits(batch=64, seed=2, device=test_device)
    g = torch.Generator().manual_seed(0)
    tok, lp = choose_tokens(z, vocab_size=16, greedy=False, temperature=0.7, top_k=3, top_p=0.5,
                            generator=g)
    _on(test_device, tok, lp)
    ref = torch.log_softmax(z[:, :16] / 0.7, -1).gather(-1, tok[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref)


def test_top_k_keeps_exactly_the_k_largest():
    z = _logits(batch=8, seed=3)[:, :16]
    kept = torch.isfinite(top_k_top_p_filter(z.clone(), top_k=5))
    assert torch.equal(kept.sum(-1), torch.full((8,), 5))
    top5 = z.topk(5, -1).indices
    assert kept.gather(-1, top5).all()


def test_top_p_filter_matches_plain_loop():
    z = _logits(batch=32, seed=4)[:, :16]
    for top_p in (0.05, 0.3, 0.6, 0.9, 0.999):
        kept = torch.isfinite(top_k_top_p_filter(z.clone(), top_p=top_p))
        probs = torch.softmax(z.double(), -1)
        for b in range(z.shape[0]):
            assert set(torch.nonzero(kept[b]).flatten().tolist()) == _nucleus_loop(
                probs[b].tolist(), top_p), (b, top_p)


@pytest.mark.device
def test_top_k_one_equals_greedy(test_device):
    z = _logits(batch=50, seed=5, device=test_device)
    g = torch.Generator().manual_seed(0)
    tok, _ = choose_tokens(z, vocab_size=16, greedy=False, temperature=1.3, top_k=1, generator=g)
    assert torch.equal(tok, z[:, :16].argmax(-1))


def test_sampled_tokens_stay_inside_the_nucleus():
    z = _logits(batch=1, seed=6).expand(4000, -1).contiguous()
    g = torch.Generator().manual_seed(0)
    tok, _ = choose_tokens(z, vocab_size=16, greedy=False, temperature=1.0, top_p=0.7, generator=g)
    nucleus = _nucleus_loop(torch.softmax(z[0, :16].double(), -1).tolist(), 0.7)
    assert set(tok.tolist()) <= nucleus and len(set(tok.tolist())) > 1


def test_empirical_frequencies_follow_the_tempered_distribution():
    z = _logits(batch=1, seed=7).expand(40000, -1).contiguous()
    g = torch.Generator().manual_seed(1)
    tok, _ = choose_tokens(z, vocab_size=16, greedy=False, temperature=1.5, generator=g)
    freq = torch.bincount(tok, minlength=16).double() / tok.numel()
    expected = torch.softmax(z[0, :16].double() / 1.5, -1)
    assert (freq - expected).abs().max() < 0.01


@pytest.mark.device
def test_suppressed_ids_are_never_chosen_greedy_or_sampled(test_device):
    z = _logits(batch=500, seed=8, device=test_device)
    suppress = torch.unique(z[:3, :16].argmax(-1))  # the favourites of the first rows
    tok, _ = choose_tokens(z, vocab_size=16, greedy=True, suppress_ids=suppress)
    assert not torch.isin(tok, suppress).any()
    g = torch.Generator().manual_seed(0)
    tok, _ = choose_tokens(z, vocab_size=16, greedy=False, suppress_ids=suppress, generator=g)
    assert not torch.isin(tok, suppress).any()


@pytest.mark.device
@pytest.mark.parametrize("greedy", [True, False])
def test_suppression_of_some_rows_leaves_the_others_as_without_it(test_device, greedy):
    """``suppress_rows`` (multi-turn ``rollout.min_new_tokens``, per row): the rows it marks
    never choose a suppressed id, the others choose exactly as with no suppression; every
    log-prob is the unsuppressed distribution's."""
    z = _logits(batch=500, seed=8, device=test_device)
    suppress = torch.unique(z[:3, :16].argmax(-1))
    rows = torch.arange(500, device=test_device) % 2 == 0
    kw = {} if greedy else {"temperature": 0.8, "top_p": 0.9}
    gen = (lambda: None) if greedy else (lambda: torch.Generator().manual_seed(0))
    free, free_lp = choose_tokens(z, vocab_size=16, greedy=greedy, generator=gen(), **kw)
    tok, lp = choose_tokens(z, vocab_size=16, greedy=greedy, suppress_ids=suppress, suppress_rows=rows,
                            generator=gen(), **kw)
    assert not torch.isin(tok[rows], suppress).any()
    assert torch.isin(free[rows], suppress).any()  # the suppression changed something
    assert torch.equal(tok[~rows], free[~rows]) and torch.equal(lp[~rows], free_lp[~rows])
    t = 1.0 if greedy else 0.8
    own = torch.log_softmax(z[:, :16].float() / t, -1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, own, atol=1e-6, rtol=0)
    none, _ = choose_tokens(z, vocab_size=16, greedy=greedy, suppress_ids=suppress, generator=gen(),
                            suppress_rows=torch.zeros_like(rows), **kw)
    assert torch.equal(none, free)


@pytest.mark.device
def test_same_generator_seed_same_tokens(test_device):
    z = _logits(batch=64, seed=9, device=test_device)
    a, _ = choose_tokens(z, vocab_size=16, greedy=False, generator=torch.Generator().manual_seed(3))
    b, _ = choose_tokens(z, vocab_size=16, greedy=False, generator=torch.Generator().manual_seed(3))
    c, _ = choose_tokens(z, vocab_size=16, greedy=False, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def _reference_nucleus_filter(scores, top_p):
    """Textbook top-p on the fully sorted vocabulary (what the candidate search replaces)."""
    sorted_s, order = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(sorted_s, dim=-1)
    remove = (probs.cumsum(-1) - probs) >= top_p
    remove[:, 0] = False
    return scores.masked_fill(torch.empty_like(remove).scatter_(-1, order, remove), float("-inf"))


def _large_vocab_scores(vocab=6000, seed=10):
    """Rows from very peaked (nucleus of a few tokens) to flat (most of the vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.1, 0.02, 3.0])[:, None]  # no exact ties
    return torch.randn(8, vocab, generator=g) * scale


def test_top_p_candidate_search_equals_full_sort_on_a_large_vocab():
    z = _large_vocab_scores()
    for top_p in (0.05, 0.5, 0.9, 0.99):
        got = torch.isfinite(top_k_top_p_filter(z.clone(), top_p=top_p))
        ref = torch.isfinite(_reference_nucleus_filter(z, top_p))
        assert torch.equal(got, ref), top_p
        sizes = got.sum(-1)
        if top_p >= 0.5:  # both regimes: found among few candidates, and nearly a full sort
            assert sizes.min() < 50 and sizes.max() > 1000
    with_k = torch.isfinite(top_k_top_p_filter(z.clone(), top_k=300, top_p=0.9))
    ref_k = z.clone()
    ref_k.masked_fill_(ref_k < torch.topk(ref_k, 300, -1).values[:, -1:], float("-inf"))
    assert torch.equal(with_k, torch.isfinite(_reference_nucleus_filter(ref_k, 0.9)))


@pytest.mark.device
def test_top_p_draw_among_candidates_equals_the_full_vocabulary_draw(test_device):
    """Same uniforms -> the same tokens as the inverse CDF over the whole filtered vocab."""
    z = _large_vocab_scores().repeat(50, 1).to(test_device)
    vocab = z.shape[1]
    for temperature, top_p in ((0.7, 0.9), (1.0, 0.5), (1.3, 0.99)):
        tok, lp = choose_tokens(z, vocab_size=vocab, greedy=False, temperature=temperature,
                                top_p=top_p, generator=torch.Generator().manual_seed(7))
        _on(test_device, tok, lp)
        # the uniforms come from the (host) generator, whatever the logits' device
        u = torch.rand(z.shape[0], generator=torch.Generator().manual_seed(7),
                       dtype=torch.float64).to(test_device)
        filt = _reference_nucleus_filter(z / temperature, top_p)
        cdf = torch.softmax(filt, -1, dtype=torch.float64).cumsum(-1)
        ref = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        assert torch.equal(tok, ref), (temperature, top_p)
        assert torch.isfinite(filt.gather(-1, tok[:, None])).all()
        torch.testing.assert_close(lp, torch.log_softmax(z / temperature, -1).gather(
            -1, tok[:, None]).squeeze(-1))


def test_two_level_draw_equals_the_float64_cdf_and_never_draws_an_excluded_token():
    """_draw_full (block masses, then one block) against the textbook float64 softmax +
    cumsum over the whole vocabulary: same tokens for the same uniforms, on a vocabulary
    that is not a multiple of the block, with excluded (-inf) tokens inside and a fully
    excluded last block, and uniforms at the very top of [0, 1)."""
    from nemo_rlhf.rollout.sampling import _BLOCK, _draw_full

    vocab = 3 * _BLOCK + 77
    g = torch.Generator().manual_seed(12)
    scale = torch.tensor([0.02, 0.5, 1.0, 3.0, 8.0])[:, None]
    z = (torch.randn(5, vocab, generator=g) * scale).repeat(40, 1)
    z[:, 2 * _BLOCK + 5:] = float("-inf")  # the last partial block and more excluded
    z[:, 10:40] = float("-inf")
    u = torch.rand(z.shape[0], generator=g, dtype=torch.float64)
    u[:5] = 1.0 - 2.0 ** -53
    u[5:10] = 0.0
    tok = _draw_full(z, u)
    cdf = torch.softmax(z, -1, dtype=torch.float64).cumsum(-1)
    ref = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    assert torch.equal(tok[5:], ref[5:])
    assert torch.isfinite(z.gather(-1, tok[:, None])).all()
    assert (tok[:5] == 2 * _BLOCK + 4).all()  # the top uniform: the last finite token
    assert torch.unique(tok).numel() > 50  # not degenerate
