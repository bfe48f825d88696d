"""Which parameters are heads: the one definition, without megatron (the checkpoint tools
and the rollout engines import it).

A model's heads are its top-level ``value_head`` (the critic's, on the last pipeline stage
of a PPO actor-critic) and ``reward_head`` (an RM's). They are not part of the policy: the
reference keeps no copy of them, the rollout engines never receive them, LoRA leaves them
trainable beside the adapters, and a checkpoint may lack them (initialised instead).
"""

from __future__ import annotations

HEAD_NAMES = ("value_head", "reward_head")
"""Top-level module names of the heads."""


def is_head_param(name: str) -> bool:
    """Whether the parameter or state-dict entry ``name`` of a bare model (``value_head.weight``;
    no ``model.`` / ``critic.`` prefix) belongs to a head."""
    return name.split(".", 1)[0] in HEAD_NAMES


def is_head_key(key: str) -> bool:
    """Whether a checkpoint key ``<part>.<parameter name>`` (``model.value_head.weight``,
    ``critic.value_head.bias``) belongs to a head."""
    return is_head_param(key.split(".", 1)[1]) if "." in key else False


__all__ = ["HEAD_NAMES", "is_head_key", "is_head_param"]
