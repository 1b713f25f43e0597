"""Traffic capture (`sagesched serve --capture DIR`): one JSON line per finished request.

A record holds what a scheduling study needs and nothing a user wrote: wall-clock arrival,
model, prompt and output token counts (the backend's `usage`), TTFT and TTLT, outcome and HTTP
status, backend and policy. Never the prompt or the answer text. The file format is the one
`loadgen.traces.capture` reads (source `capture`), so `sagesched traces`, `sagesched study
--trace` and `sagesched replay` take a capture as they take a public trace.

Bounded in every direction: records wait in a queue of `CaptureSettings.queue` (a full queue
drops the record and counts it, `sagesched_capture_records_total{result="dropped"}`); files
rotate at `max_file_mb` and only the newest `max_files` are kept. Writing happens in a worker
thread, in batches, so the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.config import CaptureSettings
from gateway.metrics import RequestTrace

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
    }


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

    def offer(self, trace: RequestTrace) -> None:
        """Queue the record of a settled request; drop it (counted) if the queue is full."""
        try:
            self._queue.put_nowait(record_of(trace, time.time(), time.monotonic()))
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
            if rest:
                self._write(rest)
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
