"""data.chat_template=model: the tokenizer folder's own Jinja chat template, rendered and
tokenized exactly as Hugging Face's ``apply_chat_template(add_generation_prompt=True)``:
the same ids on a Llama-3-style template (BOS written by the template) and on a
SmolLM2-style ChatML one (a default system message when none is given)."""

from __future__ import annotations

import json

import pytest

from nemo_rlhf.data.datasets import DataConfig, encode_prompt, load_prompt_dataset
from nemo_rlhf.data.templates import format_prompt
from nemo_rlhf.data.tokenizer import Tokenizer

LLAMA3_STYLE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
CHATML_WITH_DEFAULT_SYSTEM = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = {
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "chatml": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
}
TEMPLATES = {"llama3": LLAMA3_STYLE, "chatml": CHATML_WITH_DEFAULT_SYSTEM}
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|im_start|>", "<|im_end|>"]


def _tokenizer_dir(tmp_path, kind: str, as_jinja_file: bool):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["What is 26+28? Answer with just the number.", "You are a helpful assistant.",
              "system user assistant", "Reverse 4821 please"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path / f"{kind}_{as_jinja_file}"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    config = dict(SPECIALS[kind])
    if as_jinja_file:
        (d / "chat_template.jinja").write_text(TEMPLATES[kind])
    else:
        config["chat_template"] = TEMPLATES[kind]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("kind", ["llama3", "chatml"])
@pytest.mark.parametrize("system", [None, "Be brief."])
def test_ids_equal_transformers_apply_chat_template(tmp_path, kind, system):
    from transformers import PreTrainedTokenizerFast

    d = _tokenizer_dir(tmp_path, kind, as_jinja_file=kind == "chatml")
    ours = Tokenizer(d)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), chat_template=TEMPLATES[kind],
                                 **SPECIALS[kind])
    for prompt in ("What is 26+28? Answer with just the number.", "  Reverse 4821 please\n"):
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(expected, list):  # a BatchEncoding in some versions
            expected = expected["input_ids"]
        got = encode_prompt(ours, prompt, "model", system)
        assert got == list(expected)
        assert format_prompt(prompt, "model", system, ours) == hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False)
    if kind == "llama3":  # the template writes the BOS, once
        assert got[0] == ours.bos_id and got.count(ours.bos_id) == 1
    else:  # the template's default system message when the row has none
        assert ("tiny test assistant" in format_prompt("x", "model", system, ours)) == (system is None)


def test_a_prompt_file_loads_through_the_models_template(tmp_path):
    d = _tokenizer_dir(tmp_path, "llama3", as_jinja_file=False)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "What is 26+28?", "answer": "54"}) + "\n")
    cfg = DataConfig(train_file="x", tokenizer_dir=str(d), chat_template="model", max_seq_length=64)
    ds = load_prompt_dataset(tmp_path / "p.jsonl", Tokenizer(d), cfg, max_prompt_length=64)
    assert ds[0].prompt_ids == encode_prompt(Tokenizer(d), "What is 26+28?", "model")
    assert ds[0].extras == {"answer": "54"}


def test_a_tokenizer_without_a_template_is_refused_naming_the_key_and_folder(tmp_path):
    d = _tokenizer_dir(tmp_path, "llama3", as_jinja_file=False)
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"data.chat_template='model' needs .* tokenizer .*chat_template.jinja"):
        encode_prompt(Tokenizer(d), "hi", "model")
    with pytest.raises(ValueError, match="valid choices"):
        DataConfig(train_file="x", tokenizer_dir="y", chat_template="llama3")
