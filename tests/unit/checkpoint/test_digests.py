"""A checkpoint holds what the model held: the digests taken from memory at save, the
read-back before publication, and ``nemo-rlhf-ckpt validate --deep``.

One single-process job (gloo) trains a tiny actor-critic in bf16-mixed (so fp32 masters and
Adam moments are saved beside the bf16 weights) and saves into a fresh folder per test; the
faults are planted with ``NEMO_RLHF_FAULT`` (:mod:`nemo_rlhf.checkpoint.faults`).
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from nemo_rlhf.checkpoint import CheckpointError, find_latest_checkpoint, save_checkpoint
from nemo_rlhf.checkpoint.digests import deep_problems, read_digests, tensor_digest
from nemo_rlhf.checkpoint.faults import FAULT_ENV
from nemo_rlhf.checkpoint.io import load_full_tensors
from nemo_rlhf.tools.ckpt.cli import main as ckpt_main


@pytest.fixture(scope="module")
def job():
    """``(save(root, step, **kw), model)``: a tiny bf16-mixed actor-critic after one AdamW step."""
    from nemo_rlhf.distributed import LaunchEnv, ParallelConfig, destroy_distributed, initialize_distributed
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.models.engine import finalize_grads, forward_backward, wrap_ddp
    from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig

    model_cfg = load_model_preset("tiny", vocab_size=64, value_head_init_std=0.1)
    optim = OptimizerConfig(lr=1e-2, warmup_steps=1)
    dims = initialize_distributed(ParallelConfig(), seed=5, launch_env=LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"))
    try:
        model = wrap_ddp(build_model(model_cfg, dims, precision="bf16-mixed", seed=5))
        opt = MixedPrecisionOptimizer(model, optim)
        ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(0))

        def loss_fn(output, mb):
            logits, values = output
            loss = logits.float().pow(2).mean() * 1e-2 + (values.float() - 1).pow(2).mean()
            return loss, {"loss": loss.detach()}

        forward_backward(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], loss_fn)
        finalize_grads(model)
        opt.step()
        config = {"model": asdict(model_cfg), "trainer": {"precision": "bf16-mixed"}}

        def save(root, step, **kw):
            return save_checkpoint(root, step, model, opt, {"step": step}, config, dims, {}, **kw)

        yield save, model
    finally:
        destroy_distributed()


def _validate(capsys, *argv):
    rc = ckpt_main([str(a) for a in argv] + ["--json"])
    out, _ = capsys.readouterr()
    return rc, json.loads(out)


def test_tensor_digest_is_bit_exact():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert tensor_digest(a) == tensor_digest(a.clone()) == tensor_digest(torch.tensor([[1.0, 2.0, 3.0]]))
    assert tensor_digest(a) != tensor_digest(torch.tensor([1.0, 2.0, 3.0000002]))  # one ulp
    assert tensor_digest(a) != tensor_digest(a.double())  # same values, other dtype
    assert tensor_digest(a) != tensor_digest(torch.tensor([1.0, 2.0]))
    assert tensor_digest(torch.tensor([0.0])) != tensor_digest(torch.tensor([-0.0]))
    assert tensor_digest(torch.ones(4, 4).t()) == tensor_digest(torch.ones(4, 4))  # row-major bytes
    assert tensor_digest(torch.zeros(0)) == tensor_digest(torch.zeros(0, 3))


def test_every_saved_tensor_is_digested_and_deep_validate_recomputes_it(job, tmp_path, capsys):
    save, model = job
    path = save(tmp_path, 1)
    entries = read_digests(path)
    keys = {e["key"] for e in entries}
    assert any(k.startswith("model.") and "value_head" in k for k in keys)
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in keys)
    assert any(k.startswith("optimizer.master.") for k in keys)  # bf16 weights: fp32 masters
    full = load_full_tensors(path)
    assert keys == {k for k, v in full.items() if torch.is_tensor(v)}  # every saved tensor, each once
    assert (path / "digests" / "rank_0.json").is_file()
    assert "digests/rank_0.json" in json.loads((path / "metadata.json").read_text())["files"]
    rc, doc = _validate(capsys, "validate", path, "--deep")
    assert rc == 0 and doc["ok"] and doc["digests_compared"] == len(entries), doc


@pytest.mark.parametrize("fault, names", [("change_after_digest", r"rank 0: model\..*in memory at save"),
                                          ("overwrite_shard", r"rank 0: ")])
def test_a_tensor_changed_under_the_save_or_a_shard_overwritten_is_not_published(job, tmp_path, monkeypatch,
                                                                                  fault, names):
    """A tensor changed in memory between its digest and the write, or a shard file
    overwritten after the write: CheckpointError naming the tensor, nothing half-made left."""
    save, _ = job
    first = save(tmp_path, 1)
    monkeypatch.setenv(FAULT_ENV, f"{fault}:2")
    with pytest.raises(CheckpointError, match=r"(?s)step 2 not published.*" + names):
        save(tmp_path, 2)
    assert find_latest_checkpoint(tmp_path) == first
    assert (tmp_path / "latest").read_text().strip() == "step_1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]


def test_deep_validate_finds_what_the_file_checksums_cannot(job, tmp_path, monkeypatch, capsys):
    """verify_after_save off and a tensor changed under the save: the files are intact (their
    checksums were taken from what was written), only the digests show the difference."""
    save, _ = job
    monkeypatch.setenv(FAULT_ENV, "change_after_digest:3")
    path = save(tmp_path, 3, verify=False)
    rc, doc = _validate(capsys, "validate", path)
    assert rc == 0 and doc["ok"], doc
    rc, doc = _validate(capsys, "validate", path, "--deep")
    assert rc == 1 and len(doc["problems"]) == 1, doc
    assert doc["problems"][0].startswith("model.") and "in memory at save" in doc["problems"][0]


def test_deep_problems_name_a_checkpoint_without_digests(job, tmp_path):
    save, _ = job
    path = save(tmp_path, 1)
    full = load_full_tensors(path)
    for f in (path / "digests").iterdir():
        f.unlink()
    (path / "digests").rmdir()
    assert deep_problems(path, full) == ["no digests/ (a checkpoint written before tensor digests): nothing to compare"]


@pytest.mark.parametrize("fault", ["enospc", "enospc_publish", "dist_write"])
def test_no_space_left_during_a_save_keeps_the_previous_checkpoint_and_says_so(job, tmp_path, monkeypatch, fault):
    """A full disk at the shards (megatron's write failing), at this rank's own files, or at
    rank 0's metadata: CheckpointError naming ENOSPC, the partial folder removed, the
    previous checkpoint still the newest; the next save (space freed) works."""
    import errno

    from megatron.core import dist_checkpointing

    save, _ = job
    first = save(tmp_path, 1)
    if fault == "dist_write":
        real = dist_checkpointing.save

        def full_disk(sharded, directory, *a, **kw):
            (tmp_path / ".tmp_step_2" / "dist" / "__0_0.distcp").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(dist_checkpointing, "save", full_disk)
    else:
        monkeypatch.setenv(FAULT_ENV, f"{fault}:2")
    with pytest.raises(CheckpointError, match=r"step 2 not saved: rank 0.*No space left on device.*"
                                              r"was removed; .*latest still names step_1"):
        save(tmp_path, 2)
    assert find_latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]
    monkeypatch.undo()
    assert save(tmp_path, 2) == tmp_path / "step_2" == find_latest_checkpoint(tmp_path)
