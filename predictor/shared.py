"""Shared learning across gateway replicas: completed requests through one Redis stream.

Each replica learns its own completions locally (`LengthPredictor.observe_async`); this
component, registered as one of the predictor's `listeners`, also publishes each of them —
(model, embedding, prompt tokens, output tokens, replica id, time) — to a Redis stream, and
in a background task reads the other replicas' records and learns them with
`LengthPredictor.learn_vectors`: no re-embedding, and never echoed back (only `observe_async`
calls listeners). A replica that starts late first learns the stream's most recent records
(up to `warm_items`, oldest first), so it predicts like the others from its first request;
a replica restored from a snapshot learns only the records published after it was written
(`warm_after_s`), which its snapshot cannot hold — including its own, when it crashed
before saving them — so a restart duplicates nothing.

Why a stream and not pub/sub: a stream keeps the last `maxlen` records (trimmed approximately,
like the local history ring), so a late starter can warm from it and a replica that lost
Redis for a while catches up from the last record id it read when Redis is back.

Failure model: Redis is optional. Publishing is fire-and-forget into a bounded buffer (full:
the record is dropped and counted), so a request never waits for Redis. When Redis is lost
(refused, reset, timeout) the replica keeps learning locally, logs one line per state change
(lost / restored), counts it in `stats()` and reconnects with exponential backoff; nothing is
raised to a caller. The gateway exports `stats()` (`gateway.observability.metrics`).

Record fields (bytes): `m` model ("" = default state), `e` embedding encoding (`i8`: int8
values times the float32 scale `s`, 1 byte a dimension; `f32`: float32), `v` the embedding,
`p` / `o` prompt and output tokens, `r` replica id, `t` publish time (Unix ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from numpy.typing import ArrayLike, NDArray

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from predictor.model import LengthPredictor

log = logging.getLogger("sagesched.predictor.shared")

ENCODINGS = ("int8", "float32")
READ_BATCH_ITEMS = 256
"""Records one XREAD (or one warm page of XREVRANGE) returns at most."""
PUBLISH_BATCH_ITEMS = 64
"""Records one pipelined round trip publishes at most."""
Entry = tuple[bytes, dict[bytes, bytes]]
"""A stream entry as redis-py returns it: (id, fields)."""
_DOWN = (OSError, asyncio.TimeoutError)  # plus redis.exceptions.RedisError, imported lazily


@dataclass(frozen=True, slots=True)
class SharedRecord:
    """One completed request as the stream carries it."""

    model: str
    vector: NDArray[np.float32]
    prompt_tokens: float
    output_tokens: float
    replica: str
    time_ms: float


def encode(record: SharedRecord, encoding: str = "int8") -> dict[str, bytes]:
    """A record's stream fields. int8: value i is `int8[i] * scale`, scale = max |x| / 127
    (within scale / 2 of the original; cosine ≥ 0.9999 for MiniLM's unit vectors)."""
    v = np.asarray(record.vector, dtype=np.float32).ravel()
    fields = {
        "m": record.model.encode(),
        "p": repr(float(record.prompt_tokens)).encode(),
        "o": repr(float(record.output_tokens)).encode(),
        "r": record.replica.encode(),
        "t": repr(float(record.time_ms)).encode(),
    }
    if encoding == "float32":
        return fields | {"e": b"f32", "v": v.tobytes()}
    if encoding != "int8":
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    peak = float(np.abs(v).max()) if v.size else 0.0
    scale = peak / 127.0
    q = np.zeros(v.size, np.int8) if scale == 0.0 else np.rint(v / scale).astype(np.int8)
    return fields | {"e": b"i8", "s": repr(scale).encode(), "v": q.tobytes()}


def decode(fields: dict[bytes, bytes], dim: int) -> SharedRecord:
    """Inverse of `encode`; `ValueError` on a malformed record or another dimension."""
    try:
        kind = fields[b"e"]
        if kind == b"f32":
            v = np.frombuffer(fields[b"v"], dtype=np.float32)
        elif kind == b"i8":
            v = np.frombuffer(fields[b"v"], dtype=np.int8) * np.float32(float(fields[b"s"]))
        else:
            raise ValueError(f"unknown embedding encoding {kind!r}")
        record = SharedRecord(
            model=fields[b"m"].decode(),
            vector=v.astype(np.float32),
            prompt_tokens=float(fields[b"p"]),
            output_tokens=float(fields[b"o"]),
            replica=fields[b"r"].decode(),
            time_ms=float(fields[b"t"]),
        )
    except (KeyError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed shared-learning record: {exc!r}") from None
    if record.vector.size != dim:
        raise ValueError(f"record embedding is {record.vector.size}-d, this predictor's {dim}-d")
    return record


def default_replica_id() -> str:
    """host name and process id: unique per gateway process, stable across a container's
    restarts (its host name stays, and it runs as pid 1)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def redacted(url: str) -> str:
    """The URL without a password (for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class SharedLearning:
    """Publishes this replica's completions to a Redis stream and learns the others'.

    Paired `start` / `stop` on the predictor's event loop. `offer` (the predictor listener)
    never blocks and never raises. The counters in `stats()` are plain numbers.
    """

    def __init__(
        self,
        predictor: LengthPredictor,
        redis_url: str,
        *,
        stream: str = "sagesched:learning",
        maxlen: int = 100_000,
        replica_id: str | None = None,
        encoding: str = "int8",
        buffer_items: int = 1024,
        warm_items: int | None = None,
        warm_after_s: float | None = None,
        block_ms: int = 1000,
        timeout_s: float = 1.0,
        backoff_s: tuple[float, float] = (0.1, 5.0),
    ) -> None:
        """`maxlen`: records the stream keeps (approximately); `warm_items`: records learned at
        start (default: the smaller of `maxlen` and the predictor's ring); `warm_after_s`: Unix
        time before which records are not warmed (the predictor's snapshot, written then,
        holds them; None: no snapshot, all are learned); `block_ms`: longest
        XREAD wait; `timeout_s`: longest silence beyond it before Redis counts as lost;
        `backoff_s`: first and largest wait between reconnection attempts."""
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
        if maxlen < 1 or buffer_items < 1 or block_ms < 1 or timeout_s <= 0:
            raise ValueError("maxlen, buffer_items, block_ms and timeout_s must be positive")
        self.predictor = predictor
        self.url, self.stream, self.maxlen = redis_url, stream, maxlen
        self.replica = replica_id or default_replica_id()
        self.encoding = encoding
        capacity = predictor.config.capacity_items
        self.warm_items = min(maxlen, capacity) if warm_items is None else warm_items
        self.warm_after_ms = -math.inf if warm_after_s is None else warm_after_s * 1000.0
        self.block_ms, self.timeout_s, self.backoff_s = block_ms, timeout_s, backoff_s
        self._buffer: asyncio.Queue[SharedRecord] = asyncio.Queue(buffer_items)
        self._last_id: bytes | None = None  # newest record id read; None: not warmed yet
        self._task: asyncio.Task[None] | None = None
        self._up_event = asyncio.Event()
        self._was_up = False
        self.state = "starting"
        """"starting" (not connected yet), "up", "down" (lost; one log line per change) or
        "stopped"."""
        # counters (plain numbers; `stats`)
        self.published = self.received = self.warmed = 0
        self.dropped = self.failed = self.malformed = self.disconnects = 0
        self.delays_s: list[float] = []
        """Publish-to-learned delay of each received record (bounded; docs, tests)."""

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Listen to the predictor's completions and start the background task (it connects,
        warms and follows the stream; an unreachable Redis is not an error)."""
        if self._task is not None:
            return
        self.predictor.listeners.append(self.offer)
        self._task = asyncio.create_task(self._run(), name="shared-learning")

    async def stop(self, flush_s: float = 1.0) -> None:
        """Stop listening, publish what is buffered (for up to `flush_s` while connected),
        stop the background task and close the connection."""
        if self._task is None:
            return
        with contextlib.suppress(ValueError):
            self.predictor.listeners.remove(self.offer)
        if self.connected and not self._buffer.empty():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._drained(), flush_s)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        self.state = "stopped"
        self._up_event.clear()

    async def wait_connected(self, timeout_s: float) -> bool:
        """Whether Redis is (or comes) up within `timeout_s` — warmed and following."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._up_event.wait(), timeout_s)
        return self.connected

    async def _drained(self) -> None:
        while self.connected and not self._buffer.empty():
            await asyncio.sleep(0.01)

    # -- publishing ---------------------------------------------------------------------

    def offer(
        self, model: str | None, vector: ArrayLike, prompt_tokens: float, output_tokens: float
    ) -> None:
        """Queue one locally learned completion for publishing (a predictor listener). Never
        blocks: a full buffer drops the record and counts it."""
        record = SharedRecord(
            model or "",
            np.asarray(vector, dtype=np.float32).ravel(),
            float(prompt_tokens),
            float(output_tokens),
            self.replica,
            time.time() * 1000.0,
        )
        try:
            self._buffer.put_nowait(record)
        except asyncio.QueueFull:
            self.dropped += 1

    async def _publish(self, client: aioredis.Redis) -> None:
        """Drain the buffer into the stream, a pipelined batch per round trip."""
        while True:
            batch = [await self._buffer.get()]
            while len(batch) < PUBLISH_BATCH_ITEMS and not self._buffer.empty():
                batch.append(self._buffer.get_nowait())
            pipe = client.pipeline(transaction=False)
            for record in batch:
                fields: Any = encode(record, self.encoding)
                pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)
            try:
                async with asyncio.timeout(self.timeout_s):
                    await pipe.execute()
            except BaseException:
                self.failed += len(batch)
                raise
            self.published += len(batch)

    # -- following ----------------------------------------------------------------------

    async def _warm(self, client: aioredis.Redis) -> None:
        """Learn the stream's `warm_items` newest records published after `warm_after_s` (any
        replica's: none of them is in this predictor yet), oldest first; remember the newest
        id so that following misses nothing in between."""
        pages: list[list[Entry]] = []
        top, held = b"+", 0
        while held < self.warm_items:
            want = min(READ_BATCH_ITEMS * 4, self.warm_items - held)
            async with asyncio.timeout(self.timeout_s):
                reply = await client.xrevrange(self.stream, max=top, min=b"-", count=want)
            page = cast(list[Entry], reply)
            if not page:
                break
            pages.append(page)
            held += len(page)
            top = b"(" + page[-1][0]
            if float(page[-1][1].get(b"t", b"inf")) < self.warm_after_ms:
                break  # older pages hold only records the snapshot has
        newest = pages[0][0][0] if pages else b"0-0"
        after = self.warm_after_ms
        for page in reversed(pages):
            learned = await self._learn(list(reversed(page)), lambda r: r.time_ms >= after)
            self.warmed += learned
        self._last_id = newest

    async def _follow(self, client: aioredis.Redis) -> None:
        """Learn the other replicas' records as they arrive (XREAD BLOCK)."""
        assert self._last_id is not None
        while True:
            streams: Any = {self.stream: self._last_id}
            async with asyncio.timeout(self.block_ms / 1000.0 + self.timeout_s):
                reply = await client.xread(streams, count=READ_BATCH_ITEMS, block=self.block_ms)
            for _, entries in cast(list[tuple[bytes, list[Entry]]], reply or ()):
                if entries:
                    self._last_id = entries[-1][0]
                    self.received += await self._learn(entries, self._theirs, timed=True)

    def _theirs(self, record: SharedRecord) -> bool:
        return record.replica != self.replica

    async def _learn(
        self, entries: Sequence[Entry], keep: Callable[[SharedRecord], bool], timed: bool = False
    ) -> int:
        """Learn the records among `entries` that `keep` accepts (one batch per model, off the
        loop); returns how many."""
        dim = self.predictor.embedder.dim
        by_model: dict[str, list[SharedRecord]] = {}
        for _, fields in entries:
            try:
                record = decode(fields, dim)
            except ValueError as exc:
                self.malformed += 1
                if self.malformed == 1:
                    log.warning("shared learning: skipping a malformed record: %s", exc)
                continue
            if keep(record):
                by_model.setdefault(record.model, []).append(record)
        learned = 0
        for model, records in by_model.items():
            await asyncio.to_thread(
                self.predictor.learn_vectors,
                np.stack([r.vector for r in records]),
                [r.output_tokens for r in records],
                [r.prompt_tokens for r in records],
                model or None,
            )
            learned += len(records)
            if timed:
                now_ms = time.time() * 1000.0
                self.delays_s.extend((now_ms - r.time_ms) / 1000.0 for r in records)
                del self.delays_s[:-10_000]
        return learned

    # -- connection ---------------------------------------------------------------------

    async def _run(self) -> None:
        """Connect, warm (first time only), then publish and follow until Redis fails; wait
        (exponential backoff) and reconnect, resuming after the last record read."""
        from redis.exceptions import RedisError

        wait = self.backoff_s[0]
        while True:
            client = self._connect()
            try:
                async with asyncio.timeout(self.timeout_s):
                    await client.ping()
                if self._last_id is None:
                    await self._warm(client)
                self._up()
                wait = self.backoff_s[0]
                await _first_failure(self._publish(client), self._follow(client))
            except (RedisError, *_DOWN) as exc:
                self._down(exc)
            except Exception as exc:  # never let the task die: log, then as if Redis failed
                log.error("shared learning failed", exc_info=exc)
                self._down(exc)
            finally:
                with contextlib.suppress(Exception):
                    await client.aclose()
            await asyncio.sleep(wait)
            wait = min(wait * 2, self.backoff_s[1])

    def _connect(self) -> aioredis.Redis:
        """A client that neither retries nor times out by itself: this loop reconnects, and
        each call is bounded by `asyncio.timeout` (redis-py's `socket_timeout` sends through
        Python 3.11's `asyncio.wait_for`, which can swallow a cancellation)."""
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        return aioredis.Redis.from_url(
            self.url,
            socket_connect_timeout=self.timeout_s,
            socket_timeout=None,
            protocol=2,  # the reply shapes `_warm` and `_follow` read
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )

    def _up(self) -> None:
        if self.state != "up":
            word = "restored" if self._was_up else "connected"
            self._was_up = True
            log.info(
                "shared learning: Redis at %s %s (replica %s, stream %s)",
                redacted(self.url), word, self.replica, self.stream,
            )  # fmt: skip
            self.state = "up"
            self._up_event.set()

    def _down(self, exc: BaseException) -> None:
        if self.state != "down":
            self.disconnects += 1
            log.warning(
                "shared learning: Redis at %s lost (%s); learning locally only until it is back",
                redacted(self.url), _describe(exc),
            )  # fmt: skip
            self.state = "down"
            self._up_event.clear()

    @property
    def connected(self) -> bool:
        """Whether Redis answered last (records are published and followed)."""
        return self.state == "up"

    def stats(self) -> dict[str, float]:
        """Plain numbers for the metrics: `connected` (1/0), records `published`, `received`
        (learned from others), `warmed` (learned at start), `dropped` (buffer full),
        `failed` (lost with a failed publish), `malformed`, and `disconnects`."""
        return {
            "connected": float(self.connected),
            "published": self.published,
            "received": self.received,
            "warmed": self.warmed,
            "dropped": self.dropped,
            "failed": self.failed,
            "malformed": self.malformed,
            "disconnects": self.disconnects,
        }


async def _first_failure(*work: Coroutine[Any, Any, None]) -> None:
    """Run `work` concurrently until one of them ends; re-raise how it ended. The others are
    cancelled and awaited — cancelled again while they survive, since a library may swallow
    one cancellation (Python 3.11's `asyncio.wait_for` does when its inner call completes at
    the same moment)."""
    tasks = [asyncio.create_task(w) for w in work]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pending = {t for t in tasks if not t.done()}
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)
    failures = [t.exception() for t in tasks if not t.cancelled()]  # each one retrieved
    first = next((f for f in failures if f is not None), None)
    if first is not None:
        raise first


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
