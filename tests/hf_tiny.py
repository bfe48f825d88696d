"""Tiny random Hugging Face models, written by transformers' own classes, as a user has them.

:func:`write_hf_folder` saves a 2-layer random model of one architecture with a byte-level
BPE tokenizer and that family's chat-template style into an HF folder (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``), for the tests that
start from ``nemo-rlhf-ckpt import-hf`` (``tests/e2e/test_walkthrough.py``,
``tests/e2e/test_model_families.py``). :func:`write_data` writes the preference pairs and
prompts those tests train on. Offline: nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

LLAMA3_TEMPLATE = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
CHATML_TEMPLATE = (  # Qwen's (no BOS token; <|im_end|> ends a turn)
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MISTRAL_TEMPLATE = (  # [INST] ... [/INST] turns; a system turn goes before the first user turn
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
    "{% set ns.system = '' %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")

FAMILIES = {  # tokenizer special tokens (bos, eos, pad, others) and chat template of each family
    "llama3": {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": "<|eot_id|>",
               "special": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "template": LLAMA3_TEMPLATE},
    "mistral": {"bos": "<s>", "eos": "</s>", "pad": "</s>", "special": ["<s>", "</s>", "[INST]", "[/INST]"],
                "template": MISTRAL_TEMPLATE},
    "qwen": {"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
             "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "template": CHATML_TEMPLATE},
}
ARCHS = ("llama", "llama31", "mistral", "qwen3", "qwen3_moe")
"""What :func:`write_hf_folder` builds: ``llama`` (Llama 3: GQA, untied), ``llama31`` (Llama
3.1's ``llama3`` RoPE scaling with its original context shrunk to 32 tokens, so that prompts
of a few dozen tokens reach past it; tied like Llama 3.2), ``mistral`` (no sliding window,
untied) and ``qwen3`` (dense: q/k norms, a head size of its own, 24 on a hidden size of 64,
tied; ChatML, no BOS) and ``qwen3_moe`` (Qwen3's attention, every layer a mixture of 4
experts of size 48, top-2, ``norm_topk_prob``, untied)."""


def _tokenizer(out: Path, family: dict):
    """Trains and saves the byte-level BPE tokenizer; returns it and its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["user assistant system", "Say something kind.", "Thanks, that was kind.",
              "No. Go away.", "What is a cat?", "A cat is a small animal."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=family["special"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": family["bos"], "eos_token": family["eos"], "pad_token": family["pad"],
        "chat_template": family["template"], "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok, tok.get_vocab_size()


def write_hf_folder(out: Path, arch: str, seed: int = 0) -> None:
    """A 2-layer random model of ``arch`` (one of :data:`ARCHS`; hidden 64, 4 query heads, 2 KV
    heads, SwiGLU 96, context 128) and its tokenizer, saved by transformers into ``out``."""
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: valid choices are {list(ARCHS)}")
    family = FAMILIES["qwen" if arch.startswith("qwen3") else "mistral" if arch == "mistral" else "llama3"]
    out.mkdir(parents=True)
    tok, vocab = _tokenizer(out, family)
    ids = {"bos_token_id": tok.token_to_id(family["bos"]) if family["bos"] else None,
           "eos_token_id": tok.token_to_id(family["eos"]), "pad_token_id": tok.token_to_id(family["pad"])}
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **ids)
    if arch == "llama":
        config = transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=500000.0, **common)
    elif arch == "llama31":
        config = transformers.LlamaConfig(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}, **common)
    elif arch == "mistral":
        config = transformers.MistralConfig(tie_word_embeddings=False, sliding_window=None,
                                            rope_theta=1000000.0, **common)
    elif arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            tie_word_embeddings=False, head_dim=24, attention_bias=False, use_sliding_window=False,
            rope_theta=1000000.0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)
    else:
        config = transformers.Qwen3Config(tie_word_embeddings=True, head_dim=24, attention_bias=False,
                                          use_sliding_window=False, rope_theta=1000000.0, **common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out, safe_serialization=True)


def write_data(folder: Path) -> None:
    """``prefs.jsonl`` / ``prefs_val.jsonl`` (8 / 4 preference pairs, plain text and chat
    messages) and ``prompts.jsonl`` / ``prompts_val.jsonl`` (8 / 2 prompts, one with a
    system turn) in ``folder``."""
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
