"""Traffic captured by the gateway (`sagesched serve --capture DIR`, `gateway.capture`).

Source `capture` (needs a path: one capture file or the capture folder, whose
`capture-*.jsonl` files are read in name order, i.e. time order). Each completed request
becomes a `TraceRequest` on the wall clock (arrival in epoch seconds; windows rebase it),
with the backend's prompt and output token counts and the served model as the tenant.
Requests that did not complete (rejected, failed, cancelled) carry no true output length and
are left out; `capture_summary` counts them.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

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


def _completed(records: list[dict[str, Any]], source: str) -> list[TraceRequest]:
    requests = [
        TraceRequest(
            arrival_s=float(r["arrival_s"]),
            prompt_tokens=int(r["prompt_tokens"]),
            output_tokens=int(r["output_tokens"]),
            source=source,
            tenant=r.get("model"),
        )
        for r in records
        if r.get("outcome") == "completed"
        and r.get("prompt_tokens")
        and int(r.get("output_tokens") or 0) > 0
    ]
    requests.sort(key=lambda q: q.arrival_s)
    return requests


def capture_summary(path: Path) -> dict[str, Any]:
    """Counts by outcome and model, the time span, the arrival rate and the completed
    requests' mean lengths of a capture (its files read once)."""
    records = read_records(path)
    arrivals = sorted(float(r["arrival_s"]) for r in records)
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    done = _completed(records, "capture")
    summary: dict[str, Any] = {
        "files": len(capture_files(path)),
        "records": len(records),
        "outcomes": dict(Counter(str(r.get("outcome")) for r in records)),
        "models": dict(Counter(str(r.get("model")) for r in records)),
        "span_s": span,
        "rate_per_s": (len(records) - 1) / span if span > 0 else None,
        "completed_requests": len(done),
    }
    if done:
        summary["prompt_tokens_mean"] = sum(r.prompt_tokens for r in done) / len(done)
        summary["output_tokens_mean"] = sum(r.output_tokens for r in done) / len(done)
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
