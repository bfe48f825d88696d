"""Tokenized SFT, preference and prompt datasets, and their padding collators.

Token layout (the same in SFT, RM and PPO)::

    prompt_ids   = [BOS] + encode(format_prompt(prompt, chat_template, system_prompt))
    response_ids = encode(response) + [EOS]

(no BOS when the tokenizer has none). Prompt and response are encoded separately, so a
BPE merge never spans the boundary and the prompt length is exact.

A multi-turn SFT row (a demonstration of a tool-calling episode, #51) carries ``segments``
instead of ``response``: ``[{"kind": "policy" | "env", "text": str}, ...]``, policy first
and last, kinds alternating. Its ``response_ids`` are built token-in/token-out as an
episode's trajectory is (:mod:`nemo_rlhf.rollout.trajectory`; the data layer sits below
the rollout's, so :func:`encode_segments` appends the ids itself): each segment is
tokenised **alone** and appended, a policy segment as ``encode(text) + [EOS]`` (a turn
ends at EOS, as the episodes' turns do), an environment segment as ``encode(text)`` (the
observation exactly as the episode appends it: ``env.observation_template`` filled, chat
headers included). ``SFTSample.loss_mask`` is then 1 on policy tokens and 0 on the
environment's, so the SFT loss never trains the model to predict a tool's output.

A whole conversation (a preference pair of multi-turn episodes, an RM server ``messages``
item) is the single-turn layout with everything before its final assistant message as the
prompt (:func:`encode_conversation`).

Batches are right-padded with the tokenizer's PAD id; ``attention_mask`` and ``loss_mask`` come from
lengths, never from comparing ids with PAD (PAD may equal EOS).

Over-long rows (``len(prompt_ids) + len(response_ids) > max_seq_length``):
``overlong_policy=truncate`` cuts the response (its EOS goes first; a segmented row's loss
mask with it) and keeps the row when at least one response (policy) token is left;
``drop`` drops it. A preference pair is dropped when
either side would be, or when truncation makes chosen and rejected identical. A prompt
row (PPO) is always dropped when its prompt is longer than ``max_prompt_length``: a cut
question changes its answer. Every case is counted in the :class:`LoadReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, Optional, Sequence, TypeVar

import torch
from omegaconf import MISSING

from nemo_rlhf.config import check_choice
from nemo_rlhf.data.jsonl import CONVERSATION_FIELDS, DataError, LoadReport, check_field_map
from nemo_rlhf.data.tables import read_rows
from nemo_rlhf.data.templates import check_template, format_prompt
from nemo_rlhf.data.tokenizer import Tokenizer

OVERLONG_POLICIES = ("truncate", "drop")
SEGMENT_KINDS = ("policy", "env")
"""``kind`` of an SFT row's segment: the policy's text (trained on) or the environment's
(not trained on); the values of :data:`nemo_rlhf.rollout.trajectory.POLICY` / ``ENV``."""


@dataclass
class DataConfig:
    """Dataset files, tokenizer and formatting (config group ``data``)."""

    train_file: str = MISSING
    """Training set: a JSONL file, a parquet file or folder, or a ``datasets``
    ``save_to_disk`` folder (:mod:`nemo_rlhf.data.tables`)."""
    val_file: Optional[str] = None
    """Validation set (the same formats); None: no validation."""
    tokenizer_dir: str = MISSING
    """Directory with ``tokenizer.json`` and ``special_tokens.json`` / ``tokenizer_config.json``."""
    chat_template: Optional[str] = None
    """``null`` (raw prompt), ``chatml``, or ``model``: the tokenizer folder's own Jinja chat
    template, rendered as Hugging Face's ``apply_chat_template`` does."""
    system_prompt: Optional[str] = None
    """System message (needs a ``chat_template``)."""
    max_seq_length: int = 32
    """Longest prompt + response in tokens, BOS and EOS included."""
    overlong_policy: str = "truncate"
    """``truncate`` (cut the response) or ``drop`` (drop the row)."""
    skip_invalid: bool = False
    """Skip and count invalid rows instead of failing on the first one."""
    fields: dict[str, str] = field(default_factory=dict)
    """The file's column for a field whose name differs, e.g. ``{prompt: question, chosen:
    good, rejected: bad}`` (fields: ``prompt``, ``response``, ``chosen``, ``rejected``,
    ``messages``); on the command line ``'+data.fields={prompt: question}'``."""

    def __post_init__(self) -> None:
        check_template(self.chat_template, "data.chat_template")
        if self.system_prompt and self.chat_template is None:
            raise ValueError("data.system_prompt is set but data.chat_template is null; "
                             "set data.chat_template=chatml or model")
        check_choice("data.overlong_policy", self.overlong_policy, OVERLONG_POLICIES)
        check_field_map(dict(self.fields))
        if self.max_seq_length < 2:
            raise ValueError(f"data.max_seq_length={self.max_seq_length}: must be >= 2")


@dataclass
class SFTSample:
    """One SFT example."""

    prompt_ids: list[int]
    """BOS + formatted prompt."""
    response_ids: list[int]
    """Response + EOS (no EOS when truncated); a segmented row's segments' ids, appended."""
    loss_mask: Optional[list[int]] = None
    """Per ``response_ids`` token: 1 trained on (policy), 0 not (environment); None: every
    response token is trained on (a single-turn row)."""


@dataclass
class PreferenceSample:
    """One preference pair."""

    prompt_ids: list[int]
    """BOS + formatted prompt."""
    chosen_ids: list[int]
    """Preferred response + EOS."""
    rejected_ids: list[int]
    """Dispreferred response + EOS."""


@dataclass
class PromptSample:
    """One PPO / evaluation prompt."""

    prompt_ids: list[int]
    """BOS + formatted prompt."""
    prompt: str
    """The raw prompt text (reward functions see this)."""
    extras: dict = field(default_factory=dict)
    """The row's other fields (e.g. ``answer``)."""


S = TypeVar("S")


@dataclass
class TokenizedDataset(Generic[S]):
    """Samples plus the report of what loading kept, skipped, truncated and dropped."""

    samples: list[S]
    report: LoadReport

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> S:
        return self.samples[i]


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat_template: Optional[str] = None,
                  system_prompt: Optional[str] = None, messages: Optional[list[dict]] = None) -> list[int]:
    """``[BOS] + encode(format_prompt(prompt, ...))``.

    No BOS when the tokenizer has none, with ``chat_template="model"`` (the model's template
    writes it where it wants one: the ids equal ``apply_chat_template``'s), or when the
    formatted text already starts with the BOS token's text (ChatML tokenizers such as
    SmolLM2's use ``<|im_start|>`` as BOS).
    """
    text = format_prompt(prompt, chat_template, system_prompt, tokenizer, messages)
    ids = tokenizer.encode(text)
    if tokenizer.bos_id is None or chat_template == "model" or (
            tokenizer.bos_token and text.startswith(tokenizer.bos_token)):
        return ids
    return [tokenizer.bos_id] + ids


def encode_response(tokenizer: Tokenizer, response: str) -> list[int]:
    """``encode(response) + [EOS]``."""
    return tokenizer.encode(response) + [tokenizer.eos_id]


def encode_segments(tokenizer: Tokenizer, segments: Sequence[dict]) -> tuple[list[int], list[int]]:
    """A segmented SFT row's response, token-in/token-out (module docstring): each segment
    tokenised alone and appended, a policy segment as ``encode(text) + [EOS]``, an
    environment segment as ``encode(text)``.

    Args:
        segments: ``[{"kind": "policy" | "env", "text": str}]``, as the row holds them
            (validated on reading, :mod:`nemo_rlhf.data.jsonl`).

    Returns:
        ``(ids, loss_mask)``: the appended ids and, per id, 1 on policy tokens, 0 on
        environment tokens (same length).

    Raises:
        ValueError: a segment kind not in :data:`SEGMENT_KINDS` (naming it and the choices),
            an environment segment that encodes to no tokens, or text the tokenizer cannot
            encode.
    """
    ids: list[int] = []
    mask: list[int] = []
    for i, seg in enumerate(segments):
        kind = seg["kind"]
        if kind not in SEGMENT_KINDS:
            raise ValueError(f"segments[{i}].kind={kind!r}: valid kinds are {list(SEGMENT_KINDS)}")
        part = encode_response(tokenizer, seg["text"]) if kind == "policy" else tokenizer.encode(seg["text"])
        if not part:
            raise ValueError(f"segments[{i}]: the environment's text {seg['text']!r} encodes to no tokens")
        ids.extend(part)
        mask.extend([1 if kind == "policy" else 0] * len(part))
    return ids, mask


def check_conversation(messages, where: str = "messages") -> list[dict]:
    """A whole conversation: a list of at least two ``{"role": str, "content": str}``
    messages whose last one is the assistant's (the turn that is scored).

    Raises:
        ValueError: naming ``where``, the message and what is wrong.
    """
    if not isinstance(messages, list) or len(messages) < 2:
        raise ValueError(f"{where}: expected a conversation, a list of at least two "
                         f"{{'role', 'content'}} messages ending with the assistant's, got {messages!r:.200}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"] \
                or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}[{i}]: expected {{'role': str, 'content': str}}, got {m!r:.200}")
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"{where}: the last message must be the assistant's (the turn the reward "
                         f"model scores), got {messages[-1]['role']!r}")
    return messages


def encode_conversation(tokenizer: Tokenizer, messages: list[dict], chat_template: Optional[str] = None,
                        system_prompt: Optional[str] = None) -> tuple[list[int], list[int]]:
    """A whole conversation as the reward model reads it: ``(prompt_ids, response_ids)``.

    The one rendering of a conversation for the RM, used by the RM trainer's conversation
    pairs (:func:`load_preference_dataset`) and by the RM server's ``messages`` items
    (:class:`~nemo_rlhf.reward.rm_scorer.RewardModelScorer`), so training and serving
    cannot drift. It is the single-turn layout with everything before the final assistant
    message as the prompt:

    * ``prompt_ids``: ``messages[:-1]`` rendered by ``chat_template`` with its generation
      prompt (:func:`encode_prompt` of those messages: the template's own rendering of the
      earlier assistant and tool/user turns, as ``apply_chat_template(messages[:-1],
      add_generation_prompt=True)``); with ``chat_template=None`` (a tokenizer without a
      template, e.g. the tiny model's) ``[BOS]`` and each message's content tokenised alone,
      concatenated (as a trajectory is built: the prompt, then each turn's ids appended);
    * ``response_ids``: the final assistant message, ``encode(content) + [EOS]``.

    So ``[user p, assistant r]`` gives exactly the single-turn ids of ``(p, r)``, and the
    score is read at the EOS, as the RM is trained on single-turn pairs (a whole
    ``apply_chat_template(messages)`` would end with the template's closer after the EOS,
    e.g. ChatML's newline).

    Args:
        tokenizer: the RM's tokenizer.
        messages: ``[{"role", "content"}, ...]``, at least two, the last the assistant's.
        chat_template / system_prompt: the RM's ``data.chat_template`` / ``data.system_prompt``.

    Returns:
        ``(prompt_ids, response_ids)``, lists of ints.

    Raises:
        ValueError: a malformed conversation (:func:`check_conversation`), a system prompt
            without a template, or what :func:`encode_prompt` raises.
    """
    check_conversation(messages)
    context, final = messages[:-1], messages[-1]["content"]
    if chat_template is None:
        if system_prompt:
            raise ValueError("data.system_prompt is set but data.chat_template is null; "
                             "a system prompt needs a chat template ('chatml' or 'model')")
        prompt = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        for m in context:
            prompt += tokenizer.encode(m["content"])
    else:
        prompt = encode_prompt(tokenizer, "", chat_template, system_prompt, [dict(m) for m in context])
    return prompt, encode_response(tokenizer, final)


def _split_pair(chosen: list[int], rejected: list[int]) -> tuple[list[int], list[int], list[int]]:
    """``(shared prefix, chosen rest, rejected rest)`` of two whole sequences; each rest
    keeps at least one token."""
    k = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        k += 1
    k = min(k, len(chosen) - 1, len(rejected) - 1)
    return chosen[:k], chosen[k:], rejected[k:]


def _encode_field(fn, where: str, name: str, *args):
    try:
        return fn(*args)
    except ValueError as exc:
        raise DataError(f"{where}: field {name!r}: {exc}") from None


def _fit(prompt_len: int, response: list[int], cfg: DataConfig) -> Optional[list[int]]:
    """The response cut to fit, None when the row must be dropped."""
    room = cfg.max_seq_length - prompt_len
    if len(response) <= room:
        return response
    if cfg.overlong_policy == "drop" or room < 1:
        return None
    return response[:room]


def sft_loss_tokens(sample: SFTSample) -> int:
    """Tokens of ``sample`` the SFT loss counts: its policy tokens (every response token
    of a single-turn row)."""
    return len(sample.response_ids) if sample.loss_mask is None else sum(sample.loss_mask)


def _load(path, kind: str, cfg: DataConfig, build) -> TokenizedDataset:
    rows, wheres, report = read_rows(path, kind, cfg.skip_invalid, dict(cfg.fields))
    samples = []
    for row, where in zip(rows, wheres):
        try:
            sample = build(row, where, report)
        except DataError as exc:
            if not cfg.skip_invalid:
                raise
            report.add_error(str(exc))
            continue
        if sample is not None:
            samples.append(sample)
    report.rows_kept = len(samples)
    return TokenizedDataset(samples, report)


def load_sft_dataset(path: str | Path, tokenizer: Tokenizer, cfg: DataConfig) -> TokenizedDataset[SFTSample]:
    """Read, validate and tokenize an SFT JSONL file (``response`` rows, or ``segments``
    rows: the module docstring).

    Raises:
        DataError: an invalid row (file, line, field) unless ``cfg.skip_invalid``.
    """
    def build(row, where, report):
        p = _encode_field(encode_prompt, where, "messages" if "messages" in row else "prompt", tokenizer,
                          row["prompt"], cfg.chat_template, cfg.system_prompt, row.get("messages"))
        mask = None
        if "segments" in row:
            r, mask = _encode_field(encode_segments, where, "segments", tokenizer, row["segments"])
        else:
            r = _encode_field(encode_response, where, "response", tokenizer, row["response"])
        fitted = _fit(len(p), r, cfg)
        if fitted is not None and mask is not None:
            mask = mask[:len(fitted)]
            if not any(mask):  # the cut left only environment tokens: nothing to train on
                fitted = None
        if fitted is None:
            report.dropped_overlong += 1
            return None
        report.truncated += len(fitted) < len(r)
        return SFTSample(p, fitted, mask)

    return _load(path, "sft", cfg, build)


def load_preference_dataset(path: str | Path, tokenizer: Tokenizer,
                            cfg: DataConfig) -> TokenizedDataset[PreferenceSample]:
    """Read, validate and tokenize a preference JSONL file.

    A pair of whole conversations (``chosen`` / ``rejected`` message lists,
    :mod:`nemo_rlhf.data.jsonl`) is rendered by :func:`encode_conversation` (what the RM
    server scores); the sample's ``prompt_ids`` is the longest prefix the two renderings
    share and ``chosen_ids`` / ``rejected_ids`` the rest of each, so ``prompt_ids +
    chosen_ids`` is the chosen conversation's ids exactly (before any truncation).

    Raises:
        DataError: an invalid row (file, line, field) unless ``cfg.skip_invalid``.
    """
    def build(row, where, report):
        if CONVERSATION_FIELDS[0] in row:  # a pair of whole conversations
            c_p, c_r = _encode_field(encode_conversation, where, "chosen", tokenizer,
                                     row[CONVERSATION_FIELDS[0]], cfg.chat_template, cfg.system_prompt)
            r_p, r_r = _encode_field(encode_conversation, where, "rejected", tokenizer,
                                     row[CONVERSATION_FIELDS[1]], cfg.chat_template, cfg.system_prompt)
            p, c, r = _split_pair(c_p + c_r, r_p + r_r)
        else:
            p = _encode_field(encode_prompt, where, "messages" if "messages" in row else "prompt", tokenizer,
                              row["prompt"], cfg.chat_template, cfg.system_prompt, row.get("messages"))
            c = _encode_field(encode_response, where, "chosen", tokenizer, row["chosen"])
            r = _encode_field(encode_response, where, "rejected", tokenizer, row["rejected"])
        fc, fr = _fit(len(p), c, cfg), _fit(len(p), r, cfg)
        if fc is None or fr is None or fc == fr:
            report.dropped_overlong += 1
            return None
        report.truncated += len(fc) < len(c) or len(fr) < len(r)
        return PreferenceSample(p, fc, fr)

    return _load(path, "preference", cfg, build)


def load_prompt_dataset(path: str | Path, tokenizer: Tokenizer, cfg: DataConfig,
                        max_prompt_length: int) -> TokenizedDataset[PromptSample]:
    """Read, validate and tokenize a prompt JSONL file (PPO, evaluation).

    Rows whose tokenized prompt is longer than ``max_prompt_length`` are dropped and
    counted (whatever ``overlong_policy`` says).

    Raises:
        DataError: an invalid row (file, line, field) unless ``cfg.skip_invalid``.
    """
    def build(row, where, report):
        p = _encode_field(encode_prompt, where, "messages" if "messages" in row else "prompt", tokenizer,
                          row["prompt"], cfg.chat_template, cfg.system_prompt, row.get("messages"))
        if len(p) > max_prompt_length:
            report.dropped_overlong += 1
            return None
        extras = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
        return PromptSample(p, row["prompt"], extras)

    return _load(path, "prompt", cfg, build)


# --------------------------------------------------------------------------- collation
def pad_right(seqs: Sequence[Sequence[int]], pad_id: int,
              length: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists.

    Returns:
        ``(input_ids [B, L] int64, attention_mask [B, L] int64)`` with ``L = length`` or
        the longest sequence.

    Raises:
        ValueError: a sequence is longer than ``length``.
    """
    longest = max((len(s) for s in seqs), default=0)
    length = longest if length is None else length
    if longest > length:
        raise ValueError(f"sequence of {longest} tokens does not fit the padded length {length}")
    # host tensors: forward_backward moves micro-batches to dims.device
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(seqs), length), dtype=torch.long, device="cpu")
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(list(s), dtype=torch.long, device="cpu")
        mask[i, :len(s)] = 1
    return ids, mask


def sft_length(sample: SFTSample) -> int:
    """Tokens of an SFT sample (prompt + response)."""
    return len(sample.prompt_ids) + len(sample.response_ids)


def preference_length(sample: PreferenceSample) -> int:
    """Tokens of the longer side of a preference pair."""
    return len(sample.prompt_ids) + max(len(sample.chosen_ids), len(sample.rejected_ids))


def pair_tokens(sample: PreferenceSample) -> int:
    """Tokens of both sides of a preference pair (the chosen and the rejected row's)."""
    return 2 * len(sample.prompt_ids) + len(sample.chosen_ids) + len(sample.rejected_ids)


def collate_sft(samples: Sequence[SFTSample], pad_id: int, length: Optional[int] = None) -> dict:
    """SFT micro-batch.

    Returns:
        ``input_ids [B, L]`` int64, ``attention_mask [B, L]`` int64 and ``loss_mask
        [B, L]`` float32: 1.0 at response tokens (the targets of the loss; EOS included)
        that :attr:`SFTSample.loss_mask` does not exclude (a segmented row: policy tokens
        only), 0.0 at BOS, prompt, environment tokens and padding.
    """
    ids, mask = pad_right([s.prompt_ids + s.response_ids for s in samples], pad_id, length)
    loss_mask = torch.zeros(ids.shape, dtype=torch.float32, device="cpu")  # host, as ids
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        if s.loss_mask is None:
            loss_mask[i, p:p + len(s.response_ids)] = 1.0
        else:
            loss_mask[i, p:p + len(s.response_ids)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def collate_preference(samples: Sequence[PreferenceSample], pad_id: int,
                       length: Optional[int] = None) -> dict:
    """RM micro-batch of ``B`` pairs: rows ``0..B-1`` chosen, ``B..2B-1`` rejected.

    Returns:
        ``input_ids [2B, L]`` int64, ``attention_mask [2B, L]`` int64, ``lengths [2B]``
        int64 (valid tokens per row; the reward is read at ``lengths - 1``).
    """
    seqs = ([s.prompt_ids + s.chosen_ids for s in samples]
            + [s.prompt_ids + s.rejected_ids for s in samples])
    ids, mask = pad_right(seqs, pad_id, length)
    return {"input_ids": ids, "attention_mask": mask, "lengths": mask.sum(-1)}
