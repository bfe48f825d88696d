"""Trajectories (#51): append-only token ids, the loss mask, the padded batch layout, and the
prefix check that catches chat templates which rewrite earlier turns."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_rlhf.data.templates import render_model_template
from nemo_rlhf.rollout.trajectory import (
    ENV,
    POLICY,
    PrefixMismatch,
    Segment,
    Trajectory,
    check_prefix_extension,
    to_padded_batch,
)


def test_segments_mask_and_logprobs_follow_the_appends():
    tr = Trajectory([5, 6, 7])
    tr.append_policy([10, 11], [-0.5, -0.25])
    tr.append_env([20, 21, 22])
    tr.append_env([23])  # a second environment piece joins the same segment
    tr.append_policy([12], [-1.0])
    assert tr.token_ids == [5, 6, 7, 10, 11, 20, 21, 22, 23, 12]
    assert tr.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1]
    assert tr.logprobs == [0, 0, 0, -0.5, -0.25, 0, 0, 0, 0, -1.0]
    assert tr.segments == [Segment(POLICY, 3, 5), Segment(ENV, 5, 9), Segment(POLICY, 9, 10)]
    assert (tr.turns, tr.policy_tokens, tr.prompt_length, len(tr)) == (2, 3, 3, 10)
    assert not tr.truncated
    tr.mark_truncated()
    assert tr.truncated


def test_bad_appends_are_refused():
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        Trajectory([])
    tr = Trajectory([1])
    with pytest.raises(ValueError, match="the policy speaks first"):
        tr.append_env([2])
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        tr.append_policy([2, 3], [-1.0])
    with pytest.raises(ValueError, match="non-finite"):
        tr.append_policy([2], [float("nan")])
    with pytest.raises(ValueError, match="at least one token"):
        tr.append_policy([], [])
    tr.append_policy([2], [-1.0])
    with pytest.raises(ValueError, match="turn 1 is already a policy segment"):
        tr.append_policy([3], [-1.0])
    with pytest.raises(ValueError, match=">= 0"):
        tr.append_env([-1])
    assert tr.token_ids == [1, 2]  # nothing half-appended


def test_prefix_check_names_turn_and_position():
    check_prefix_extension([1, 2, 3], [1, 2, 3, 4], turn=2)  # an extension
    check_prefix_extension([1, 2, 3], [1, 2, 3], turn=2)  # equal is fine
    with pytest.raises(PrefixMismatch, match=r"turn 3: .* first difference at position 1") as e:
        check_prefix_extension([1, 2, 3], [1, 9, 3, 4], turn=3)
    assert (e.value.turn, e.value.position) == (3, 1)
    with pytest.raises(PrefixMismatch, match=r"turn 2: .* fewer than the previous 3"):
        check_prefix_extension([1, 2, 3], [1, 2], turn=2)


def test_padded_batch_layout():
    # row 0: prompt [5, 6], then P(10, 11) E(20) P(12)      -> 4 tokens after the prompt
    # row 1: prompt [7],    then P(13) (one turn, today's single-turn case) -> 1 token
    a = Trajectory([5, 6])
    a.append_policy([10, 11], [-0.5, -0.25])
    a.append_env([20])
    a.append_policy([12], [-1.0])
    b = Trajectory([7])
    b.append_policy([13], [-2.0])
    b.mark_truncated()
    out = to_padded_batch([a, b], pad_id=0)
    assert out.prompt_length == 2
    assert out.input_ids.tolist() == [[5, 6, 10, 11, 20, 12], [0, 7, 13, 0, 0, 0]]
    assert out.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]]
    assert out.response_mask.tolist() == [[True, True, False, True], [True, False, False, False]]
    assert out.logprobs.tolist() == [[-0.5, -0.25, 0.0, -1.0], [-2.0, 0.0, 0.0, 0.0]]
    assert out.response_lengths.tolist() == [4, 1]
    assert out.turns.tolist() == [2, 1]
    assert out.truncated.tolist() == [False, True]
    with pytest.raises(ValueError, match="trajectory 0 has no policy turn"):
        to_padded_batch([Trajectory([1])], pad_id=0)


def test_padded_batch_feeds_the_micro_batch_extents():
    # the last policy token (column 3 of row 0) is inside the row's extent
    from nemo_rlhf.trainers.ppo.micro_batches import row_extents

    a = Trajectory([5, 6])
    a.append_policy([10, 11], [-0.5, -0.25])
    a.append_env([20])
    a.append_policy([12], [-1.0])
    out = to_padded_batch([a], pad_id=0)
    assert row_extents(out.attention_mask, out.response_mask, out.prompt_length) == ([0], [4])


# --------------------------------------------------------------------------------------
# Chat templates: the append-only check catches the ones that rewrite earlier turns
# --------------------------------------------------------------------------------------

# No newline between turns, content as generated: append-only.
APPEND_ONLY = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# ChatML's newline after every <|im_end|>: the policy stops at <|im_end|> (its EOS), the next
# message rendered alone starts at <|im_start|>, and the full render has a "\n" in between
# that neither the policy nor the environment appended (verl #6501's tool-boundary newline).
NEWLINE_BETWEEN_TURNS = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Qwen3-style: earlier assistant turns lose their <think>...</think> (NeMo-RL #2821/#2856).
STRIPS_THINK = (
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["What is 12*34? Use the calculator.", "<think>call it</think>", "408 The answer is 408.",
              "user assistant tool"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _render_ids(bpe, template, messages):
    text = render_model_template(SimpleNamespace(chat_template=template, eos_token="<|im_end|>"),
                                 messages, add_generation_prompt=True)
    return bpe.encode(text).ids


def _episode(bpe, template):
    """Two assistant turns with a tool call between them, built token-in/token-out (the
    policy's ids appended as sampled, the tool message rendered alone and appended); before
    turn 2 the whole conversation is re-rendered and checked against the trajectory."""
    messages = [{"role": "user", "content": "What is 12*34? Use the calculator."}]
    tr = Trajectory(_render_ids(bpe, template, messages))
    turn1 = "<think>call it</think>12*34"
    ids = bpe.encode(turn1 + "<|im_end|>").ids  # what the policy sampled, EOS included
    tr.append_policy(ids, [-0.1] * len(ids))
    messages.append({"role": "assistant", "content": turn1})
    tool = {"role": "tool", "content": "408"}
    tr.append_env(_render_ids(bpe, template, [tool]))  # the new message alone
    messages.append(tool)
    check_prefix_extension(tr.token_ids, _render_ids(bpe, template, messages), turn=tr.turns + 1)
    return tr


def test_append_only_template_passes(bpe):
    tr = _episode(bpe, APPEND_ONLY)
    assert tr.turns == 1 and tr.segments[-1].kind == ENV


def test_newline_between_turns_is_caught_naming_the_turn(bpe):
    with pytest.raises(PrefixMismatch, match=r"turn 2: .*first difference at position") as e:
        _episode(bpe, NEWLINE_BETWEEN_TURNS)
    # the position is the first token after the policy's <|im_end|>: where the "\n" went in
    prompt = _render_ids(bpe, NEWLINE_BETWEEN_TURNS,
                         [{"role": "user", "content": "What is 12*34? Use the calculator."}])
    first_turn = bpe.encode("<think>call it</think>12*34<|im_end|>").ids
    assert e.value.position == len(prompt) + len(first_turn)


def test_think_stripping_template_is_caught_naming_the_turn(bpe):
    with pytest.raises(PrefixMismatch, match=r"turn 2: .*first difference at position") as e:
        _episode(bpe, STRIPS_THINK)
    prompt = _render_ids(bpe, STRIPS_THINK, [{"role": "user", "content": "What is 12*34? Use the calculator."}])
    assert e.value.position == len(prompt)  # the first token of the stripped <think>
    assert e.value.turn == 2


def test_one_turn_trajectory_is_the_single_turn_layout():
    # one policy segment: the padded batch is the single-turn RolloutBatch layout (prompt
    # left-padded, response from column P, a valid prefix as response_mask)
    a, b = Trajectory([1, 2, 3]), Trajectory([4])
    a.append_policy([7, 8], [-1.0, -1.0])
    b.append_policy([9, 10, 11], [-1.0, -1.0, -1.0])
    out = to_padded_batch([a, b], pad_id=0, device=torch.device("cpu"))
    assert out.input_ids.tolist() == [[1, 2, 3, 7, 8, 0], [0, 0, 4, 9, 10, 11]]
    assert out.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert out.response_lengths.tolist() == out.response_mask.sum(-1).tolist()
