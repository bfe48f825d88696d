"""Datasets (SFT, preference, prompts), the tokenizer wrapper and the prompt template.

``jsonl`` reads and validates rows (:class:`DataError` names file, line and field);
``datasets`` tokenizes them and pads batches; ``templates`` holds :func:`format_prompt`,
the one formatter SFT, RM and PPO share; ``tokenizer`` wraps a Hugging Face
``tokenizer.json`` with explicit BOS/EOS/PAD ids. The demo tasks' data: :mod:`nemo_rlhf.tasks`.
"""

from nemo_rlhf.data.datasets import (
    DataConfig,
    PreferenceSample,
    PromptSample,
    SFTSample,
    TokenizedDataset,
    collate_preference,
    collate_sft,
    encode_conversation,
    encode_prompt,
    encode_response,
    load_preference_dataset,
    load_prompt_dataset,
    load_sft_dataset,
    pad_right,
)
from nemo_rlhf.data.jsonl import DataError, LoadReport, read_jsonl
from nemo_rlhf.data.tables import read_rows
from nemo_rlhf.data.templates import CHAT_TEMPLATES, format_prompt
from nemo_rlhf.data.tokenizer import Tokenizer

__all__ = [
    "CHAT_TEMPLATES", "DataConfig", "DataError", "LoadReport", "PreferenceSample", "PromptSample",
    "SFTSample", "TokenizedDataset", "Tokenizer", "collate_preference", "collate_sft",
    "encode_conversation", "encode_prompt", "encode_response", "format_prompt", "load_preference_dataset",
    "load_prompt_dataset", "load_sft_dataset", "pad_right", "read_jsonl", "read_rows",
]
