"""PPO with LoRA on one frozen base, end to end on one rank (one spawn, fp32):

* ``reference.mode`` resolves to ``adapters_off``: no reference weights are kept, and the
  reference log-probs after training are exactly the base model's;
* the rollout's log-probs (the KV-cache decode) are the adapted model's;
* only the adapters and the value head train; ``critic.mode=separate`` is a second adapter
  set and value head whose frozen base is the actor's own tensors; the base is bit-identical after 2 steps;
* the checkpoints hold the adapters and the head only, plus the base's path and content
  hash; a resume restores the adapters and their Adam state bit for bit; a base whose
  content changed is refused (resume and load), a moved one is taken with ``lora_base``;
* ``export-hf --merge-lora`` gives a transformers model with the LoRA model's logits, and
  ``export-hf --peft`` an adapter that ``peft`` loads onto the base's export with the same
  logits.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data

COMMON = ("reward.functions=[{name: 'tests.ppo_helpers:length_reward'}]", "optim.lr=1e-2",
          "trainer.precision=32", "critic.mode=shared")
LORA = ("model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8",
        "exp_manager.init_value_head=true", "exp_manager.save_interval=1")


def _logits(model, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    from nemo_rlhf.models.engine import model_forward, unwrap

    core = unwrap(model)
    was = core.training
    core.eval()
    with torch.no_grad():
        out = model_forward(core, ids, torch.ones_like(ids), with_values=False)
    core.train(was)
    return out[..., :vocab].float()


def _hf_logits(folder: Path, ids: torch.Tensor, adapter: Path | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _worker(rank: int, tmp: str):
    from megatron.core import dist_checkpointing

    from nemo_rlhf.checkpoint import CheckpointError, load_model_weights, read_metadata, save_checkpoint
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.lora import adapters_disabled
    from nemo_rlhf.tools.ckpt.cli import main as ckpt_main
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    out = {}
    # the base: the tiny model's initial weights, saved as a checkpoint (what import-hf or
    # an SFT run would give)
    t0 = build(compose_ppo(data, tmp / "base_exp", *COMMON))
    base = save_checkpoint(tmp / "base", 0, t0.model, config=t0.run_config, dims=t0.dims)
    vocab = t0.cfg.model.vocab_size
    base_params = {n: p.detach().clone() for n, p in t0.model.named_parameters()
                   if not n.startswith("module.value_head")}
    batch = t0.generate([t0.encoded[i] for i in range(4)])
    ids = torch.as_tensor([t0.encoded[i][:6] for i in range(2)])
    out["base_logits"] = _logits(t0.model, ids, vocab)
    kl_temp = t0.cfg.kl_temperature
    out["base_lp"] = t0.actor.logprobs(batch, t0.model, temperature=kl_temp)["logprobs"]
    t0.close()

    cfg = compose_ppo(data, tmp / "exp", *COMMON, *LORA, f"exp_manager.init_from={base}")
    out["reference_mode"] = cfg.reference.mode
    trainer = build(cfg)
    out["reference_bytes"] = trainer.reference.weight_bytes()
    out["trainable"] = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    out["optimizer_params"] = len(trainer.optimizer.ordered_params)
    trainer.fit()
    after = dict(trainer.model.named_parameters())
    out["base_changed"] = [n for n, p in base_params.items() if not torch.equal(after[n], p)]
    fwd = trainer.compute_old_and_reference(batch)
    out["ref_lp"], out["old_lp"] = fwd.ref_logprobs, fwd.old_logprobs
    out["lora_logits"] = _logits(trainer.model, ids, vocab)
    # the rollout (the KV-cache decode) samples from the adapted model, not the base
    rolled = trainer.generate([trainer.encoded[i] for i in range(4)])
    out["rollout_lp"] = torch.where(rolled.response_mask, rolled.logprobs, 0.0)
    out["train_lp"] = torch.where(rolled.response_mask, trainer.actor.logprobs(
        rolled, temperature=cfg.rollout.logprob_temperature)["logprobs"], 0.0)
    with adapters_disabled(trainer.model):
        out["rollout_base_lp"] = torch.where(rolled.response_mask, trainer.actor.logprobs(
            rolled, temperature=cfg.rollout.logprob_temperature)["logprobs"], 0.0)
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    opt_state = trainer.optimizer.optimizer.state
    adam = {n: opt_state[p]["exp_avg"].clone() for n, p in trainer.model.named_parameters()
            if p.requires_grad}
    trainer.close()

    last = tmp / "exp" / "checkpoints" / "step_2"
    meta = read_metadata(last)
    out["lora_base"] = meta["lora_base"]
    out["base_path"], out["base_hash_ok"] = str(base.resolve()), None
    saved = dist_checkpointing.load_tensors_metadata(str(last / "dist"))
    out["saved_keys"] = sorted(saved)

    def model_numel(tensors):
        return sum(math.prod(t.global_shape) for k, t in tensors.items() if k.startswith("model."))

    out["numels"] = (model_numel(saved),
                     model_numel(dist_checkpointing.load_tensors_metadata(str(base / "dist"))))

    # resume: the adapters and their Adam moments bit for bit
    resumed = build(compose_ppo(data, tmp / "exp", *COMMON, *LORA, f"exp_manager.init_from={base}",
                                "exp_manager.resume=auto", "trainer.max_steps=3"))
    resumed.resume()
    st = resumed.optimizer.optimizer.state
    out["resumed_step"] = resumed.step
    out["resume_mismatch"] = [n for n, p in resumed.model.named_parameters() if p.requires_grad
                              and not (torch.equal(p, adapters[n]) and torch.equal(st[p]["exp_avg"], adam[n]))]
    out["resumed_base_changed"] = [n for n, p in base_params.items()
                                   if not torch.equal(dict(resumed.model.named_parameters())[n], p)]
    resumed.close()

    # a base whose content changed: refused on resume and on load; a moved copy is taken
    with torch.no_grad():
        next(p for n, p in t0.model.named_parameters() if "linear_fc2.weight" in n).add_(1e-3)
    changed = save_checkpoint(tmp / "changed", 0, t0.model, config=t0.run_config, dims=t0.dims)
    try:
        build(compose_ppo(data, tmp / "exp", *COMMON, *LORA, f"exp_manager.init_from={changed}",
                          "exp_manager.resume=auto", "trainer.max_steps=3")).resume()
        out["resume_on_changed_base"] = "accepted"
    except CheckpointError as exc:
        out["resume_on_changed_base"] = str(exc)
    fresh = build_model(cfg.model, trainer.dims, "32", kind="actor_critic", seed=5)
    try:
        load_model_weights(last, fresh, lora_base=str(changed))
        out["load_on_changed_base"] = "accepted"
    except CheckpointError as exc:
        out["load_on_changed_base"] = str(exc)
    moved = tmp / "moved_base"
    shutil.copytree(base, moved)
    load_model_weights(last, fresh, lora_base=str(moved))
    out["moved_logits"] = _logits(fresh, ids, vocab)

    # a separate LoRA critic: a second adapter set + value head on the same base tensors
    sep = build(compose_ppo(data, tmp / "sep", *COMMON[:-1], *LORA, "critic.mode=separate",
                            f"exp_manager.init_from={base}", "trainer.max_steps=1"))
    critic = sep.critic.checkpoint[0]
    actor_ptrs = {n: p.data_ptr() for n, p in sep.model.named_parameters()}
    frozen = [(n, p) for n, p in critic.named_parameters() if not p.requires_grad]
    out["sep_shared"] = bool(frozen) and all(actor_ptrs.get(n) == p.data_ptr() for n, p in frozen)
    out["sep_trainable"] = sorted(n for n, p in critic.named_parameters() if p.requires_grad)
    before = {n: p.detach().clone() for n, p in critic.named_parameters() if p.requires_grad}
    sep.fit()
    out["sep_moved"] = [n for n, p in critic.named_parameters() if p.requires_grad
                        and not torch.equal(p, before[n])]
    out["sep_base_changed"] = [n for n, p in base_params.items()
                               if not torch.equal(dict(sep.model.named_parameters())[n], p)]
    out["sep_keys"] = sorted(dist_checkpointing.load_tensors_metadata(
        str(tmp / "sep" / "checkpoints" / "step_1" / "dist")))
    sep.close()

    # exports
    hf = {k: tmp / f"hf_{k}" for k in ("merged", "base", "peft")}
    out["rc"] = {
        "no_flag": ckpt_main(["export-hf", str(last), "--out", str(tmp / "x"), "--no-tokenizer"]),
        "merged": ckpt_main(["export-hf", str(last), "--out", str(hf["merged"]), "--no-tokenizer",
                             "--merge-lora"]),
        "base": ckpt_main(["export-hf", str(base), "--out", str(hf["base"]), "--no-tokenizer"]),
        "peft": ckpt_main(["export-hf", str(last), "--out", str(hf["peft"]), "--peft"]),
    }
    out["x_exists"] = (tmp / "x").exists()
    out["merged_logits"] = _hf_logits(hf["merged"], ids)
    out["peft_logits"] = _hf_logits(hf["base"], ids, adapter=hf["peft"])
    out["peft_config"] = json.loads((hf["peft"] / "adapter_config.json").read_text())
    return out


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_ranks(_worker, world_size=1, tmp=str(tmp_path_factory.mktemp("lora_ppo")))[0]


def test_the_reference_is_the_base_with_the_adapters_off_and_keeps_no_weights(result):
    assert result["reference_mode"] == "adapters_off" and result["reference_bytes"] == 0
    assert torch.equal(result["ref_lp"], result["base_lp"])
    # the policy did move away from it (the adapters trained)
    assert (result["old_lp"] - result["ref_lp"]).abs().max() > 1e-4


def test_only_the_adapters_and_the_value_head_train_and_the_base_stays_bit_identical(result):
    trainable = result["trainable"]
    assert trainable and all("_lora." in n or "value_head" in n for n in trainable)
    assert any("value_head" in n for n in trainable)
    assert {n.rsplit(".", 1)[-1] for n in trainable if "_lora." in n} == {"lora_a", "lora_b"}
    assert result["optimizer_params"] == len(trainable)
    assert result["base_changed"] == [] and result["resumed_base_changed"] == []


def test_the_rollout_samples_from_the_adapted_model(result):
    torch.testing.assert_close(result["rollout_lp"], result["train_lp"], atol=1e-5, rtol=0)
    assert (result["rollout_lp"] - result["rollout_base_lp"]).abs().max() > 1e-4


def test_checkpoints_hold_adapters_and_heads_and_name_the_base(result):
    keys = result["saved_keys"]
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("_lora." in k or "value_head" in k for k in model_keys), model_keys
    assert result["lora_base"]["path"] == result["base_path"] and len(result["lora_base"]["hash"]) == 16
    lora_numel, base_numel = result["numels"]  # model tensors' elements: a fraction of the base's
    assert 0 < lora_numel * 5 < base_numel, result["numels"]


def test_resume_restores_the_adapters_and_their_adam_state_bit_for_bit(result):
    assert result["resumed_step"] == 2 and result["resume_mismatch"] == []


def test_a_changed_base_is_refused_and_a_moved_one_is_taken(result):
    assert "reference" in result["resume_on_changed_base"], result["resume_on_changed_base"]
    assert "content hash" in result["load_on_changed_base"], result["load_on_changed_base"]
    torch.testing.assert_close(result["moved_logits"], result["lora_logits"], atol=0, rtol=0)


def test_a_separate_lora_critic_is_a_second_adapter_set_on_the_same_base_tensors(result):
    assert result["sep_shared"]  # the critic's frozen base is the actor's storage
    trainable = result["sep_trainable"]
    assert trainable and all("_lora." in n or n.startswith("module.value_head") or "value_head" in n
                             for n in trainable) and any("value_head" in n for n in trainable)
    assert set(result["sep_moved"]) == set(trainable)  # adapters (B from 0) and head trained
    assert result["sep_base_changed"] == []
    critic_keys = [k for k in result["sep_keys"] if k.startswith("critic.")]
    assert critic_keys and all("_lora." in k or "value_head" in k for k in critic_keys), critic_keys


def test_merged_and_peft_exports_give_the_lora_models_logits(result):
    rc = result["rc"]
    assert rc["no_flag"] != 0 and not result["x_exists"]  # a LoRA checkpoint needs a choice
    assert rc["merged"] == rc["base"] == rc["peft"] == 0, rc
    want = result["lora_logits"]
    assert (want - result["base_logits"]).abs().max() > 1e-3  # the adapters matter
    torch.testing.assert_close(result["merged_logits"], want, atol=2e-5, rtol=0)
    torch.testing.assert_close(result["peft_logits"], want, atol=2e-5, rtol=0)
    cfg = result["peft_config"]
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and set(cfg["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
