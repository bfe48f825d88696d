"""Verify-after-save on two gloo ranks: at DP=2 (rank 1 writes no shard of its own and reads
nothing back) and at TP=2 (each rank its own shards); a tensor changed under the save on
rank 1 alone stops the save on both ranks with the same message, nothing published; no
space left on one rank (its own files, or rank 0's metadata) stops the save on both, the
other rank naming the failing one, instead of leaving it waiting in a barrier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks


def _worker(rank: int, tmp: str) -> dict:
    from nemo_rlhf.checkpoint import CheckpointError, find_latest_checkpoint, save_checkpoint
    from nemo_rlhf.checkpoint.digests import read_digests
    from nemo_rlhf.checkpoint.faults import FAULT_ENV
    from nemo_rlhf.distributed import ParallelConfig, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.engine import finalize_grads, forward_backward, wrap_ddp
    from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig

    cfg = load_model_preset("tiny", vocab_size=64, value_head_init_std=0.1)
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    out = {}
    for layout, pc in {"dp2": ParallelConfig(), "tp2": ParallelConfig(tensor_model_parallel_size=2)}.items():
        dims = initialize_distributed(pc, seed=3)
        model = wrap_ddp(build_model(cfg, dims, seed=3))
        opt = MixedPrecisionOptimizer(model, OptimizerConfig(lr=1e-2), mp_group=dims.mp_group)

        def loss_fn(output, mb):
            logits, values = output
            loss = logits.float().pow(2).mean() * 1e-2 + values.float().pow(2).mean()
            return loss, {"loss": loss.detach()}

        forward_backward(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], loss_fn)
        finalize_grads(model)
        opt.step()
        root = Path(tmp) / layout
        first = save_checkpoint(root, 1, model, opt, {}, None, dims)
        res = {"published": find_latest_checkpoint(root) == first,
               "ranks_with_digests": sorted(p.name for p in (first / "digests").glob("rank_*.json")),
               "own_digests": sum(1 for f in [first / "digests" / f"rank_{rank}.json"] if f.is_file()),
               "n_entries": len(read_digests(first))}
        res["path"] = str(first)
        if rank == 1:
            os.environ[FAULT_ENV] = "change_after_digest:2"
        try:
            save_checkpoint(root, 2, model, opt, {}, None, dims)
            res["error"] = None
        except CheckpointError as exc:
            res["error"] = str(exc)
        os.environ.pop(FAULT_ENV, None)
        torch.distributed.barrier()
        res["latest_after"] = (root / "latest").read_text().strip()
        res["left"] = sorted(p.name for p in root.iterdir())
        # a full disk on one rank: at its own files (rank 1), at the metadata (rank 0)
        for step, (fault, on_rank) in enumerate((("enospc", 1), ("enospc_publish", 0)), start=3):
            if rank == on_rank:
                os.environ[FAULT_ENV] = f"{fault}:{step}"
            try:
                save_checkpoint(root, step, model, opt, {}, None, dims)
                res[fault] = None
            except CheckpointError as exc:
                res[fault] = str(exc)
            os.environ.pop(FAULT_ENV, None)
        res["left_after_enospc"] = sorted(p.name for p in root.iterdir())
        out[layout] = res
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, world_size=2, tmp=str(tmp_path_factory.mktemp("digests")))


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_verified_save_and_a_fault_on_one_rank_stops_both(results, layout):
    r0, r1 = results[0][layout], results[1][layout]
    assert r0["published"] and r1["published"]
    # offline, in this (non-distributed) process, as nemo-rlhf-ckpt validate --deep does
    from nemo_rlhf.checkpoint.digests import deep_problems
    from nemo_rlhf.checkpoint.io import load_full_tensors

    assert deep_problems(Path(r0["path"]), load_full_tensors(Path(r0["path"]))) == []
    assert r0["n_entries"] > 0
    if layout == "dp2":  # the DP replica on rank 1 writes nothing: its digest file is empty
        assert r0["n_entries"] == r1["n_entries"]
    # the fault was planted on rank 1; at DP=2 rank 1 saves no shard, so nothing differs there
    if layout == "tp2":
        assert r0["error"] is not None and r0["error"] == r1["error"]
        assert "rank 1: model." in r0["error"] and "rank 0:" not in r0["error"]
        assert r0["latest_after"] == "step_1" and r0["left"] == ["latest", "step_1"]
    else:
        assert r0["error"] is None and r1["error"] is None and r0["latest_after"] == "step_2"


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_no_space_on_one_rank_stops_the_save_on_both(results, layout):
    r0, r1 = results[0][layout], results[1][layout]
    assert "rank 1: OSError" in r1["enospc"] and "No space left on device" in r1["enospc"]
    assert "rank 1 failed (its log has the error)" in r0["enospc"]
    assert "rank 0 publishing: OSError" in r0["enospc_publish"] and "No space left" in r0["enospc_publish"]
    assert "rank 0 failed" in r1["enospc_publish"]
    latest = r0["latest_after"]
    assert r0["left_after_enospc"] == sorted(["latest", "step_1", *(["step_2"] if latest == "step_2" else [])])
