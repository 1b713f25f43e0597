"""Traffic capture (`sagesched serve --capture DIR`): one JSON line per finished request.

A record holds what a scheduling study needs and nothing a user wrote: wall-clock arrival,
model, prompt and output token counts (the backend's `usage`), TTFT and TTLT, outcome and HTTP
status, backend and policy. Never the prompt or the answer text. The file format is the one
`loadgen.traces.capture` reads (source `capture`), so `sagesched traces`, `sagesched study
--trace` and `sagesched replay` take a capture as they take a public trace.

With `CaptureSettings.embeddings` (opt-in: an embedding can leak what the prompt said), a
record also carries the prompt's embedding as the predictor made it for scheduling (kept on the
job's `Ticket`; never a second forward pass), int8-quantised with one scale and base64-encoded
(`encode_embedding`; 384 dimensions → 512 characters). A request the predictor never embedded
(no predictor, rejected before the prediction, prediction shed) has none. When the prediction
still runs beside a request that already finished, its record waits for it (`offer`).

Bounded in every direction: records wait in a queue of `CaptureSettings.queue` (a full queue
drops the record and counts it, `sagesched_capture_records_total{result="dropped"}`); files
rotate at `max_file_mb` and only the newest `max_files` are kept. Writing happens in a worker
thread, in batches, so the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gateway.config import CaptureSettings
from gateway.observability.metrics import RequestTrace, tenant_id
from gateway.scheduling.dispatcher import Ticket

log = logging.getLogger(__name__)

PREFIX = "capture-"
SUFFIX = ".jsonl"
SCHEMA = 1


def record_of(trace: RequestTrace, now_wall: float, now_mono: float) -> dict[str, Any]:
    """The capture record of a settled request (monotonic times turned into wall time)."""

    def since_arrival(t: float | None) -> float | None:
        return None if t is None else round(t - trace.arrived, 6)

    return {
        "v": SCHEMA,
        "arrival_s": round(now_wall - (now_mono - trace.arrived), 6),
        "model": trace.model,
        "prompt_tokens": trace.prompt_tokens,
        "output_tokens": trace.output_tokens,
        "ttft_s": since_arrival(trace.first_token),
        "ttlt_s": since_arrival(trace.finished),
        "outcome": None if trace.outcome is None else trace.outcome.value,
        "status": trace.status,
        "backend": trace.backend or None,
        "policy": trace.policy,
        "class": trace.klass or None,
        "tenant": tenant_id(trace.tenant, 16) if trace.tenant else None,  # a pseudonym only
        "trace_id": trace.trace_id,
    }


def encode_embedding(vector: Any) -> dict[str, Any] | None:
    """A float vector as `{"int8": base64 of int8 values, "scale": float}`: value i is
    `int8[i] * scale`, within `scale / 2` of the original (scale = max |x| / 127). None for a
    vector with a non-finite value. Read back by `loadgen.traces.capture.decode_embedding`."""
    v = np.asarray(vector, dtype=np.float64).ravel()
    peak = float(np.max(np.abs(v))) if v.size else 0.0
    if not np.isfinite(peak):
        return None
    scale = peak / 127.0
    q = np.zeros(v.size, np.int8) if scale == 0.0 else np.rint(v / scale).astype(np.int8)
    return {"int8": base64.b64encode(q.tobytes()).decode("ascii"), "scale": scale}


def _with_embedding(record: dict[str, Any], vector: Any) -> dict[str, Any]:
    if vector is not None and (encoded := encode_embedding(vector)) is not None:
        record["embedding"] = encoded
    return record


class CaptureWriter:
    """Queue → rotating JSONL files. `offer` from the event loop; `run` as a task."""

    def __init__(self, settings: CaptureSettings, count: Callable[[str], None]) -> None:
        """`count(result)`: called once per record with `written` or `dropped`."""
        assert settings.dir is not None
        self.settings = settings
        self.dir = Path(settings.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._count = count
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(settings.queue)
        self._path: Path | None = None
        self._seq = 0
        # records waiting for their prompt's embedding; bounded by the gateway's bound on
        # predictor work running beside requests (`prediction.MAX_PENDING`)
        self._waiting: dict[int, dict[str, Any]] = {}
        self._ids = itertools.count()

    def offer(self, trace: RequestTrace, ticket: Ticket | None = None) -> None:
        """Queue the record of a settled request; drop it (counted) if the queue is full.

        With embeddings on and the request's `ticket`, the record carries the prompt's
        embedding; if the prediction still runs beside the request (`ticket.refining`), the
        record is queued when it ends (or, if the writer stops first, written without it)."""
        record = record_of(trace, time.time(), time.monotonic())
        if ticket is None or not self.settings.embeddings:
            self._put(record)
            return
        pending = ticket.refining
        if pending is None or pending.done():
            self._put(_with_embedding(record, ticket.prompt_vector))
            return
        key = next(self._ids)
        self._waiting[key] = record
        pending.add_done_callback(lambda _: self._embedded(key, ticket))

    def _embedded(self, key: int, ticket: Ticket) -> None:
        record = self._waiting.pop(key, None)
        if record is not None:  # None: the writer stopped and wrote it without
            self._put(_with_embedding(record, ticket.prompt_vector))

    def _put(self, record: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self._count("dropped")

    async def run(self) -> None:
        """Write queued records in batches until cancelled; then, once the batch in flight
        is on disk, flush what is still queued."""
        inflight: asyncio.Future[None] | None = None
        try:
            while True:
                batch = [await self._queue.get()]
                while not self._queue.empty() and len(batch) < 1024:
                    batch.append(self._queue.get_nowait())
                inflight = asyncio.ensure_future(asyncio.to_thread(self._write, batch))
                await asyncio.shield(inflight)
                for _ in batch:
                    self._queue.task_done()
        except asyncio.CancelledError:
            if inflight is not None and not inflight.done():
                await inflight  # one writer at a time, also while stopping
            rest = []
            while not self._queue.empty():
                rest.append(self._queue.get_nowait())
            rest.extend(self._waiting.values())  # their predictions never ended
            self._waiting.clear()
            if rest:  # off the loop as well: the stop may flush a full queue
                await asyncio.to_thread(self._write, rest)
            raise

    async def flushed(self) -> None:
        """Return once every record offered so far is written (or counted as dropped)."""
        await self._queue.join()

    def _write(self, batch: list[dict[str, Any]]) -> None:
        lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in batch)
        try:
            path = self._current()
            with path.open("a", encoding="utf-8") as f:
                f.write(lines)
        except OSError:
            log.exception("capture: cannot write to %s; %d records dropped", self.dir, len(batch))
            for _ in batch:
                self._count("dropped")
            return
        for _ in batch:
            self._count("written")

    def _current(self) -> Path:
        """The file to append to: a new one at start and when the current one is full."""
        limit = self.settings.max_file_mb * 1024 * 1024
        if self._path is None or (self._path.exists() and self._path.stat().st_size >= limit):
            self._seq += 1
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            self._path = self.dir / f"{PREFIX}{stamp}-{self._seq:04d}{SUFFIX}"
            self._prune()
        return self._path

    def _prune(self) -> None:
        """Keep the newest `max_files` capture files (the current one included)."""
        files = sorted(self.dir.glob(f"{PREFIX}*{SUFFIX}"))  # names sort by time, then seq
        keep = max(0, self.settings.max_files - 1)  # room for the file about to be created
        for old in files[: max(0, len(files) - keep)]:
            with contextlib.suppress(OSError):
                old.unlink()
