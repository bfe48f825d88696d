"""What a buffered rollout item becomes in a checkpoint (JSON) and back, bit for bit."""

from __future__ import annotations

import torch

from nemo_rlhf.rollout.generate import RolloutBatch
from nemo_rlhf.rollout.transport import (RolloutItem, RolloutResult, batch_from_json, batch_to_host, batch_to_json,
                                         result_from_json, result_to_json)

ENCODED = [[i, i + 1, 2] for i in range(8)]


def _batch(prompts, fill: float) -> RolloutBatch:
    ids = torch.tensor(prompts, dtype=torch.int64)
    n = len(prompts)
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_length=ids.shape[1],
                        response_ids=ids[:, :1], response_mask=torch.ones(n, 1, dtype=torch.bool),
                        response_lengths=torch.ones(n, dtype=torch.int64), ended=torch.ones(n, dtype=torch.bool),
                        truncated=torch.zeros(n, dtype=torch.bool), logprobs=torch.full((n, 1), fill))


def test_a_buffered_item_survives_its_json_form_bit_for_bit():
    batch = _batch([[3, 4, 5], [6, 7, 8]], 0.0)
    batch.logprobs = torch.tensor([[-0.1234567], [-2.5e-8]], dtype=torch.float32)
    host = batch_to_host(batch)
    host["half"] = torch.tensor([1.5, -0.333], dtype=torch.bfloat16)
    back = batch_from_json(batch_to_json(host))
    assert back.keys() == host.keys()
    for k, v in host.items():
        if torch.is_tensor(v):
            assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k
        else:
            assert back[k] == v, k
    item = RolloutItem(step=3, dp_rank=1, prompt_indices=[2, 2, 5], prompts=[ENCODED[i] for i in (2, 2, 5)],
                       version=1)
    res = RolloutResult(item=item, version=1, batch=host, worker=0, generate_s=0.25)
    again = result_from_json(result_to_json(res), ENCODED)
    assert again.item == item and again.version == 1 and again.generate_s == 0.25 and again.worker == -1
    assert all(torch.equal(again.batch[k], v) for k, v in host.items() if torch.is_tensor(v))
