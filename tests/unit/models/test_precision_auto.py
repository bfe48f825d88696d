"""trainer.precision=auto: the host GEMM probe decides, the choice is logged and concrete."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.config import AUTO_BF16_MIN_SPEEDUP, precision_dtype, resolve_precision

HOST = torch.device("cpu")


def test_auto_picks_bf16_only_where_the_host_bf16_gemm_is_clearly_faster():
    fast = lambda: {"fp32": 75.0, "bf16": 346.0}  # noqa: E731 - AMX-class host
    slow = lambda: {"fp32": 53.0, "bf16": 0.9}  # noqa: E731 - no AVX-512 BF16
    close = lambda: {"fp32": 100.0, "bf16": 100.0 * AUTO_BF16_MIN_SPEEDUP * 0.99}  # noqa: E731
    assert resolve_precision("auto", HOST, probe=fast)[0] == "bf16-mixed"
    assert resolve_precision("auto", HOST, probe=slow)[0] == "32"
    assert resolve_precision("auto", HOST, probe=close)[0] == "32"
    choice, reason = resolve_precision("auto", HOST, probe=slow)
    assert "bf16 0.9 vs fp32 53.0 GFLOP/s" in reason


def test_explicit_precisions_pass_through_and_auto_is_never_a_dtype():
    for p in ("32", "bf16-mixed", "fp16-mixed"):
        assert resolve_precision(p, HOST, probe=lambda: 1 / 0)[0] == p  # no probe run
    with pytest.raises(ValueError, match="resolved first"):
        precision_dtype("auto")
    with pytest.raises(ValueError, match="trainer.precision='bf32'"):
        resolve_precision("bf32", HOST)


def test_the_real_probe_measures_both_dtypes():
    from nemo_rlhf.models.config import host_gemm_gflops

    rates = host_gemm_gflops(n=64, reps=1)
    assert set(rates) == {"fp32", "bf16"} and all(r > 0 for r in rates.values())
