"""Tokenizer special tokens (pad == eos included), padding collators, and the SFT loss
mask: no prompt token ever enters the SFT loss."""

from __future__ import annotations

import json

import pytest
import torch

from nemo_rlhf.data.datasets import (
    PreferenceSample,
    SFTSample,
    collate_preference,
    collate_sft,
    pad_right,
)
from nemo_rlhf.tasks.precedence import SPECIAL_TOKENS, build_char_tokenizer_json
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.trainers.sft import make_sft_loss_fn, sft_loss


def _tok_dir(tmp_path, specials: dict, name="special_tokens.json"):
    (tmp_path / "tokenizer.json").write_text(build_char_tokenizer_json())
    (tmp_path / name).write_text(json.dumps(specials))
    return tmp_path


def test_tokenizer_reads_special_ids_and_round_trips(tmp_path):
    tok = Tokenizer(_tok_dir(tmp_path, SPECIAL_TOKENS))
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 17)
    ids = tok.encode("3+3*6=21")
    assert len(ids) == 8 and tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == "3+3*6=21"
    with pytest.raises(ValueError, match="cannot tokenize"):
        tok.encode("3 x 4")


def test_tokenizer_from_hf_tokenizer_config_with_content_dicts_and_no_pad(tmp_path):
    cfg = {"bos_token": {"content": "<bos>"}, "eos_token": "<eos>"}
    tok = Tokenizer(_tok_dir(tmp_path, cfg, name="tokenizer_config.json") / "tokenizer.json")
    assert tok.pad_id == tok.eos_id == 2 and tok.bos_id == 1


def test_tokenizer_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(build_char_tokenizer_json())
    with pytest.raises(FileNotFoundError, match="special_tokens.json"):
        Tokenizer(tmp_path)
    (tmp_path / "special_tokens.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match="'</s>' is not in the vocabulary"):
        Tokenizer(tmp_path)


def _samples(eos: int):
    # prompt: BOS 5 6 | response: 7 EOS      and a longer second row
    return [SFTSample([1, 5, 6], [7, eos]), SFTSample([1, 5], [8, 9, 10, eos])]


def test_sft_collate_masks_come_from_lengths_when_pad_equals_eos():
    eos = pad = 2
    batch = collate_sft(_samples(eos), pad_id=pad, length=8)
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7, 2, 2, 2, 2], [1, 5, 8, 9, 10, 2, 2, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]]
    # the EOS at position 4 (== pad id) is a response token; the padding after it is not
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0]]


def test_sft_loss_mask_excludes_every_prompt_token_and_padding():
    samples = _samples(eos=2)
    batch = collate_sft(samples, pad_id=0)
    for row, s in zip(batch["loss_mask"], samples):
        p = len(s.prompt_ids)
        assert row[:p].sum() == 0 and row[p:p + len(s.response_ids)].eq(1).all()
        assert row[p + len(s.response_ids):].sum() == 0


class _Dims:
    tp_group, tp_rank = None, 0


def test_sft_loss_value_on_a_hand_made_case_and_no_gradient_from_prompt_positions():
    torch.manual_seed(0)
    samples = _samples(eos=2)
    batch = collate_sft(samples, pad_id=0)
    vocab = 17
    logits = torch.randn(2, batch["input_ids"].shape[1], 128, requires_grad=True)  # padded vocab
    n_tokens = 6  # response tokens of the global batch: 2 + 4
    loss, stats = make_sft_loss_fn(_Dims(), vocab, n_tokens)(logits, batch)
    # by hand: targets of positions t are tokens t+1; only response tokens count
    logp = torch.log_softmax(logits[..., :vocab].detach().double(), -1)
    want = -(logp[0, 2, 7] + logp[0, 3, 2] + logp[1, 1, 8] + logp[1, 2, 9] + logp[1, 3, 10]
             + logp[1, 4, 2]) / n_tokens
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    assert float(stats["tokens"]) == 6
    loss.backward()
    g = logits.grad.abs().sum(-1)
    # position t predicts token t+1: row 0 positions 0,1 predict prompt tokens 5,6
    assert g[0, :2].eq(0).all() and g[0, 2:4].gt(0).all() and g[0, 4:].eq(0).all()
    assert g[1, :1].eq(0).all() and g[1, 1:5].gt(0).all() and g[1, 5:].eq(0).all()


def test_sft_loss_is_a_masked_sum_over_the_global_count():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    assert float(sft_loss(lp, mask, num_tokens=6)) == pytest.approx((2 + 3 + 6) / 6)


def test_preference_collate_puts_chosen_rows_first_with_their_lengths():
    s = [PreferenceSample([1, 5], [7, 2], [8, 9, 2]), PreferenceSample([1, 6, 6], [3, 2], [4, 2])]
    b = collate_preference(s, pad_id=2)
    assert b["input_ids"].shape == (4, 5)
    assert b["lengths"].tolist() == [4, 5, 5, 5]
    assert b["input_ids"][0].tolist() == [1, 5, 7, 2, 2] and b["attention_mask"][0].tolist() == [1, 1, 1, 1, 0]
    assert b["input_ids"][2].tolist() == [1, 5, 8, 9, 2]


def test_pad_right_rejects_a_sequence_longer_than_the_length():
    with pytest.raises(ValueError, match="does not fit"):
        pad_right([[1, 2, 3]], 0, length=2)
