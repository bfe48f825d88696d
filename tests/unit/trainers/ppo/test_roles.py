"""The PPO roles without a trainer (#50): :class:`ForwardPasses` cuts a rollout into
forward micro-batches and puts the results back in row order; :class:`PolicyRole`'s
log-probs and training loss equal a direct ``response_logprobs(model_forward(...))`` on a
tiny one-rank megatron model; the critic roles give (or do not give) values and
checkpoint parts as their ``critic.mode`` says."""

from __future__ import annotations

import types

import pytest
import torch

from nemo_rlhf.algorithms import ppo as P
from nemo_rlhf.models.engine import model_forward
from nemo_rlhf.models.logprobs import response_logprobs, response_values
from nemo_rlhf.rollout.generate import RolloutBatch
from nemo_rlhf.trainers.ppo.roles import (ForwardPasses, NoCritic, PolicyRole, SeparateCritic,
                                          SharedValueHead, build_critic_role, no_timers)
from nemo_rlhf.trainers.ppo.step_data import Advantages, ForwardResults
from tests.single_rank import single_rank

VOCAB = 64
CPU = types.SimpleNamespace(device=torch.device("cpu"), cp=1)  # ForwardPasses reads the CP size


def _batch(prompt_lengths=(4, 2, 3), response_lengths=(5, 2, 4), seed=0) -> RolloutBatch:
    """A rollout of left-padded prompts (longest ``P``) and right-padded responses
    (longest ``R``), ids in ``[1, VOCAB)``, pad 0."""
    g = torch.Generator().manual_seed(seed)
    B, P_len, R = len(prompt_lengths), max(prompt_lengths), max(response_lengths)
    ids = torch.zeros(B, P_len + R, dtype=torch.long)
    att = torch.zeros(B, P_len + R, dtype=torch.long)
    rmask = torch.zeros(B, R, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        ids[b, P_len - p:P_len + r] = torch.randint(1, VOCAB, (p + r,), generator=g)
        att[b, P_len - p:P_len + r] = 1
        rmask[b, :r] = True
    lengths = torch.tensor(response_lengths)
    return RolloutBatch(input_ids=ids, attention_mask=att, prompt_length=P_len,
                        response_ids=ids[:, P_len:].clone(), response_mask=rmask,
                        response_lengths=lengths, ended=lengths < R, truncated=lengths == R,
                        logprobs=torch.zeros(B, R), vocab_size=VOCAB)


# --------------------------------------------------------------------- ForwardPasses

def test_fixed_micro_batches_top_up_the_last_one_and_gather_drops_the_copies():
    batch = _batch(prompt_lengths=(4, 2, 3, 1, 4), response_lengths=(5, 2, 4, 1, 3))
    micro, plans = ForwardPasses(CPU, VOCAB, forward_micro_batch_size=2).micro_batches(batch)
    assert plans is None and [mb["input_ids"].shape for mb in micro] == [(2, 9)] * 3
    assert torch.equal(torch.cat([mb["input_ids"] for mb in micro])[:5], batch.input_ids)
    assert torch.equal(micro[2]["input_ids"][1], batch.input_ids[4])  # the last row, copied
    assert torch.equal(micro[2]["attention_mask"][1], batch.attention_mask[4])
    # each micro-batch's result: its rows' first ids; the copy is dropped on the way back
    res = [{"x": mb["input_ids"][:, :1].float()} for mb in micro]
    out = ForwardPasses.gather(res, None, batch)
    assert torch.equal(out["x"], batch.input_ids[:, :1].float())
    assert ForwardPasses.gather([], None, batch) is None  # off the last stage


def test_a_micro_batch_size_above_the_batch_gives_one_micro_batch():
    batch = _batch()
    micro, plans = ForwardPasses(CPU, VOCAB, forward_micro_batch_size=8).micro_batches(batch)
    assert plans is None and len(micro) == 1 and torch.equal(micro[0]["input_ids"], batch.input_ids)


@pytest.mark.parametrize("packing", [False, True])
def test_token_budget_micro_batches_cut_padding_and_gather_restores_row_order(packing):
    batch = _batch(prompt_lengths=(4, 2, 3, 1), response_lengths=(5, 2, 4, 1))
    passes = ForwardPasses(CPU, VOCAB, forward_micro_batch_size=1, max_tokens_per_micro_batch=12,
                           sequence_packing=packing, packed_row_length=12 if packing else 0)
    micro, plans = passes.micro_batches(batch)
    assert plans is not None and len(micro) > 1
    assert sorted(r for p in plans for r in p.rows) == [0, 1, 2, 3]
    P_len = batch.prompt_length
    for mb, plan in zip(micro, plans):
        assert mb["input_ids"].shape[1] <= batch.input_ids.shape[1]  # padding columns cut
        p = mb["prompt_length"]
        for i, row in enumerate(plan.rows):  # each row's response tokens where it had them
            n = int(batch.response_lengths[row])
            assert torch.equal(mb["input_ids"][i, p:p + n], batch.input_ids[row, P_len:P_len + n])
    # a per-token result of each micro-batch ([rows, its R]) lands in its rows, zeros beyond
    res = [{"ids": mb["input_ids"][:, mb["prompt_length"]:].float()} for mb in micro]
    out = ForwardPasses.gather(res, plans, batch)["ids"]
    assert out.shape == batch.response_mask.shape
    assert torch.equal(out * batch.response_mask, batch.response_ids.float() * batch.response_mask)


def test_logprob_request_only_with_a_chunk_size_and_without_duplicate_temperatures():
    assert ForwardPasses(CPU, VOCAB, 2).logprob_request(4, (1.0,), entropy=False) is None
    req = ForwardPasses(CPU, VOCAB, 2, logprob_chunk_size=16).logprob_request(4, (0.7, 0.7, 1.0), True)
    assert req.prompt_length == 4 and req.temperatures == (0.7, 1.0)
    assert req.vocab_size == VOCAB and req.compute_entropy and req.chunk_size == 16


def test_from_config_reads_the_ppo_sizes():
    ppo = types.SimpleNamespace(forward_micro_batch_size=3, max_tokens_per_micro_batch=100,
                                sequence_packing=True, packed_row_length=50, logprob_chunk_size=8)
    p = ForwardPasses.from_config(ppo, VOCAB, CPU)
    assert (p.dims, p.vocab_size, p.forward_micro_batch_size, p.max_tokens_per_micro_batch,
            p.sequence_packing, p.packed_row_length, p.logprob_chunk_size) == (CPU, VOCAB, 3, 100, True, 50, 8)


# --------------------------------------------------------------------- PolicyRole on a model

@pytest.fixture(scope="module")
def dims():
    with single_rank(seed=0) as d:
        yield d


@pytest.fixture(scope="module")
def model(dims):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset

    return build_model(load_model_preset("tiny", vocab_size=VOCAB, init_method_std=0.1), dims, seed=7)


def _direct(model, dims, batch, temperature):
    """The reference computation: one forward over the whole batch, eval mode."""
    was = model.training
    model.eval()
    with torch.no_grad():
        logits, values = model_forward(model, batch.input_ids, batch.attention_mask)
    model.train(was)
    lp, _ = response_logprobs(logits, (batch.input_ids, batch.prompt_length), dims, temperature,
                              vocab_size=VOCAB, compute_entropy=False)
    return lp, response_values(values, batch.prompt_length, lp.shape[1])


PASSES = {
    "fixed_rows": dict(forward_micro_batch_size=2),
    "token_budget": dict(forward_micro_batch_size=1, max_tokens_per_micro_batch=14),
    "packed": dict(forward_micro_batch_size=1, max_tokens_per_micro_batch=14, sequence_packing=True,
                   packed_row_length=14),
    "fused_chunked": dict(forward_micro_batch_size=2, logprob_chunk_size=16),
}


@pytest.mark.parametrize("how", list(PASSES))
def test_policy_logprobs_equal_a_direct_forward(dims, model, how):
    batch = _batch()
    role = PolicyRole(model, None, ForwardPasses(dims, VOCAB, **PASSES[how]), dims, temperature=0.8,
                      kl_temperature=1.0, with_values=True)
    model.train()
    out = role.logprobs(batch, kl_temperature=1.0, with_values=True)
    assert model.training  # eval mode for the pass, the previous mode restored
    lp, values = _direct(model, dims, batch, 0.8)
    lp_kl, _ = _direct(model, dims, batch, 1.0)
    m = batch.response_mask
    assert out["logprobs"].dtype == torch.float32 and out["logprobs"].shape == m.shape
    torch.testing.assert_close(out["logprobs"][m], lp[m], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out["kl_logprobs"][m], lp_kl[m], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out["values"][m], values[m], atol=2e-5, rtol=1e-5)
    assert not torch.allclose(lp[m], lp_kl[m])  # the two temperatures differ


def test_policy_logprobs_at_one_temperature_have_no_kl_logprobs_nor_values_unasked(dims, model):
    batch = _batch()
    role = PolicyRole(model, None, ForwardPasses(dims, VOCAB, 4), dims, temperature=1.0,
                      kl_temperature=1.0, with_values=True)
    out = role.logprobs(batch, kl_temperature=1.0)
    assert set(out) == {"logprobs"}
    out = role.logprobs(batch, temperature=0.5)  # an explicit temperature wins over the role's
    lp, _ = _direct(model, dims, batch, 0.5)
    m = batch.response_mask
    torch.testing.assert_close(out["logprobs"][m], lp[m], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kl_temperature", [0.8, 1.0])
def test_policy_loss_fn_is_ppo_loss_of_the_direct_logprobs(dims, model, kl_temperature):
    batch = _batch()
    B, R = batch.response_mask.shape
    g = torch.Generator().manual_seed(3)
    m = batch.response_mask
    mb = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "response_mask": m,
          "old_logprobs": -torch.rand(B, R, generator=g), "advantages": torch.randn(B, R, generator=g),
          "old_values": torch.randn(B, R, generator=g), "returns": torch.randn(B, R, generator=g),
          "ref_logprobs": -torch.rand(B, R, generator=g)}
    objective = P.PPOObjective(kl_loss_coef=0.1, entropy_coef=0.01)
    n_tokens, n_seqs = m.sum().float() * 2, torch.tensor(2.0 * B)  # "global": another DP rank's too
    role = PolicyRole(model, None, ForwardPasses(dims, VOCAB, 4), dims, temperature=0.8,
                      kl_temperature=kl_temperature, with_values=True)
    fn = role.loss_fn(objective, n_tokens, n_seqs, batch.prompt_length, value_only=False)
    with torch.no_grad():
        output = model_forward(model, batch.input_ids, batch.attention_mask)
        loss, stats = fn(output, mb)
        logits, values = output
        args = ((batch.input_ids, batch.prompt_length), dims)
        lp, ent = response_logprobs(logits, *args, 0.8, vocab_size=VOCAB)
        lp_kl = response_logprobs(logits, *args, kl_temperature, vocab_size=VOCAB, compute_entropy=False)[0]
        want, want_stats = P.ppo_loss(objective, lp, ent, m, n_tokens, n_seqs, old_logprobs=mb["old_logprobs"],
                                      advantages=mb["advantages"], values=response_values(values, batch.prompt_length, R),
                                      old_values=mb["old_values"], returns=mb["returns"], kl_logprobs=lp_kl,
                                      ref_logprobs=mb["ref_logprobs"])
        value_only, _ = role.loss_fn(objective, n_tokens, n_seqs, batch.prompt_length, value_only=True)(output, mb)
    torch.testing.assert_close(loss, want)
    assert set(stats) == set(want_stats)
    for k in want_stats:
        torch.testing.assert_close(stats[k], want_stats[k])
    assert stats["value_loss_sum"] != 0 and value_only != loss  # the value term in; policy off alone


# --------------------------------------------------------------------- the critic roles

def test_the_critic_role_is_chosen_by_the_estimator_and_the_critic_mode():
    passes = ForwardPasses(CPU, VOCAB, 2)
    assert isinstance(build_critic_role(False, ("stage", "opt"), passes), NoCritic)
    assert isinstance(build_critic_role(True, None, passes), SharedValueHead)
    sep = build_critic_role(True, ("stage", "opt"), passes)
    assert isinstance(sep, SeparateCritic) and sep.checkpoint == ("stage", "opt") and sep.passes is passes


def _step_parts(B=2, R=3):
    fwd = ForwardResults(old_logprobs=torch.zeros(B, R), ref_logprobs=torch.zeros(B, R),
                         kl_logprobs=torch.zeros(B, R), values=torch.tensor([[1.0, 2.0, 3.0], [0.0, 1.0, 5.0]]))
    adv = Advantages(advantages=torch.ones(B, R), returns=torch.tensor([[2.0, 2.0, 4.0], [1.0, 0.0, 9.0]]),
                     kl=torch.zeros(B, R), loss_mask=torch.tensor([[True, True, True], [True, True, False]]))
    return fwd, adv


def test_shared_value_head_reads_the_actors_values_and_trains_with_the_actor():
    role, values = SharedValueHead(), torch.randn(2, 3)
    assert role.values(None, {"logprobs": torch.zeros(2, 3), "values": values}, no_timers) is values
    assert role.values(None, None, no_timers) is None  # off the last stage
    assert role.needs_values and role.on_actor_backbone and role.warmup_trains_actor_head
    assert role.checkpoint is None and role.train_minibatch([], None, None, None, 0, False) is None
    fwd, adv = _step_parts()
    t = role.training_tensors(fwd, adv)
    assert t["old_values"] is fwd.values and t["returns"] is adv.returns
    # over the 5 masked tokens: R = 2 2 4 1 0, R - V = 1 0 1 1 -1
    torch.testing.assert_close(role.explained_variance_sums(fwd, adv, adv.loss_mask),
                               torch.tensor([9.0, 25.0, 2.0, 4.0, 5.0], dtype=torch.float64))


def test_no_critic_gives_no_values_no_value_tensors_and_no_explained_variance():
    role = NoCritic()
    fwd, adv = _step_parts()
    assert not role.needs_values and not role.on_actor_backbone and not role.warmup_trains_actor_head
    assert role.values(None, {"values": torch.ones(2, 3)}, no_timers) is None
    assert role.training_tensors(fwd, adv) == {}
    assert role.explained_variance_sums(fwd, adv, adv.loss_mask) is None and role.checkpoint is None


def test_a_separate_critic_values_its_own_model_in_eval_mode(dims):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset

    critic = build_model(load_model_preset("tiny", vocab_size=VOCAB, init_method_std=0.1), dims,
                         kind="critic", seed=9)
    timed = []

    class Timers:
        def __call__(self, name):
            timed.append(name)
            return no_timers(name)

    batch = _batch()
    role = SeparateCritic(critic, "opt", ForwardPasses(dims, VOCAB, forward_micro_batch_size=2))
    assert role.checkpoint == (critic, "opt") and role.needs_values and not role.on_actor_backbone
    critic.train()
    got = role.values(batch, {"values": torch.zeros(3, 5)}, Timers())  # the actor's are not read
    assert critic.training and timed == ["critic_values"]
    critic.eval()
    with torch.no_grad():
        want = response_values(model_forward(critic, batch.input_ids, batch.attention_mask),
                               batch.prompt_length, batch.response_mask.shape[1])
    m = batch.response_mask
    assert got.shape == m.shape
    torch.testing.assert_close(got[m], want[m], atol=2e-5, rtol=1e-5)
    role.train()
    assert critic.training


def test_train_minibatch_steps_the_value_head_alone_or_everything(dims):
    """``value_head_only`` (a critic warm-up on the actor's backbone): the policy does not
    move and the weights version stays; a full step moves the backbone and bumps it."""
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.engine import wrap_ddp
    from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig
    from nemo_rlhf.trainers.ppo.roles import is_value_head

    # a non-zero value head: the value loss reaches the backbone (a zero head gives it no gradient)
    cfg = load_model_preset("tiny", vocab_size=VOCAB, init_method_std=0.1, value_head_init_std=0.1)
    model = wrap_ddp(build_model(cfg, dims, seed=5))
    role = PolicyRole(model, MixedPrecisionOptimizer(model, OptimizerConfig(lr=1e-2)),
                      ForwardPasses(dims, VOCAB, 4), dims, temperature=1.0, kl_temperature=1.0, with_values=True)
    batch = _batch()
    B, R = batch.response_mask.shape
    g = torch.Generator().manual_seed(4)
    (mb,), _ = role.passes.micro_batches(batch)
    mb.update(response_mask=batch.response_mask, old_logprobs=-torch.rand(B, R, generator=g),
              advantages=torch.randn(B, R, generator=g), old_values=torch.zeros(B, R),
              returns=torch.randn(B, R, generator=g))
    n_tokens, n_seqs = batch.response_mask.sum().float(), torch.tensor(float(B))

    def moved(before):
        return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fn = role.loss_fn(P.PPOObjective(), n_tokens, n_seqs, batch.prompt_length, value_only=True)
    res, stepped, norm = role.train_minibatch([mb], fn, batch.prompt_length, False, value_head_only=True)
    changed = moved(before)
    assert stepped and norm > 0 and len(res) == 1 and "value_loss_sum" in res[0]
    assert changed and all(is_value_head(n) for n in changed) and role.weights_version == 0
    assert any(p.main_grad.abs().sum() > 0 for n, p in model.named_parameters() if not is_value_head(n))

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fn = role.loss_fn(P.PPOObjective(), n_tokens, n_seqs, batch.prompt_length, value_only=False)
    _, stepped, _ = role.train_minibatch([mb], fn, batch.prompt_length, False)
    changed = moved(before)
    assert stepped and any(not is_value_head(n) for n in changed) and role.weights_version == 1
