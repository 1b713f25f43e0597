"""Traffic captured by the gateway (`sagesched serve --capture DIR`,
`gateway.observability.capture`).

Source `capture` (needs a path: one capture file or the capture folder, whose
`capture-*.jsonl` files are read in name order, i.e. time order). Each completed request
becomes a `TraceRequest` on the wall clock (arrival in epoch seconds; windows rebase it),
with the backend's prompt and output token counts and the served model as the tenant.
Requests that did not complete (rejected, failed, cancelled) carry no true output length and
are left out; `capture_summary` counts them.

A capture made with `capture.embeddings` on also holds each embedded prompt's MiniLM vector
(`{"int8": base64, "scale": s}`, written by `gateway.observability.capture.encode_embedding`);
`decode_embedding` turns one back into floats and `capture_embeddings` lists them in the order
of `read_capture` (None where a record has none; nothing here requires them).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from loadgen.schema import TraceRequest
from loadgen.traces.base import TraceFileSource
from loadgen.traces.registry import SourceInfo, open_text, register_source

PATTERN = "capture-*.jsonl*"


def capture_files(path: Path) -> list[Path]:
    """`path` itself, or the capture files in the folder `path`, in time order."""
    if path.is_dir():
        files = sorted(path.glob(PATTERN))
        if not files:
            raise ValueError(f"{path}: no {PATTERN} files")
        return files
    return [path]


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every capture record under `path`, in file order (a torn last line is skipped)."""
    out: list[dict[str, Any]] = []
    for file in capture_files(path):
        with open_text(file) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash or a rotation in progress
                if not isinstance(rec, dict) or "arrival_s" not in rec:
                    raise ValueError(f"{file}:{n}: not a capture record")
                out.append(rec)
    return out


def read_capture(path: Path, source: str) -> list[TraceRequest]:
    """The completed requests of a capture, in arrival order."""
    return _completed(read_records(path), source)


def capture_embeddings(path: Path) -> list[NDArray[np.float32] | None]:
    """The prompt embedding of each request of `read_capture(path)`, in the same order
    (None where the record has none)."""
    return [decode_embedding(r) for r in _completed_records(read_records(path))]


def decode_embedding(record: dict[str, Any]) -> NDArray[np.float32] | None:
    """The record's prompt embedding as float32 (each value within `scale / 2` of the one
    the gateway's predictor computed), or None if it has none."""
    enc = record.get("embedding")
    if enc is None:
        return None
    try:
        q = np.frombuffer(base64.b64decode(enc["int8"], validate=True), dtype=np.int8)
        return (q.astype(np.float32) * np.float32(enc["scale"])).astype(np.float32)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise ValueError(f"not a capture embedding: {str(enc)[:80]}") from exc


def _completed_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of completed requests with both counts, in arrival order (stable)."""
    done = [
        r
        for r in records
        if r.get("outcome") == "completed"
        and r.get("prompt_tokens")
        and int(r.get("output_tokens") or 0) > 0
    ]
    done.sort(key=lambda r: float(r["arrival_s"]))
    return done


def _completed(records: list[dict[str, Any]], source: str) -> list[TraceRequest]:
    return [
        TraceRequest(
            arrival_s=float(r["arrival_s"]),
            prompt_tokens=int(r["prompt_tokens"]),
            output_tokens=int(r["output_tokens"]),
            source=source,
            tenant=r.get("model"),
        )
        for r in _completed_records(records)
    ]


def capture_summary(path: Path) -> dict[str, Any]:
    """Counts by outcome and model, the time span, the arrival rate and the completed
    requests' mean lengths of a capture (its files read once)."""
    records = read_records(path)
    arrivals = sorted(float(r["arrival_s"]) for r in records)
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    done = _completed_records(records)
    summary: dict[str, Any] = {
        "files": len(capture_files(path)),
        "records": len(records),
        "outcomes": dict(Counter(str(r.get("outcome")) for r in records)),
        "models": dict(Counter(str(r.get("model")) for r in records)),
        "classes": dict(Counter(str(r.get("class")) for r in records)),
        "span_s": span,
        "rate_per_s": (len(records) - 1) / span if span > 0 else None,
        "completed_requests": len(done),
        "with_embedding": sum(1 for r in records if r.get("embedding") is not None),
    }
    if done:
        summary["prompt_tokens_mean"] = sum(int(r["prompt_tokens"]) for r in done) / len(done)
        summary["output_tokens_mean"] = sum(int(r["output_tokens"]) for r in done) / len(done)
    return summary


register_source(
    TraceFileSource(
        SourceInfo(
            "capture",
            "traffic recorded by `sagesched serve --capture DIR` (a capture file or folder)",
            "trace",
            needs_path=True,
        ),
        read_capture,
        None,
    )
)
