"""Adam state of parameters that have not stepped yet survives a checkpoint exactly.

During a critic warm-up only the value head steps: the backbone has no Adam state yet. A
checkpoint taken then (e.g. on SIGUSR1) must load, and the resumed run must continue
bit-identically: every parameter keeps its own Adam step count (bias correction).
"""

from __future__ import annotations

import json

import torch

from tests.single_rank import single_rank


def _loss_fn(output, mb):
    logits, values = output
    loss = logits.float().pow(2).mean() * 1e-2 + (values - 1).pow(2).mean()
    return loss, {"loss": loss.detach()}


def _build(dims):
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.engine import wrap_ddp
    from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig

    model = wrap_ddp(build_model(load_model_preset("tiny", vocab_size=64,
                                                   value_head_init_std=0.1), dims, seed=3))
    return model, MixedPrecisionOptimizer(model, OptimizerConfig(lr=1e-2))


def _step(model, opt, batch, only=None):
    from nemo_rlhf.models.engine import finalize_grads, forward_backward

    opt.zero_grad()
    forward_backward(model, [batch], _loss_fn)
    finalize_grads(model)
    assert opt.step(only=only)[0]


def test_a_checkpoint_taken_during_the_critic_warmup_resumes_bit_identically(tmp_path):
    from nemo_rlhf.checkpoint import load_checkpoint, save_checkpoint

    def value_head(name):
        return "value_head" in name.split(".")

    ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with single_rank() as dims:
        model, opt = _build(dims)
        _step(model, opt, batch, only=value_head)  # warm-up: the backbone has no Adam state
        path = save_checkpoint(tmp_path, 1, model, opt, {"step": 1}, None, dims)
        _step(model, opt, batch)
        _step(model, opt, batch)
        uninterrupted = {k: v.detach().clone() for k, v in model.state_dict().items()
                         if isinstance(v, torch.Tensor)}

        resumed, resumed_opt = _build(dims)
        load_checkpoint(path, resumed, resumed_opt)
        _step(resumed, resumed_opt, batch)
        _step(resumed, resumed_opt, batch)
        after = {k: v for k, v in resumed.state_dict().items() if isinstance(v, torch.Tensor)}
    assert uninterrupted.keys() == after.keys()
    differ = [k for k in after if not torch.equal(after[k], uninterrupted[k])]
    assert not differ, f"resumed weights differ from the uninterrupted run: {differ[:5]}"
    steps = json.loads((path / "metadata.json").read_text())["optimizer_param_steps"]
    assert steps["value_head.weight"] == 1 and steps["value_head.bias"] == 1
    assert steps["decoder.layers.0.self_attention.linear_qkv.weight"] == 0
    assert all(v in (0, 1) for v in steps.values())


def test_bf16_mixed_with_frozen_lower_layers_saves_and_resumes_bit_identically(tmp_path):
    """rm.freeze_layers under trainer.precision=bf16-mixed: the frozen layers' fp32 norm
    weights are their own masters like the trained layers' (found on the SmolLM2 demo's RM
    in bf16: the save failed with megatron's 'Invalid access pattern' for the stacked
    layer_norm_weight, covered by the 10 frozen layers only)."""
    from nemo_rlhf.checkpoint import load_checkpoint, save_checkpoint

    ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def build_frozen(dims):
        from nemo_rlhf.models.actor_critic import build_model
        from nemo_rlhf.models.config import load_model_preset
        from nemo_rlhf.models.engine import wrap_ddp
        from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig

        model = build_model(load_model_preset("tiny", vocab_size=64, value_head_init_std=0.1), dims,
                            "bf16-mixed", seed=3)
        for name, p in model.named_parameters():  # as RMTrainer.init_weights: before DDP
            if name.startswith(("embedding.", "decoder.layers.0.")):
                p.requires_grad_(False)
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
        assert frozen == {torch.bfloat16, torch.float32}, frozen  # both kinds are frozen
        model = wrap_ddp(model)
        return model, MixedPrecisionOptimizer(model, OptimizerConfig(lr=1e-2))

    with single_rank() as dims:
        model, opt = build_frozen(dims)
        frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        _step(model, opt, batch)
        path = save_checkpoint(tmp_path, 1, model, opt, {"step": 1}, None, dims)
        _step(model, opt, batch)
        uninterrupted = {k: v.detach().clone() for k, v in model.state_dict().items()
                         if isinstance(v, torch.Tensor)}
        resumed, resumed_opt = build_frozen(dims)
        load_checkpoint(path, resumed, resumed_opt)
        _step(resumed, resumed_opt, batch)
        after = {k: v for k, v in resumed.state_dict().items() if isinstance(v, torch.Tensor)}
        frozen_after = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    differ = [k for k in after if not torch.equal(after[k], uninterrupted[k])]
    assert not differ, f"resumed weights differ from the uninterrupted run: {differ[:5]}"
    assert frozen_before.keys() == frozen_after.keys() and frozen_before
    assert all(torch.equal(frozen_before[n], frozen_after[n]) for n in frozen_before)
