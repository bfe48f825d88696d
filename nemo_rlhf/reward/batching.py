"""The scorer interface of the reward-model server and its dynamic batcher.

A *scorer* is whatever turns (prompt, response) pairs into scalar rewards: a megatron RM
checkpoint in production, a length or hash function in tests. The server never calls it
directly: every request goes through :class:`DynamicBatcher`, whose single *model
thread* builds the scorer, then repeatedly gathers queued items from concurrent requests
and makes one ``score_batch`` call per group. All scorer calls (construction,
``metadata``, ``score_batch``, ``close``) happen on that one thread, so a scorer needs no
locking, a CUDA scorer can set its device once in its factory (the current device is
per thread), and a multi-rank scorer can issue its broadcasts from a single place.

One request's fault stays its own:
- Before a request's first item joins a batch, the model thread calls the scorer's
  optional ``check_items(items)`` with all of that request's items; an
  :class:`ItemRejected` (e.g. :class:`ItemTooLong`: more tokens than the model takes)
  fails that request alone, and its items never reach ``score_batch``.
- When ``score_batch`` still raises (or returns bad scores) on a batch holding several
  requests, the batch is split in two halves of whole requests and each half is scored
  again, recursively, so only the requests whose items make the scorer fail receive its
  exception; the others get the scores they would get alone. A request that is the only
  one in a failing call receives that call's exception.

Simplified on purpose:
- One batch is scored at a time; there is no pipelining of tokenisation with the forward.
- ``check_items`` and ``score_batch`` both see a request's items, so a text scorer
  tokenises them twice (cheap next to the forward).
- A scorer that fails on every call (a broken model) is called up to ``2 * requests - 1``
  times per batch before every request gets the error.
- Items are scored in arrival order; there is no length bucketing.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import numbers
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

__all__ = [
    "BatcherStopped",
    "DynamicBatcher",
    "ItemRejected",
    "ItemTooLong",
    "ScoreItem",
    "Scorer",
    "validate_token_ids",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoreItem:
    """One item to score: a (prompt, response) pair as text or as token ids, or a whole
    conversation as messages (exactly one form).

    Text form: ``prompt`` and ``response`` are strings (either may be empty).
    Token form: ``prompt_ids`` and ``response_ids`` are lists of ints in the scorer's
    vocabulary. Conversation form: ``messages``, a list of ``{"role": str, "content":
    str}`` ending with the assistant's message (a multi-turn episode, #51), which the
    scorer renders with its chat template (a scorer that takes it says so with
    ``takes_conversations = True``). Raises ``ValueError`` when no form or several are
    given, or a form is incomplete.
    """

    prompt: str | None = None
    response: str | None = None
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    messages: list[dict] | None = None

    def __post_init__(self) -> None:
        has_text = self.prompt is not None or self.response is not None
        has_ids = self.prompt_ids is not None or self.response_ids is not None
        has_messages = self.messages is not None
        if has_text + has_ids + has_messages > 1:
            raise ValueError("ScoreItem: give one form: prompt/response, prompt_ids/response_ids or messages")
        if has_text and (self.prompt is None or self.response is None):
            raise ValueError("ScoreItem: the text form needs both prompt and response")
        if has_ids and (self.prompt_ids is None or self.response_ids is None):
            raise ValueError("ScoreItem: the token form needs both prompt_ids and response_ids")
        if not has_text and not has_ids and not has_messages:
            raise ValueError("ScoreItem: needs prompt/response (str), prompt_ids/response_ids (list[int]) "
                             "or messages (list of {role, content})")

    @property
    def is_tokens(self) -> bool:
        """True for the token-id form."""
        return self.prompt_ids is not None

    @property
    def is_conversation(self) -> bool:
        """True for the conversation (``messages``) form."""
        return self.messages is not None

    def to_json(self) -> dict[str, Any]:
        """The wire form used by ``POST /score``: only the fields of this item's form."""
        if self.is_tokens:
            return {"prompt_ids": list(self.prompt_ids), "response_ids": list(self.response_ids)}
        if self.is_conversation:
            return {"messages": [dict(m) for m in self.messages]}
        return {"prompt": self.prompt, "response": self.response}


class ItemRejected(ValueError):
    """A scorer refuses an item for a reason of the item itself (the client's fault).

    Raised by a scorer's ``check_items`` (or ``score_batch``); the server answers the
    request holding the item with HTTP ``status`` (422 here) and the message, which
    should name the item (``items[3]: ...``) and the rule it breaks.

    Args:
        message: what is wrong, naming the item and the limit.
        field: the offending field, e.g. ``items[3]``, or None.
    """

    status: int = 422

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ItemTooLong(ItemRejected):
    """An item with more tokens than the scorer takes (prompt + response over its
    ``max_seq_length``); the server answers 413."""

    status = 413


@runtime_checkable
class Scorer(Protocol):
    """What the reward-model server needs from a model.

    ``vocab_size``: size of the tokenizer vocabulary; token ids must lie in
    ``[0, vocab_size)``. ``None`` means the scorer takes text only, and the server rejects
    token-id items with 422.

    Optional: ``takes_conversations = True`` when ``score_batch`` renders
    conversation items (``ScoreItem.messages``, e.g. with the RM's chat template); without
    it the server rejects them with 422.

    Optional: a ``close()`` method, called once on the model thread when the server stops
    (a multi-rank scorer uses it to release the ranks waiting for broadcasts).

    Optional: a ``check_items(items: list[ScoreItem]) -> None`` method, called on the model
    thread with all items of one request before any of them joins a batch. It raises
    :class:`ItemRejected` (:class:`ItemTooLong` for a sequence over the scorer's token
    limit, after any truncation the scorer is configured to apply) naming ``items[i]``,
    ``i`` being the item's index in that request. It must accept every item that
    ``score_batch`` accepts. A scorer that tokenises text checks lengths here, since only
    it knows the token count of a text item; without the method, an item the scorer
    cannot take is still isolated to its request (see the module docstring), at the cost
    of extra ``score_batch`` calls.

    Multi-rank (TP/PP) reward models: only global rank 0 runs :func:`serve`; the scorer
    it builds is the rank-0 half of a collective. Its ``score_batch`` tokenises and pads
    the items, broadcasts a small header (op, batch, seq len) and then the token tensors
    to the other ranks, runs the forward with them, collects the values from the last
    pipeline stage, and returns them; ``close()`` broadcasts a stop op. The other ranks
    build the same model and loop on receiving headers until stop. Because the batcher
    makes every call on one thread, one at a time, the ranks always see the same
    sequence of collectives.
    """

    vocab_size: int | None

    def score_batch(self, items: list[ScoreItem]) -> list[float]:
        """Scores ``items`` (any length >= 1): one finite float per item, in order.

        Called on the model thread only, one call at a time. Raise on failure; never
        return a placeholder score.
        """
        ...

    def metadata(self) -> dict[str, Any]:
        """JSON-able description: model name, checkpoint path and step, tokenizer, and
        the reward statistics ``reward_mean`` / ``reward_std`` when the checkpoint has them.
        Called once, right after the scorer is built."""
        ...


def validate_token_ids(ids: Any, vocab_size: int | None, field: str = "ids") -> list[int]:
    """Checks that ``ids`` is a list of ints in ``[0, vocab_size)`` and returns it.

    ``vocab_size=None`` only checks the ids are non-negative ints. ``bool`` and floats
    such as ``3.0`` are rejected. Raises ``ValueError`` whose message names ``field`` and
    the offending position, e.g. ``items[2].response_ids[5]: token id 50257 out of range
    [0, 50257)``.
    """
    if not isinstance(ids, list):
        raise ValueError(f"{field}: expected a list of ints, got {type(ids).__name__}")
    for pos, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise ValueError(f"{field}[{pos}]: expected an int token id, got {type(tok).__name__} {tok!r}")
        if tok < 0 or (vocab_size is not None and tok >= vocab_size):
            valid = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"{field}[{pos}]: token id {tok} out of range {valid}")
    return ids


class BatcherStopped(RuntimeError):
    """Raised for requests submitted to (or still queued in) a stopped batcher."""


@dataclass
class _Request:
    items: list[ScoreItem]
    future: Future
    arrival: float
    scores: list[float | None] = field(default_factory=list)
    next_index: int = 0  # first item not yet handed to a batch
    unscored: int = 0  # items not yet scored


class DynamicBatcher:
    """Groups concurrently submitted items into ``scorer.score_batch`` calls on one thread.

    The model thread first calls ``scorer_factory()`` (state ``"loading"``), then serves
    batches (state ``"ready"``). A batch is closed when it holds ``max_batch_size`` items
    or when the oldest queued item has waited ``max_wait_ms`` milliseconds, whichever is
    first. A request larger than ``max_batch_size`` is split across consecutive batches;
    a batch may hold items of several requests. Each request's future receives its own
    scores, in order, once all its items are scored, or the exception of the scorer call
    that failed on its own items (:class:`ItemRejected` from ``check_items``; see the
    module docstring for how a failing batch is split).

    Args:
        scorer_factory: builds the :class:`Scorer`; runs on the model thread.
        max_batch_size: most items per ``score_batch`` call (>= 1).
        max_wait_ms: how long the oldest queued item may wait for companions, in ms (>= 0).
    """

    def __init__(self, scorer_factory: Callable[[], Scorer], max_batch_size: int, max_wait_ms: float) -> None:
        if max_batch_size < 1:
            raise ValueError(f"DynamicBatcher: max_batch_size={max_batch_size}; valid: an int >= 1")
        if max_wait_ms < 0:
            raise ValueError(f"DynamicBatcher: max_wait_ms={max_wait_ms}; valid: a number >= 0")
        self._factory = scorer_factory
        self._max_batch = max_batch_size
        self._max_wait_s = max_wait_ms / 1000.0
        self._cond = threading.Condition()
        self._queue: collections.deque[_Request] = collections.deque()
        self._queued_items = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._state = "created"
        self._error: BaseException | None = None
        self._scorer: Scorer | None = None
        self._metadata: dict[str, Any] | None = None
        self._vocab_size: int | None = None
        self._takes_conversations = False
        self._stats = {
            "requests": 0,
            "items": 0,
            "batches": 0,
            "items_scored": 0,
            "failed_batches": 0,
            "rejected_requests": 0,
            "isolated_failures": 0,
            "largest_batch": 0,
            "score_time_s": 0.0,
        }

    # ----------------------------------------------------------------- properties
    @property
    def state(self) -> str:
        """One of ``created``, ``loading``, ``ready``, ``failed``, ``stopped``."""
        return self._state

    @property
    def error(self) -> BaseException | None:
        """The scorer factory's exception when ``state == "failed"``."""
        return self._error

    @property
    def scorer_metadata(self) -> dict[str, Any] | None:
        """``scorer.metadata()`` captured once after loading; ``None`` before."""
        return self._metadata

    @property
    def takes_conversations(self) -> bool:
        """The scorer's ``takes_conversations`` captured after loading (False before, or
        when it has none)."""
        return self._takes_conversations

    @property
    def vocab_size(self) -> int | None:
        """The scorer's ``vocab_size`` captured after loading."""
        return self._vocab_size

    def stats(self) -> dict[str, Any]:
        """Counters: requests and items submitted, batches (successful ``score_batch``
        calls), items_scored, failed_batches (``score_batch`` calls that raised or returned
        bad scores, retries of halves included), rejected_requests (refused by
        ``check_items``), isolated_failures (requests failed by a ``score_batch`` call
        holding only their items), largest_batch (items), score_time_s (s in
        ``score_batch``), queued_items."""
        with self._cond:
            out = dict(self._stats)
            out["queued_items"] = self._queued_items
        out["score_time_s"] = round(out["score_time_s"], 6)
        return out

    # ----------------------------------------------------------------- lifecycle
    def start(
        self,
        on_ready: Callable[[], None] | None = None,
        on_failed: Callable[[BaseException], None] | None = None,
    ) -> None:
        """Starts the model thread. ``on_ready()`` / ``on_failed(exc)`` are called on it
        after the factory returns or raises; ``on_ready`` returns before :attr:`state`
        becomes ``"ready"``."""
        if self._thread is not None:
            raise RuntimeError("DynamicBatcher.start() called twice")
        self._state = "loading"
        self._thread = threading.Thread(
            target=self._run, args=(on_ready, on_failed), name="rm-model-thread", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the model thread after the batch in progress; queued requests fail with
        :class:`BatcherStopped`. Idempotent. Waits up to ``timeout_s`` seconds, but not
        while the factory is still loading (it cannot be interrupted; the daemon thread
        then ends with the process, calling ``close()`` if the factory returns first)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            loading = self._state == "loading"
        if self._thread is not None and not loading and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("reward model thread still running %.1f s after stop()", timeout_s)

    def submit(self, items: list[ScoreItem]) -> Future:
        """Queues ``items`` (validated, non-empty) and returns a Future of their scores
        (``list[float]``, same order). Raises :class:`BatcherStopped` after ``stop()`` and
        ``RuntimeError`` unless the state is ``ready``."""
        if not items:
            raise ValueError("DynamicBatcher.submit: empty item list")
        fut: Future = Future()
        req = _Request(items=list(items), future=fut, arrival=time.monotonic())
        req.scores = [None] * len(items)
        req.unscored = len(items)
        with self._cond:
            if self._stopping:
                raise BatcherStopped("reward model server is shutting down")
            if self._state != "ready":
                raise RuntimeError(f"reward model is not ready (state {self._state})")
            self._queue.append(req)
            self._queued_items += len(items)
            self._stats["requests"] += 1
            self._stats["items"] += len(items)
            self._cond.notify_all()
        return fut

    # ----------------------------------------------------------------- model thread
    def _run(self, on_ready, on_failed) -> None:
        scorer = None
        try:
            scorer = self._factory()
            # JSON-safe copy (paths and numpy scalars become strings) taken once, on this thread.
            metadata = json.loads(json.dumps(dict(scorer.metadata()), default=str))
            vocab_size = getattr(scorer, "vocab_size", None)
            bad_vocab = isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1
            if vocab_size is not None and bad_vocab:
                raise ValueError(f"scorer.vocab_size={vocab_size!r}; valid: a positive int or None")
        except BaseException as exc:  # noqa: BLE001 - reported through state and on_failed
            logger.exception("reward model scorer failed to load")
            self._error = exc
            self._state = "failed"
            if scorer is not None:
                _close(scorer)
            if on_failed is not None:
                on_failed(exc)
            return
        self._scorer, self._metadata, self._vocab_size = scorer, metadata, vocab_size
        self._takes_conversations = getattr(scorer, "takes_conversations", False) is True
        try:
            # on_ready first (the server writes its address file there), then the state: a
            # client that saw /health say "ready" finds the address file written
            if not self._stopping and on_ready is not None:
                on_ready()
            with self._cond:
                self._state = "ready" if not self._stopping else "stopped"
            while True:
                parts = self._next_batch()
                if parts is None:
                    break
                self._score(scorer, parts)
        finally:
            with self._cond:
                self._state = "stopped"
                leftover = list(self._queue)
                self._queue.clear()
                self._queued_items = 0
            for req in leftover:
                if not req.future.done():
                    req.future.set_exception(BatcherStopped("reward model server stopped before scoring"))
            _close(scorer)

    def _next_batch(self) -> list[tuple[_Request, int, int]] | None:
        """Blocks until a batch is due; returns [(request, start, end)] or None to stop."""
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            deadline = self._queue[0].arrival + self._max_wait_s
            while self._queued_items < self._max_batch and not self._stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if self._stopping:
                return None
            parts: list[tuple[_Request, int, int]] = []
            room = self._max_batch
            while self._queue and room > 0:
                req = self._queue[0]
                if req.next_index == 0 and not req.future.set_running_or_notify_cancel():
                    self._drop_head(req)  # cancelled by the caller before it was scored
                    continue
                if req.future.done():  # an earlier part of it failed
                    self._drop_head(req)
                    continue
                take = min(room, len(req.items) - req.next_index)
                parts.append((req, req.next_index, req.next_index + take))
                req.next_index += take
                self._queued_items -= take
                room -= take
                if req.next_index == len(req.items):
                    self._queue.popleft()
            return parts

    def _drop_head(self, req: _Request) -> None:
        self._queue.popleft()
        self._queued_items -= len(req.items) - req.next_index

    def _score(self, scorer: Scorer, parts: list[tuple[_Request, int, int]]) -> None:
        """Checks the requests starting in this batch, then scores the admitted parts."""
        check = getattr(scorer, "check_items", None)
        if callable(check):
            parts = [part for part in parts if part[1] > 0 or self._admit(check, part[0])]
        if parts:
            self._score_parts(scorer, parts)

    def _admit(self, check: Callable[[list[ScoreItem]], Any], req: _Request) -> bool:
        """Runs ``check(req.items)``; on an exception fails ``req`` with it (its items left
        in the queue are dropped by :meth:`_next_batch`) and returns False."""
        try:
            check(req.items)
        except Exception as exc:  # noqa: BLE001 - delivered to this request only
            if not isinstance(exc, ItemRejected):
                logger.exception("scorer.check_items failed on a request of %d items", len(req.items))
            with self._cond:
                self._stats["rejected_requests"] += 1
            if not req.future.done():
                req.future.set_exception(exc)
            return False
        return True

    def _score_parts(self, scorer: Scorer, parts: list[tuple[_Request, int, int]]) -> None:
        """One ``score_batch`` call over ``parts`` ([(request, start, end)], one part per
        request). When it fails and holds several requests, the parts are halved and each
        half is scored again (recursion depth <= log2(len(parts)) + 1); a call over a
        single request's part delivers its exception to that request."""
        items = [it for req, lo, hi in parts for it in req.items[lo:hi]]
        t0 = time.perf_counter()
        try:
            scores = scorer.score_batch(items)
            scores = _check_scores(scores, len(items))
        except Exception as exc:  # noqa: BLE001 - delivered to the request(s) it belongs to
            with self._cond:
                self._stats["failed_batches"] += 1
                self._stats["score_time_s"] += time.perf_counter() - t0
            if len(parts) > 1:
                logger.warning("score_batch failed on %d items of %d requests (%s: %s); scoring each half again",
                               len(items), len(parts), type(exc).__name__, exc)
                mid = len(parts) // 2
                self._score_parts(scorer, parts[:mid])
                self._score_parts(scorer, parts[mid:])
                return
            req = parts[0][0]
            if isinstance(exc, ItemRejected):
                logger.warning("score_batch refused a request's %d items: %s", len(items), exc)
            else:
                logger.exception("score_batch failed on a request's %d items", len(items))
            with self._cond:
                self._stats["isolated_failures"] += 1
            if not req.future.done():
                req.future.set_exception(exc)
            return
        with self._cond:
            self._stats["batches"] += 1
            self._stats["items_scored"] += len(items)
            self._stats["largest_batch"] = max(self._stats["largest_batch"], len(items))
            self._stats["score_time_s"] += time.perf_counter() - t0
        pos = 0
        for req, lo, hi in parts:
            req.scores[lo:hi] = scores[pos : pos + hi - lo]
            pos += hi - lo
            req.unscored -= hi - lo
            if req.unscored == 0 and not req.future.done():
                req.future.set_result(list(req.scores))


def _close(scorer: Any) -> None:
    close = getattr(scorer, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - shutting down anyway
            logger.exception("scorer.close() failed")


def _check_scores(scores: Any, n: int) -> list[float]:
    """Scorer output -> list of n finite floats, else ``ValueError`` naming the problem."""
    try:
        scores = list(scores.tolist() if hasattr(scores, "tolist") else scores)
    except TypeError as exc:
        raise ValueError(f"scorer.score_batch returned {type(scores).__name__}, expected a list of floats") from exc
    if len(scores) != n:
        raise ValueError(f"scorer.score_batch returned {len(scores)} scores for {n} items")
    out = []
    for i, s in enumerate(scores):
        if isinstance(s, bool) or not isinstance(s, numbers.Real):
            raise ValueError(f"scorer.score_batch returned {type(s).__name__} {s!r} at position {i}, expected a float")
        if not math.isfinite(s):
            raise ValueError(f"scorer.score_batch returned non-finite score {s!r} at position {i}")
        out.append(float(s))
    return out
