"""PPO trainer on one rank: critic warm-up, train/eval modes, the KL's temperature.

* Critic warm-up (``trainer.critic_warmup_steps``) trains the value head only: the actor's
  log-probs are bit-identical after the warm-up steps (weight decay on), the head moved.
* Every forward-only pass (old log-probs and values, reference, rollout) runs in eval
  mode and the PPO updates in train mode: with dropout 0.1 the old log-probs are
  deterministic and equal the rollout's, and the offloaded reference equals the colocated
  one.
* ``kl.temperature`` picks the distributions the KL penalty compares.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

COMMON = ("reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "optim.lr=1e-3")


def _direct_logprobs(trainer, model, batch, temperature: float) -> torch.Tensor:
    """Response log-probs ``[B, R]`` of ``model`` at ``temperature``, one plain eval forward."""
    from nemo_rlhf.models.logprobs import response_logprobs
    from nemo_rlhf.models.engine import model_forward, unwrap

    core = unwrap(model)
    was_training = core.training
    core.eval()
    with torch.no_grad():
        logits = model_forward(core, batch.input_ids, batch.attention_mask, with_values=False)
    core.train(was_training)
    lp, _ = response_logprobs(logits, batch, trainer.dims, temperature,
                              vocab_size=trainer.cfg.model.vocab_size, compute_entropy=False)
    return torch.where(batch.response_mask, lp, 0.0)


# --- critic warm-up --------------------------------------------------------------------------

def _warmup_worker(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    cfg = compose_ppo(data, tmp / "exp", *COMMON, "trainer.critic_warmup_steps=2",
                      "optim.weight_decay=0.1", "ppo.value_loss_coef=1.0")
    trainer = build(cfg)
    batch = trainer.generate([trainer.encoded[i] for i in range(8)])

    def snapshot():
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    before, lp_before = snapshot(), _direct_logprobs(trainer, trainer.model, batch, 1.0)
    warm = []
    for _ in range(2):  # the loop's bookkeeping, as fit() does it
        warm.append(trainer.train_step())
        trainer.step += 1
    after, lp_after = snapshot(), _direct_logprobs(trainer, trainer.model, batch, 1.0)
    state = trainer.optimizer.optimizer.state
    backbone = [p for n, p in trainer.model.named_parameters() if "value_head" not in n]
    out = {
        "logprobs_bit_identical": torch.equal(lp_before, lp_after),
        "backbone_changed": [n for n in before if "value_head" not in n
                             and not torch.equal(before[n], after[n])],
        "head_changed": [n for n in before if "value_head" in n
                         and not torch.equal(before[n], after[n])],
        "backbone_adam_state": sum(1 for p in backbone if state.get(p)),
        "warm_grad_norm": [m["grad_norm"] for m in warm],
    }
    trainer.train_step()  # after the warm-up the policy trains
    out["backbone_changed_after_warmup"] = any(
        not torch.equal(before[n], p) for n, p in trainer.model.named_parameters()
        if "value_head" not in n)
    return out


@pytest.fixture(scope="module")
def warmup(tmp_path_factory):
    return run_ranks(_warmup_worker, world_size=1, tmp=str(tmp_path_factory.mktemp("warm")))[0]


def test_critic_warmup_leaves_the_actor_log_probs_bit_identical(warmup):
    assert warmup["backbone_changed"] == [], warmup["backbone_changed"]
    assert warmup["logprobs_bit_identical"]
    assert warmup["backbone_adam_state"] == 0  # no Adam moments: no late jump after warm-up


def test_critic_warmup_trains_the_value_head_then_the_policy_trains(warmup):
    assert warmup["head_changed"] and all(g > 0 for g in warmup["warm_grad_norm"])
    assert warmup["backbone_changed_after_warmup"]


# --- train / eval modes with dropout -----------------------------------------------------------

def _dropout_worker(rank: int, tmp: str):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.train_ppo import build
    from nemo_rlhf.models.engine import unwrap
    from nemo_rlhf.trainers.ppo.reference import ReferencePolicy

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    cfg = compose_ppo(data, tmp / "exp", *COMMON, "model.hidden_dropout=0.1",
                      "model.attention_dropout=0.1", "rollout.temperature=0.7")
    trainer = build(cfg)
    out = {}
    batch = trainer.generate([trainer.encoded[i] for i in range(8)])
    first = trainer.compute_old_and_reference(batch)
    again = trainer.compute_old_and_reference(batch)
    out["old_deterministic"] = torch.equal(first.old_logprobs, again.old_logprobs)
    out["values_deterministic"] = torch.equal(first.values, again.values)
    out["ref_deterministic"] = torch.equal(first.ref_logprobs, again.ref_logprobs)
    out["rollout_vs_old"] = (first.old_logprobs - batch.logprobs).abs()[batch.response_mask].max().item()

    def make_stage():
        return build_model(cfg.model, trainer.dims, cfg.trainer.precision, seed=99)

    offload = trainer.reference
    trainer.reference = ReferencePolicy(unwrap(trainer.model), "colocated", build_fn=make_stage)
    coloc = trainer.compute_old_and_reference(batch).ref_logprobs
    out["offload_vs_colocated"] = (coloc - first.ref_logprobs).abs().max().item()
    trainer.reference = offload

    # which mode each forward of the actor's stage ran in, by phase of one PPO step
    modes, phase = [], {"name": "rollout"}
    unwrap(trainer.model).register_forward_pre_hook(
        lambda mod, args: modes.append((phase["name"], mod.training)))
    for name in ("compute_old_and_reference", "update"):
        real = getattr(trainer, name)

        def wrapped(*a, _real=real, _name=name, **kw):
            phase["name"] = _name
            try:
                return _real(*a, **kw)
            finally:
                phase["name"] = "other"
        setattr(trainer, name, wrapped)
    trainer.train_step()
    out["modes"] = sorted(set(modes))
    return out


@pytest.fixture(scope="module")
def dropout(tmp_path_factory):
    return run_ranks(_dropout_worker, world_size=1, tmp=str(tmp_path_factory.mktemp("drop")))[0]


def test_forward_only_passes_are_deterministic_with_dropout(dropout):
    assert dropout["old_deterministic"] and dropout["values_deterministic"]
    assert dropout["ref_deterministic"]


def test_old_logprobs_equal_the_rollout_logprobs_with_dropout(dropout):
    assert dropout["rollout_vs_old"] <= 1e-5


def test_offload_reference_equals_colocated_with_dropout(dropout):
    assert dropout["offload_vs_colocated"] <= 1e-6


def test_forward_only_passes_run_in_eval_mode_and_updates_in_train_mode(dropout):
    # the rollout is an eval-mode pass too (generate's own, outside the hooked phases it
    # calls the model through the incremental stage, so it may not appear here)
    assert ("compute_old_and_reference", False) in dropout["modes"]
    assert ("update", True) in dropout["modes"]
    assert ("compute_old_and_reference", True) not in dropout["modes"], dropout["modes"]
    assert ("update", False) not in dropout["modes"], dropout["modes"]


# --- the KL penalty's temperature ----------------------------------------------------------------

def _kl_temperature_worker(rank: int, tmp: str):
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    out = {}
    for mode in ("sampling", "unscaled"):
        cfg = compose_ppo(data, tmp / mode, *COMMON, "rollout.temperature=0.7",
                          f"kl.temperature={mode}")
        trainer = build(cfg)
        batch = trainer.generate([trainer.encoded[i] for i in range(8)])
        fwd = trainer.compute_old_and_reference(batch)
        kl_temp = 0.7 if mode == "sampling" else 1.0
        direct_t = _direct_logprobs(trainer, trainer.model, batch, kl_temp)  # actor == reference
        direct_s = _direct_logprobs(trainer, trainer.model, batch, 0.7)
        mask = batch.response_mask
        out[mode] = {
            "ref_vs_direct": (fwd.ref_logprobs - direct_t).abs()[mask].max().item(),
            "kl_lp_vs_direct": (fwd.kl_logprobs - direct_t).abs()[mask].max().item(),
            "old_vs_sampling_temp": (fwd.old_logprobs - direct_s).abs()[mask].max().item(),
            "ref_vs_sampling_temp": (fwd.ref_logprobs - direct_s).abs()[mask].max().item(),
            "kl_mean_step1": trainer.train_step()["kl_mean"],
        }
    return out


@pytest.fixture(scope="module")
def kl_temperature(tmp_path_factory):
    return run_ranks(_kl_temperature_worker, world_size=1,
                     tmp=str(tmp_path_factory.mktemp("kltemp")))[0]


@pytest.mark.parametrize("mode", ["sampling", "unscaled"])
def test_kl_compares_actor_and_reference_at_the_configured_temperature(kl_temperature, mode):
    r = kl_temperature[mode]
    assert r["ref_vs_direct"] <= 1e-5 and r["kl_lp_vs_direct"] <= 1e-5
    assert r["old_vs_sampling_temp"] <= 1e-5  # the PPO ratio stays at the sampling temperature
    assert abs(r["kl_mean_step1"]) <= 1e-5  # actor == reference at step 1, in both modes


def test_unscaled_reference_is_not_the_temperature_scaled_one(kl_temperature):
    assert kl_temperature["unscaled"]["ref_vs_sampling_temp"] > 1e-3  # the test means something


def test_kl_temperature_is_validated_naming_the_key_and_choices(tmp_path):
    with pytest.raises(Exception, match=r"kl.temperature='hot': valid choices are \['sampling', 'unscaled'\]"):
        compose_ppo(tmp_path, tmp_path / "exp", "kl.temperature=hot")
    assert compose_ppo(tmp_path, tmp_path / "exp").kl.temperature == "sampling"  # the default
