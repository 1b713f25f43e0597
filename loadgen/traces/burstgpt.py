"""BurstGPT (HPMLL/BurstGPT, CC-BY 4.0): Azure OpenAI GPT-3.5/GPT-4 usage logs.

Sources:
- `burstgpt-v1`: the v1 column set `Timestamp, Model, Request tokens, Response tokens, Total
  tokens, Log Type` (shared: the first 400 rows of `BurstGPT_1.csv`, `burstgpt_slice.csv.gz`);
- `burstgpt-v3`: the release-v2.0 column set, which adds `Session ID` and `Elapsed time`
  after `Timestamp` (shared: first 400 rows of `BurstGPT_3.csv`, `burstgpt3_slice.csv.gz`).
  Users with the full CSVs pass `path`; the reader picks columns by name, so either column
  set reads with either source;
- `burstgpt-lengths`: `burst_data_8000.json` (8,000 (input, output) length pairs sampled from
  the Hugging Face mirror, no timestamps). `arrival_s` is the row index (1 s apart): usable
  for length distributions only.

Mapping: `arrival_s` = `Timestamp` (s on the trace's clock, since 00:00 of its first day);
`prompt_tokens` = Request tokens; `output_tokens` = Response tokens; `tenant` = Model
(ChatGPT / GPT-4); `session` = Session ID when present and non-empty.
Failed requests (0 response tokens) are skipped by default (`read_burstgpt_csv(...,
skip_failed=False)` keeps them): a replay cannot ask for 0 output tokens.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from loadgen.schema import TraceRequest
from loadgen.traces.base import TraceFileSource
from loadgen.traces.registry import SourceInfo, open_text, register_source

_REQUIRED = {"Timestamp", "Model", "Request tokens", "Response tokens"}


def read_burstgpt_csv(path: Path, source: str, *, skip_failed: bool = True) -> list[TraceRequest]:
    """A BurstGPT CSV (v1 or v3 columns) as requests, stably sorted by timestamp."""
    requests: list[TraceRequest] = []
    with open_text(path) as f:
        reader = csv.DictReader(f)
        missing = _REQUIRED - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: not a BurstGPT CSV, missing columns {sorted(missing)}")
        for row in reader:
            output = int(float(row["Response tokens"]))
            if skip_failed and output == 0:
                continue
            requests.append(
                TraceRequest(
                    arrival_s=float(row["Timestamp"]),
                    prompt_tokens=int(float(row["Request tokens"])),
                    output_tokens=output,
                    source=source,
                    tenant=row["Model"] or None,
                    session=row.get("Session ID") or None,
                )
            )
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def read_burstgpt_lengths(path: Path, source: str) -> list[TraceRequest]:
    """`burst_data_8000.json`'s length pairs, in file order; `arrival_s` = row index (s)."""
    with open_text(path) as f:
        data = json.load(f)
    return [
        TraceRequest(
            arrival_s=float(i),
            prompt_tokens=int(pair["input_length"]),
            output_tokens=int(pair["output_length"]),
            source=source,
        )
        for i, pair in enumerate(data["data"])
    ]


register_source(
    TraceFileSource(
        SourceInfo("burstgpt-v1", "BurstGPT v1 columns (BurstGPT_1.csv; 400-row slice)", "trace"),
        read_burstgpt_csv,
        "traces/burstgpt/burstgpt_slice.csv.gz",
    )
)
register_source(
    TraceFileSource(
        SourceInfo(
            "burstgpt-v3",
            "BurstGPT v3 columns with sessions (BurstGPT_3.csv, v2.0; 400-row slice)",
            "trace",
        ),
        read_burstgpt_csv,
        "traces/burstgpt/burstgpt3_slice.csv.gz",
    )
)
register_source(
    TraceFileSource(
        SourceInfo(
            "burstgpt-lengths",
            "BurstGPT length pairs, no timestamps (burst_data_8000.json; 8,000 pairs)",
            "lengths",
            has_arrivals=False,
        ),
        read_burstgpt_lengths,
        "traces/burstgpt/burst_data_8000.json.gz",
    )
)
