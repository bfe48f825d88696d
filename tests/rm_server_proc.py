"""A reward-model server with a fake scorer, run as a subprocess by the reward tests.

    python tests/rm_server_proc.py --address-file F [--port P] [--load-delay-s S] ...

The fake scorer is deterministic (:func:`expected_score`), so a test can compare served
scores with in-process ones. Special responses: one containing ``RAISE`` makes the batch
fail; one containing ``SLOW`` makes the batch take 5 s (to kill the server mid-request).
``--checkpoint-path`` and ``--scale`` make another "RM" (its identity and scores differ).
Conversation items (``messages``) are scored too (``takes_conversations``); ``--log-items F``
appends every scored item's wire form and score to ``F`` (JSONL).
With ``--max-tokens N`` an item over N fake tokens (:func:`fake_tokens`) is refused by
``check_items`` (ItemTooLong) and makes ``score_batch`` raise, as a real RM's forward would.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import zlib

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from nemo_rlhf.reward.batching import ItemTooLong, ScoreItem  # noqa: E402
from nemo_rlhf.reward.server import RMServerConfig, serve  # noqa: E402

VOCAB_SIZE = 1000


def expected_score(item: ScoreItem) -> float:
    """len(response) + a hash-derived fraction of (prompt, response), in [len, len+1); a
    conversation's response is its last message, its prompt the JSON of the others."""
    if getattr(item, "messages", None) is not None:  # a conversation (ScoreItem.is_conversation)
        prompt, response = json.dumps(item.messages[:-1]), item.messages[-1]["content"]
        length = len(response)
    elif item.is_tokens:
        prompt, response = ",".join(map(str, item.prompt_ids)), ",".join(map(str, item.response_ids))
        length = len(item.response_ids)
    else:
        prompt, response, length = item.prompt, item.response, len(item.response)
    return float(length) + zlib.crc32(f"{prompt}\x00{response}".encode()) / 2**32


def fake_tokens(item: ScoreItem) -> int:
    """Fake token count: one token per character of prompt + response, or the id count."""
    if item.is_tokens:
        return len(item.prompt_ids) + len(item.response_ids)
    if getattr(item, "messages", None) is not None:  # a conversation (ScoreItem.is_conversation)
        return sum(len(m["content"]) for m in item.messages)
    return len(item.prompt) + len(item.response)


class HashScorer:
    """Fake RM: costs ``call_ms`` per call plus ``item_ms`` per item; scores by expected_score.

    ``max_tokens``: the longest item in :func:`fake_tokens` (None: no limit).
    """

    vocab_size = VOCAB_SIZE
    takes_conversations = True

    def __init__(self, call_ms: float = 0.0, item_ms: float = 0.0, max_tokens: int | None = None,
                 checkpoint_path: str = "/fake/rm", scale: float = 1.0, log_items: str | None = None) -> None:
        self.call_ms, self.item_ms, self.max_seq_length = call_ms, item_ms, max_tokens
        self.checkpoint_path, self.scale, self.log_items = checkpoint_path, scale, log_items

    def check_items(self, items: list[ScoreItem]) -> None:
        """Raises ItemTooLong naming the first item over ``max_seq_length`` fake tokens."""
        for i, it in enumerate(items):
            if self.max_seq_length is not None and fake_tokens(it) > self.max_seq_length:
                raise ItemTooLong(f"items[{i}]: {fake_tokens(it)} tokens exceed max_seq_length={self.max_seq_length}",
                                  f"items[{i}]")

    def score_batch(self, items: list[ScoreItem]) -> list[float]:
        for it in items:
            if self.max_seq_length is not None and fake_tokens(it) > self.max_seq_length:
                raise ValueError(f"fake forward: a row of {fake_tokens(it)} tokens is past the position range")
            text = it.response if it.response is not None else ""
            if "RAISE" in text:
                raise RuntimeError("fake scorer exploded on purpose")
            if "SLOW" in text:
                time.sleep(5.0)
        time.sleep((self.call_ms + self.item_ms * len(items)) / 1000.0)
        scores = [self.scale * expected_score(it) for it in items]
        if self.log_items:  # one JSON line per item: its wire form and its score
            with open(self.log_items, "a") as f:
                for it, sc in zip(items, scores):
                    f.write(json.dumps({"item": it.to_json(), "score": sc}) + "\n")
        return scores

    def metadata(self) -> dict:
        return {"model_name": "hash-scorer", "checkpoint_path": self.checkpoint_path, "checkpoint_step": 7,
                "tokenizer": "fake-bytes", "reward_mean": 2.0, "reward_std": 4.0,
                "max_seq_length": self.max_seq_length}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address-file", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--load-delay-s", type=float, default=0.0)
    p.add_argument("--release-file", default=None, help="loading lasts until this file exists")
    p.add_argument("--fail-load", action="store_true")
    p.add_argument("--call-ms", type=float, default=0.0)
    p.add_argument("--item-ms", type=float, default=0.0)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--max-items-per-request", type=int, default=1024)
    p.add_argument("--max-text-chars", type=int, default=65536)
    p.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    p.add_argument("--auth-token-env", default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="the fake scorer's max_seq_length")
    p.add_argument("--checkpoint-path", default="/fake/rm", help="the RM identity in /metadata")
    p.add_argument("--scale", type=float, default=1.0, help="scores are scale * expected_score")
    p.add_argument("--log-items", default=None, help="append each scored item and its score to this JSONL")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[rm-server] %(levelname)s %(message)s")
    cfg = RMServerConfig(
        port=args.port, max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
        max_items_per_request=args.max_items_per_request, max_text_chars=args.max_text_chars,
        max_body_bytes=args.max_body_bytes, auth_token_env=args.auth_token_env, address_file=args.address_file,
    )

    def factory() -> HashScorer:
        time.sleep(args.load_delay_s)
        while args.release_file and not os.path.exists(args.release_file):
            time.sleep(0.02)
        if args.fail_load:
            raise RuntimeError("fake checkpoint is corrupt")
        return HashScorer(args.call_ms, args.item_ms, args.max_tokens, args.checkpoint_path, args.scale,
                          args.log_items)

    serve(factory, cfg)


if __name__ == "__main__":
    main()
