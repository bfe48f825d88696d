"""optim.adam_impl: torch's fused, foreach and for-loop AdamW kernels step the masters alike.

The update must not depend on the kernel beyond rounding, a checkpoint written under one
kernel must resume under another, and a wrong name is refused with the choices.
"""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.trainers.mixed_precision import ADAM_IMPLS, MixedPrecisionOptimizer, OptimizerConfig


class _Model(torch.nn.Module):
    """A matrix (decayed) and a bias (not decayed), grads in ``main_grad`` as under megatron DDP."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc = torch.nn.Linear(48, 32).to(dtype)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(32, 48, generator=g))
            self.fc.bias.copy_(torch.randn(32, generator=g))
        for p in self.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)

    def zero_grad_buffer(self):
        for p in self.parameters():
            p.main_grad.zero_()


def _cfg(impl: str) -> OptimizerConfig:
    return OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, adam_impl=impl)


def _grads(model, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=g) * (step + 1))


def _run(impl: str, steps: int, dtype=torch.float32, start=None):
    model = _Model(dtype)
    opt = MixedPrecisionOptimizer(model, _cfg(impl))
    if start is not None:
        model.load_state_dict(start[0])
        opt.load_state_dict(start[1])
    first = 0 if start is None else start[2]
    for s in range(first, first + steps):
        opt.zero_grad()
        _grads(model, s)
        stepped, _ = opt.step()
        assert stepped
    return model, opt


def test_default_is_fused_and_reaches_torch():
    assert OptimizerConfig().adam_impl == "fused"
    _, opt = _run("fused", 1)
    assert opt.optimizer.defaults["fused"] is True
    _, opt = _run("foreach", 1)
    assert opt.optimizer.defaults["foreach"] is True and not opt.optimizer.defaults["fused"]
    _, opt = _run("for_loop", 1)
    assert opt.optimizer.defaults["foreach"] is False and not opt.optimizer.defaults["fused"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_gives_the_same_update(dtype):
    """Three clipped, decayed steps: the masters agree to fp32 rounding, and they moved."""
    ref_model, ref_opt = _run("for_loop", 3, dtype)
    init = _Model(dtype)
    moved = (ref_opt.masters[0] - init.fc.weight.float()).abs().max()
    assert moved > 1e-3
    for impl in ("fused", "foreach"):
        model, opt = _run(impl, 3, dtype)
        for a, b in zip(opt.masters, ref_opt.masters):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        # the model's params are the masters rounded to its dtype (bf16: at most one ulp apart)
        tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=8e-3, atol=0)
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert a.dtype == dtype
            torch.testing.assert_close(a, b, **tol)


def test_a_checkpoint_resumes_under_another_kernel():
    """Two steps under ``for_loop``, saved; two more under ``fused`` = four under ``for_loop``."""
    model, opt = _run("for_loop", 2)
    start = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict(), 2)
    resumed, ropt = _run("fused", 2, start=start)
    straight, sopt = _run("for_loop", 4)
    for a, b in zip(ropt.masters, sopt.masters):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    step = ropt.optimizer.state[ropt.masters[0]]["step"]
    assert float(step) == 4.0


def test_an_unknown_kernel_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"optim.adam_impl='apex'.*fused.*foreach.*for_loop"):
        OptimizerConfig(adam_impl="apex")
    assert ADAM_IMPLS == ("fused", "foreach", "for_loop")
