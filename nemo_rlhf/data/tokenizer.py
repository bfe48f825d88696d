"""A Hugging Face ``tokenizers`` tokenizer with explicit BOS / EOS / PAD ids (offline).

A tokenizer directory holds ``tokenizer.json`` and one of

* ``special_tokens.json``: ``{"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}``
* ``tokenizer_config.json`` (Hugging Face): the same keys, a string or ``{"content": ...}``.

``pad_token`` may be absent (then PAD = EOS) or equal to EOS: nothing in the package
decides anything from a token id being PAD; masks and lengths do. ``bos_token`` may be
absent (nothing is prepended). Special tokens are never added by ``encode``; the dataset
code places BOS and EOS itself.

``chat_template``: the model's Jinja chat template, from ``chat_template.jinja`` or the
``chat_template`` of ``tokenizer_config.json`` (a list of named templates: the one named
``default``), else None (``data.chat_template=model`` needs it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

SPECIAL_FILES = ("special_tokens.json", "tokenizer_config.json")


def _token_text(value) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token entry {value!r}: expected a string or {{'content': str}}")


class Tokenizer:
    """``tokenizer.json`` plus special-token ids.

    Args:
        path: a directory holding ``tokenizer.json`` (and a special-tokens file), or the
            ``tokenizer.json`` file itself (special tokens read from its directory).

    Raises:
        FileNotFoundError: no ``tokenizer.json`` or no special-tokens file.
        ValueError: no EOS token, or a special token missing from the vocabulary.
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer: {file} does not exist")
        self.path = file.parent
        self.hf = HFTokenizer.from_file(str(file))
        specials = self._read_specials(self.path)
        self.bos_token = _token_text(specials.get("bos_token"))
        self.eos_token = _token_text(specials.get("eos_token"))
        self.pad_token = _token_text(specials.get("pad_token")) or self.eos_token
        if self.eos_token is None:
            raise ValueError(f"tokenizer {self.path}: no eos_token in {SPECIAL_FILES}")
        self.unk_token = _token_text(specials.get("unk_token"))
        self.chat_template = self._read_chat_template(self.path)
        self.bos_id = self._id(self.bos_token) if self.bos_token else None
        self.eos_id = self._id(self.eos_token)
        self.pad_id = self._id(self.pad_token)

    @staticmethod
    def _read_specials(directory: Path) -> dict:
        for name in SPECIAL_FILES:
            p = directory / name
            if p.is_file():
                return json.loads(p.read_text(encoding="utf-8"))
        raise FileNotFoundError(f"tokenizer {directory}: none of {SPECIAL_FILES} found "
                                f"(they name bos_token / eos_token / pad_token)")

    @staticmethod
    def _read_chat_template(directory: Path) -> Optional[str]:
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        config = directory / "tokenizer_config.json"
        if not config.is_file():
            return None
        value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(value, list):  # named templates
            value = next((t.get("template") for t in value if t.get("name") == "default"), None)
        return value if isinstance(value, str) else None

    def _id(self, token: str) -> int:
        tid = self.hf.token_to_id(token)
        if tid is None:
            raise ValueError(f"tokenizer {self.path}: special token {token!r} is not in the vocabulary")
        return tid

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``model.vocab_size``)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without any special token added.

        Raises:
            ValueError: the text cannot be tokenized (e.g. a character outside a
                vocabulary without an unknown token).
        """
        try:
            return self.hf.encode(text, add_special_tokens=False).ids
        except Exception as exc:  # tokenizers raises a bare Exception
            raise ValueError(f"cannot tokenize {text[:60]!r}: {exc}") from None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens dropped by default)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def fingerprint(self) -> str:
        """sha256 hex digest of what maps text to ids here: the tokenizer's serialised form, the
        BOS / EOS / PAD ids and the chat template. Two tokenizers with one fingerprint
        give the same ids for the same text and conversation (the PPO trainer compares
        the policy's with the served RM's to decide whether the RM may read the
        trajectory's own ids, :mod:`nemo_rlhf.reward.functions`)."""
        import hashlib

        h = hashlib.sha256(self.hf.to_str().encode())
        h.update(json.dumps([self.bos_id, self.eos_id, self.pad_id, self.chat_template]).encode())
        return h.hexdigest()

    def describe(self) -> dict:
        """JSON-able facts: path, vocab size and special ids (checkpoint metadata)."""
        return {"path": str(self.path), "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "pad_id": self.pad_id}
