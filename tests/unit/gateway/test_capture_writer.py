"""`gateway.capture.CaptureWriter`: bounded queue, rotation, pruning, no text in a record."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path

from gateway.capture import CaptureWriter, record_of
from gateway.config import CaptureSettings
from gateway.errors import Outcome
from gateway.metrics import RequestTrace


def _trace(i: int) -> RequestTrace:
    t = RequestTrace(model="m", arrived=100.0 + i, policy="fcfs", backend="b")
    t.dispatched, t.first_token, t.finished = 100.5 + i, 101.0 + i, 103.0 + i
    t.output_tokens, t.prompt_tokens = 40 + i, 12
    t.outcome = Outcome.COMPLETED
    return t


def test_record_holds_counts_and_times_only() -> None:
    rec = record_of(_trace(0), now_wall=1_000.0, now_mono=110.0)
    assert rec["arrival_s"] == 990.0  # the arrival 10 s before now, on the wall clock
    assert (rec["ttft_s"], rec["ttlt_s"]) == (1.0, 3.0)
    assert (rec["prompt_tokens"], rec["output_tokens"], rec["outcome"]) == (12, 40, "completed")
    assert set(rec) == {"v", "arrival_s", "model", "prompt_tokens", "output_tokens", "ttft_s",
                        "ttlt_s", "outcome", "status", "backend", "policy"}  # fmt: skip


async def test_full_queue_drops_and_counts(tmp_path: Path) -> None:
    counts = {"written": 0, "dropped": 0}
    writer = CaptureWriter(CaptureSettings(dir=str(tmp_path), queue=50), _counter(counts))
    for i in range(80):  # before the writer runs: 50 fit, 30 are dropped
        writer.offer(_trace(i))
    task = asyncio.create_task(writer.run())
    await writer.flushed()
    await _stop(task)
    assert counts == {"written": 50, "dropped": 30}, counts
    lines = [json.loads(x) for f in tmp_path.glob("capture-*.jsonl") for x in f.read_text().split()]
    assert [r["output_tokens"] for r in lines] == [40 + i for i in range(50)]


async def test_files_rotate_and_only_the_newest_are_kept(tmp_path: Path) -> None:
    counts = {"written": 0, "dropped": 0}
    settings = CaptureSettings(dir=str(tmp_path), max_file_mb=0.0005, max_files=3)
    writer = CaptureWriter(settings, _counter(counts))
    task = asyncio.create_task(writer.run())
    for r in range(8):  # 8 batches of 10 records (~2 KB each, over the 512-byte limit)
        for i in range(10):
            writer.offer(_trace(10 * r + i))
        await writer.flushed()
    for i in range(80, 85):  # queued when the gateway stops: flushed on cancel
        writer.offer(_trace(i))
    await _stop(task)
    assert counts == {"written": 85, "dropped": 0}, counts
    files = sorted(tmp_path.glob("capture-*.jsonl"))
    assert len(files) == 3, files
    kept = [json.loads(x) for f in files for x in f.read_text().split()]
    assert [r["output_tokens"] for r in kept] == [40 + i for i in range(60, 85)]


def _counter(counts: dict[str, int]) -> Callable[[str], None]:
    def count(result: str) -> None:
        counts[result] += 1

    return count


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
