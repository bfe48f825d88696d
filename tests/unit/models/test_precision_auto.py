"""trainer.precision=auto: the machine's bf16 instructions decide (not a timing, which
depends on the load), the choice is logged and concrete."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.models.config import cpu_flags, host_bf16, precision_dtype, resolve_precision

HOST = torch.device("cpu")


@pytest.mark.parametrize("flags,capability,env,fast", [
    ({"avx2", "amx_bf16", "avx512_bf16"}, "AVX512", {}, True),  # AMX
    ({"avx2", "avx512f", "avx512_bf16"}, "AVX512", {}, True),  # AVX-512 BF16 without AMX
    ({"avx2", "avx512f"}, "AVX512", {}, False),  # AVX-512 without bf16 dot products
    ({"avx2"}, "AVX2", {}, False),  # AVX2-only
    ({"avx512f", "avx512_bf16"}, "AVX2", {}, False),  # ATEN_CPU_CAPABILITY=avx2
    ({"avx512f", "avx512_bf16"}, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),
    ({"avx512f", "avx512_bf16"}, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True),
    ({"avx512f", "avx512_bf16"}, "AVX512", {"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
])
def test_host_bf16_follows_the_cpu_flags_and_the_kernels_torch_uses(flags, capability, env, fast):
    got, reason = host_bf16(flags, capability, env)
    assert got is fast, reason
    assert reason


def test_auto_resolves_by_the_machine_and_says_why():
    assert resolve_precision("auto", HOST, host_bf16=lambda: (True, "amx"))[0] == "bf16-mixed"
    choice, reason = resolve_precision("auto", HOST, host_bf16=lambda: host_bf16({"avx2"}, "AVX2", {}))
    assert choice == "32" and "bf16 GEMMs are emulated" in reason
    assert host_bf16(None if cpu_flags() is not None else set(), "AVX512", {})[0] in (True, False)


def test_cpu_flags_reads_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) is None
    assert host_bf16(None, "AVX512", {})[1]  # this machine's own answer has a reason


def test_explicit_precisions_pass_through_and_auto_is_never_a_dtype():
    for p in ("32", "bf16-mixed", "fp16-mixed"):
        assert resolve_precision(p, HOST, host_bf16=lambda: 1 / 0)[0] == p  # nothing read
    with pytest.raises(ValueError, match="resolved first"):
        precision_dtype("auto")
    with pytest.raises(ValueError, match="trainer.precision='bf32'"):
        resolve_precision("bf32", HOST)


def test_the_gemm_probe_still_measures_both_dtypes():
    """``host_gemm_gflops`` stays for the benchmarks' peak estimates."""
    from nemo_rlhf.models.config import host_gemm_gflops

    rates = host_gemm_gflops(n=64, reps=1)
    assert set(rates) == {"fp32", "bf16"} and all(r > 0 for r in rates.values())
