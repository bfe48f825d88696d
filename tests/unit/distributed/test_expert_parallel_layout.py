"""``parallel.expert_model_parallel_size``: the layouts refused before any process group
exists (naming the keys and the values that would work), and where it reaches megatron."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_rlhf.distributed.parallel import ParallelConfig, validate_parallel_layout


def _ep(ep: int, **kw) -> ParallelConfig:
    return ParallelConfig(expert_model_parallel_size=ep, **kw)


@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_ep_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match=rf"parallel\.expert_model_parallel_size={value}: must be an integer >= 1"):
        _ep(value)


def test_ep_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match=r"parallel\.expert_model_parallel_size=2 on a dense model "
                                         r"\(model\.num_moe_experts is null\).*set parallel\.expert_model_parallel_size=1"):
        validate_parallel_layout(_ep(2), world_size=2)


def test_ep_must_divide_the_data_parallel_size_naming_the_values_that_work():
    # 8 ranks at PP=2: DP=4; EP=8 does not divide it; of 1, 2, 4 all divide the 8 experts
    with pytest.raises(ValueError, match=r"parallel\.expert_model_parallel_size=8 must divide the data-parallel "
                                         r"size 4 \(world size 8 / \(tensor_model_parallel_size=1 x "
                                         r"pipeline_model_parallel_size=2\)\).*valid values.*: \[1, 2, 4\]"):
        validate_parallel_layout(_ep(8, pipeline_model_parallel_size=2), world_size=8, num_moe_experts=8)
    # TP takes ranks too: 4 ranks at TP=2 leave DP=2
    with pytest.raises(ValueError, match=r"must divide the data-parallel size 2.*: \[1, 2\]"):
        validate_parallel_layout(_ep(4, tensor_model_parallel_size=2), world_size=4, num_moe_experts=4)


def test_ep_must_divide_the_experts():
    with pytest.raises(ValueError, match=r"model\.num_moe_experts=6 is not divisible by "
                                         r"parallel\.expert_model_parallel_size=4.*valid values.*: \[1, 2\]"):
        validate_parallel_layout(_ep(4), world_size=8, num_moe_experts=6)


def test_valid_expert_layouts_return_the_data_parallel_size():
    assert validate_parallel_layout(_ep(2), 2, num_moe_experts=4) == 2
    assert validate_parallel_layout(_ep(2, pipeline_model_parallel_size=2), 4, num_layers=2,
                                    num_moe_experts=4) == 2
    assert validate_parallel_layout(_ep(4), 8, num_moe_experts=128) == 8
    assert validate_parallel_layout(_ep(1), 2) == 2  # EP=1 needs no model facts


@pytest.mark.parametrize("job", ["evaluate", "RM server"])
def test_evaluate_and_the_rm_server_refuse_expert_parallelism(job):
    from nemo_rlhf.models.moe import refuse_expert_parallel

    with pytest.raises(ValueError, match=rf"parallel\.expert_model_parallel_size=2 in the {job} job.*"
                                         r"set parallel\.expert_model_parallel_size=1"):
        refuse_expert_parallel(_ep(2), job)
    refuse_expert_parallel(_ep(1), job)


def test_the_distributed_optimizer_with_expert_parallelism_is_refused_naming_both_keys():
    from nemo_rlhf.trainers.mixed_precision import OptimizerConfig
    from nemo_rlhf.trainers.optimizers import validate_optimizer

    dims = SimpleNamespace(device=torch.device("cuda"), ep=2)  # (the device is only read)
    with pytest.raises(ValueError, match=r"optim\.use_distributed_optimizer=true with "
                                         r"parallel\.expert_model_parallel_size=2"):
        validate_optimizer(OptimizerConfig(use_distributed_optimizer=True), dims)
    validate_optimizer(OptimizerConfig(), dims)


def test_the_expert_parallel_size_reaches_megatron_s_config():
    from nemo_rlhf.models.config import ModelConfig, build_transformer_config

    cfg = ModelConfig(vocab_size=100, num_moe_experts=4, moe_ffn_hidden_size=32)
    assert build_transformer_config(cfg, 1, 1, ep=2).expert_model_parallel_size == 2
    assert build_transformer_config(cfg, 1, 1).expert_model_parallel_size == 1


def test_a_ppo_job_at_ep2_on_a_dense_model_is_refused_before_any_process_group(tmp_path):
    """The PPO entry passes model.num_moe_experts to the layout check (null here: dense)."""
    import torch.distributed as dist

    from nemo_rlhf.train_ppo import build
    from tests.ppo_helpers import compose_ppo, make_demo_data

    cfg = compose_ppo(make_demo_data(tmp_path / "data"), tmp_path / "exp", "parallel.expert_model_parallel_size=2")
    with pytest.raises(ValueError, match=r"parallel\.expert_model_parallel_size=2 on a dense model"):
        build(cfg)
    assert not dist.is_initialized()


def test_checkpoint_listings_name_the_expert_parallel_size_when_it_is_not_1():
    from nemo_rlhf.tools.ckpt._common import layout_text

    assert layout_text({"parallel": {"tp": 1, "pp": 1, "dp": 2, "ep": 2, "world_size": 2}}) == "tp1 pp1 dp2 ep2"
    assert layout_text({"parallel": {"tp": 2, "pp": 1, "dp": 1, "ep": 1}}) == "tp2 pp1 dp1"
    assert layout_text({"parallel": {"tp": 2, "pp": 1, "dp": 1}}) == "tp2 pp1 dp1"  # saved before EP
