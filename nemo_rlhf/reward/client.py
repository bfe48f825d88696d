"""HTTP client of the reward-model server (:mod:`nemo_rlhf.reward.server`).

The one rule: a score that could not be obtained is an error, never a default. Every
failure ends in :class:`RewardServiceError` whose message names the URL and what failed
(connection refused, timeout, HTTP status with the server's message, malformed reply,
wrong number of scores).

Retries: connection errors, timeouts and 5xx are retried with exponential backoff
(``backoff_s * 2**k`` seconds before retry k+1); 4xx are not (the request itself is
wrong). Scoring is a pure function of the request, so retrying a POST is safe.

A slow server is not a dead one: ``timeout_s`` bounds how long the client waits for an
answer before it asks whether the server is alive, not how long the scoring may take.
Each ``POST /score`` carries a request id (``X-Request-ID``, kept across its retries), and
the server attaches a repeated id to the work already in flight for it (it is never
queued twice). When an attempt times out, the client probes ``GET /health`` (answered
by the server's event loop while the model is busy): a server that answers ``ready`` is
busy, and the client asks again with the same id without spending a retry, for at most
``max_wait_s`` seconds in all; a server that does not answer (dead, unreachable) spends a
retry, so a dead server is reported after the retries, as before.

A server that refuses connections (killed, being restarted, still binding its port) may
be coming back: with ``restart_wait_s > 0`` a refused connection does not spend a retry
while it lasts less than ``restart_wait_s`` seconds (polled with the backoff, at most 1 s
apart); the request is then sent again with the same id (a restarted server scores it
afresh: scoring is pure). Past ``restart_wait_s`` the error names the URL and how long the
connection was refused. A connection broken mid-reply (the server killed while it scores)
spends a retry, then the restart wait applies to the reconnection.

Simplified on purpose: synchronous (the PPO trainer calls it between phases); chunks of a
large request are sent one after another, not concurrently.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
import uuid
from typing import Any, Mapping, Sequence

import httpx

from nemo_rlhf.distributed.split import chunk_slices
from nemo_rlhf.reward.batching import ScoreItem

__all__ = ["RewardModelClient", "RewardServiceError"]


class RewardServiceError(RuntimeError):
    """The reward service could not produce scores; the message names the URL and the cause."""


def _server_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or "(empty body)"
    if isinstance(body, dict):
        for key in ("error", "detail", "status"):
            if key in body:
                field = body.get("field")
                return f"{body[key]}" + (f" (field {field})" if field and key == "error" else "")
    return json.dumps(body)[:500]


class RewardModelClient:
    """Client of one reward-model server.

    Args:
        url: server base URL, ``http://host:port``.
        timeout_s: per-attempt timeout in seconds (connect, read, write each); a read
            timeout on ``/score`` is followed by a ``/health`` probe (module docstring).
        max_retries: retries after the first attempt on connection errors, timeouts and
            5xx; 0 disables retries.
        backoff_s: sleep before the first retry in seconds; doubles each retry.
        auth_token: bearer token for servers started with ``auth_token_env``; None: none.
        chunk_size: most items per ``POST /score``; larger lists are split into
            sequential requests. None: one request (the server's
            ``max_items_per_request`` must then allow it).
        max_wait_s: the longest one ``/score`` request may wait on a server that is alive
            and busy (answers ``/health``), in seconds, over all its attempts.
        restart_wait_s: how long a refused connection (a server down or restarting) is
            retried without spending a retry, in seconds, counted from the first refusal in
            a row; 0: a refused connection spends a retry like any connection error.
        allow_nonfinite: return NaN / Inf scores from the server as they are (the caller,
            ``reward.invalid_scores=skip``, counts and skips them); False: a malformed reply.
        transport: an ``httpx`` transport, for tests only.

    Thread-safe: one client may be shared by threads.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        auth_token: str | None = None,
        chunk_size: int | None = None,
        transport: httpx.BaseTransport | None = None,
        max_wait_s: float = 3600.0,
        restart_wait_s: float = 0.0,
        allow_nonfinite: bool = False,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"RewardModelClient: url={url!r}; valid: http://host:port")
        if timeout_s <= 0:
            raise ValueError(f"RewardModelClient: timeout_s={timeout_s}; valid: a number of seconds > 0")
        if max_retries < 0:
            raise ValueError(f"RewardModelClient: max_retries={max_retries}; valid: an int >= 0")
        if backoff_s < 0:
            raise ValueError(f"RewardModelClient: backoff_s={backoff_s}; valid: a number of seconds >= 0")
        if not max_wait_s > 0:
            raise ValueError(f"RewardModelClient: max_wait_s={max_wait_s}; valid: a number of seconds > 0")
        if not restart_wait_s >= 0:
            raise ValueError(f"RewardModelClient: restart_wait_s={restart_wait_s}; valid: a number of seconds >= 0")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"RewardModelClient: chunk_size={chunk_size}; valid: None or an int >= 1")
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.chunk_size = chunk_size
        self.max_wait_s = float(max_wait_s)
        self.restart_wait_s = float(restart_wait_s)
        self.allow_nonfinite = bool(allow_nonfinite)
        self.refused_waits = 0
        """Refused connections waited out within ``restart_wait_s`` (counted)."""
        self.busy_waits = 0
        """Attempts that timed out on a server that answered ``/health`` ready (counted)."""
        headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._http = httpx.Client(
            base_url=self.url, timeout=httpx.Timeout(self.timeout_s), headers=headers, transport=transport
        )

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def from_address_file(
        cls, path: str, wait_s: float = 0.0, poll_s: float = 0.1, **kwargs: Any
    ) -> "RewardModelClient":
        """A client for the address a server wrote to ``path`` (see ``RMServerConfig.address_file``).

        Waits up to ``wait_s`` seconds for the file to appear. ``kwargs`` go to the
        constructor. Raises :class:`RewardServiceError` naming the path when no valid
        address shows up in time.
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with open(path, encoding="utf-8") as f:
                    address = f.read().strip()
                valid = address.startswith(("http://", "https://"))
                problem = None if valid else f"unexpected content {address[:100]!r}"
            except FileNotFoundError:
                problem = "file does not exist"
            if problem is None:
                return cls(address, **kwargs)
            if time.monotonic() >= deadline:
                raise RewardServiceError(
                    f"no reward service address in {os.path.abspath(path)} after {wait_s} s: {problem}"
                )
            time.sleep(poll_s)

    def close(self) -> None:
        """Closes the connection pool."""
        self._http.close()

    def __enter__(self) -> "RewardModelClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ requests
    def _request(self, method: str, path: str, payload: Any = None, retry: bool = True,
                 request_id: str | None = None) -> httpx.Response:
        """One call with retries; returns a 2xx response or raises RewardServiceError.

        With ``request_id`` (sent as ``X-Request-ID``; the server deduplicates it), a
        timed-out attempt on a server that answers ``/health`` ready is repeated without
        spending a retry, until ``max_wait_s`` has passed since the first attempt."""
        attempts = self.max_retries + 1 if retry else 1
        content = json.dumps(payload).encode() if payload is not None else None
        headers = {"Content-Type": "application/json"} if content is not None else {}
        if request_id is not None:
            headers["X-Request-ID"] = request_id
        last = "no attempt made"
        start = time.monotonic()
        failed = 0
        refused_since = None  # the first refused connection of the current run of them
        while failed < attempts:
            try:
                resp = self._http.request(method, path, content=content, headers=headers or None)
            except httpx.ConnectError as exc:
                last = f"connection failed ({exc})"
                now = time.monotonic()
                refused_since = now if refused_since is None else refused_since
                down = now - refused_since
                if self.restart_wait_s > 0:
                    if down < self.restart_wait_s:
                        self.refused_waits += 1
                        pause = min(self.backoff_s * 2 ** min(self.refused_waits - 1, 10), 1.0,
                                    self.restart_wait_s - down)
                        time.sleep(max(pause, 0.01))
                        continue  # not a retry spent: the server may be restarting
                    raise RewardServiceError(
                        f"reward service {self.url}{path}: connection refused for {down:.1f} s "
                        f"(waited {now - start:.1f} s in all): the server did not come back within "
                        f"reward.restart_wait_s={self.restart_wait_s:g} ({exc})")
                failed += 1
                self._backoff(failed, attempts)
                continue
            except httpx.TimeoutException as exc:
                refused_since = None
                last = f"timed out after {self.timeout_s} s ({type(exc).__name__})"
                if request_id is not None and isinstance(exc, httpx.ReadTimeout):
                    waited = time.monotonic() - start
                    alive = self._busy_but_alive()
                    if alive is not None and waited < self.max_wait_s:
                        self.busy_waits += 1
                        continue  # the same id again: the server attaches it to its work
                    if alive is not None:
                        last = (f"still busy after {waited:.0f} s (reward.max_wait_s={self.max_wait_s:g}; "
                                f"last /health: {alive})")
                        break
                    last += "; /health did not answer either"
                failed += 1
                self._backoff(failed, attempts)
                continue
            except httpx.TransportError as exc:  # server died mid-reply, connection reset, ...
                refused_since = None
                last = f"connection broken ({type(exc).__name__}: {exc})"
                failed += 1
                self._backoff(failed, attempts)
                continue
            refused_since = None
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {_server_message(resp)}"
                failed += 1
                self._backoff(failed, attempts)
                continue
            if resp.status_code >= 400:
                raise RewardServiceError(
                    f"reward service {self.url}{path}: HTTP {resp.status_code}: {_server_message(resp)}"
                )
            return resp
        waited = time.monotonic() - start
        raise RewardServiceError(f"reward service {self.url}{path}: {last} (gave up after {failed} attempt(s), "
                                 f"{waited:.1f} s after the first)")

    def _backoff(self, failed: int, attempts: int) -> None:
        if failed < attempts:
            time.sleep(self.backoff_s * 2 ** (failed - 1))

    def _busy_but_alive(self) -> dict[str, Any] | None:
        """The ``/health`` body when the server answers 200 ``ready`` (alive, so a timed-out
        ``/score`` is work still in progress), else None."""
        try:
            status, body = self.health()
        except RewardServiceError:
            return None
        return body if status == 200 and body.get("status") == "ready" else None

    def _json(self, resp: httpx.Response, path: str) -> Any:
        try:
            return resp.json()
        except ValueError:
            raise RewardServiceError(
                f"reward service {self.url}{path}: malformed reply (not JSON): {resp.text[:200]!r}"
            ) from None

    def score(self, items: Sequence[ScoreItem | Mapping[str, Any]]) -> list[float]:
        """Scores ``items``: ``ScoreItem`` s or dicts in the wire form
        (``{"prompt", "response"}`` or ``{"prompt_ids", "response_ids"}``).

        Returns one float per item, in order (``[]`` for no items). Raises
        :class:`RewardServiceError` on any failure after retries; never returns a
        default score.
        """
        wire = [it.to_json() if isinstance(it, ScoreItem) else dict(it) for it in items]
        step = self.chunk_size or max(len(wire), 1)
        scores: list[float] = []
        for s in chunk_slices(len(wire), step):
            scores.extend(self._score_chunk(wire[s]))
        return scores

    def score_texts(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """``score`` for parallel lists of prompt and response strings: ``[batch]`` floats."""
        if len(prompts) != len(responses):
            raise ValueError(f"score_texts: {len(prompts)} prompts but {len(responses)} responses")
        return self.score([{"prompt": p, "response": r} for p, r in zip(prompts, responses)])

    def _score_chunk(self, wire: list[dict[str, Any]]) -> list[float]:
        resp = self._request("POST", "/score", {"items": wire}, request_id=uuid.uuid4().hex)
        body = self._json(resp, "/score")
        where = f"reward service {self.url}/score"
        if not isinstance(body, dict) or "scores" not in body:
            raise RewardServiceError(f"{where}: malformed reply (no 'scores' list): {str(body)[:200]}")
        scores = body["scores"]
        if not isinstance(scores, list):
            raise RewardServiceError(f"{where}: malformed reply ('scores' is {type(scores).__name__}, not a list)")
        if len(scores) != len(wire):
            raise RewardServiceError(f"{where}: wrong number of scores: got {len(scores)} for {len(wire)} items")
        for i, s in enumerate(scores):
            if isinstance(s, bool) or not isinstance(s, numbers.Real) or (
                    not self.allow_nonfinite and not math.isfinite(s)):
                raise RewardServiceError(f"{where}: malformed reply (score {i} is {s!r}, not a finite float)")
        return [float(s) for s in scores]

    def health(self) -> tuple[int, dict[str, Any]]:
        """One ``GET /health`` without retries: (HTTP status, body). Raises
        :class:`RewardServiceError` when the server cannot be reached."""
        try:
            resp = self._http.get("/health", timeout=min(self.timeout_s, 5.0))
        except httpx.HTTPError as exc:
            raise RewardServiceError(f"reward service {self.url}/health: {type(exc).__name__}: {exc}") from None
        try:
            body = resp.json()
        except ValueError:
            body = {"raw": resp.text[:200]}
        return resp.status_code, body if isinstance(body, dict) else {"raw": body}

    def wait_until_healthy(self, deadline_s: float = 600.0, poll_s: float = 0.25) -> dict[str, Any]:
        """Polls ``GET /health`` until it answers 200 ``ready``, for at most ``deadline_s``
        seconds; returns the health body. Raises :class:`RewardServiceError` naming the URL
        and the last status seen (e.g. ``HTTP 503 {'status': 'loading'}`` or a connection
        error)."""
        deadline = time.monotonic() + deadline_s
        last = "never polled"
        while True:
            try:
                status, body = self.health()
                if status == 200 and body.get("status") == "ready":
                    return body
                last = f"HTTP {status} {body}"
            except RewardServiceError as exc:
                last = str(exc)
            if time.monotonic() + poll_s > deadline:
                raise RewardServiceError(f"reward service {self.url} not healthy after {deadline_s} s; last status: {last}")
            time.sleep(poll_s)

    def metadata(self) -> dict[str, Any]:
        """``GET /metadata`` (retried like ``score``): ``{"scorer": ..., "server": ...,
        "stats": ...}``. The scorer part holds e.g. ``reward_mean``/``reward_std``."""
        body = self._json(self._request("GET", "/metadata"), "/metadata")
        if not isinstance(body, dict) or "scorer" not in body:
            raise RewardServiceError(f"reward service {self.url}/metadata: malformed reply (no 'scorer'): {str(body)[:200]}")
        return body

    def stats(self) -> dict[str, Any]:
        """``GET /stats``: batching counters (``batches``, ``items_scored``, ``requests``, ...)."""
        body = self._json(self._request("GET", "/stats"), "/stats")
        if not isinstance(body, dict):
            raise RewardServiceError(f"reward service {self.url}/stats: malformed reply: {str(body)[:200]}")
        return body
