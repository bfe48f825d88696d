"""The reward-model server as a real subprocess on a free loopback port, with its client.

Every subprocess is stopped in a ``finally`` (terminate, then kill).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from nemo_rlhf.reward.batching import ScoreItem
from nemo_rlhf.reward.client import RewardModelClient, RewardServiceError
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[3]
HELPER = REPO / "tests" / "rm_server_proc.py"
TOKEN_ENV = "NEMO_RLHF_TEST_RM_TOKEN"
TOKEN = "s3cret-test-token"

_spec = importlib.util.spec_from_file_location("rm_server_proc", HELPER)
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def running_server(tmp_path: Path, name: str, *args: str, env: dict | None = None):
    """Starts the helper server; yields (process, address-file path, log path); always stops it."""
    addr, log_path = tmp_path / f"{name}.addr", tmp_path / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HELPER), "--address-file", str(addr), *args],
            cwd=REPO, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        yield proc, addr, log_path
    finally:
        _stop(proc)


def _client(url: str, **kw) -> RewardModelClient:
    kw = {"timeout_s": 10.0, "max_retries": 1, "backoff_s": 0.05, "auth_token": TOKEN, **kw}
    return RewardModelClient(url, **kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One shared server: auth on, 10 ms per scorer call, 20 ms batching window, small limits."""
    tmp = tmp_path_factory.mktemp("rm_server")
    args = ["--call-ms", "10", "--max-wait-ms", "20", "--max-batch-size", "64", "--max-items-per-request", "32",
            "--max-text-chars", "100", "--max-body-bytes", "65536", "--auth-token-env", TOKEN_ENV]
    with running_server(tmp, "shared", *args, env={TOKEN_ENV: TOKEN}) as (proc, addr, log):
        try:
            client = RewardModelClient.from_address_file(str(addr), wait_s=30, auth_token=TOKEN)
        except RewardServiceError:
            pytest.fail(f"server did not start; log:\n{log.read_text()}")
        client.close()
        yield SimpleNamespace(url=client.url, addr=addr, proc=proc)


@pytest.fixture
def client(server):
    with _client(server.url) as c:
        yield c


def _good(client: RewardModelClient) -> None:
    item = ScoreItem(prompt="p", response="good")
    assert client.score([item]) == [fake.expected_score(item)]


# --------------------------------------------------------------------------- happy path
def test_served_scores_equal_in_process_scores(client):
    items = [ScoreItem(prompt=f"q{i}", response="r" * i) for i in range(10)]
    items += [ScoreItem(prompt_ids=[1, 2, 3], response_ids=[4, 5]), ScoreItem(prompt="", response="")]
    assert client.score(items) == [fake.expected_score(it) for it in items]
    assert client.score([]) == []


def test_address_file_holds_real_port_and_metadata_reports_scorer_and_server(server, client):
    address = server.addr.read_text().strip()
    assert address == server.url and not address.endswith(":0")
    meta = client.metadata()
    assert meta["scorer"]["checkpoint_step"] == 7 and meta["scorer"]["reward_std"] == 4.0
    assert meta["server"]["address"] == address and meta["server"]["port"] == int(address.rsplit(":", 1)[1])
    assert meta["server"]["max_batch_size"] == 64 and meta["server"]["auth"] is True
    assert TOKEN not in json.dumps(meta)  # the env var NAME is reported, never the token


def test_sixteen_concurrent_clients_get_own_scores_in_order_and_are_batched(server, client):
    before = client.stats()
    n_clients = 16
    barrier = threading.Barrier(n_clients)
    results: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        items = [ScoreItem(prompt=f"client {k}", response="x" * (k + j)) for j in range(3)]
        try:
            with _client(server.url) as c:
                c.health()  # open the connection before the start line
                barrier.wait(10)
                results[k] = c.score(items)
            assert results[k] == [fake.expected_score(it) for it in items]
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert sorted(results) == list(range(n_clients))
    after = client.stats()
    requests = after["requests"] - before["requests"]
    batches = after["batches"] - before["batches"]
    assert requests == n_clients
    assert after["items_scored"] - before["items_scored"] == 3 * n_clients
    assert batches < requests, f"{requests} concurrent requests were scored in {batches} batches"


# --------------------------------------------------------------------------- bad requests
def _items(*items) -> bytes:
    return json.dumps({"items": list(items)}).encode()


AUTH = {"Authorization": f"Bearer {TOKEN}"}
BAD_REQUESTS = {
    # name: (body bytes, headers, expected status, substrings of the error message)
    "empty_batch": (_items(), AUTH, 422, ["items", "empty"]),
    "missing_items": (b"{}", AUTH, 422, ["items"]),
    "missing_field": (_items({"prompt": "a", "response": "b"}, {"prompt": "a"}), AUTH, 422, ["items[1].response", "missing"]),
    "no_form": (_items({}), AUTH, 422, ["items[0]", "prompt", "prompt_ids"]),
    "unknown_field": (_items({"prompt": "a", "respnse": "b"}), AUTH, 422, ["items[0].respnse", "unknown"]),
    "non_string_text": (_items({"prompt": "a", "response": 5}), AUTH, 422, ["items[0].response", "string"]),
    "negative_token_id": (_items({"prompt_ids": [1, -2], "response_ids": [3]}), AUTH, 422, ["items[0].prompt_ids[1]", "-2"]),
    "token_id_over_vocab": (_items({"prompt_ids": [1], "response_ids": [3, 1000]}), AUTH, 422, ["items[0].response_ids[1]", "1000"]),
    "non_int_token_id": (_items({"prompt_ids": [1.5], "response_ids": [3]}), AUTH, 422, ["items[0].prompt_ids[0]", "int"]),
    "text_over_limit": (_items({"prompt": "a", "response": "x" * 101}), AUTH, 413, ["items[0].response", "max_text_chars=100"]),
    "too_many_items": (_items(*[{"prompt": "a", "response": "b"}] * 33), AUTH, 413, ["max_items_per_request=32"]),
    "body_over_limit": (_items({"prompt": "a", "response": "x" * 70_000}), AUTH, 413, ["max_body_bytes=65536"]),
    "invalid_json": (b'{"items": [', AUTH, 400, ["not valid JSON"]),
    "not_an_object": (b"[1, 2]", AUTH, 422, ["JSON object"]),
    "wrong_token": (_items({"prompt": "a", "response": "b"}), {"Authorization": "Bearer nope"}, 401, ["wrong bearer token"]),
    "missing_token": (_items({"prompt": "a", "response": "b"}), {}, 401, ["missing bearer token"]),
}


@pytest.mark.parametrize("kind", list(BAD_REQUESTS))
def test_bad_request_gets_4xx_with_message_and_server_keeps_serving(server, client, kind):
    body, headers, status, needles = BAD_REQUESTS[kind]
    resp = httpx.post(f"{server.url}/score", content=body, headers={"Content-Type": "application/json", **headers}, timeout=10)
    assert resp.status_code == status, resp.text
    message = resp.json()["error"]
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    _good(client)


def test_client_raises_on_4xx_with_server_message_without_retry(server, client):
    before = client.stats()["requests"]
    with pytest.raises(RewardServiceError, match=r"HTTP 422.*items\[0\]\.response") as info:
        client.score([{"prompt": "a", "response": 3}])
    assert server.url in str(info.value)
    with pytest.raises(RewardServiceError, match="HTTP 401.*wrong bearer token"):
        _client(server.url, auth_token="nope").score([ScoreItem(prompt="a", response="b")])
    assert client.stats()["requests"] == before  # rejected before queueing
    _good(client)


def test_scorer_exception_is_500_with_message_never_a_default_score(server, client):
    resp = httpx.post(f"{server.url}/score", json={"items": [{"prompt": "a", "response": "RAISE"}]}, headers=AUTH, timeout=10)
    assert resp.status_code == 500 and "exploded on purpose" in resp.json()["error"]
    with pytest.raises(RewardServiceError, match=r"HTTP 500.*exploded on purpose.*2 attempt"):
        client.score([ScoreItem(prompt="a", response="fine"), ScoreItem(prompt="a", response="RAISE")])
    _good(client)


# --------------------------------------------------------------------------- failures
def test_wrong_port_error_after_retries_names_url():
    url = f"http://127.0.0.1:{free_port()}"
    with _client(url, max_retries=2, backoff_s=0.01) as c:
        with pytest.raises(RewardServiceError) as info:
            c.score([ScoreItem(prompt="a", response="b")])
    message = str(info.value)
    assert url in message and "connection failed" in message and "3 attempt" in message


def test_killed_server_mid_run_makes_client_raise_nothing_scored(tmp_path):
    with running_server(tmp_path, "killed") as (proc, addr, _log):
        with RewardModelClient.from_address_file(str(addr), wait_s=30, max_retries=1, backoff_s=0.05, timeout_s=10) as c:
            item = ScoreItem(prompt="a", response="b")
            assert c.score([item]) == [fake.expected_score(item)]
            outcome: dict = {}

            def in_flight() -> None:
                try:
                    outcome["scores"] = c.score([ScoreItem(prompt="a", response="SLOW")])
                except RewardServiceError as exc:
                    outcome["error"] = exc

            t = threading.Thread(target=in_flight)
            t.start()
            time.sleep(0.5)  # the request is now inside the 5 s scorer call
            proc.kill()
            proc.wait(5)
            t.join(15)
            assert "scores" not in outcome and c.url in str(outcome["error"])
            with pytest.raises(RewardServiceError, match="connection failed") as info:
                c.score([item])  # between calls: the server is gone
            assert c.url in str(info.value)


def test_a_server_slower_than_the_client_timeout_scores_each_item_once(tmp_path):
    """Scoring takes 4 x 0.4 s = 1.6 s per batch, over three times the client's 0.5 s
    timeout: the request completes, the server scored each item once (the client's repeats
    carried the same request id and attached to the work in flight), and no retry was
    spent (max_retries=0 would have failed it before)."""
    with running_server(tmp_path, "slow", "--item-ms", "400") as (_proc, addr, log):
        with RewardModelClient.from_address_file(str(addr), wait_s=30, max_retries=0, timeout_s=0.5) as c:
            c.wait_until_healthy(30)
            items = [ScoreItem(prompt=f"q{i}", response="r" * i) for i in range(4)]
            t0 = time.monotonic()
            assert c.score(items) == [fake.expected_score(it) for it in items]
            took = time.monotonic() - t0
            stats = c.stats()
    assert 1.6 <= took < 4.0, took
    assert c.busy_waits >= 2  # it timed out at least twice and found the server alive each time
    assert stats["requests"] == 1 and stats["items"] == 4 and stats["items_scored"] == 4, stats
    assert stats["deduplicated_requests"] == c.busy_waits, (stats, log.read_text()[-2000:])


def test_a_server_killed_while_the_client_waits_on_it_busy_is_reported_promptly(tmp_path):
    with running_server(tmp_path, "slow_killed", "--item-ms", "3000") as (proc, addr, _log):
        with RewardModelClient.from_address_file(str(addr), wait_s=30, max_retries=1, backoff_s=0.05,
                                                 timeout_s=0.5) as c:
            c.wait_until_healthy(30)
            outcome: dict = {}

            def in_flight() -> None:
                try:
                    outcome["scores"] = c.score([ScoreItem(prompt="a", response="b")] * 4)
                except RewardServiceError as exc:
                    outcome["error"] = exc
                outcome["at"] = time.monotonic()

            t = threading.Thread(target=in_flight)
            t.start()
            time.sleep(1.5)  # the client has found the server busy (alive) at least twice
            assert c.busy_waits >= 2
            proc.kill()
            killed = time.monotonic()
            proc.wait(5)
            t.join(30)
    assert "scores" not in outcome and c.url in str(outcome["error"])
    assert outcome["at"] - killed < 5.0  # the retries' timeouts and backoff, not max_wait_s (1 h)


def test_a_server_killed_mid_request_and_restarted_on_its_port_completes_the_request(tmp_path):
    """The server is killed while it scores (a SLOW item: 5 s) and started again on the same
    port 2 s later; the client, waiting on the refused connection (reward.restart_wait_s),
    sends the request again: it completes with every item's score, each scored once by the
    new server."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    items = [ScoreItem(prompt=f"q{i}", response="r" * i) for i in range(3)]
    items.append(ScoreItem(prompt="q", response="SLOW"))
    with RewardModelClient(url, max_retries=1, backoff_s=0.05, timeout_s=10, restart_wait_s=30) as c:
        with running_server(tmp_path, "first", "--port", str(port)) as (proc, _addr, _log):
            c.wait_until_healthy(30)
            outcome: dict = {}

            def in_flight() -> None:
                try:
                    outcome["scores"] = c.score(items)
                except RewardServiceError as exc:
                    outcome["error"] = exc

            t = threading.Thread(target=in_flight)
            t.start()
            time.sleep(0.5)  # the request is now inside the 5 s scorer call
            proc.kill()
            proc.wait(5)
        time.sleep(2.0)  # down: the client's reconnections are refused
        assert t.is_alive() and "error" not in outcome, outcome
        with running_server(tmp_path, "second", "--port", str(port)) as (_proc, _addr, log):
            t.join(60)
            assert not t.is_alive()
            stats = c.stats()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["scores"] == [fake.expected_score(it) for it in items]
    assert c.refused_waits >= 1  # it waited on the refused connection, no retry spent
    assert stats["requests"] == 1 and stats["items_scored"] == len(items), (stats, log.read_text()[-2000:])


def test_a_killed_server_that_does_not_come_back_is_reported_after_restart_wait_s(tmp_path):
    with running_server(tmp_path, "gone") as (proc, addr, _log):
        with RewardModelClient.from_address_file(str(addr), wait_s=30, max_retries=3, backoff_s=0.05,
                                                 timeout_s=10, restart_wait_s=2.0) as c:
            c.wait_until_healthy(30)
            proc.kill()
            proc.wait(5)
            t0 = time.monotonic()
            with pytest.raises(RewardServiceError) as info:
                c.score([ScoreItem(prompt="a", response="b")])
            took = time.monotonic() - t0
    message = str(info.value)
    assert c.url in message and "connection refused for 2." in message, message
    assert "reward.restart_wait_s=2" in message and "waited 2." in message, message
    assert 2.0 <= took < 4.0, took  # the configured wait, not the retries' backoff nor an hour


def test_a_repeated_request_id_with_another_body_is_refused(server):
    headers = {"Authorization": f"Bearer {TOKEN}", "X-Request-ID": "same-id"}
    with httpx.Client(base_url=server.url, timeout=10) as h:
        first = h.post("/score", content=_items({"prompt": "a", "response": "bb"}), headers=headers)
        again = h.post("/score", content=_items({"prompt": "a", "response": "bb"}), headers=headers)
        other = h.post("/score", content=_items({"prompt": "a", "response": "ccc"}), headers=headers)
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    assert other.status_code == 409 and "X-Request-ID 'same-id'" in other.json()["error"]


def test_health_is_503_while_loading_then_200_and_address_file_written_when_ready(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    release = tmp_path / "release"
    with running_server(tmp_path, "loading", "--port", str(port), "--release-file", str(release)) as (proc, addr, log):
        deadline = time.monotonic() + 20
        while True:
            try:
                resp = httpx.get(f"{url}/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                time.sleep(0.05)
        assert resp.status_code == 503 and resp.json() == {"status": "loading"}
        assert not addr.exists()
        score = httpx.post(f"{url}/score", json={"items": [{"prompt": "a", "response": "b"}]}, timeout=5)
        assert score.status_code == 503 and "loading" in score.json()["error"]
        release.touch()  # the model finishes loading
        with RewardModelClient(url) as c:
            assert c.wait_until_healthy(deadline_s=20, poll_s=0.05) ["status"] == "ready"
        assert addr.read_text().strip() == url
        proc.terminate()
        proc.wait(10)
        assert not addr.exists(), "a stopped server must remove its address file"


def test_wait_until_healthy_deadline_names_url_and_last_status():
    url = f"http://127.0.0.1:{free_port()}"
    with RewardModelClient(url) as c:
        with pytest.raises(RewardServiceError, match=r"not healthy after 0.3 s; last status: .*ConnectError") as info:
            c.wait_until_healthy(deadline_s=0.3, poll_s=0.05)
    assert url in str(info.value)


def test_scorer_load_failure_stops_server_with_nonzero_exit(tmp_path):
    with running_server(tmp_path, "broken", "--fail-load") as (proc, addr, log):
        assert proc.wait(20) != 0
        assert "fake checkpoint is corrupt" in log.read_text()
        assert not addr.exists()


def test_server_refuses_to_start_when_token_env_is_unset(tmp_path, monkeypatch):
    env_name = "NEMO_RLHF_TEST_UNSET_TOKEN"
    monkeypatch.delenv(env_name, raising=False)
    with running_server(tmp_path, "notoken", "--auth-token-env", env_name) as (proc, addr, log):
        assert proc.wait(20) != 0
        assert env_name in log.read_text() and not addr.exists()


# --------------------------------------------------------------------------- isolation
MAX_TOKENS = 64
N_GOOD = 16


@pytest.fixture(scope="module")
def iso_server(tmp_path_factory):
    """A server whose fake scorer takes at most MAX_TOKENS tokens per item, with a 300 ms
    batching window (so a burst of requests shares one batch) and the default body limit."""
    tmp = tmp_path_factory.mktemp("rm_iso")
    args = ["--call-ms", "10", "--max-wait-ms", "300", "--max-batch-size", "256", "--max-tokens", str(MAX_TOKENS)]
    with running_server(tmp, "iso", *args) as (proc, addr, log):
        try:
            c = RewardModelClient.from_address_file(str(addr), wait_s=30)
        except RewardServiceError:
            pytest.fail(f"server did not start; log:\n{log.read_text()}")
        yield SimpleNamespace(url=c.url, proc=proc, client=c, log=log)
        c.close()


def _good_items(k: int) -> list[ScoreItem]:
    return [ScoreItem(prompt=f"client {k}", response="y" * k), ScoreItem(prompt_ids=[k, 1], response_ids=[2] * k)]


def _burst(url: str, bodies: dict[str, bytes]) -> dict[str, httpx.Response]:
    """POSTs every body to /score from its own thread, all released together; returns the replies."""
    barrier = threading.Barrier(len(bodies))
    replies: dict[str, httpx.Response] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            with httpx.Client(base_url=url, timeout=20) as http:
                http.get("/health")  # open the connection before the start line
                barrier.wait(10)
                replies[name] = http.post("/score", content=bodies[name], headers={"Content-Type": "application/json"})
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert sorted(replies) == sorted(bodies)
    return replies


def _burst_with_good_clients(server, bad: dict[str, bytes]) -> tuple[dict[str, httpx.Response], dict, dict]:
    """N_GOOD good clients plus the ``bad`` bodies in one burst; asserts every good client got
    200 with exactly its own scores. Returns (replies, stats before, stats after)."""
    bodies = {f"good{k}": json.dumps({"items": [it.to_json() for it in _good_items(k)]}).encode() for k in range(N_GOOD)}
    before = server.client.stats()
    replies = _burst(server.url, {**bodies, **bad})
    after = server.client.stats()
    for k in range(N_GOOD):
        resp = replies[f"good{k}"]
        assert resp.status_code == 200, f"good client {k}: HTTP {resp.status_code} {resp.text}"
        assert resp.json() == {"scores": [fake.expected_score(it) for it in _good_items(k)]}
    assert after["batches"] - before["batches"] < N_GOOD, "the burst was not batched together"
    assert server.proc.poll() is None
    return replies, before, after


def test_good_items_score_alone_as_expected(iso_server):
    # the reference the burst tests compare with: what a good request scores when sent alone
    for k in (0, N_GOOD - 1):
        assert iso_server.client.score(_good_items(k)) == [fake.expected_score(it) for it in _good_items(k)]


def test_overlong_item_gets_413_naming_item_and_limit_and_never_fails_other_clients(iso_server):
    long_text = {"items": [{"prompt": "p", "response": "ok"}, {"prompt": "p", "response": "z" * 12_000}]}
    long_ids = {"items": [{"prompt_ids": [1] * 40, "response_ids": [2] * 40}]}
    bad = {"long_text": json.dumps(long_text).encode(), "long_ids": json.dumps(long_ids).encode()}
    replies, before, after = _burst_with_good_clients(iso_server, bad)
    for name, where, tokens in [("long_text", "items[1]", 12_001), ("long_ids", "items[0]", 80)]:
        resp = replies[name]
        assert resp.status_code == 413, f"{name}: HTTP {resp.status_code} {resp.text}"
        body = resp.json()
        assert body["field"] == where
        assert f"{where}: {tokens} tokens exceed max_seq_length={MAX_TOKENS}" in body["error"]
    assert after["rejected_requests"] - before["rejected_requests"] == 2
    assert after["failed_batches"] == before["failed_batches"]  # the scorer never saw them


def test_scorer_failing_on_one_item_fails_only_its_request(iso_server):
    bad = {"raise": json.dumps({"items": [{"prompt": "p", "response": "fine"}, {"prompt": "p", "response": "RAISE"}]}).encode()}
    replies, before, after = _burst_with_good_clients(iso_server, bad)
    resp = replies["raise"]
    assert resp.status_code == 500 and "exploded on purpose" in resp.json()["error"], resp.text
    # the request shared a failing batch with others (>= 2 failed calls), then failed alone
    assert after["failed_batches"] - before["failed_batches"] >= 2
    assert after["isolated_failures"] - before["isolated_failures"] == 1


def test_deeply_nested_json_gets_400_while_good_clients_get_200(iso_server):
    depth = 200_000
    replies, _, _ = _burst_with_good_clients(iso_server, {"nested": b"[" * depth + b"]" * depth})
    resp = replies["nested"]
    assert resp.status_code == 400, resp.text
    assert "not valid JSON" in resp.json()["error"] and "nested too deeply" in resp.json()["error"]
    status, body = iso_server.client.health()
    assert status == 200 and body["status"] == "ready" and body["queued_items"] == 0
