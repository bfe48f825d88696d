"""Multi-turn SFT rows (``segments``, #51): the ids are the segments' ids appended, each
tokenised alone; the loss mask has holes on the environment's tokens; the SFT loss counts
policy tokens only (global count); a single-turn row's ids, mask and loss are unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_rlhf.data.datasets import (
    SEGMENT_KINDS,
    DataConfig,
    SFTSample,
    collate_sft,
    encode_segments,
    load_sft_dataset,
    sft_loss_tokens,
)
from nemo_rlhf.data.jsonl import DataError
from nemo_rlhf.data.tokenizer import Tokenizer
from nemo_rlhf.rollout.trajectory import ENV, POLICY, Trajectory
from nemo_rlhf.tasks.precedence import SPECIAL_TOKENS, build_char_tokenizer_json
from nemo_rlhf.trainers.sft import make_sft_loss_fn

SEGMENTS = [{"kind": "policy", "text": "37*12="}, {"kind": "env", "text": "444="},
            {"kind": "policy", "text": "444"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    (d / "tokenizer.json").write_text(build_char_tokenizer_json())
    (d / "special_tokens.json").write_text(json.dumps(SPECIAL_TOKENS))
    return Tokenizer(d)


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(**kw) -> DataConfig:
    return DataConfig(train_file="unused", tokenizer_dir="unused", **kw)


class _Dims:
    tp_group, tp_rank = None, 0


def test_segment_kinds_are_the_trajectorys():
    assert SEGMENT_KINDS == (POLICY, ENV)


def test_segments_are_tokenised_alone_and_appended_as_an_episodes_trajectory(tok):
    ids, mask = encode_segments(tok, SEGMENTS)
    eos = tok.eos_id
    call, obs, answer = tok.encode("37*12="), tok.encode("444="), tok.encode("444")
    assert ids == call + [eos] + obs + answer + [eos]
    assert mask == [1] * 7 + [0] * 4 + [1] * 4
    # the same ids and mask as the episode's trajectory after its prompt
    tr = Trajectory([tok.bos_id] + call)
    tr.append_policy(call + [eos], [0.0] * 7)
    tr.append_env(obs)
    tr.append_policy(answer + [eos], [0.0] * 4)
    assert tr.token_ids[tr.prompt_length:] == ids and tr.loss_mask[tr.prompt_length:] == mask


def test_a_segmented_row_loads_with_its_mask_and_a_response_row_without_one(tmp_path, tok):
    path = _write(tmp_path / "sft.jsonl", [{"prompt": "37*12=", "segments": SEGMENTS},
                                           {"prompt": "2*3=", "response": "6"}])
    ds = load_sft_dataset(path, tok, _cfg(max_seq_length=64))
    multi, single = ds.samples
    assert multi.prompt_ids == [tok.bos_id] + tok.encode("37*12=")
    assert (multi.response_ids, multi.loss_mask) == encode_segments(tok, SEGMENTS)
    assert single.loss_mask is None and single.response_ids == tok.encode("6") + [tok.eos_id]
    assert sft_loss_tokens(multi) == 11 and sft_loss_tokens(single) == 2


def test_one_policy_segment_gives_the_single_turn_rows_ids_mask_and_loss_bit_for_bit(tmp_path, tok):
    path = _write(tmp_path / "sft.jsonl", [{"prompt": "3+4=", "response": "7"},
                                           {"prompt": "3+4=", "segments": [{"kind": "policy", "text": "7"}]}])
    single, seg = load_sft_dataset(path, tok, _cfg()).samples
    assert single.response_ids == seg.response_ids and seg.loss_mask == [1, 1]
    a, b = collate_sft([single], tok.pad_id, 8), collate_sft([seg], tok.pad_id, 8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(0)
    logits = torch.randn(1, 8, 32)
    la, _ = make_sft_loss_fn(_Dims(), 17, sft_loss_tokens(single))(logits, a)
    lb, _ = make_sft_loss_fn(_Dims(), 17, sft_loss_tokens(seg))(logits, b)
    assert la.item() == lb.item()


def test_masked_sft_loss_on_a_hand_made_case():
    """Row 0: prompt [1, 5] | policy [6, 2] | env [7, 8] | policy [9, 2]; row 1 single-turn:
    prompt [1, 5, 6] | response [10, 2]. Global count: 4 + 2 policy tokens; the env tokens 7
    and 8 are input but never targets of the loss."""
    samples = [SFTSample([1, 5], [6, 2, 7, 8, 9, 2], [1, 1, 0, 0, 1, 1]), SFTSample([1, 5, 6], [10, 2])]
    batch = collate_sft(samples, pad_id=0)
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 0, 1, 1, 0, 0, 0]]
    n = sum(sft_loss_tokens(s) for s in samples)
    assert n == 6
    vocab = 17
    logp_row = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.0625]))  # targets' probabilities
    logits = torch.full((2, 8, vocab), -1e4)
    # put a known probability on each target: position t predicts token t+1
    targets = {(0, 1): 6, (0, 2): 2, (0, 5): 9, (0, 6): 2, (1, 2): 10, (1, 3): 2}
    for k, ((b, t), tok_id) in enumerate(targets.items()):
        p = [0.5, 0.25, 0.125, 0.0625, 0.5, 0.25][k]
        logits[b, t, tok_id] = 0.0
        logits[b, t, 0 if tok_id != 0 else 1] = float(torch.log(torch.tensor((1 - p) / p)))
    # environment targets (positions 3 and 4 of row 0 predict 7 and 8): given any logits,
    # they must not count
    logits[0, 3, 7], logits[0, 4, 8] = -50.0, -50.0
    logits.requires_grad_(True)
    loss, stats = make_sft_loss_fn(_Dims(), vocab, n)(logits, batch)
    want = -(2 * logp_row[0] + 2 * logp_row[1] + logp_row[2] + logp_row[3]) / 6
    assert loss.item() == pytest.approx(float(want), rel=1e-5)
    assert float(stats["tokens"]) == 6
    loss.backward()
    g = logits.grad.abs().sum(-1)
    assert g[0, 3].eq(0) and g[0, 4].eq(0)  # no gradient towards the tool's output
    assert g[0, 1:3].gt(0).all() and g[0, 5:7].gt(0).all()


@pytest.mark.parametrize("segments,fragment", [
    ([], "non-empty list"),
    ([{"kind": "tool", "text": "1"}], "segments[0]"),
    ([{"kind": "policy", "text": 3}], "segments[0]"),
    ([{"kind": "env", "text": "1="}, {"kind": "policy", "text": "1"}], "first and the last"),
    ([{"kind": "policy", "text": "1="}, {"kind": "env", "text": "1="}], "first and the last"),
    ([{"kind": "policy", "text": "1"}, {"kind": "policy", "text": "1"}], "two 'policy' segments"),
])
def test_bad_segments_are_refused_naming_the_field(tmp_path, tok, segments, fragment):
    path = _write(tmp_path / "sft.jsonl", [{"prompt": "1=", "segments": segments}])
    with pytest.raises(DataError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        load_sft_dataset(path, tok, _cfg())


def test_segments_and_response_together_are_refused(tmp_path, tok):
    path = _write(tmp_path / "sft.jsonl", [{"prompt": "1=", "response": "1", "segments": SEGMENTS}])
    with pytest.raises(DataError, match="not both"):
        load_sft_dataset(path, tok, _cfg())


def test_truncation_cuts_the_mask_with_the_ids_and_drops_a_row_left_without_policy_tokens(tmp_path, tok):
    # prompt 7 tokens (BOS + 37*12=); call 7, env 4, answer 4
    path = _write(tmp_path / "sft.jsonl", [{"prompt": "37*12=", "segments": SEGMENTS}])
    cut = load_sft_dataset(path, tok, _cfg(max_seq_length=7 + 7 + 2)).samples[0]
    assert len(cut.response_ids) == 9 and cut.loss_mask == [1] * 7 + [0] * 2
    ds = load_sft_dataset(path, tok, _cfg(max_seq_length=7 + 7 + 2, overlong_policy="drop"))
    assert len(ds) == 0 and ds.report.dropped_overlong == 1
    # a cut that would keep only environment tokens: impossible here (policy first), but
    # the rule holds when the first segment does not fit at all
    assert len(load_sft_dataset(path, tok, _cfg(max_seq_length=7)).samples) == 0


def test_a_segmented_chat_row_takes_its_prompt_from_messages_ending_with_the_user(tmp_path, tok):
    row = {"messages": [{"role": "user", "content": "37*12="}], "segments": SEGMENTS}
    ds = load_sft_dataset(_write(tmp_path / "sft.jsonl", [row]), tok, _cfg(max_seq_length=64))
    assert ds.samples[0].prompt_ids == [tok.bos_id] + tok.encode("37*12=")
    assert ds.samples[0].response_ids == encode_segments(tok, SEGMENTS)[0]
