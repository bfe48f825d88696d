"""The README's "Your own model" walkthrough, run as written, on a tiny random Llama.

The four commands are read from the README's code block. ``/shared`` becomes a temporary
folder holding a tiny random Llama written by transformers as an HF folder (byte-level BPE
tokenizer with a Llama-3-style Jinja chat template), a JSONL of preference pairs and a JSONL
of prompts. Each Slurm command is first validated and rendered by the launcher
(``--dry-run``) against a Llama-3-8B-shaped checkpoint (only its ``config.yaml``: TP=8 must
fit its heads), then run here as the job it launches (``--job rm``: ``nemo_rlhf.train_rm``
with the same overrides; PPO: ``launchers.local`` with the served RM and the same trainer
overrides), scaled to this machine by :data:`SCALE` and :data:`TINY`. The export is loaded
back with transformers.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
LLAMA3_TEMPLATE = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


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


def _hf_folder(out: Path) -> None:
    """A 2-layer random Llama (GQA, untied) and its tokenizer, as an HF user has them."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["user assistant system", "Say something kind.", "Thanks, that was kind.",
              "No. Go away.", "What is a cat?", "A cat is a small animal."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, rope_theta=500000.0,
        bos_token_id=tok.token_to_id("<|begin_of_text|>"), eos_token_id=tok.token_to_id("<|eot_id|>")))
    model.save_pretrained(out, safe_serialization=True)


def _data(folder: Path) -> None:
    folder.mkdir(parents=True)
    pairs = [{"prompt": "Say something kind.", "chosen": "Thanks, that was kind.", "rejected": "No. Go away."},
             {"prompt": [{"role": "user", "content": "What is a cat?"}],
              "chosen": [{"role": "assistant", "content": "A cat is a small animal."}],
              "rejected": [{"role": "assistant", "content": "Go away."}]}] * 4
    prompts = [{"prompt": "Say something kind."},
               {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "What is a cat?"}]}] * 4
    for name, rows in (("prefs", pairs), ("prefs_val", pairs[:4]), ("prompts", prompts),
                       ("prompts_val", prompts[:2])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
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


def _fake_llama3_8b(shared: Path) -> None:
    """What the Slurm validation reads of an imported Llama-3-8B: its config.yaml."""
    from dataclasses import asdict

    from nemo_rlhf.models.config import load_model_preset

    step = shared / "ckpt" / "llama3-8b-sft" / "step_0"
    step.mkdir(parents=True)
    (step.parent / "tokenizer").mkdir()
    model = asdict(load_model_preset("llama3_8b"))
    (step / "config.yaml").write_text(yaml.safe_dump({"model": model, "data": {"chat_template": "model"}}))
    (step / "COMPLETE").write_text("")


def _words(cmd: list[str], shared: Path) -> list[str]:
    return [SCALE.get(w, w).replace(SHARED, str(shared)) for w in cmd]


def _run(cmd: list[str], log: Path, timeout: int = 600) -> str:
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    log.write_text(res.stdout + res.stderr)
    assert res.returncode == 0, f"{shlex.join(cmd)} failed ({res.returncode}):\n{(res.stdout + res.stderr)[-4000:]}"
    return res.stdout + res.stderr


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


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    """Every command of the walkthrough, run; returns what the assertions need."""
    tmp = tmp_path_factory.mktemp("walkthrough")
    shared, fake, logs = tmp / "shared", tmp / "fake", tmp / "logs"
    logs.mkdir()
    _hf_folder(shared / "hf" / "llama3-8b-sft")
    _data(shared / "data")
    _fake_llama3_8b(fake)
    cmds = readme_commands()
    assert [c[:3] for c in cmds] == [["nemo-rlhf-ckpt", "import-hf", f"{SHARED}/hf/llama3-8b-sft"],
                                     ["python", "-m", "launchers.slurm"], ["python", "-m", "launchers.slurm"],
                                     ["nemo-rlhf-ckpt", "export-hf", f"{SHARED}/exp/ppo"]]
    ckpt = [sys.executable, "-m", "nemo_rlhf.tools.ckpt"]
    got = {"dry_runs": {}}
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


def test_import_records_the_model_tokenizer_and_its_chat_template(walk):
    root = walk["shared"] / "ckpt" / "llama3-8b-sft"
    cfg = yaml.safe_load((root / "step_0" / "config.yaml").read_text())
    assert cfg["model"]["num_layers"] == 2 and cfg["model"]["num_query_groups"] == 2
    assert cfg["data"]["chat_template"] == "model" and (root / "tokenizer" / "tokenizer_config.json").is_file()
    assert f"exp_manager.init_from={root}" in walk["import"]  # the hint: no --config-dir, no model=


def test_the_slurm_commands_validate_and_render_against_an_8b_checkpoint(walk):
    rm, ppo = walk["dry_runs"]["rm"], walk["dry_runs"]["ppo"]
    assert "#SBATCH --nodes=1" in rm and "#SBATCH --job-name=nemo-rlhf-rm" in rm
    assert "#SBATCH --nodes=3" in ppo and "RM_DEDICATED_NODES=1" in ppo
    assert "model from" in ppo and "num_layers=32, hidden_size=4096, num_attention_heads=32" in ppo  # taken


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
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is a cat?"}], add_generation_prompt=True,
                                  return_tensors="pt")
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert new.shape[1] == ids.shape[1] + 3 or int(new[0, -1]) == tok.eos_token_id
