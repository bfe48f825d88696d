"""The README's "Your own model" walkthrough, run as written, on a tiny random Llama and a
tiny random Qwen3 (the module fixture is parametrized over both).

The four commands are read from the README's code block. ``/shared`` becomes a temporary
folder holding a tiny random model written by transformers as an HF folder
(:mod:`tests.hf_tiny`: a byte-level BPE tokenizer with the family's Jinja chat template,
Llama 3's or Qwen's ChatML without a BOS token), a JSONL of preference pairs and a JSONL of
prompts. Each Slurm command is first validated and rendered by the launcher (``--dry-run``)
against an 8B-shaped checkpoint of the same family (only its ``config.yaml``: TP=8 must fit
its heads; Llama-3-8B, Qwen3-8B), then run here as the job it launches (``--job rm``: ``nemo_rlhf.train_rm``
with the same overrides; PPO: ``launchers.local`` with the served RM and the same trainer
overrides), scaled to this machine by :data:`SCALE` and :data:`TINY`. The export is loaded
back with transformers.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from tests.fork_server import ForkServer
from tests.hf_tiny import write_data, write_hf_folder

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SHARED = "/shared"

SCALE = {  # the cluster's sizes -> this 2-core machine's
    "parallel.tensor_model_parallel_size=8": "parallel.tensor_model_parallel_size=1",
    "trainer.precision=bf16-mixed": "trainer.precision=32",
}
TINY = {  # keys the walkthrough leaves at the real-model defaults, made small here
    "rm": ["trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
           "trainer.val_check_interval=2", "trainer.log_every_n_steps=1", "optim.warmup_steps=0",
           "data.max_seq_length=64"],
    "sft": ["trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
            "trainer.val_check_interval=2", "trainer.log_every_n_steps=1", "optim.warmup_steps=0",
            "data.max_seq_length=128"],
    "ppo": ["trainer.max_steps=2", "ppo.num_rollout_samples=4", "ppo.global_batch_size=4",
            "ppo.micro_batch_size=2", "ppo.forward_micro_batch_size=4", "rollout.max_new_tokens=6",
            "data.max_seq_length=48", "optim.warmup_steps=0", "trainer.sample_table_every=0"],
}
FAKE_8B = {  # the 8B-shaped checkpoint each family's Slurm commands are validated against
    "llama": ("llama3_8b", "num_layers=32, hidden_size=4096, num_attention_heads=32"),
    "qwen3": ("qwen3_8b", "num_layers=36, hidden_size=4096, num_attention_heads=32"),
}


def readme_commands() -> list[list[str]]:
    """The shell words of each command of the README's walkthrough block."""
    text = (REPO / "README.md").read_text().split("## Your own model", 1)[1]
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    commands, current = [], ""
    for line in block.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        current += " " + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            commands.append(shlex.split(current))
            current = ""
    return commands


def _data(folder: Path) -> None:
    write_data(folder)  # prefs / prompts JSONL
    # SFT conversations (multi-turn; the loss on the last assistant turn) as parquet, beside
    # the walkthrough: chat `messages` and a parquet file through a training job
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = [{"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "What is a cat?"},
                           {"role": "assistant", "content": "A small animal."},
                           {"role": "user", "content": "And a dog?"},
                           {"role": "assistant", "content": "A loyal animal."}]},
             {"messages": [{"role": "user", "content": "Say something kind."},
                           {"role": "assistant", "content": "You did well today."}]}] * 4
    pq.write_table(pa.Table.from_pylist(chats), folder / "sft.parquet")


def _fake_8b(shared: Path, preset: str) -> None:
    """What the Slurm validation reads of an imported 8B model (``preset``): its config.yaml,
    where the README's commands look for it."""
    from dataclasses import asdict

    from nemo_rlhf.models.config import load_model_preset

    step = shared / "ckpt" / "llama3-8b-sft" / "step_0"
    step.mkdir(parents=True)
    (step.parent / "tokenizer").mkdir()
    model = asdict(load_model_preset(preset))
    (step / "config.yaml").write_text(yaml.safe_dump({"model": model, "data": {"chat_template": "model"}}))
    (step / "COMPLETE").write_text("")


def _words(cmd: list[str], shared: Path) -> list[str]:
    return [SCALE.get(w, w).replace(SHARED, str(shared)) for w in cmd]


_SERVER: list[ForkServer] = []  # the module fixture's, while it runs


def _run(cmd: list[str], log: Path, timeout: int = 600) -> str:
    """``cmd`` (``python -m MODULE ...``) run to its end, forked by the module fixture's
    :class:`~tests.fork_server.ForkServer` (this process's environment, the repository as the
    working directory), its stdout and stderr in ``log``; returns them."""
    python, dash_m, module, *argv = cmd
    assert (python, dash_m) == (sys.executable, "-m"), cmd
    code = _SERVER[0].run(module, argv, dict(os.environ), log, timeout)
    out = log.read_text()
    assert code == 0, f"{shlex.join(cmd)} failed ({code}):\n{out[-4000:]}"
    return out


def _job_overrides(words: list[str]) -> tuple[list[str], dict]:
    """A launchers.slurm command's job overrides (no cluster.* / launcher options) and its
    launcher options."""
    opts, out, i = {}, [], 0
    while i < len(words):
        w = words[i]
        if w in ("--job", "--rm-checkpoint", "--rm-arg"):
            opts.setdefault(w, []).append(words[i + 1])
            i += 2
            continue
        if not w.startswith("cluster"):
            out.append(w)
        i += 1
    return out, opts


def _walk(arch: str, tmp: Path) -> dict:
    """Every command of the walkthrough, run from the tiny model of ``arch`` already written
    under ``tmp`` (where the README's commands read the HF folder); returns what the
    assertions need."""
    shared, fake, logs = tmp / "shared", tmp / "fake", tmp / "logs"
    cmds = readme_commands()
    assert [c[:3] for c in cmds] == [["nemo-rlhf-ckpt", "import-hf", f"{SHARED}/hf/llama3-8b-sft"],
                                     ["python", "-m", "launchers.slurm"], ["python", "-m", "launchers.slurm"],
                                     ["nemo-rlhf-ckpt", "export-hf", f"{SHARED}/exp/ppo"]]
    ckpt = [sys.executable, "-m", "nemo_rlhf.tools.ckpt"]
    got = {"dry_runs": {}, "arch": arch}
    got["import"] = _run([*ckpt, *_words(cmds[0], shared)[1:]], logs / "import.log")
    data = shared / "data"
    got["sft"] = _run([sys.executable, "-m", "nemo_rlhf.train_sft", f"sft.init_from={shared}/ckpt/llama3-8b-sft",
                       f"exp_manager.exp_dir={shared}/exp/sft", f"data.train_file={data}/sft.parquet",
                       f"data.val_file={data}/sft.parquet", *TINY["sft"]], logs / "sft.log")
    for name, cmd in (("rm", cmds[1]), ("ppo", cmds[2])):
        # the launcher's validation and script, against the 8B-shaped checkpoint
        got["dry_runs"][name] = _run([sys.executable, "-m", "launchers.slurm", "--dry-run",
                                      *[w.replace(SHARED, str(fake)) for w in cmd[3:]]], logs / f"{name}_dry.log")
        overrides, opts = _job_overrides(_words(cmd[3:], shared))
        if name == "rm":
            assert opts == {"--job": ["rm"]}
            got["rm"] = _run([sys.executable, "-m", "nemo_rlhf.train_rm", *overrides, *TINY["rm"]], logs / "rm.log")
        else:
            (rm_ckpt,) = opts["--rm-checkpoint"]
            got["ppo"] = _run([sys.executable, "-m", "launchers.local", "--rm-checkpoint", rm_ckpt,
                               "--nproc", "1", "--", *overrides, *TINY["ppo"]], logs / "ppo.log")
    got["export"] = _run([*ckpt, *_words(cmds[3], shared)[1:]], logs / "export.log")
    got["shared"] = shared
    return got


@pytest.fixture(scope="module")
def walks(tmp_path_factory):
    """The walkthrough of each family of :data:`FAKE_8B`: the HF folders and data written
    here, then the two walkthroughs' commands run side by side (each walkthrough's commands
    one after another), each forked by a :class:`~tests.fork_server.ForkServer` that has
    imported torch, megatron and the entry points once (not a fresh interpreter each);
    returns family -> :func:`_walk`'s result, or the exception it raised."""
    from concurrent.futures import ThreadPoolExecutor

    tmps = {}
    for arch in sorted(FAKE_8B):  # in-process and seeded: before the threads
        tmp = tmps[arch] = tmp_path_factory.mktemp(f"walkthrough_{arch}")
        (tmp / "logs").mkdir()
        write_hf_folder(tmp / "shared" / "hf" / "llama3-8b-sft", arch)
        _data(tmp / "shared" / "data")
        _fake_8b(tmp / "fake", FAKE_8B[arch][0])
    with ForkServer(dict(os.environ), tmp_path_factory.mktemp("fork_server")) as server:
        _SERVER[:] = [server]
        try:
            with ThreadPoolExecutor(len(tmps)) as pool:
                futures = {arch: pool.submit(_walk, arch, tmp) for arch, tmp in tmps.items()}
        finally:
            _SERVER.clear()
    return {arch: f.exception() or f.result() for arch, f in futures.items()}


@pytest.fixture(params=sorted(FAKE_8B))
def walk(request, walks):
    """One family's walkthrough (:func:`walks`); its failure, re-raised, fails each test."""
    got = walks[request.param]
    if isinstance(got, BaseException):
        raise got
    return got


def test_import_records_the_model_tokenizer_and_its_chat_template(walk):
    root = walk["shared"] / "ckpt" / "llama3-8b-sft"
    cfg = yaml.safe_load((root / "step_0" / "config.yaml").read_text())
    assert cfg["model"]["num_layers"] == 2 and cfg["model"]["num_query_groups"] == 2
    assert cfg["model"]["qk_layernorm"] == (walk["arch"] == "qwen3")
    assert cfg["data"]["chat_template"] == "model" and (root / "tokenizer" / "tokenizer_config.json").is_file()
    assert f"exp_manager.init_from={root}" in walk["import"]  # the hint: no --config-dir, no model=


def test_the_slurm_commands_validate_and_render_against_an_8b_checkpoint(walk):
    rm, ppo = walk["dry_runs"]["rm"], walk["dry_runs"]["ppo"]
    assert "#SBATCH --nodes=1" in rm and "#SBATCH --job-name=nemo-rlhf-rm" in rm
    assert "#SBATCH --nodes=3" in ppo and "RM_DEDICATED_NODES=1" in ppo
    assert "model from" in ppo and FAKE_8B[walk["arch"]][1] in ppo  # taken


def test_rm_and_ppo_take_the_model_from_the_checkpoint_and_run(walk):
    shared = walk["shared"]
    root = shared / "ckpt" / "llama3-8b-sft"
    assert f"rm.init_from={root} -> {root / 'step_0'}" in walk["rm"]
    rm_ckpt = shared / "exp" / "rm" / "checkpoints" / "step_2"
    assert (rm_ckpt / "COMPLETE").is_file()
    rm_cfg = yaml.safe_load((rm_ckpt / "config.yaml").read_text())
    # the tokenizer: the import's own copy inside its checkpoint (relocatable), the import's files
    assert rm_cfg["model"]["num_layers"] == 2 and rm_cfg["data"]["tokenizer_dir"] == str(root / "step_0" / "tokenizer")
    assert ((root / "step_0" / "tokenizer" / "tokenizer.json").read_bytes()
            == (root / "tokenizer" / "tokenizer.json").read_bytes())
    assert (rm_ckpt / "tokenizer" / "tokenizer.json").is_file()  # and the RM's checkpoint its own
    assert rm_cfg["data"]["chat_template"] == "model"
    ppo = shared / "exp" / "ppo"
    assert (ppo / "checkpoints" / "step_2" / "COMPLETE").is_file()
    steps = [json.loads(line)["step"] for line in (ppo / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 2
    rows = [json.loads(line) for line in (ppo / "eval_samples" / "step_000002.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["Say something kind.", "What is a cat?"]  # the last user turn


def test_sft_trains_on_multi_turn_messages_from_parquet_with_the_models_template(walk):
    exp = walk["shared"] / "exp" / "sft"
    assert (exp / "checkpoints" / "step_2" / "COMPLETE").is_file()
    cfg = yaml.safe_load((exp / "checkpoints" / "step_2" / "config.yaml").read_text())
    assert cfg["data"]["chat_template"] == "model" and cfg["model"]["num_layers"] == 2
    assert "sft.parquet (sft): 8 rows kept of 8; invalid skipped 0, truncated 0, dropped overlong 0" in walk["sft"]
    losses = [json.loads(line).get("train/loss") for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert any(v is not None and v == v and v > 0 for v in losses), losses


def test_the_export_loads_in_transformers_and_generates(walk):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = walk["shared"] / "hf" / "llama3-8b-ppo"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == walk["arch"]  # exported as the architecture it was imported as
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is a cat?"}], add_generation_prompt=True,
                                  return_tensors="pt")
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert new.shape[1] == ids.shape[1] + 3 or int(new[0, -1]) == tok.eos_token_id
