"""``nemo-rlhf-ckpt``: list, inspect, validate, resume-info, prune, reshard, export-hf on a
tiny trained experiment, and one clear stderr line for every bad input.

The experiment (3 checkpoints of a tiny Llama-style actor-critic with real AdamW state,
``metrics.jsonl`` with a repeated step) is built once in this process; happy paths call
``main()`` in-process, the bad-input table runs ``python -m nemo_rlhf.tools.ckpt`` in
subprocesses (forked from one that has imported it, two at a time; asserted per case).
"""

from __future__ import annotations

import json
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_rlhf.tools.ckpt.cli import main

REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- fixtures
def _make_tokenizer(directory: Path) -> None:
    """Character-level tokenizer with the project's ``special_tokens.json`` (no HF config)."""
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    specials = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}
    vocab = {tok: i for i, tok in enumerate(specials.values())}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = HFTokenizer(models.WordLevel(vocab))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.add_special_tokens(list(specials.values()))
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "special_tokens.json").write_text(json.dumps(specials))


@pytest.fixture(scope="module")
def exp(tmp_path_factory):
    """``<exp>/checkpoints/step_{1,2,3}`` with optimizer state; ``metrics.jsonl``."""
    from dataclasses import asdict

    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.data.tokenizer import Tokenizer
    from nemo_rlhf.distributed import (LaunchEnv, ParallelConfig, destroy_distributed,
                                       initialize_distributed)
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.tools.hf_convert import model_full_tensors
    from nemo_rlhf.models.engine import finalize_grads, forward_backward, unwrap, wrap_ddp
    from nemo_rlhf.trainers.mixed_precision import MixedPrecisionOptimizer, OptimizerConfig

    root = tmp_path_factory.mktemp("exp")
    _make_tokenizer(root / "tokenizer")
    tok = Tokenizer(root / "tokenizer")
    model_cfg = load_model_preset("tiny", vocab_size=tok.vocab_size, value_head_init_std=0.1)
    optim = OptimizerConfig(lr=1e-2, warmup_steps=1)
    config = {"model": asdict(model_cfg), "optim": asdict(optim), "parallel": asdict(ParallelConfig()),
              "trainer": {"precision": "32", "seed": 3},
              "data": {"tokenizer_dir": str(root / "tokenizer")}}
    dims = initialize_distributed(ParallelConfig(), seed=3,
                                  launch_env=LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"))
    try:
        model = wrap_ddp(build_model(model_cfg, dims, seed=3))
        opt = MixedPrecisionOptimizer(model, optim)
        ids = torch.randint(3, tok.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        def loss_fn(output, mb):
            logits, values = output
            loss = logits.float().pow(2).mean() * 1e-2 + (values - 1).pow(2).mean()
            return loss, {"loss": loss.detach()}

        lines = []
        for step in (1, 2, 3):
            opt.zero_grad()
            forward_backward(model, [batch], loss_fn)
            finalize_grads(model)
            opt.step()
            state = {"step": step, "metrics": {"train/loss": 1.0 / step}}
            save_checkpoint(root / "checkpoints", step, model, opt, state, config, dims,
                            {"model": model_cfg.fingerprint()})
            lines.append({"step": step, "reward_mean": 0.1 * step, "kl_mean": 0.01})
        lines.insert(1, {"step": 2, "reward_mean": -5.0})  # crashed run; the resumed one repeats step 2
        (root / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        torch.save(model_full_tensors(unwrap(model)), root / "model_tensors.pt")  # step 3, in memory
    finally:
        destroy_distributed()
    return root


@pytest.fixture
def copy(exp, tmp_path):
    """A private copy of the experiment (for tests that damage or delete)."""
    dst = tmp_path / "exp"
    shutil.copytree(exp, dst)
    return dst


def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _json(capsys, *argv):
    rc, out, err = _run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


# --------------------------------------------------------------------------- list / inspect
def test_list_shows_steps_latest_layout_and_last_metrics_of_each_step(exp, capsys):
    doc = _json(capsys, "list", exp)
    rows = {r["step"]: r for r in doc["checkpoints"]}
    assert sorted(rows) == [1, 2, 3] and doc["latest"] == "step_3"
    assert rows[3]["latest"] and not rows[2]["latest"]
    assert all(r["status"] == "complete" and r["size_bytes"] > 0 for r in rows.values())
    assert rows[1]["parallel"] == {"tp": 1, "pp": 1, "dp": 1, "world_size": 1}
    assert rows[2]["metrics"]["reward_mean"] == pytest.approx(0.2)  # the later line of step 2
    assert rows[3]["metrics"]["train/loss"] == pytest.approx(1 / 3)
    rc, out, _ = _run(capsys, "list", exp / "checkpoints")
    assert rc == 0 and "complete *" in out and "reward_mean=0.3" in out


def test_list_through_python_m_prints_json(exp):
    proc = subprocess.run([sys.executable, "-m", "nemo_rlhf.tools.ckpt", "list", "--json",
                           str(exp)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in json.loads(proc.stdout)["checkpoints"]] == [1, 2, 3]


def test_inspect_lists_tensor_shapes_dtypes_config_and_fingerprint(exp, capsys):
    doc = _json(capsys, "inspect", exp)  # an experiment folder resolves to its newest step
    assert doc["step"] == 3 and doc["has_optimizer"] and doc["hf_arch"] == "llama"
    shapes = {t["key"]: (t["shape"], t["dtype"]) for t in doc["tensors"]}
    assert shapes["model.decoder.layers.self_attention.linear_qkv.weight"] == ([2, 128, 64], "float32")
    assert shapes["model.embedding.word_embeddings.weight"] == ([128, 64], "float32")
    assert "optimizer.state.exp_avg.model.value_head.weight" in shapes
    assert doc["fingerprint"]["model"]["num_layers"] == 2
    rc, out, _ = _run(capsys, "inspect", exp / "checkpoints" / "step_1")
    assert rc == 0 and "step 1" in out and "linear_fc1.weight" in out


# --------------------------------------------------------------------------- validate
def test_validate_accepts_an_intact_checkpoint(exp, capsys):
    rc, out, err = _run(capsys, "validate", exp / "checkpoints" / "step_2")
    assert rc == 0 and out.startswith("OK") and not err


def _shard(ckpt: Path) -> Path:
    return sorted((ckpt / "dist").glob("*.distcp"))[0]


@pytest.mark.parametrize("damage", ["truncated", "missing", "changed_byte"])
def test_validate_catches_damaged_shards(copy, capsys, damage):
    ckpt = copy / "checkpoints" / "step_2"
    shard = _shard(ckpt)
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "missing":
        shard.unlink()
    else:
        i = len(data) // 2
        shard.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:])
    rc, out, err = _run(capsys, "validate", ckpt, "--json")
    doc = json.loads(out)
    assert rc == 1 and not doc["ok"]
    expected = {"truncated": "truncated", "missing": "missing shard",
                "changed_byte": "checksum mismatch"}
    assert any(shard.name in p and expected[damage] in p for p in doc["problems"]), doc["problems"]
    assert len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- resume-info
def test_resume_info_agrees_with_the_trainer_selection(copy, capsys):
    from nemo_rlhf.checkpoint.policy import select_resume_checkpoint

    root = copy / "checkpoints"
    shutil.copytree(root / "step_3", root / "step_4")  # newer but incomplete
    (root / "step_4" / "COMPLETE").unlink()
    shutil.copytree(root / "step_3", root / ".tmp_step_5")
    doc = _json(capsys, "resume-info", copy)
    path, why = select_resume_checkpoint("auto", root)
    assert Path(doc["path"]) == path == root / "step_3" and doc["reason"] == why
    assert doc["step"] == 3 and "step_4" in why
    shard = _shard(root / "step_3")  # corrupt the newest complete one: falls back
    shard.write_bytes(shard.read_bytes()[:-7])
    doc = _json(capsys, "resume-info", copy)
    path, why = select_resume_checkpoint("auto", root)
    assert Path(doc["path"]) == path == root / "step_2" and "corrupt" in doc["reason"]
    assert doc["sft_rm_would_load"] == str(root / "step_3")
    rc, out, _ = _run(capsys, "resume-info", copy, "--resume", "none")
    assert rc == 0 and out.startswith("would start fresh")


# --------------------------------------------------------------------------- prune
def test_prune_keeps_the_newest_and_only_stale_temps_go(copy, capsys):
    root = copy / "checkpoints"
    (root / ".tmp_step_1").mkdir()  # stale: older than step_3
    (root / ".tmp_step_9").mkdir()  # maybe a save in progress
    before = sorted(p.name for p in root.iterdir())
    doc = _json(capsys, "prune", copy, "--keep", "1", "--dry-run")
    assert sorted(Path(p).name for p in doc["would_delete"]) == [".tmp_step_1", "step_1", "step_2"]
    assert sorted(p.name for p in root.iterdir()) == before
    doc = _json(capsys, "prune", copy, "--keep", "1")
    assert sorted(p.name for p in root.iterdir()) == [".tmp_step_9", "latest", "step_3"]
    doc = _json(capsys, "prune", copy, "--keep", "1")  # the only one is never deleted
    assert doc["deleted"] == [] and (root / "step_3" / "COMPLETE").is_file()


def test_prune_keeps_the_checkpoint_latest_names(copy, capsys):
    root = copy / "checkpoints"
    (root / "latest").write_text("step_1\n")
    doc = _json(capsys, "prune", copy, "--keep", "1")
    assert [Path(p).name for p in doc["deleted"]] == ["step_2"]
    assert (root / "step_1").is_dir() and (root / "step_3").is_dir()


# --------------------------------------------------------------------------- reshard / export
def test_reshard_with_optimizer_state_verifies_every_tensor(exp, tmp_path, capsys):
    from nemo_rlhf.checkpoint.io import load_full_tensors

    out = tmp_path / "tp2"
    doc = _json(capsys, "reshard", exp, "--tp", "2", "--out", out)
    src = {k for k, v in load_full_tensors(exp / "checkpoints" / "step_3").items()
           if torch.is_tensor(v)}
    assert doc["optimizer"] and doc["tensors_verified"] == len(src)
    assert any(k.startswith("optimizer.state.exp_avg.") for k in src)
    dst = out / "step_3"
    meta = json.loads((dst / "metadata.json").read_text())
    assert meta["parallel"]["tp"] == 2 and meta["has_optimizer"] and meta["optimizer_step"] == 3
    assert json.loads((dst / "trainer_state.json").read_text())["step"] == 3
    from omegaconf import OmegaConf

    assert OmegaConf.load(dst / "config.yaml").parallel.tensor_model_parallel_size == 2


def test_export_hf_of_a_trained_actor_drops_the_value_head(exp, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    assert _run(capsys, "export-hf", exp, "--out", out)[0] == 0
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].shape == (103, 64)  # un-padded from 128 rows
    assert "lm_head.weight" in tensors and not [k for k in tensors if "head" in k and "lm_head" not in k]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 2
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 0)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<eos>" and (out / "tokenizer.json").is_file()


def test_in_memory_model_maps_like_its_checkpoint(exp, tmp_path, capsys):
    """``model_full_tensors`` (a live model) and the checkpoint export give the same HF tensors."""
    from safetensors.torch import load_file

    from nemo_rlhf.models.config import load_model_preset
    from nemo_rlhf.tools.hf_convert import megatron_to_hf

    assert _run(capsys, "export-hf", exp, "--out", tmp_path / "hf", "--no-tokenizer")[0] == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    cfg = load_model_preset("tiny", vocab_size=103)
    live = megatron_to_hf(torch.load(exp / "model_tensors.pt"), cfg, "llama")
    assert sorted(live) == sorted(exported)
    assert all(torch.equal(live[k], exported[k]) for k in live)


# --------------------------------------------------------------------------- bad input
BAD_CASES = (
    "list-missing", "list-no-checkpoints", "inspect-missing", "inspect-not-a-checkpoint",
    "validate-missing", "validate-not-a-checkpoint", "resume-info-missing", "resume-info-file",
    "resume-info-bad-path", "reshard-missing", "reshard-tp-vs-heads", "reshard-nonempty-out",
    "reshard-no-out", "reshard-damaged-source", "prune-missing", "prune-keep-0", "export-missing", "export-rm-on-actor",
    "export-wrong-arch", "export-nonempty-out", "import-missing", "import-not-hf",
    "import-unsupported", "import-no-weights")


def _bad_cases(exp: Path, scratch: Path) -> dict:
    ckpt = exp / "checkpoints" / "step_3"
    missing = scratch / "does_not_exist"
    empty = scratch / "empty"
    empty.mkdir()
    afile = scratch / "file.txt"
    afile.write_text("x")
    full = scratch / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep me")
    moe = scratch / "deepseek_v3"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    noweights = scratch / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "intermediate_size": 96, "vocab_size": 100}))
    new = scratch / "new_out"
    damaged = scratch / "damaged" / "step_3"
    shutil.copytree(ckpt, damaged)
    _shard(damaged).write_bytes(b"short")
    return {
        "list-missing": (["list", missing], "no such file"),
        "list-no-checkpoints": (["list", empty], "no checkpoints"),
        "inspect-missing": (["inspect", missing], "no such file"),
        "inspect-not-a-checkpoint": (["inspect", empty], "not a complete checkpoint"),
        "validate-missing": (["validate", missing], "no such file"),
        "validate-not-a-checkpoint": (["validate", afile], "not a complete checkpoint"),
        "resume-info-missing": (["resume-info", missing], "no such file"),
        "resume-info-file": (["resume-info", afile], "not a folder"),
        "resume-info-bad-path": (["resume-info", exp, "--resume", empty], "not a complete checkpoint"),
        "reshard-missing": (["reshard", missing, "--tp", "2", "--out", new], "no such file"),
        "reshard-tp-vs-heads": (["reshard", ckpt, "--tp", "3", "--out", new], "--tp 3 must divide"),
        "reshard-nonempty-out": (["reshard", ckpt, "--tp", "2", "--out", full], "not an empty folder"),
        "reshard-no-out": (["reshard", ckpt, "--tp", "2"], "--out"),
        "reshard-damaged-source": (["reshard", damaged, "--out", new], "is damaged"),
        "prune-missing": (["prune", missing, "--keep", "2"], "no such file"),
        "prune-keep-0": (["prune", exp, "--keep", "0"], "--keep 0"),
        "export-missing": (["export-hf", missing, "--out", new], "no such file"),
        "export-rm-on-actor": (["export-hf", ckpt, "--rm", "--out", new], "no reward_head"),
        "export-wrong-arch": (["export-hf", ckpt, "--arch", "gpt2", "--out", new],
                              "cannot export as gpt2"),
        "export-nonempty-out": (["export-hf", ckpt, "--out", full], "not an empty folder"),
        "import-missing": (["import-hf", missing, "--out", new], "no such file"),
        "import-not-hf": (["import-hf", empty, "--out", new], "no config.json"),
        "import-unsupported": (["import-hf", moe, "--out", new],
                               "'deepseek_v3' is not supported; supported: ['gpt2', 'llama', 'mistral', "
                               "'mixtral', 'qwen2', 'qwen3', 'qwen3_moe']"),
        "import-no-weights": (["import-hf", noweights, "--out", new], "no weights"),
    }


@pytest.fixture(scope="module")
def bad_results(exp, tmp_path_factory):
    """Every bad-input command line, each run as ``python -m nemo_rlhf.tools.ckpt`` in its
    own process, forked from one that has imported the entry point (:mod:`tests.forked_cli`:
    what that import printed is part of each case's output), two at a time."""
    from tests.forked_cli import run_forked

    cases = _bad_cases(exp, tmp_path_factory.mktemp("bad"))
    assert tuple(cases) == BAD_CASES
    procs = run_forked("nemo_rlhf.tools.ckpt", {name: argv for name, (argv, _) in cases.items()},
                       tmp_path_factory.mktemp("bad_out"), parallel=2)
    return {name: (procs[name], cases[name][1]) for name in cases}


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_gives_one_clear_line_and_nonzero_exit(bad_results, case):
    proc, expected = bad_results[case]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode != 0
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0] and "Traceback" not in proc.stderr, lines[0]
    assert "error" in lines[0]


def test_outputs_are_never_written_over(bad_results):
    assert (Path(bad_results["reshard-nonempty-out"][0].args[-1]) / "mine.txt").read_text() == "keep me"
    assert not Path(bad_results["export-rm-on-actor"][0].args[-1]).exists()
