"""`gateway.observability.capture.CaptureWriter`: bounded queue, rotation, pruning, no text in a
record; the
opt-in prompt embeddings (int8 encoding, a record waiting for a prediction still running)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from gateway.cli import build_parser, overrides
from gateway.config import CaptureSettings, ConfigError, TrafficClass
from gateway.errors import Outcome
from gateway.observability.capture import CaptureWriter, encode_embedding, record_of
from gateway.observability.metrics import RequestTrace
from gateway.scheduling.dispatcher import Ticket
from gateway.serving.openai_api import parse_call


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
                        "ttlt_s", "outcome", "status", "backend", "policy", "class",
                        "tenant", "trace_id"}  # fmt: skip
    assert (rec["class"], rec["tenant"], rec["trace_id"]) == (None, None, None)  # untraced


def test_record_carries_the_class_and_a_tenant_pseudonym() -> None:
    trace = _trace(0)
    trace.klass, trace.tenant = "batch", "acme-corp"
    rec = record_of(trace, now_wall=1_000.0, now_mono=110.0)
    assert rec["class"] == "batch"
    assert rec["tenant"].startswith("t-") and len(rec["tenant"]) == 18
    assert "acme" not in json.dumps(rec)  # the tenant's name never reaches the file
    assert rec["tenant"] == record_of(trace, now_wall=1.0, now_mono=1.0)["tenant"]  # stable


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


# -- prompt embeddings (opt-in) -----------------------------------------------------------


def _ticket(i: int, vector: object = None) -> Ticket:
    call = parse_call("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    ticket = Ticket(call, _trace(i), TrafficClass("standard"))
    ticket.prompt_vector = vector
    return ticket


def _records(folder: Path) -> list[dict[str, object]]:
    return [
        json.loads(x) for f in sorted(folder.glob("capture-*.jsonl")) for x in f.read_text().split()
    ]


def test_encoding_is_int8_with_one_scale() -> None:
    enc = encode_embedding(np.array([0.5, -0.25, 0.0, 1.0], dtype=np.float32))
    assert enc is not None and enc["scale"] == 1.0 / 127
    assert list(np.frombuffer(base64.b64decode(enc["int8"]), np.int8)) == [64, -32, 0, 127]
    assert encode_embedding(np.zeros(3))["scale"] == 0.0  # type: ignore[index]
    assert encode_embedding(np.array([1.0, np.nan])) is None


async def test_embeddings_are_recorded_only_when_on(tmp_path: Path) -> None:
    vec = np.linspace(-0.2, 0.3, 384, dtype=np.float32)
    for on in (False, True):
        folder = tmp_path / str(on)
        writer = CaptureWriter(CaptureSettings(dir=str(folder), embeddings=on), lambda _: None)
        task = asyncio.create_task(writer.run())
        writer.offer(_trace(0), _ticket(0, vec))
        writer.offer(_trace(1), _ticket(1, None))  # never embedded (e.g. no predictor)
        writer.offer(_trace(2))  # rejected before its job existed
        await writer.flushed()
        await _stop(task)
        records = _records(folder)
        assert len(records) == 3
        assert ["embedding" in r for r in records] == [on, False, False]


async def test_a_record_waits_for_the_prediction_running_beside_it(tmp_path: Path) -> None:
    writer = CaptureWriter(CaptureSettings(dir=str(tmp_path), embeddings=True), lambda _: None)
    task = asyncio.create_task(writer.run())
    ready = asyncio.Event()
    ticket = _ticket(0)

    async def refine() -> None:  # the prediction, still embedding when the request settles
        await ready.wait()
        ticket.prompt_vector = np.full(8, 0.1, np.float32)

    ticket.refining = asyncio.create_task(refine())
    writer.offer(_trace(0), ticket)
    await writer.flushed()
    assert _records(tmp_path) == []  # not written without its embedding
    ready.set()
    await ticket.refining  # its done callbacks (the capture's first) ran before we resume
    await writer.flushed()
    [rec] = _records(tmp_path)
    assert abs(rec["embedding"]["scale"] - 0.1 / 127) < 1e-9  # type: ignore[index]
    stuck = _ticket(1)
    stuck.refining = asyncio.create_task(asyncio.Event().wait())  # never ends
    writer.offer(_trace(1), stuck)
    await _stop(task)  # stopping writes it without an embedding
    assert [("embedding" in r, r["output_tokens"]) for r in _records(tmp_path)] == [
        (True, 40), (False, 41)]  # fmt: skip
    await _stop(stuck.refining)


def test_serve_flags_turn_embeddings_on_with_a_capture_only() -> None:
    parser = build_parser("serve")
    args = parser.parse_args(["--capture", "/tmp/cap", "--capture-embeddings"])
    assert overrides(args)["capture"] == {"dir": "/tmp/cap", "embeddings": True}
    assert overrides(parser.parse_args(["--capture", "/c"]))["capture"]["embeddings"] is False
    assert CaptureSettings(dir="/c").embeddings is False  # off by default
    with pytest.raises(ConfigError, match="needs --capture DIR"):
        overrides(parser.parse_args(["--capture-embeddings"]))
