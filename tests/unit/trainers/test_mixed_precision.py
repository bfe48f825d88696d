"""Optimizer wrapper: fp16 dynamic loss scaling, non-finite skip, LR schedule."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rlhf.trainers.mixed_precision import (
    DynamicLossScaler,
    MixedPrecisionOptimizer,
    OptimizerConfig,
    lr_lambda,
)


class _Tiny(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 4, dtype=dtype))
        self.b = torch.nn.Parameter(torch.zeros(4, dtype=dtype))


def test_loss_scaler_halves_on_overflow_and_doubles_after_window():
    s = DynamicLossScaler(initial=1024.0, minimum=1.0, window=2)
    s.update(overflow=True)
    assert s.scale == 512.0
    s.update(overflow=False)
    assert s.scale == 512.0
    s.update(overflow=False)
    assert s.scale == 1024.0
    for _ in range(20):
        s.update(overflow=True)
    assert s.scale == 1.0  # never below the minimum


def test_nonfinite_gradient_skips_the_step_and_leaves_weights_unchanged():
    m = _Tiny()
    opt = MixedPrecisionOptimizer(m, OptimizerConfig(lr=0.1))
    m.w.grad = torch.full_like(m.w, float("nan"))
    m.b.grad = torch.ones_like(m.b)
    before = [p.detach().clone() for p in m.parameters()]
    stepped, norm = opt.step()
    assert stepped is False and not math.isfinite(norm)
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))


def test_fp16_overflow_skips_and_backs_off_the_scale_then_steps_unscaled():
    m = _Tiny(torch.float16)
    opt = MixedPrecisionOptimizer(m, OptimizerConfig(lr=0.1, initial_loss_scale=8.0, clip_grad=0),
                                  fp16=True)
    m.w.grad = torch.full_like(m.w, float("inf"))
    m.b.grad = torch.zeros_like(m.b)
    assert opt.step()[0] is False and opt.scaler.scale == 4.0
    opt.zero_grad()
    m.w.grad = torch.full_like(m.w, 4.0)  # = scale * true grad of 1.0
    m.b.grad = torch.zeros_like(m.b)
    stepped, norm = opt.step()
    assert stepped and norm == pytest.approx(4.0)  # sqrt(16 * 1.0^2): unscaled
    assert m.w.dtype == torch.float16 and opt.masters[0].dtype == torch.float32
    assert torch.all(m.w < 1.0)  # the fp32 master stepped and was copied back


def test_bf16_params_get_fp32_master_weights():
    m = _Tiny(torch.bfloat16)
    opt = MixedPrecisionOptimizer(m, OptimizerConfig(lr=1e-3))
    assert all(x.dtype == torch.float32 for x in opt.masters)
    m.w.grad = torch.full_like(m.w, 1.0)
    m.b.grad = torch.zeros_like(m.b)
    opt.step()
    # 1 - 1e-3 is not representable in bf16, the master keeps the exact update
    assert opt.masters[0][0, 0].item() == pytest.approx(1 - 1e-3, abs=1e-6)


def test_lr_warmup_then_cosine_decay_to_min_lr():
    f = lr_lambda(OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=2, decay_steps=10,
                                  decay_style="cosine"))
    assert f(0) == 0.5 and f(1) == 1.0
    assert f(2) == pytest.approx(1.0) and f(12) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_bad_optimizer_config_names_the_key():
    with pytest.raises(ValueError, match=r"optim\.decay_style='step'"):
        OptimizerConfig(decay_style="step")


def test_step_only_selected_params_leaves_the_others_without_update_state_or_decay():
    """Critic warm-up steps the value head only: the rest must not move, not even through
    AdamW's weight decay, and must not start Adam moments or a step count."""
    m = _Tiny()
    opt = MixedPrecisionOptimizer(m, OptimizerConfig(lr=0.1, weight_decay=0.5, clip_grad=0))
    w0, b0 = m.w.detach().clone(), m.b.detach().clone()
    for _ in range(2):
        m.w.grad = torch.ones_like(m.w)
        m.b.grad = torch.full_like(m.b, 2.0)
        stepped, norm = opt.step(only=lambda name: name == "b")
        assert stepped and norm == pytest.approx(4.0)  # sqrt(4 * 2^2): b's gradient only
    assert torch.equal(m.w, w0)
    assert not torch.equal(m.b, b0)
    assert m.w not in opt.optimizer.state or not opt.optimizer.state[m.w]
    opt.zero_grad()
    m.w.grad = torch.ones_like(m.w)
    m.b.grad = torch.ones_like(m.b)
    opt.step()  # then a plain step moves everything
    assert not torch.equal(m.w, w0)
