"""``parallel.context_parallel_size``: the layouts refused before any process group exists
(naming the keys and the values that would work), and the data-parallel size it leaves."""

from __future__ import annotations

import pytest

from nemo_rlhf.distributed.parallel import ParallelConfig, validate_parallel_layout


@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_cp_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match=rf"parallel\.context_parallel_size={value}: must be an integer >= 1"):
        ParallelConfig(context_parallel_size=value)


def test_cp_defaults_to_one():
    assert ParallelConfig().context_parallel_size == 1


def test_cp_takes_ranks_from_data_parallel():
    assert validate_parallel_layout(ParallelConfig(context_parallel_size=2), world_size=8) == 4
    assert validate_parallel_layout(ParallelConfig(context_parallel_size=2, tensor_model_parallel_size=2,
                                                   pipeline_model_parallel_size=2), world_size=8) == 1


def test_cp_must_divide_what_tp_and_pp_leave_naming_the_values_that_work():
    with pytest.raises(ValueError, match=r"parallel\.context_parallel_size=4 with tensor_model_parallel_size=2 "
                                         r"and pipeline_model_parallel_size=1: tp\*pp\*cp=8 does not divide the "
                                         r"world size 4; valid context_parallel_size values for this TP and PP: "
                                         r"\[1, 2\]"):
        validate_parallel_layout(ParallelConfig(context_parallel_size=4, tensor_model_parallel_size=2),
                                 world_size=4)


def test_cp_on_a_moe_model_takes_expert_parallel_ranks_from_dp_and_cp():
    """megatron carves the expert groups from the DP x CP ranks of a TP x PP position: at
    world 2, CP=2 (DP=1) EP=2 is the CP group; EP must divide DP x CP."""
    assert validate_parallel_layout(ParallelConfig(context_parallel_size=2), world_size=2, num_moe_experts=4) == 1
    assert validate_parallel_layout(ParallelConfig(context_parallel_size=2, expert_model_parallel_size=2),
                                    world_size=2, num_moe_experts=4) == 1
    assert validate_parallel_layout(ParallelConfig(context_parallel_size=2, expert_model_parallel_size=4),
                                    world_size=4, num_moe_experts=4) == 2
    with pytest.raises(ValueError, match=r"parallel\.expert_model_parallel_size=4 must divide the data-parallel "
                                         r"size 1 x context_parallel_size=2 .*valid values for this layout and "
                                         r"model\.num_moe_experts=4: \[1, 2\]"):
        validate_parallel_layout(ParallelConfig(context_parallel_size=2, expert_model_parallel_size=4),
                                 world_size=2, num_moe_experts=4)
