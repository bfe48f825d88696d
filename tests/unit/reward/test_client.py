"""RewardModelClient against scripted replies (httpx.MockTransport): retries and malformed replies."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from nemo_rlhf.reward.batching import ScoreItem
from nemo_rlhf.reward.client import RewardModelClient, RewardServiceError
from nemo_rlhf.reward.server import write_address_file

URL = "http://rm.test:1234"
ITEMS = [ScoreItem(prompt="a", response="b"), ScoreItem(prompt="c", response="d")]


def _client(replies, **kw):
    """A client whose transport answers with ``replies`` in turn (callables or responses); records requests."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        reply = replies[min(len(calls), len(replies)) - 1]
        return reply(request) if callable(reply) else reply

    kw = {"max_retries": 2, "backoff_s": 0.001, **kw}
    return RewardModelClient(URL, transport=httpx.MockTransport(handler), **kw), calls


def test_sends_wire_items_and_bearer_token():
    client, calls = _client([httpx.Response(200, json={"scores": [1.5, -2]})], auth_token="tok")
    assert client.score(ITEMS) == [1.5, -2.0]
    assert calls[0].headers["authorization"] == "Bearer tok"
    assert calls[0].url.path == "/score"
    assert json.loads(calls[0].content) == {"items": [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]}


def test_chunk_size_splits_requests_and_concatenates_in_order():
    def echo(request):
        items = json.loads(request.content)["items"]
        return httpx.Response(200, json={"scores": [float(len(it["response"])) for it in items]})

    client, calls = _client([echo], chunk_size=2)
    items = [ScoreItem(prompt="p", response="x" * n) for n in range(5)]
    assert client.score(items) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert len(calls) == 3


def test_5xx_is_retried_then_succeeds():
    client, calls = _client([httpx.Response(503, json={"error": "loading"}), httpx.Response(200, json={"scores": [1, 2]})])
    assert client.score(ITEMS) == [1.0, 2.0] and len(calls) == 2


def test_5xx_exhausting_retries_names_url_status_and_server_message():
    client, calls = _client([httpx.Response(500, json={"error": "CUDA out of memory"})])
    with pytest.raises(RewardServiceError, match=rf"{URL}/score: HTTP 500: CUDA out of memory \(gave up after 3 attempt"):
        client.score(ITEMS)
    assert len(calls) == 3


def test_4xx_is_not_retried():
    client, calls = _client([httpx.Response(422, json={"error": "items[0].response: expected a string", "field": "items[0].response"})])
    with pytest.raises(RewardServiceError, match=r"HTTP 422: items\[0\]\.response: expected a string"):
        client.score(ITEMS)
    assert len(calls) == 1


def test_timeouts_are_retried_with_exponential_backoff_then_named():
    def timeout(request):
        raise httpx.ReadTimeout("read timed out", request=request)

    client, calls = _client([timeout], max_retries=3, backoff_s=0.02, timeout_s=7)
    t0 = time.monotonic()
    with pytest.raises(RewardServiceError, match=rf"{URL}/score: timed out after 7.0 s \(ReadTimeout\); /health did not answer "
                                                 r"either .*4 attempt"):
        client.score(ITEMS)
    scored = [c for c in calls if c.url.path == "/score"]
    assert len(scored) == 4 and time.monotonic() - t0 >= 0.02 + 0.04 + 0.08
    # each timeout was followed by a liveness probe; every attempt carried the same request id
    assert [c.url.path for c in calls] == ["/score", "/health"] * 4
    assert len({c.headers["x-request-id"] for c in scored}) == 1


def test_a_timeout_on_a_server_that_answers_health_is_waited_out_without_spending_retries():
    # the server is alive and busy: /score times out three times, /health answers ready each
    # time, then the fourth /score (same request id) returns; max_retries=0 would have failed
    state = {"score_calls": 0}

    def handler(request):
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ready", "queued_items": 2, "items_scored": 0})
        state["score_calls"] += 1
        if state["score_calls"] <= 3:
            raise httpx.ReadTimeout("read timed out", request=request)
        return httpx.Response(200, json={"scores": [1, 2]})

    client, calls = _client([handler], max_retries=0, timeout_s=1)
    assert client.score(ITEMS) == [1.0, 2.0]
    assert client.busy_waits == 3
    ids = {c.headers["x-request-id"] for c in calls if c.url.path == "/score"}
    assert len(ids) == 1  # the server deduplicates it: the work is queued once
    # ... but not forever: past max_wait_s the busy server is reported as such
    state["score_calls"] = -10**9
    client2, _ = _client([handler], max_retries=0, timeout_s=1, max_wait_s=0.01)
    time.sleep(0.02)
    with pytest.raises(RewardServiceError, match=r"still busy after .*reward.max_wait_s=0.01"):
        client2.score(ITEMS)


def test_broken_connection_is_retried():
    def broken(request):
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    client, calls = _client([broken, httpx.Response(200, json={"scores": [3, 4]})])
    assert client.score(ITEMS) == [3.0, 4.0] and len(calls) == 2


@pytest.mark.parametrize(
    "reply, needle",
    [
        (httpx.Response(200, text="<html>oops</html>"), "malformed reply (not JSON)"),
        (httpx.Response(200, json={"score": [1, 2]}), "malformed reply (no 'scores' list)"),
        (httpx.Response(200, json={"scores": "1,2"}), "'scores' is str, not a list"),
        (httpx.Response(200, json={"scores": [1, "2"]}), "score 1 is '2', not a finite float"),
        (httpx.Response(200, json={"scores": [1, None]}), "score 1 is None"),
        (httpx.Response(200, json={"scores": [True, 1]}), "score 0 is True"),
        (httpx.Response(200, text='{"scores": [1, NaN]}'), "score 1 is nan"),
        (httpx.Response(200, json={"scores": [1.0]}), "wrong number of scores: got 1 for 2 items"),
    ],
)
def test_malformed_reply_raises_naming_url_and_problem(reply, needle):
    client, calls = _client([reply])
    with pytest.raises(RewardServiceError) as info:
        client.score(ITEMS)
    assert needle in str(info.value) and URL in str(info.value)
    assert len(calls) == 1  # a 200 with a bad body is not retried


def test_from_address_file_waits_for_the_file(tmp_path):
    path = tmp_path / "rm.addr"
    threading.Timer(0.2, write_address_file, args=(str(path), "http://127.0.0.1:4321")).start()
    client = RewardModelClient.from_address_file(str(path), wait_s=5, poll_s=0.02)
    assert client.url == "http://127.0.0.1:4321"
    assert not list(tmp_path.glob("*.tmp.*"))


def test_from_address_file_times_out_naming_the_path(tmp_path):
    path = tmp_path / "missing.addr"
    with pytest.raises(RewardServiceError, match=r"missing\.addr after 0.1 s: file does not exist"):
        RewardModelClient.from_address_file(str(path), wait_s=0.1, poll_s=0.02)
    path.write_text("garbage\n")
    with pytest.raises(RewardServiceError, match="unexpected content 'garbage'"):
        RewardModelClient.from_address_file(str(path))


def test_wait_until_healthy_reports_last_status():
    client, _ = _client([httpx.Response(503, json={"status": "loading"})])
    with pytest.raises(RewardServiceError, match=r"rm.test:1234 not healthy after 0.1 s; last status: HTTP 503 \{'status': 'loading'\}"):
        client.wait_until_healthy(deadline_s=0.1, poll_s=0.02)
    ready, _ = _client([httpx.Response(503, json={"status": "loading"}), httpx.Response(200, json={"status": "ready"})])
    assert ready.wait_until_healthy(deadline_s=5, poll_s=0.01) == {"status": "ready"}


def test_constructor_validation():
    for kwargs, needle in [({"url": "localhost:1"}, "url="), ({"timeout_s": 0}, "timeout_s=0"),
                           ({"max_retries": -1}, "max_retries=-1"), ({"chunk_size": 0}, "chunk_size=0")]:
        with pytest.raises(ValueError, match=needle):
            RewardModelClient(**{"url": URL, **kwargs})
