"""A checkpoint is relocatable: it holds a copy of its tokenizer, so moved to another folder
(filesystem, cluster) with the original tokenizer folder gone, it still verifies, evaluates
and starts a PPO run, which takes the tokenizer from the checkpoint's own copy.

Before the copy, the checkpoint's ``config.yaml`` named the tokenizer by the path the run
was given (absolute, or relative to that run's working directory), and every reader used it
as it was: a moved checkpoint loaded whatever tokenizer was at that path, or none."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("forked_python")  # the python -m runs: forks of a preloaded server


def _run(args: list[str]) -> str:
    res = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def test_a_moved_checkpoint_verifies_evaluates_and_starts_ppo_without_its_original_tokenizer(tmp_path):
    from nemo_rlhf.checkpoint import read_metadata, verify_checkpoint
    from nemo_rlhf.tasks.reversal import ReversalTaskConfig, make_reversal_dataset

    data = tmp_path / "data"
    make_reversal_dataset(data, ReversalTaskConfig(n_sft=64, n_pref=8, n_ppo=16, n_eval=8, n_val=8))
    _run(["nemo_rlhf.train_sft", "--config-name", "sft_tiny", f"exp_manager.exp_dir={tmp_path / 'exp' / 'sft'}",
          f"data.train_file={data / 'sft.jsonl'}", f"data.val_file={data / 'sft_val.jsonl'}",
          f"data.tokenizer_dir={data / 'tokenizer'}", "trainer.max_steps=2", "trainer.val_check_interval=2"])
    ckpt = tmp_path / "exp" / "sft" / "checkpoints" / "step_2"
    tokenizer = (data / "tokenizer" / "tokenizer.json").read_bytes()
    assert (ckpt / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer
    assert "tokenizer/tokenizer.json" in read_metadata(ckpt)["files"]  # checksummed with the shards

    shutil.move(str(tmp_path / "exp"), str(tmp_path / "elsewhere"))
    shutil.rmtree(data / "tokenizer")
    moved = tmp_path / "elsewhere" / "sft" / "checkpoints" / "step_2"
    assert verify_checkpoint(moved) == []

    out = tmp_path / "eval.json"
    _run(["nemo_rlhf.evaluate", f"checkpoint={moved}", f"data={data / 'eval.jsonl'}", f"out={out}"])
    assert json.loads(out.read_text())["num_responses"] == 8

    ppo = tmp_path / "ppo"
    log = _run(["nemo_rlhf.train_ppo", "--config-name", "ppo_tiny", f"exp_manager.init_from={moved}",
                f"exp_manager.exp_dir={ppo}", f"data.train_file={data / 'ppo_prompts.jsonl'}",
                f"data.val_file={data / 'eval.jsonl'}", "trainer.max_steps=1", "trainer.val_check_interval=0",
                "exp_manager.save_interval=1", "ppo.num_rollout_samples=8", "ppo.global_batch_size=8",
                "ppo.micro_batch_size=8", "ppo.forward_micro_batch_size=8", "reward.normalization=none",
                "reward.functions=[{name: arithmetic_exact_match}]"])
    assert f"data.tokenizer_dir={moved / 'tokenizer'}" in log
    ppo_ckpt = ppo / "checkpoints" / "step_1"
    cfg = yaml.safe_load((ppo_ckpt / "config.yaml").read_text())
    assert cfg["data"]["tokenizer_dir"] == str(moved / "tokenizer")
    assert (ppo_ckpt / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer
