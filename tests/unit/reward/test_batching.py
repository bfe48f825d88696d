"""DynamicBatcher in-process, request parsing, and RMServerConfig validation."""

from __future__ import annotations

import math
import re
import threading
import time

import pytest

from nemo_rlhf.reward.batching import (
    BatcherStopped,
    DynamicBatcher,
    ItemRejected,
    ItemTooLong,
    ScoreItem,
    validate_token_ids,
)
from nemo_rlhf.reward.server import RequestError, RMServerConfig, parse_score_request


class RecordingScorer:
    """score = float(len(response)); records each batch size and the calling thread.

    ``bad``: every call raises ("raise") or returns too few ("short") or NaN ("nan") scores.
    ``poison``: a response text that makes any call holding it raise.
    """

    vocab_size = 100

    def __init__(self, delay_s: float = 0.0, bad: str | None = None, poison: str | None = None) -> None:
        self.delay_s, self.bad, self.poison = delay_s, bad, poison
        self.batches: list[int] = []
        self.responses: list[list[str]] = []
        self.threads: set[str] = set()
        self.closed = False
        self.started = threading.Event()

    def score_batch(self, items):
        self.started.set()
        self.threads.add(threading.current_thread().name)
        self.batches.append(len(items))
        self.responses.append([it.response for it in items])
        time.sleep(self.delay_s)
        if self.poison is not None and any(it.response == self.poison for it in items):
            raise RuntimeError(f"cannot score {self.poison!r}")
        if self.bad == "raise":
            raise RuntimeError("model fault")
        if self.bad == "short":
            return [0.0] * (len(items) - 1)
        if self.bad == "nan":
            return [math.nan] * len(items)
        return [float(len(it.response)) for it in items]

    def metadata(self):
        return {"model_name": "recording"}

    def close(self):
        self.closed = True


def _items(lengths):
    return [ScoreItem(prompt="p", response="x" * n) for n in lengths]


def _ready(batcher: DynamicBatcher) -> DynamicBatcher:
    done = threading.Event()
    batcher.start(on_ready=done.set, on_failed=lambda exc: done.set())
    assert done.wait(5)
    deadline = time.monotonic() + 5  # on_ready returns just before the state turns ready
    while batcher.state == "loading" and time.monotonic() < deadline:
        time.sleep(0.001)
    return batcher


def test_on_ready_runs_before_the_state_says_ready():
    """The server writes its address file in on_ready: a client that saw "ready" on /health
    must find it written."""
    seen = []
    b = DynamicBatcher(RecordingScorer, max_batch_size=4, max_wait_ms=0)
    done = threading.Event()
    b.start(on_ready=lambda: (seen.append(b.state), done.set()))
    try:
        assert done.wait(5) and seen == ["loading"]
        deadline = time.monotonic() + 5
        while b.state != "ready" and time.monotonic() < deadline:
            time.sleep(0.001)
        assert b.state == "ready"
    finally:
        b.stop()


def test_large_request_is_split_into_max_batch_size_calls_and_reassembled_in_order():
    scorer = RecordingScorer()
    b = _ready(DynamicBatcher(lambda: scorer, max_batch_size=4, max_wait_ms=0))
    try:
        lengths = list(range(10))
        assert b.submit(_items(lengths)).result(5) == [float(n) for n in lengths]
        assert scorer.batches == [4, 4, 2]
        assert b.stats()["batches"] == 3 and b.stats()["largest_batch"] == 4
    finally:
        b.stop()


def test_concurrent_submissions_share_one_call_and_each_gets_its_slice():
    scorer = RecordingScorer()
    b = _ready(DynamicBatcher(lambda: scorer, max_batch_size=100, max_wait_ms=200))
    try:
        futures = [b.submit(_items([k, k + 1])) for k in range(5)]
        assert [f.result(5) for f in futures] == [[float(k), float(k + 1)] for k in range(5)]
        assert scorer.batches == [10]  # closed by the 200 ms window, all five together
    finally:
        b.stop()


def test_full_batch_is_scored_without_waiting_for_the_window():
    scorer = RecordingScorer()
    b = _ready(DynamicBatcher(lambda: scorer, max_batch_size=2, max_wait_ms=10_000))
    try:
        t0 = time.monotonic()
        assert b.submit(_items([1, 2])).result(5) == [1.0, 2.0]
        assert time.monotonic() - t0 < 5
    finally:
        b.stop()


def test_all_scorer_calls_happen_on_the_one_model_thread_and_close_is_called():
    scorer = RecordingScorer()
    seen = []

    def factory():
        seen.append(threading.current_thread().name)
        return scorer

    b = _ready(DynamicBatcher(factory, max_batch_size=3, max_wait_ms=1))
    futures = [b.submit(_items([1, 2])) for _ in range(4)]
    [f.result(5) for f in futures]
    b.stop()
    assert scorer.threads == set(seen) == {"rm-model-thread"} and scorer.closed and b.state == "stopped"


@pytest.mark.parametrize("bad, match", [("raise", "model fault"), ("short", "0 scores for 1 items"), ("nan", "non-finite")])
def test_scorer_fault_fails_every_request_in_the_batch_and_later_batches_still_work(bad, match):
    scorer = RecordingScorer(bad=bad)
    b = _ready(DynamicBatcher(lambda: scorer, max_batch_size=8, max_wait_ms=50))
    try:
        futures = [b.submit(_items([1])), b.submit(_items([2]))]
        for f in futures:
            with pytest.raises(Exception, match=match):
                f.result(5)
        scorer.bad = None
        assert b.submit(_items([3])).result(5) == [3.0]
        assert b.stats()["failed_batches"] == 3  # the pair, then each request alone
        assert b.stats()["isolated_failures"] == 2
    finally:
        b.stop()


def test_factory_failure_sets_failed_state_and_submit_is_refused():
    def factory():
        raise OSError("no such checkpoint")

    failures = []
    b = DynamicBatcher(factory, max_batch_size=2, max_wait_ms=1)
    done = threading.Event()
    b.start(on_failed=lambda exc: (failures.append(exc), done.set()))
    assert done.wait(5)
    assert b.state == "failed" and isinstance(b.error, OSError) and failures
    with pytest.raises(RuntimeError, match="not ready"):
        b.submit(_items([1]))


def test_stop_fails_queued_requests_and_refuses_new_ones():
    scorer = RecordingScorer(delay_s=0.3)
    b = _ready(DynamicBatcher(lambda: scorer, max_batch_size=1, max_wait_ms=0))
    first = b.submit(_items([1]))
    assert scorer.started.wait(5)  # first is being scored
    queued = b.submit(_items([2]))
    b.stop()
    assert first.result(5) == [1.0]
    with pytest.raises(BatcherStopped):
        queued.result(5)
    with pytest.raises(BatcherStopped):
        b.submit(_items([3]))


def test_validate_token_ids_names_field_and_position():
    assert validate_token_ids([0, 5, 99], 100, "x") == [0, 5, 99]
    for ids, needle in [([1, -1], "x[1]: token id -1"), ([100], "x[0]: token id 100 out of range [0, 100)"),
                        ([True], "x[0]: expected an int"), ([2.0], "x[0]: expected an int"), ("12", "x: expected a list")]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            validate_token_ids(ids, 100, "x")
    assert validate_token_ids([10**6], None) == [10**6]


def test_score_item_requires_exactly_one_complete_form():
    assert ScoreItem(prompt="a", response="").to_json() == {"prompt": "a", "response": ""}
    assert ScoreItem(prompt_ids=[1], response_ids=[]).is_tokens
    for kwargs in [{}, {"prompt": "a"}, {"prompt": "a", "response": "b", "response_ids": [1]}, {"prompt_ids": [1]}]:
        with pytest.raises(ValueError, match="ScoreItem"):
            ScoreItem(**kwargs)


def test_parse_rejects_token_items_for_a_text_only_scorer():
    cfg = RMServerConfig()
    with pytest.raises(RequestError, match=r"items\[0\]: this reward model takes text only") as info:
        parse_score_request(b'{"items": [{"prompt_ids": [1], "response_ids": [2]}]}', cfg, vocab_size=None)
    assert info.value.status == 422
    with pytest.raises(RequestError, match="mixes text fields"):
        parse_score_request(b'{"items": [{"prompt": "a", "response_ids": [2]}]}', cfg, vocab_size=10)
    assert parse_score_request(b'{"items": [{"prompt": "a", "response": "b"}]}', cfg, None) == [ScoreItem(prompt="a", response="b")]


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("port", 70000, "RMServerConfig.port=70000 is invalid; valid: an int in [0, 65535]"),
        ("max_batch_size", 0, "RMServerConfig.max_batch_size=0 is invalid; valid: an int >= 1"),
        ("max_wait_ms", -1, "RMServerConfig.max_wait_ms=-1"),
        ("max_body_bytes", 1.5, "RMServerConfig.max_body_bytes=1.5"),
        ("auth_token_env", "not a name", "environment variable NAME"),
        ("log_level", "loud", "server.log_level='loud': valid choices are ['critical', 'error', 'warning'"),
        ("address_file", "", "RMServerConfig.address_file"),
    ],
)
def test_server_config_validation_names_key_and_valid_values(key, value, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        RMServerConfig(**{key: value})


def test_stop_while_loading_returns_at_once_and_close_follows_the_factory():
    release = threading.Event()
    scorer = RecordingScorer()

    def slow_factory():
        release.wait(5)
        return scorer

    b = DynamicBatcher(slow_factory, max_batch_size=2, max_wait_ms=1)
    b.start()
    t0 = time.monotonic()
    b.stop(timeout_s=10)
    assert time.monotonic() - t0 < 1 and b.state == "loading"
    release.set()
    deadline = time.monotonic() + 5
    while not scorer.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scorer.closed and b.state == "stopped" and scorer.batches == []


class CheckingScorer(RecordingScorer):
    """RecordingScorer whose ``check_items`` refuses responses longer than ``max_len`` (413)
    and the response "bad" (422)."""

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.checked: list[int] = []

    def check_items(self, items):
        self.checked.append(len(items))
        for i, it in enumerate(items):
            if it.response == "bad":
                raise ItemRejected(f"items[{i}]: bad item", f"items[{i}]")
            if len(it.response) > self.max_len:
                raise ItemTooLong(f"items[{i}]: {len(it.response)} tokens exceed max_seq_length={self.max_len}")


def test_check_items_refuses_a_request_before_batching_and_its_companions_share_one_call():
    scorer = CheckingScorer(max_len=5)
    b = _ready(DynamicBatcher(lambda: scorer, max_batch_size=100, max_wait_ms=200))
    try:
        good1, long, good2 = (b.submit(_items(n)) for n in ([1, 2], [3, 9], [4]))
        bad = b.submit([ScoreItem(prompt="p", response="x"), ScoreItem(prompt="p", response="bad")])
        good3 = b.submit(_items([5]))
        assert good1.result(5) == [1.0, 2.0] and good2.result(5) == [4.0] and good3.result(5) == [5.0]
        with pytest.raises(ItemTooLong, match=re.escape("items[1]: 9 tokens exceed max_seq_length=5")) as info:
            long.result(5)
        assert info.value.status == 413
        with pytest.raises(ItemRejected, match=re.escape("items[1]: bad item")) as info:
            bad.result(5)
        assert info.value.status == 422 and info.value.field == "items[1]"
        assert scorer.batches == [4]  # the good requests only, in one call
        assert scorer.checked == [2, 2, 1, 2, 1]  # each request checked once, whole, in order
        stats = b.stats()
        assert stats["rejected_requests"] == 2 and stats["failed_batches"] == 0
    finally:
        b.stop()


def test_refused_request_split_across_batches_drops_its_remaining_items():
    scorer = CheckingScorer(max_len=5)
    b = _ready(DynamicBatcher(lambda: scorer, max_batch_size=2, max_wait_ms=0))
    try:
        with pytest.raises(ItemTooLong, match=re.escape("items[4]")):
            b.submit(_items([1, 1, 1, 1, 9])).result(5)
        assert b.submit(_items([2])).result(5) == [2.0]
        assert scorer.batches == [1] and b.stats()["queued_items"] == 0
    finally:
        b.stop()


def test_a_failing_item_fails_only_its_request_and_the_others_get_their_alone_scores():
    scorer = RecordingScorer(poison="boom")
    b = _ready(DynamicBatcher(lambda: scorer, max_batch_size=100, max_wait_ms=200))
    try:
        futures = [b.submit(_items([k, k + 1])) for k in range(7)]
        bad = b.submit([ScoreItem(prompt="p", response="ok"), ScoreItem(prompt="p", response="boom")])
        futures.append(b.submit(_items([8])))
        for k, f in enumerate(futures[:7]):
            assert f.result(5) == [float(k), float(k + 1)]
        assert futures[7].result(5) == [8.0]
        with pytest.raises(RuntimeError, match="cannot score 'boom'"):
            bad.result(5)
        assert scorer.batches[0] == 17  # all nine requests were in one failing call first
        assert sum(1 for r in scorer.responses if "boom" in r) <= 5  # halving: depth log2(9) + 1
        stats = b.stats()
        assert stats["isolated_failures"] == 1 and stats["items_scored"] == 15
        assert stats["failed_batches"] == sum(1 for r in scorer.responses if "boom" in r)
    finally:
        b.stop()


def test_a_large_request_with_a_failing_item_is_dropped_after_its_failing_part():
    scorer = RecordingScorer(poison="boom")
    b = _ready(DynamicBatcher(lambda: scorer, max_batch_size=2, max_wait_ms=0))
    try:
        items = [ScoreItem(prompt="p", response=r) for r in ("a", "boom", "c", "d")]
        with pytest.raises(RuntimeError, match="cannot score"):
            b.submit(items).result(5)
        assert b.submit(_items([3])).result(5) == [3.0]
        assert scorer.responses == [["a", "boom"], ["xxx"]]  # items c, d were never scored
    finally:
        b.stop()


@pytest.mark.parametrize("body", [b"[" * 200_000 + b"]" * 200_000, b'{"items": ' + b"[" * 5000])
def test_parse_refuses_deeply_nested_json_with_400(body):
    with pytest.raises(RequestError, match="not valid JSON: nested too deeply") as info:
        parse_score_request(body, RMServerConfig(), vocab_size=10)
    assert info.value.status == 400 and info.value.field == "body"


def test_parse_refuses_an_over_long_integer_literal_with_400():
    body = b'{"items": [{"prompt_ids": [' + b"7" * 5000 + b'], "response_ids": []}]}'
    with pytest.raises(RequestError, match="not valid JSON: .*digits") as info:
        parse_score_request(body, RMServerConfig(), vocab_size=10)
    assert info.value.status == 400
