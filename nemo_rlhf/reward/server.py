"""The reward model served as its own process: HTTP layer over a pluggable scorer.

Endpoints (JSON in and out; errors are ``{"error": message, "field": key-or-null}``):

- ``POST /score`` ``{"items": [{"prompt": str, "response": str} |
  {"prompt_ids": [int], "response_ids": [int]} | {"messages": [{"role": str, "content":
  str}, ...]}, ...]}`` -> ``{"scores": [float, ...]}`` in item order. A ``messages`` item is
  a whole conversation (a multi-turn episode: at least two messages, the last the
  assistant's), rendered by the scorer with its chat template
  (:func:`nemo_rlhf.data.datasets.encode_conversation` for an RM checkpoint); a scorer
  without ``takes_conversations`` answers it 422. 400 invalid JSON (including a body
  nested too deeply to parse), 401 missing/wrong bearer token, 413 over a size limit
  (body, items, characters, or an item with more tokens than the scorer takes: the
  message names ``items[i]`` and the limit), 422 schema errors (empty batch, missing field, wrong type, token id outside the
  vocabulary, an item the scorer refuses), 500 the scorer raised on this request's own
  items (its message is returned; there is never a default score), 503 the scorer is
  still loading or the server is stopping. One request's fault never fails another's:
  items are checked by the scorer before they are batched, and a batch on which the
  scorer fails is split until the failure is pinned to its request(s) (see
  :mod:`nemo_rlhf.reward.batching`). A request with an ``X-Request-ID`` header that
  repeats one still in flight (or among the last :data:`DEDUP_WINDOW` answered) gets
  that request's scores: a client's retry never queues the same work twice (a repeated
  id with another body is 409).
- ``GET /health`` -> 200 ``{"status": "ready", "queued_items", "items_scored"}`` once the
  scorer is loaded (answered while the model is busy: how a client tells a slow server
  from a dead one); 503 ``{"status": "loading"}`` before (the socket is up while the
  model loads). No auth.
- ``GET /metadata`` -> ``{"status", "scorer": scorer.metadata(), "server": config and
  address, "stats": batching counters}``; 503 while loading.
- ``GET /stats`` -> batching counters (``batches``, ``items_scored``, ``requests``, ...).

Concurrent requests are grouped by :class:`~nemo_rlhf.reward.batching.DynamicBatcher`,
whose single model thread makes every scorer call. :func:`serve` binds the socket,
builds the scorer on that thread, and once both HTTP and the scorer are up writes
``http://host:port`` to ``address_file`` (tmp + rename).

Simplified on purpose: no TLS (bind loopback, or use the bearer token on a trusted
cluster network); the per-item token limit is the scorer's (its ``check_items`` runs on
the model thread, since only the scorer can tokenise text), so an over-long item is
answered once its request reaches the model thread, not at parse time; one uvicorn
worker, since the model lives in this process.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import os
import re
import socket
import threading
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from nemo_rlhf.config import check_choice
from nemo_rlhf.reward.batching import (
    BatcherStopped,
    DynamicBatcher,
    ItemRejected,
    ScoreItem,
    Scorer,
    validate_token_ids,
)

__all__ = [
    "RMServerConfig",
    "RequestError",
    "build_app",
    "parse_score_request",
    "serve",
    "write_address_file",
]

logger = logging.getLogger(__name__)

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_TEXT_KEYS = ("prompt", "response")
_ID_KEYS = ("prompt_ids", "response_ids")
_MESSAGES_KEY = "messages"
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass
class RMServerConfig:
    """Configuration of the reward-model HTTP server (:func:`serve`)."""

    host: str = "127.0.0.1"
    """Interface to bind. Loopback by default; a wildcard (0.0.0.0) should come with auth_token_env."""
    port: int = 0
    """TCP port; 0 picks a free port, and address_file then carries the real one."""
    advertise_host: str | None = None
    """Host written to address_file; None: host, or this machine's hostname when host is a wildcard."""
    max_batch_size: int = 64
    """Most items per scorer.score_batch call; larger requests are split across calls."""
    max_wait_ms: float = 5.0
    """How long (ms) the oldest queued item waits for other requests to join its batch."""
    max_items_per_request: int = 1024
    """Most items in one POST /score; more -> 413."""
    max_text_chars: int = 65536
    """Most characters in one prompt or response string; more -> 413."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Most bytes in one request body; more -> 413."""
    auth_token_env: str | None = None
    """NAME of the env variable holding the bearer token (the token never goes in a config); None: no auth."""
    address_file: str | None = None
    """Where to write http://host:port once the scorer is loaded (tmp + rename); None: don't write."""
    log_level: str = "warning"
    """uvicorn log level: one of critical, error, warning, info, debug, trace."""

    def __post_init__(self) -> None:
        def bad(key: str, valid: str) -> ValueError:
            return ValueError(f"RMServerConfig.{key}={getattr(self, key)!r} is invalid; valid: {valid}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not isinstance(self.host, str):
            raise bad("host", "an interface address string such as 127.0.0.1")
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise bad("port", "an int in [0, 65535] (0 picks a free port)")
        if self.advertise_host is not None and (not isinstance(self.advertise_host, str) or not self.advertise_host):
            raise bad("advertise_host", "None or a non-empty host name")
        for key in ("max_batch_size", "max_items_per_request", "max_text_chars", "max_body_bytes"):
            value = getattr(self, key)
            if not is_int(value) or value < 1:
                raise bad(key, "an int >= 1")
        wait = self.max_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 60_000:
            raise bad("max_wait_ms", "a number of milliseconds in [0, 60000]")
        env = self.auth_token_env
        if env is not None and (not isinstance(env, str) or not _ENV_NAME.match(env)):
            raise bad("auth_token_env", "None or an environment variable NAME such as NEMO_RLHF_RM_TOKEN")
        if self.address_file is not None and (not isinstance(self.address_file, str) or not self.address_file):
            raise bad("address_file", "None or a file path")
        check_choice("server.log_level", self.log_level, _LOG_LEVELS)


class RequestError(Exception):
    """A client error: HTTP ``status`` (4xx), a ``message``, and the offending ``field``
    (e.g. ``items[3].response``) or None."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


# --------------------------------------------------------------------------- parsing
def parse_score_request(body: bytes, cfg: RMServerConfig, vocab_size: int | None,
                        takes_conversations: bool = False) -> list[ScoreItem]:
    """Parses and validates a ``POST /score`` body into ``ScoreItem`` s.

    ``vocab_size``: the scorer's; None means token-id items are rejected (text-only scorer).
    ``takes_conversations``: the scorer's; False means ``messages`` items are rejected (422).
    Raises :class:`RequestError` (400 not JSON, or JSON nested deeper than the parser's
    recursion limit, about 1000 levels, or a number the parser refuses; 413 too many items
    or a text over ``cfg.max_text_chars``; 422 any schema error) naming the field and
    item index.
    """
    try:
        payload = json.loads(body)
    except RecursionError:
        raise RequestError(400, "request body is not valid JSON: nested too deeply "
                                "(the schema needs 4 levels: {items: [{prompt_ids: [...]}]})", "body") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int over sys.get_int_max_str_digits()
        raise RequestError(400, f"request body is not valid JSON: {exc}", "body") from None
    if not isinstance(payload, dict):
        raise RequestError(422, f'request body must be a JSON object {{"items": [...]}}, got {_json_type(payload)}', "body")
    for key in payload:
        if key != "items":
            raise RequestError(422, f"unknown field {key!r}; valid: items", key)
    if "items" not in payload:
        raise RequestError(422, "missing field 'items' (a list of {prompt, response} or {prompt_ids, response_ids})", "items")
    raw_items = payload["items"]
    if not isinstance(raw_items, list):
        raise RequestError(422, f"items: expected a list, got {_json_type(raw_items)}", "items")
    if not raw_items:
        raise RequestError(422, "items: empty batch; send at least one item", "items")
    if len(raw_items) > cfg.max_items_per_request:
        raise RequestError(
            413, f"items: {len(raw_items)} items exceed max_items_per_request={cfg.max_items_per_request}", "items"
        )
    return [_parse_item(raw, i, cfg, vocab_size, takes_conversations) for i, raw in enumerate(raw_items)]


def _parse_messages(raw: Any, where: str, cfg: RMServerConfig, takes_conversations: bool) -> ScoreItem:
    """A ``{"messages": [...]}`` item (a whole conversation)."""
    field = f"{where}.messages"
    if not takes_conversations:
        raise RequestError(422, f"{where}: this reward model does not take conversations ('messages'); "
                                f"send 'prompt' and 'response' or token ids", field)
    msgs = raw["messages"]
    if not isinstance(msgs, list) or len(msgs) < 2:
        raise RequestError(422, f"{field}: expected a list of at least two {{role, content}} messages "
                                f"(the prompt, then the turns), got {_json_type(msgs)}", field)
    for j, m in enumerate(msgs):
        at = f"{field}[{j}]"
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise RequestError(422, f"{at}: expected an object with exactly 'role' and 'content'", at)
        if not isinstance(m["role"], str) or not m["role"] or not isinstance(m["content"], str):
            raise RequestError(422, f"{at}: 'role' must be a non-empty string and 'content' a string", at)
        if len(m["content"]) > cfg.max_text_chars:
            raise RequestError(413, f"{at}.content: {len(m['content'])} characters exceed "
                                    f"max_text_chars={cfg.max_text_chars}", f"{at}.content")
    if msgs[-1]["role"] != "assistant":
        raise RequestError(422, f"{field}: the last message must be the assistant's (the scored turn), "
                                f"got {msgs[-1]['role']!r}", field)
    return ScoreItem(messages=[{"role": m["role"], "content": m["content"]} for m in msgs])


def _parse_item(raw: Any, index: int, cfg: RMServerConfig, vocab_size: int | None,
                takes_conversations: bool = False) -> ScoreItem:
    where = f"items[{index}]"
    if not isinstance(raw, dict):
        raise RequestError(422, f"{where}: expected an object, got {_json_type(raw)}", where)
    valid = _TEXT_KEYS + _ID_KEYS + (_MESSAGES_KEY,)
    for key in raw:
        if key not in valid:
            raise RequestError(
                422, f"{where}.{key}: unknown field; valid: {', '.join(valid)}", f"{where}.{key}"
            )
    if _MESSAGES_KEY in raw:
        if len(raw) > 1:
            raise RequestError(422, f"{where}: mixes 'messages' with other fields; use one form per item",
                               where)
        return _parse_messages(raw, where, cfg, takes_conversations)
    has_text = any(k in raw for k in _TEXT_KEYS)
    has_ids = any(k in raw for k in _ID_KEYS)
    if has_text and has_ids:
        raise RequestError(422, f"{where}: mixes text fields (prompt, response) with token fields "
                                f"(prompt_ids, response_ids); use one form per item", where)
    if not has_text and not has_ids:
        raise RequestError(422, f"{where}: missing fields; give 'prompt' and 'response' (strings) "
                                f"or 'prompt_ids' and 'response_ids' (lists of ints)", where)
    if has_text:
        values = {}
        for key in _TEXT_KEYS:
            field = f"{where}.{key}"
            if key not in raw:
                raise RequestError(422, f"{field}: missing field (a string)", field)
            value = raw[key]
            if not isinstance(value, str):
                raise RequestError(422, f"{field}: expected a string, got {_json_type(value)}", field)
            if len(value) > cfg.max_text_chars:
                raise RequestError(
                    413, f"{field}: {len(value)} characters exceed max_text_chars={cfg.max_text_chars}", field
                )
            values[key] = value
        return ScoreItem(prompt=values["prompt"], response=values["response"])
    if vocab_size is None:
        raise RequestError(422, f"{where}: this reward model takes text only; send 'prompt' and 'response'", where)
    values = {}
    for key in _ID_KEYS:
        field = f"{where}.{key}"
        if key not in raw:
            raise RequestError(422, f"{field}: missing field (a list of ints)", field)
        try:
            values[key] = validate_token_ids(raw[key], vocab_size, field)
        except ValueError as exc:
            raise RequestError(422, str(exc), field) from None
    return ScoreItem(prompt_ids=values["prompt_ids"], response_ids=values["response_ids"])


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------- app
def _error(status: int, message: str, field: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "field": field}, status_code=status, headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body of {declared} bytes exceeds max_body_bytes={limit}", "body")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(413, f"request body exceeds max_body_bytes={limit}", "body")
    return bytes(body)


DEDUP_WINDOW = 1024
"""Answered request ids remembered for deduplication (besides those in flight)."""


def build_app(
    batcher: DynamicBatcher,
    cfg: RMServerConfig,
    *,
    auth_token: str | None,
    address: str,
    on_startup: Callable[[], None] | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    """The FastAPI app serving ``batcher`` (see the module docstring for the endpoints).

    ``auth_token``: the bearer token required on /score, /metadata and /stats (None: no
    auth). ``on_startup`` runs when HTTP is up; ``on_shutdown`` (blocking, run in a
    worker thread) when uvicorn shuts down, before it returns.
    """

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if on_startup is not None:
            on_startup()
        yield
        if on_shutdown is not None:
            await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="nemo_rlhf reward model", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    expected = auth_token.encode() if auth_token is not None else None

    def check_auth(request: Request) -> JSONResponse | None:
        if expected is None:
            return None
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        headers = {"WWW-Authenticate": "Bearer"}
        if scheme.lower() != "bearer" or not value.strip():
            return _error(401, "missing bearer token (header 'Authorization: Bearer <token>')", "Authorization", headers)
        if not hmac.compare_digest(value.strip().encode(), expected):
            return _error(401, "wrong bearer token", "Authorization", headers)
        return None

    def server_info() -> dict[str, Any]:
        info = asdict(cfg)
        info.update(address=address, port=urlsplit(address).port, auth=expected is not None,
                    vocab_size=batcher.vocab_size, pid=os.getpid())
        return info

    # request id -> (sha256 of the body, the future of its scores); oldest first
    requests_by_id: collections.OrderedDict[str, tuple[str, Any]] = collections.OrderedDict()
    dedup = {"deduplicated_requests": 0}

    @app.get("/health")
    async def health() -> JSONResponse:
        state = batcher.state
        body: dict[str, Any] = {"status": state}
        if state == "failed":
            body["error"] = repr(batcher.error)
        if state == "ready":
            counters = batcher.stats()
            body.update(queued_items=counters["queued_items"], items_scored=counters["items_scored"])
        return JSONResponse(body, status_code=200 if state == "ready" else 503)

    @app.get("/stats")
    async def stats(request: Request) -> JSONResponse:
        if (denied := check_auth(request)) is not None:
            return denied
        return JSONResponse({"status": batcher.state, **batcher.stats(), **dedup})

    @app.get("/metadata")
    async def metadata(request: Request) -> JSONResponse:
        if (denied := check_auth(request)) is not None:
            return denied
        if batcher.state != "ready":
            return _error(503, f"reward model is {batcher.state}; metadata is available once it is ready")
        return JSONResponse({
            "status": batcher.state,
            "scorer": batcher.scorer_metadata,
            "server": server_info(),
            "stats": batcher.stats(),
        })

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        if (denied := check_auth(request)) is not None:
            return denied
        if batcher.state != "ready":
            return _error(503, f"reward model is {batcher.state}; retry once GET /health returns 200")
        try:
            body = await _read_body(request, cfg.max_body_bytes)
            items = parse_score_request(body, cfg, batcher.vocab_size, batcher.takes_conversations)
        except RequestError as exc:
            return _error(exc.status, exc.message, exc.field)
        request_id = request.headers.get("x-request-id")
        digest = hashlib.sha256(body).hexdigest() if request_id else None
        seen = requests_by_id.get(request_id) if request_id else None
        if seen is not None and seen[1].done() and seen[1].exception() is not None:
            seen = None  # it failed: a retry scores it again (the fault may have been transient)
        if seen is not None:
            if seen[0] != digest:
                return _error(409, f"X-Request-ID {request_id!r} was already used for another request body",
                              "X-Request-ID")
            future = seen[1]  # a retry: wait for the work already queued or done for it
            dedup["deduplicated_requests"] += 1
        else:
            try:
                future = batcher.submit(items)
            except (BatcherStopped, RuntimeError) as exc:  # stopping, or not ready
                return _error(503, str(exc))
            if request_id:
                requests_by_id[request_id] = (digest, future)
                while len(requests_by_id) > DEDUP_WINDOW:
                    oldest = next(iter(requests_by_id))
                    if not requests_by_id[oldest][1].done():
                        break  # never forget work in flight
                    requests_by_id.popitem(last=False)
        try:
            scores = await asyncio.wrap_future(future)
        except BatcherStopped as exc:
            return _error(503, str(exc))
        except ItemRejected as exc:  # the scorer refused one of this request's items
            return _error(exc.status, str(exc), exc.field)
        except Exception as exc:  # noqa: BLE001 - a scorer fault is reported, never papered over
            return _error(500, f"scorer failed on this request's items: {type(exc).__name__}: {exc}")
        return JSONResponse({"scores": scores})

    return app


# --------------------------------------------------------------------------- serve
def write_address_file(path: str, address: str) -> None:
    """Writes ``address`` + newline to ``path`` atomically (tmp file, fsync, rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(address + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_address_file(path: str, only_if: str | None = None) -> None:
    try:
        if only_if is not None:
            with open(path, encoding="utf-8") as f:
                if f.read().strip() != only_if:
                    return
        os.remove(path)
    except FileNotFoundError:
        pass


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
    except OSError as exc:
        raise OSError(f"reward model server cannot bind RMServerConfig.host={host!r} port={port}: {exc}") from exc
    sock.listen(2048)
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _read_auth_token(cfg: RMServerConfig) -> str | None:
    if cfg.auth_token_env is None:
        if cfg.host not in ("127.0.0.1", "localhost", "::1"):
            logger.warning("reward model server binds %s without auth (RMServerConfig.auth_token_env is None)", cfg.host)
        return None
    token = os.environ.get(cfg.auth_token_env, "")
    if not token:
        raise ValueError(
            f"RMServerConfig.auth_token_env={cfg.auth_token_env!r} names an environment variable that is unset "
            f"or empty; export it with the bearer token, or set auth_token_env to None"
        )
    return token


def serve(scorer_factory: Callable[[], Scorer], cfg: RMServerConfig) -> None:
    """Runs the reward-model server in this process until SIGINT/SIGTERM (blocking).

    Order: bind the socket (so /health answers 503 "loading" at once), build the scorer
    with ``scorer_factory()`` on the model thread, then -- once HTTP is up too -- write
    the address to ``cfg.address_file``. A stale address file is removed at start and
    ours at shutdown. Must run on the main thread for signal handling.

    Raises ``ValueError`` when ``cfg.auth_token_env`` names an unset variable;
    ``OSError`` when the socket cannot be bound or the address file cannot be written;
    ``RuntimeError`` (chained to the factory's exception) when the scorer fails to load.
    In the last two cases the server shuts down first.
    """
    import uvicorn  # imported here so the client side never needs it

    token = _read_auth_token(cfg)
    if cfg.address_file:
        _remove_address_file(cfg.address_file)
    sock = _bind(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    advertised = cfg.advertise_host or (socket.gethostname() if cfg.host in _WILDCARD_HOSTS else cfg.host)
    address = _url(advertised, port)

    batcher = DynamicBatcher(scorer_factory, cfg.max_batch_size, cfg.max_wait_ms)
    http_up = threading.Event()
    server: uvicorn.Server | None = None
    shutdown_lock = threading.Lock()
    shut_down = False
    address_error: list[OSError] = []

    def on_ready() -> None:
        while not http_up.wait(0.05):
            if server is not None and server.should_exit:
                return
        if cfg.address_file:
            try:
                write_address_file(cfg.address_file, address)
            except OSError as exc:
                logger.exception("cannot write RMServerConfig.address_file=%r; stopping", cfg.address_file)
                address_error.append(exc)
                server.should_exit = True
                raise
        logger.info("reward model server ready at %s", address)

    def on_failed(_exc: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    def shutdown() -> None:
        nonlocal shut_down
        with shutdown_lock:
            if shut_down:
                return
            shut_down = True
        batcher.stop()
        if cfg.address_file:
            _remove_address_file(cfg.address_file, only_if=address)

    app = build_app(batcher, cfg, auth_token=token, address=address, on_startup=http_up.set, on_shutdown=shutdown)
    server = uvicorn.Server(uvicorn.Config(app, log_level=cfg.log_level, access_log=False, lifespan="on"))
    logger.info("reward model server listening on %s; loading the scorer", address)
    batcher.start(on_ready=on_ready, on_failed=on_failed)
    try:
        server.run(sockets=[sock])
    finally:
        shutdown()
        sock.close()
    if batcher.state == "failed":
        raise RuntimeError(f"reward model scorer failed to load: {batcher.error!r}") from batcher.error
    if address_error:
        raise OSError(f"cannot write RMServerConfig.address_file={cfg.address_file!r}: {address_error[0]}")
