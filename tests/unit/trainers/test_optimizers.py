"""optim.use_distributed_optimizer: the adapter around megatron's DistributedOptimizer.

megatron's optimizer asserts CUDA tensors, so on the host the adapter's own logic (the LR
schedule it writes, the skip on a non-finite norm, fp16 overflow, ``only=`` for the critic
warm-up, checkpoint hooks) is driven through a stand-in with megatron's method names; the
real optimizer runs in ``make gpu-check`` (``ppo_tiny_distopt``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig, lr_lambda
from nemo_rlhf.trainers.optimizers import (
    MegatronDistributedOptimizer,
    build_optimizer,
    megatron_optimizer_config,
    validate_optimizer,
)


class _Model(torch.nn.Module):
    """Two parameters whose grads live in ``main_grad`` as under megatron DDP."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Linear(3, 3, bias=False)
        self.value_head = torch.nn.Linear(3, 1, bias=False)
        for p in self.parameters():
            p.main_grad = torch.zeros_like(p)
        self.zeroed_buffers = 0

    def zero_grad_buffer(self):
        self.zeroed_buffers += 1
        for p in self.parameters():
            p.main_grad.zero_()


class _MegatronStandIn:
    """megatron ``MixedPrecisionOptimizer``'s step pieces over a torch AdamW (main params
    are the model params, as for fp32 models)."""

    def __init__(self, model, weight_decay=0.0, overflow=False):
        self.params = list(model.parameters())
        self.inner = torch.optim.AdamW(self.params, lr=123.0, weight_decay=weight_decay)
        self.overflow = overflow
        self.calls = []

    @property
    def param_groups(self):
        return self.inner.param_groups

    def prepare_grads(self):
        self.calls.append("prepare_grads")
        for p in self.params:
            p.grad = p.main_grad.clone()
        return self.overflow

    def get_grad_norm(self):
        self.calls.append("get_grad_norm")
        return float(torch.sqrt(sum(p.grad.pow(2).sum() for p in self.params)))

    def clip_grad_norm(self, clip):
        self.calls.append(("clip_grad_norm", clip))
        norm = self.get_grad_norm()
        if clip / (norm + 1e-6) < 1.0:
            for p in self.params:
                p.grad.mul_(clip / (norm + 1e-6))
        return norm

    def step_with_ready_grads(self):
        self.calls.append("step_with_ready_grads")
        self.inner.step()
        return True

    def zero_grad(self):
        self.calls.append("zero_grad")
        for p in self.params:
            p.grad = None

    def scale_loss(self, loss):
        return loss * 8.0

    def sharded_state_dict(self, model_sd, is_loading=False, metadata=None):
        self.calls.append(("sharded_state_dict", is_loading, dict(metadata or {})))
        return {"state": "sharded"}

    def load_state_dict(self, sd):
        self.calls.append(("load_state_dict", sd))


def _set_grads(model, backbone=1.0, head=1.0):
    model.backbone.weight.main_grad.fill_(backbone)
    model.value_head.weight.main_grad.fill_(head)


def test_lr_schedule_is_written_into_the_param_groups_before_every_step():
    cfg = OptimizerConfig(lr=0.1, warmup_steps=3, clip_grad=0.0)
    model = _Model()
    opt = MegatronDistributedOptimizer(model, cfg, megatron_optimizer=_MegatronStandIn(model))
    fn = lr_lambda(cfg)
    seen = []
    for step in range(4):
        assert opt.lr == pytest.approx(0.1 * fn(step))
        assert all(g["lr"] == pytest.approx(0.1 * fn(step)) for g in opt.optimizer.param_groups)
        seen.append(opt.lr)
        _set_grads(model)
        assert opt.step()[0] is True
    assert seen == pytest.approx([0.1 / 3, 0.2 / 3, 0.1, 0.1])
    assert opt.scheduler.state_dict() == {"last_epoch": 4}


def test_a_non_finite_norm_skips_the_step_and_leaves_the_weights_unchanged():
    model = _Model()
    opt = MegatronDistributedOptimizer(model, OptimizerConfig(lr=0.1),
                                       megatron_optimizer=_MegatronStandIn(model))
    before = [p.detach().clone() for p in model.parameters()]
    _set_grads(model, backbone=float("nan"))
    stepped, norm = opt.step()
    assert stepped is False and not math.isfinite(norm)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert "step_with_ready_grads" not in opt.optimizer.calls
    assert opt.scheduler.last_epoch == 0  # the schedule does not advance on a skipped step


def test_an_fp16_overflow_skips_the_step_and_zeroes_the_grads():
    model = _Model()
    stand_in = _MegatronStandIn(model, overflow=True)
    opt = MegatronDistributedOptimizer(model, OptimizerConfig(lr=0.1), precision="fp16-mixed",
                                       megatron_optimizer=stand_in)
    _set_grads(model)
    assert opt.step() == (False, float("inf"))
    assert stand_in.calls[-1] == "zero_grad" and model.zeroed_buffers == 1
    assert "step_with_ready_grads" not in stand_in.calls


def test_clipping_goes_through_megatron_clip_grad_norm_and_no_clip_through_the_norm():
    model = _Model()
    clipped = MegatronDistributedOptimizer(model, OptimizerConfig(lr=0.1, clip_grad=0.5),
                                           megatron_optimizer=_MegatronStandIn(model))
    _set_grads(model, backbone=1.0, head=1.0)
    stepped, norm = clipped.step()
    assert stepped and norm == pytest.approx(math.sqrt(12.0))  # 9 + 3 ones
    assert ("clip_grad_norm", 0.5) in clipped.optimizer.calls
    model2 = _Model()
    unclipped = MegatronDistributedOptimizer(model2, OptimizerConfig(lr=0.1, clip_grad=0.0),
                                             megatron_optimizer=_MegatronStandIn(model2))
    _set_grads(model2)
    unclipped.step()
    assert "get_grad_norm" in unclipped.optimizer.calls
    assert not any(isinstance(c, tuple) and c[0] == "clip_grad_norm"
                   for c in unclipped.optimizer.calls)


def test_only_keeps_the_rejected_parameters_bit_identical_even_with_weight_decay():
    model = _Model()
    opt = MegatronDistributedOptimizer(model, OptimizerConfig(lr=0.1, weight_decay=0.1),
                                       megatron_optimizer=_MegatronStandIn(model, weight_decay=0.1))
    backbone, head = model.backbone.weight.detach().clone(), model.value_head.weight.detach().clone()
    for _ in range(3):
        _set_grads(model, backbone=1.0, head=1.0)
        assert opt.step(only=lambda name: "value_head" in name.split("."))[0]
    assert torch.equal(model.backbone.weight, backbone)
    assert not torch.equal(model.value_head.weight, head)
    assert [g["weight_decay"] for g in opt.optimizer.param_groups] == [0.1]  # restored
    _set_grads(model, backbone=1.0, head=1.0)
    opt.step()  # without only=: the backbone moves again
    assert not torch.equal(model.backbone.weight, backbone)


def test_fp16_hands_the_loss_scale_to_the_model_config():
    model = _Model()
    model.config = SimpleNamespace(grad_scale_func=None)
    MegatronDistributedOptimizer(model, OptimizerConfig(), precision="fp16-mixed",
                                 megatron_optimizer=_MegatronStandIn(model))
    assert model.config.grad_scale_func(torch.tensor(2.0)) == 16.0


def test_checkpoint_hooks_use_the_reshardable_layout_and_restore_the_lr():
    model = _Model()
    cfg = OptimizerConfig(lr=0.1, warmup_steps=4, clip_grad=0.0)
    stand_in = _MegatronStandIn(model)
    opt = MegatronDistributedOptimizer(model, cfg, megatron_optimizer=stand_in)
    assert opt.sharded_state_dict({"model.x": 1}, is_loading=True) == {"state": "sharded"}
    assert stand_in.calls[-1] == ("sharded_state_dict", True,
                                  {"distrib_optim_sharding_type": "fully_sharded_model_space"})
    opt.scheduler.load_state_dict({"last_epoch": 2})
    opt.load_sharded({"state": "loaded"})
    assert stand_in.calls[-1] == ("load_state_dict", {"state": "loaded"})
    assert all(g["lr"] == pytest.approx(0.1 * 3 / 4) for g in stand_in.param_groups)


def test_megatron_config_carries_the_optim_keys_and_leaves_clipping_to_the_adapter():
    cfg = OptimizerConfig(lr=3e-4, min_lr=1e-5, weight_decay=0.01, adam_beta2=0.98, clip_grad=1.0)
    m = megatron_optimizer_config(cfg, "bf16-mixed")
    assert (m.lr, m.min_lr, m.weight_decay, m.adam_beta2) == (3e-4, 1e-5, 0.01, 0.98)
    assert m.bf16 and not m.fp16 and m.params_dtype == torch.bfloat16
    assert m.use_distributed_optimizer and m.clip_grad == 0.0


def test_the_distributed_optimizer_is_refused_without_cuda_naming_the_key():
    dims = SimpleNamespace(device=torch.device("cpu"), mp_group=None)
    with pytest.raises(ValueError, match="optim.use_distributed_optimizer=true needs CUDA"):
        validate_optimizer(OptimizerConfig(use_distributed_optimizer=True), dims)
    validate_optimizer(OptimizerConfig(), dims)  # the default is fine anywhere
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="set optim.use_distributed_optimizer=false"):
            MegatronDistributedOptimizer(_Model(), OptimizerConfig(use_distributed_optimizer=True))
    assert isinstance(build_optimizer(_Model(), OptimizerConfig(), dims, "32"),
                      MixedPrecisionOptimizer)


def test_resuming_with_the_other_optimizer_fails_naming_the_key(tmp_path):
    from nemo_rlhf.checkpoint import load_checkpoint, save_checkpoint
    from nemo_rlhf.checkpoint.layout import CheckpointError
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.engine import wrap_ddp
    from tests.single_rank import single_rank

    with single_rank() as dims:
        model = wrap_ddp(build_model(load_model_preset("tiny", vocab_size=64), dims, seed=1))
        adamw = MixedPrecisionOptimizer(model, OptimizerConfig())
        path = save_checkpoint(tmp_path, 1, model, adamw, {"step": 1}, None, dims)
        distopt = MegatronDistributedOptimizer(model, OptimizerConfig(),
                                               megatron_optimizer=_MegatronStandIn(model))
        with pytest.raises(CheckpointError,
                           match=r"'adamw' format.*set optim.use_distributed_optimizer=false"):
            load_checkpoint(path, model, distopt)
        assert load_checkpoint(path, model, adamw)["step"] == 1  # the same format loads
