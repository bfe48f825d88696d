"""MoE routing replay in the PPO roles (#52): the actor's forward-only pass over a rollout
replays the routes the megatron engine recorded, through fixed-row micro-batches (a topped-up
last one) and token-budget micro-batches (rows selected, padding columns cut); an
expert-parallel filler micro-batch is not replayed.

The routers are switched to megatron's sigmoid scores with an expert bias (DeepSeek-V3's
auxiliary-loss-free balancing): the bias moves the top-k choice only, the gate weights are the
unbiased scores of the chosen experts. Changing the bias between the rollout and the training
forward (a router update, standing in for a trainer whose router numerics differ from the
rollout engine's) changes the choices and nothing else: the replayed forward gives the
rollout's behaviour log-probs (up to the decode's rounding), the plain one does not.
"""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models import engine as E
from nemo_rlhf.models.routing_replay import moe_routers
from nemo_rlhf.rollout import RolloutConfig
from nemo_rlhf.rollout.engines import MegatronRolloutEngine
from nemo_rlhf.trainers.ppo.roles import ForwardPasses, PolicyRole
from tests.ppo_helpers import bias_routing
from tests.single_rank import random_prompts, single_rank

VOCAB = 100
MOE = dict(vocab_size=VOCAB, init_method_std=0.1, qk_layernorm=True, kv_channels=24, num_moe_experts=4,
           moe_router_topk=2, moe_ffn_hidden_size=32)


@pytest.fixture(scope="module")
def setup():
    """``(dims, model, batch)``: a rollout of 5 rows recorded with its routes, then the
    routers' expert bias changed."""
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset

    with single_rank(seed=0) as dims:
        cfg = load_model_preset("tiny", **MOE)
        with torch.no_grad():
            model = build_model(cfg, dims, seed=11)
            for r in moe_routers(model):
                r.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
        bias_routing(model, torch.zeros(MOE["num_moe_experts"]))
        eng = MegatronRolloutEngine(dims, eos_token_id=VOCAB - 1, pad_token_id=0, vocab_size=VOCAB,
                                    max_sequence_length=64, record_routes=True)
        batch = eng.generate(model, random_prompts((5, 9, 3, 7, 4), VOCAB, 5),
                             RolloutConfig(max_new_tokens=10, temperature=1.0, seed=4),
                             call_index=0, weights_version=0)
        # the trainer's routers now choose differently (the same gate weights for a choice)
        bias_routing(model, torch.randn(MOE["num_moe_experts"], generator=torch.Generator().manual_seed(9)))
        yield dims, model, batch


def _role(dims, model, **passes):
    return PolicyRole(model, None, ForwardPasses(dims, VOCAB, **passes), dims, 1.0, 1.0, with_values=False)


PASSES = {"fixed_rows_topped_up": dict(forward_micro_batch_size=2),
          "token_budget": dict(forward_micro_batch_size=1, max_tokens_per_micro_batch=40)}


@pytest.mark.parametrize("passes", PASSES.values(), ids=PASSES.keys())
def test_the_replayed_old_logprobs_are_the_rollout_s_behaviour_logprobs(setup, passes):
    dims, model, batch = setup
    assert batch.routes is not None and batch.routes.shape[:2] == batch.input_ids.shape
    role = _role(dims, model, **passes)
    mask = batch.response_mask
    replayed = role.logprobs(batch, replay_routes=True)["logprobs"]
    plain = role.logprobs(batch)["logprobs"]
    d_replay = (replayed - batch.logprobs).abs()[mask]
    d_plain = (plain - batch.logprobs).abs()[mask]
    assert float(d_replay.max()) < 1e-5
    assert float(d_plain.max()) > 1e-2  # the perturbed routers' own choices


def test_replay_needs_the_rollout_s_routes(setup):
    from dataclasses import replace

    dims, model, batch = setup
    with pytest.raises(ValueError, match="moe.routing_replay=true: the rollout batch has no routes"):
        _role(dims, model, forward_micro_batch_size=2).logprobs(replace(batch, routes=None), replay_routes=True)


def test_an_expert_parallel_filler_micro_batch_is_not_replayed(setup, monkeypatch):
    """A filler ([1, 1] dummy, no routes) runs with the router's own choice; the real
    micro-batches still replay (their log-probs are the rollout's)."""
    dims, model, batch = setup
    pad = E._pad_for_expert_parallel

    def with_filler(model_, micro, forward_only, device):
        micro, n = pad(model_, micro, forward_only, device)
        ids = torch.zeros(1, 1, dtype=torch.long)
        return micro + [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], n + 1

    monkeypatch.setattr(E, "_pad_for_expert_parallel", with_filler)
    replayed = _role(dims, model, forward_micro_batch_size=1, max_tokens_per_micro_batch=40).logprobs(
        batch, replay_routes=True)["logprobs"]
    assert float((replayed - batch.logprobs).abs()[batch.response_mask].max()) < 1e-5


def test_a_separate_critic_s_values_route_by_its_own_router(setup):
    """``critic.mode=separate``: the critic's forward is not replayed (its values are its
    own routers' even when the actor replays)."""
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.routing_replay import RoutingReplay
    from nemo_rlhf.models.logprobs import response_values
    from nemo_rlhf.trainers.ppo.roles import SeparateCritic, no_timers

    dims, _, batch = setup
    critic = build_model(load_model_preset("tiny", **MOE, value_head_init_std=1.0), dims, kind="critic", seed=12)
    with torch.no_grad():
        for r in moe_routers(critic):
            r.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    bias_routing(critic, torch.randn(MOE["num_moe_experts"], generator=torch.Generator().manual_seed(9)))
    values = SeparateCritic(critic, None, ForwardPasses(dims, VOCAB, forward_micro_batch_size=5)).values(
        batch, None, no_timers)
    P_len, R, m = batch.prompt_length, batch.response_mask.shape[1], batch.response_mask
    critic.eval()
    with torch.no_grad():
        own = response_values(E.model_forward(critic, batch.input_ids, batch.attention_mask), P_len, R)
        with RoutingReplay(critic, "replay", batch.routes):
            replayed = response_values(E.model_forward(critic, batch.input_ids, batch.attention_mask), P_len, R)
    assert float((values - own).abs()[m].max()) < 1e-6
    assert float((values - replayed).abs()[m].max()) > 1e-4


def test_only_the_megatron_engine_records_routes():
    import types

    from nemo_rlhf.rollout.engines import build_rollout_engine

    common = dict(eos_token_id=1, pad_token_id=0, record_routes=True)
    model_cfg = types.SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=64)
    eng = build_rollout_engine(RolloutConfig(), None, model_cfg, **common)
    assert isinstance(eng, MegatronRolloutEngine) and eng.kwargs["record_routes"] is True
    with pytest.raises(ValueError, match="rollout.engine=vllm: moe.routing_replay records the routes in the "
                                         "megatron engine's decode only"):
        build_rollout_engine(RolloutConfig(engine="vllm"), None, model_cfg, **common)
