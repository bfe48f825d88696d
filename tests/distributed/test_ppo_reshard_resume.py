"""A PPO checkpoint saved at TP=1,PP=2 resumes at TP=2,PP=1 and at DP=2 (2 gloo ranks):
model outputs equal the saved model's, and the optimizer state is carried over."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.ppo_helpers import compose_ppo, make_demo_data


def _outputs(trainer, ids, mask):
    """Log-probs and values of the trainer's model for a fixed batch, on every rank."""
    import torch.distributed as dist

    res = trainer.actor.logprobs(_Batch(ids, mask), with_values=True)
    box = [None]
    if res is not None:
        box = [{"logprobs": res["logprobs"], "values": res["values"]}]
    dist.broadcast_object_list(box, src=dist.get_world_size() - 1)  # a last-stage rank
    return box[0]


class _Batch:
    def __init__(self, ids, mask):
        self.input_ids, self.attention_mask, self.prompt_length = ids, mask, 4


def _worker(rank: int, tmp: str):
    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.checkpoint.io import load_full_tensors
    from nemo_rlhf.train_ppo import build

    tmp = Path(tmp)
    data = make_demo_data(tmp / "data")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 15, (4, 8), generator=g)
    mask = torch.ones_like(ids)
    common = ("ppo.num_rollout_samples=8", "ppo.global_batch_size=8", "ppo.micro_batch_size=2",
              "ppo.forward_micro_batch_size=2", "model.value_head_init_std=0.05")
    cfg = compose_ppo(data, tmp / "src", *common, "parallel.pipeline_model_parallel_size=2")
    src = build(cfg)
    src.train_step()
    src.step = 1
    save_checkpoint(tmp / "src" / "checkpoints", 1, src.model, src.optimizer, src.state_dict(),
                    None, src.dims, src.fingerprint)
    out = {"src": _outputs(src, ids, mask)}
    full_src = load_full_tensors(tmp / "src" / "checkpoints" / "step_1")
    for name, tp in (("tp2", 2), ("dp2", 1)):
        cfg = compose_ppo(data, tmp / "src", *common, "exp_manager.resume=auto",
                          f"parallel.tensor_model_parallel_size={tp}")
        t = build(cfg)
        t.resume()  # exp_manager.exp_dir is the source run's: its checkpoints
        out[name] = _outputs(t, ids, mask)
        out[name + "_step"] = t.step
        save_checkpoint(tmp / name, 1, t.model, t.optimizer, t.state_dict(), None, t.dims)
        full = load_full_tensors(tmp / name / "step_1")
        out[name + "_optimizer_equal"] = all(
            torch.equal(full[k], full_src[k]) for k in full_src
            if k.startswith("optimizer.") and isinstance(full_src[k], torch.Tensor))
        out[name + "_optimizer_keys"] = sum(k.startswith("optimizer.") for k in full)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, world_size=2, tmp=str(tmp_path_factory.mktemp("reshard")))[0]


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_pp2_checkpoint_resumes_at_other_layout_with_same_outputs_and_optimizer_state(results, layout):
    assert results[layout + "_step"] == 1
    for key in ("logprobs", "values"):
        torch.testing.assert_close(results[layout][key], results["src"][key], atol=1e-5, rtol=0)
    assert results[layout + "_optimizer_keys"] > 0
    assert results[layout + "_optimizer_equal"]
