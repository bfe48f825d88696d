"""Single-process foundations: vocab-parallel log-probs, config errors, launch env, compat."""

from __future__ import annotations

import pytest
import torch

from nemo_rlhf.distributed.launch_env import expand_first_host, read_launch_env
from nemo_rlhf.distributed.parallel import ParallelConfig, validate_parallel_layout
from nemo_rlhf.models.config import load_model_preset, precision_dtype
from nemo_rlhf.models.vocab_parallel import vocab_parallel_logprobs


def _naive(logits, ids, temperature, vocab_size=None):
    z = logits.float() / temperature
    if vocab_size is not None:
        z[..., vocab_size:] = float("-inf")
    logp_all = torch.log_softmax(z, dim=-1)
    lp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    ent = -(torch.where(p > 0, p * logp_all, torch.zeros_like(p))).sum(-1)
    return lp, ent


@pytest.mark.device
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_vocab_parallel_logprobs_and_entropy_equal_log_softmax(temperature, test_device):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 64, generator=g) * 3).to(test_device)
    ids = torch.randint(0, 64, (3, 5), generator=g).to(test_device)
    lp, ent = vocab_parallel_logprobs(logits, ids, temperature=temperature)
    ref_lp, ref_ent = _naive(logits, ids, temperature)
    assert lp.device == ent.device == logits.device
    # |log-probs| reach ~20, where a float32 ulp is ~2e-6: a GPU's reduction order may
    # differ from log_softmax's by a few ulps; on the host both agree to 1e-6
    atol = 1e-6 if test_device.type == "cpu" else 1e-5
    torch.testing.assert_close(lp, ref_lp, atol=atol, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=atol, rtol=0)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32


@pytest.mark.device
def test_vocab_parallel_gradients_equal_autograd_of_log_softmax(test_device):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 4, 32, generator=g, dtype=torch.float64).float().to(test_device)
    ids = torch.randint(0, 32, (2, 4), generator=g).to(test_device)
    w_lp = torch.randn(2, 4, generator=g).to(test_device)
    w_ent = torch.randn(2, 4, generator=g).to(test_device)
    a = base.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(a, ids, temperature=0.7)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    b = base.clone().requires_grad_(True)
    ref_lp, ref_ent = _naive(b, ids, 0.7)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    assert a.grad.device == a.device
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.device
def test_padded_vocab_rows_get_zero_probability(test_device):
    logits = torch.zeros(1, 2, 8, device=test_device)
    logits[..., 6:] = 50.0  # padding rows with huge logits must not steal mass
    ids = torch.tensor([[0, 5]], device=test_device)
    lp, ent = vocab_parallel_logprobs(logits, ids, vocab_size=6)
    log6 = torch.log(torch.tensor(6.0)).item()
    torch.testing.assert_close(lp, torch.full((1, 2), -log6, device=test_device))
    torch.testing.assert_close(ent, torch.full((1, 2), log6, device=test_device))


@pytest.mark.device
def test_bf16_logits_give_fp32_logprobs_close_to_fp32(test_device):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 6, 128, generator=g) * 2).to(test_device)
    ids = torch.randint(0, 128, (2, 6), generator=g).to(test_device)
    lp16, ent16 = vocab_parallel_logprobs(logits.bfloat16(), ids)
    lp32, ent32 = vocab_parallel_logprobs(logits, ids)
    assert lp16.dtype == torch.float32 and ent16.dtype == torch.float32
    # bf16 has 8 mantissa bits: logits of magnitude ~6 are rounded by up to ~0.016
    assert (lp16 - lp32).abs().max() < 0.05
    assert (ent16 - ent32).abs().max() < 0.05


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long), temperature=0)


def test_tp3_on_2_ranks_names_key_and_valid_values():
    with pytest.raises(ValueError, match=r"parallel\.tensor_model_parallel_size=3.*valid values: \[1, 2\]"):
        validate_parallel_layout(ParallelConfig(tensor_model_parallel_size=3), world_size=2)


def test_num_layers_not_divisible_by_pp_names_both_keys():
    with pytest.raises(ValueError, match=r"model\.num_layers=3.*pipeline_model_parallel_size=2"):
        validate_parallel_layout(ParallelConfig(pipeline_model_parallel_size=2), world_size=2,
                                 num_layers=3)


def test_tp_must_divide_kv_heads():
    with pytest.raises(ValueError, match=r"num_query_groups=3.*valid TP sizes: \[1, 3\]"):
        validate_parallel_layout(ParallelConfig(tensor_model_parallel_size=2), world_size=6,
                                 num_attention_heads=6, num_query_groups=3)


def test_valid_layout_returns_dp_size():
    assert validate_parallel_layout(ParallelConfig(tensor_model_parallel_size=2), 8, 4, 4, 2) == 4


def test_unknown_model_preset_lists_valid_presets():
    with pytest.raises(ValueError, match=r"model='nope'.*valid presets: \['gpt2', 'llama', 'llama3_1_8b', 'llama3_2_1b', 'llama3_2_3b', 'llama3_70b', 'llama3_8b', 'qwen2', 'qwen2_5_7b', 'qwen3_0_6b', 'qwen3_14b', 'qwen3_1_7b', 'qwen3_30b_a3b', 'qwen3_32b', 'qwen3_4b', 'qwen3_8b', 'smollm2_135m', 'tiny'\]"):
        load_model_preset("nope")


def test_bad_model_field_names_key():
    with pytest.raises(ValueError, match=r"model\.activation='relu'.*swiglu"):
        load_model_preset("tiny", activation="relu")


def test_unknown_precision_names_key():
    with pytest.raises(ValueError, match=r"trainer\.precision='fp8'"):
        precision_dtype("fp8")


def test_presets_load_and_pad_vocab_independently_of_tp():
    for name in ("tiny", "llama", "gpt2", "qwen2"):
        cfg = load_model_preset(name, vocab_size=50257)
        assert cfg.padded_vocab_size % 128 == 0 and cfg.padded_vocab_size >= 50257


def test_launch_env_torchrun_slurm_and_single():
    env = read_launch_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                           "MASTER_ADDR": "h", "MASTER_PORT": "123"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port,
            env.launcher) == (1, 4, 1, "h", 123, "torchrun")
    env = read_launch_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                           "SLURM_JOB_NODELIST": "gpu[007-009,012],cpu1", "SLURM_JOB_ID": "12345"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port,
            env.launcher) == (3, 8, 1, "gpu007", 22345, "slurm")
    assert read_launch_env({}).launcher == "single"
    with pytest.raises(ValueError, match="rank 4 outside world size 4"):
        read_launch_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_expand_first_host():
    assert expand_first_host("node7") == "node7"
    assert expand_first_host("a[01-03]") == "a01"
    assert expand_first_host("x1,x2") == "x1"


def test_cpu_compat_refuses_to_activate_when_cuda_is_available(monkeypatch):
    from nemo_rlhf.distributed import cpu_compat

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="must not be activated when CUDA is available"):
        cpu_compat.activate()
