"""Empty responses cannot reach the PPO trainer.

A rollout row always holds its first generated token (an EOS or stop token drawn first
gives the one-token response ``[EOS]``), so a response is empty only when no token is
generated at all: ``rollout.max_new_tokens=0``, which the PPO config refuses up front.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_rlhf.algorithms.ppo import compute_token_rewards
from nemo_rlhf.rollout import RolloutConfig, generate
from tests.ppo_helpers import compose_ppo
from tests.single_rank import random_prompts, single_rank

VOCAB = 50
EOS = VOCAB - 1


def test_ppo_config_refuses_max_new_tokens_zero_naming_the_key(tmp_path):
    with pytest.raises(Exception, match=r"rollout.max_new_tokens=0: .*>= 1"):
        compose_ppo(Path(tmp_path), tmp_path / "exp", "rollout.max_new_tokens=0")
    cfg = compose_ppo(Path(tmp_path), tmp_path / "exp", "rollout.max_new_tokens=1")
    assert cfg.rollout.max_new_tokens == 1


def test_a_stop_token_drawn_first_gives_a_one_token_response_that_carries_its_score():
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset

    with single_rank(seed=0) as dims:
        model = build_model(load_model_preset("tiny", vocab_size=VOCAB), dims, seed=3)
        # every token id is a stop token: whatever is drawn first ends the response
        cfg = RolloutConfig(max_new_tokens=4, stop_token_ids=list(range(VOCAB)), seed=1)
        batch = generate(model, dims, random_prompts((3, 5, 2), VOCAB), cfg, eos_token_id=EOS,
                         pad_token_id=0, vocab_size=VOCAB, max_sequence_length=32, call_index=0)
    assert batch.response_lengths.tolist() == [1, 1, 1]
    assert batch.response_mask.all() and batch.ended.all()
    lp = batch.logprobs
    rewards, _ = compute_token_rewards(lp, lp, torch.tensor([1.0, 2.0, 3.0]),
                                       batch.response_mask, beta=0.1)
    assert rewards[:, 0].tolist() == [1.0, 2.0, 3.0]  # each score sits on the one token
