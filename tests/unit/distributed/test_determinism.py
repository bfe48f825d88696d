"""Deterministic mode's pieces (#52): the environment it fills or refuses, the torch flags
it sets, and the fixed-order scan the rollout's sampler uses on CUDA in that mode."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.distributed.determinism import cumsum, enable_deterministic_mode, scan_cumsum


@pytest.fixture
def restore_torch_flags():
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def test_the_mode_fills_the_unset_variables_and_sets_the_torch_flags(restore_torch_flags):
    env = {"NCCL_ALGO": "Ring", "OTHER": "x"}
    applied = enable_deterministic_mode(env)
    assert applied == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring",
                       "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    assert env["OTHER"] == "x" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    # the other accepted cuBLAS workspace is kept
    assert enable_deterministic_mode({"CUBLAS_WORKSPACE_CONFIG": ":16:8"})["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize("key, value", [("CUBLAS_WORKSPACE_CONFIG", ":0:0"), ("NCCL_ALGO", "Tree"),
                                        ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")])
def test_a_nondeterministic_setting_is_refused_naming_it(key, value, restore_torch_flags):
    env = {key: value}
    with pytest.raises(ValueError, match=rf"trainer.deterministic=true: {key}='{value}'.*valid choices"):
        enable_deterministic_mode(env)
    assert env == {key: value}  # nothing filled before the refusal


def test_the_scan_is_an_inclusive_prefix_sum_in_a_fixed_order():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [0.5, -1.0, 0.0, 2.0, 0.25]], dtype=torch.float64)
    torch.testing.assert_close(scan_cumsum(x), torch.tensor([[1.0, 3.0, 6.0, 10.0, 15.0],
                                                             [0.5, -0.5, -0.5, 1.5, 1.75]], dtype=torch.float64))
    torch.testing.assert_close(scan_cumsum(x.T, dim=0), x.T.cumsum(0))
    r = torch.rand(3, 1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.testing.assert_close(scan_cumsum(r), r.cumsum(-1), rtol=1e-12, atol=1e-12)
    assert torch.equal(scan_cumsum(r), scan_cumsum(r.clone()))
    one = torch.tensor([[2.0]])
    out = scan_cumsum(one)
    assert torch.equal(out, one) and out.data_ptr() != one.data_ptr()  # a new tensor, as cumsum's


def test_cumsum_on_the_cpu_is_torch_cumsum_bit_for_bit_in_either_mode(restore_torch_flags):
    r = torch.rand(4, 777, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    assert torch.equal(cumsum(r, dim=-1), torch.cumsum(r, dim=-1))
    torch.use_deterministic_algorithms(True)
    assert torch.equal(cumsum(r, dim=-1), torch.cumsum(r, dim=-1))  # CPU cumsum: deterministic
