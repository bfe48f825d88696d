"""The PPO job's config: with LoRA, ``reference.mode`` null resolves to ``adapters_off``
(``offload`` without); the combinations that cannot work (LoRA ones, vLLM rollouts of a
mixture-of-experts model) are refused naming the keys."""

from __future__ import annotations

import pytest

from nemo_rlhf.trainers.ppo.config import REFERENCE_MODES
from tests.conf_helpers import typed_job


def test_the_reference_mode_follows_lora_unless_given():
    assert "adapters_off" in REFERENCE_MODES
    assert typed_job("ppo", []).reference.mode == "offload"
    assert typed_job("ppo", ["model.lora.enabled=true"]).reference.mode == "adapters_off"
    assert typed_job("ppo", ["model.lora.enabled=true", "reference.mode=colocated"]).reference.mode == "colocated"


@pytest.mark.parametrize("overrides, needle", [
    (["reference.mode=adapters_off"], "reference.mode=adapters_off needs model.lora.enabled=true"),
    (["model.lora.enabled=true", "critic.mode=separate", "critic.init_from=/some/rm"],
     "model.lora.enabled=true with critic.mode=separate and critic.init_from=/some/rm"),
    (["rollout.engine=vllm", "model.num_moe_experts=4", "model.moe_router_topk=2"],
     "rollout.engine=vllm with model.num_moe_experts=4"),
    (["model.lora.enabled=true", "model.lora.target_modules=[linear_q]"],
     "model.lora.target_modules='linear_q': valid choices are"),
])
def test_lora_combinations_that_cannot_work_are_refused_naming_the_keys(overrides, needle):
    with pytest.raises(ValueError) as err:
        typed_job("ppo", overrides)
    assert needle in str(err.value)
