"""Azure LLM inference traces (Azure/AzurePublicDataset, CC-BY 4.0).

Sources:
- `azure-code-2023`, `azure-conv-2023`: the 2023 Splitwise traces (8,819 and 19,366 rows),
  read from `traces/azure/AzureLLMInferenceTrace_{code,conv}.csv.gz` in the shared folder;
- `azure-2024`: the 2024 week-long DynamoLLM traces (`AzureLLMInferenceTrace_{code,conv}_1week
  .csv`), not shared or shipped: pass `path`.

Format (both years): header `TIMESTAMP,ContextTokens,GeneratedTokens`. 2023 timestamps are
naive wall clock with 7 fractional digits (`2023-11-16 18:17:03.9799600`); the 2024 files use
ISO-8601 with a UTC offset and microseconds (`2024-05-10 00:00:00.009930+00:00`). Both parse
with `parse_timestamp` (any number of fractional digits, optional `Z`/offset, naive = UTC),
which keeps the fraction exactly (no datetime truncation to microseconds).

Mapping: `arrival_s` = seconds since the file's first row; `prompt_tokens` = ContextTokens;
`output_tokens` = GeneratedTokens. No tenant or session. Rows keep file order, stably sorted
by time if the file is not already sorted. Files may be plain or `.gz`.
"""

from __future__ import annotations

import csv
import re
from datetime import UTC, datetime
from pathlib import Path

from loadgen.schema import TraceRequest
from loadgen.traces.base import TraceFileSource
from loadgen.traces.registry import SourceInfo, open_text, register_source

_TS = re.compile(
    r"^\s*(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(\.\d+)?\s*(Z|[+-]\d\d:?\d\d)?\s*$", re.IGNORECASE
)


def parse_timestamp(text: str) -> tuple[int, float]:
    """(whole epoch seconds, fraction in [0, 1)) of an Azure trace timestamp.

    Naive times are taken as UTC. Plain numbers are read as epoch seconds. Kept in two parts
    so differences between nearby rows lose no precision.
    """
    m = _TS.match(text)
    if m is None:
        value = float(text)  # ValueError for anything else
        whole = int(value // 1)
        return whole, value - whole
    base, frac, zone = m.groups()
    zone = "+00:00" if zone is None or zone.upper() == "Z" else zone
    stamp = datetime.fromisoformat(base.replace(" ", "T") + zone).astimezone(UTC)
    return int(stamp.timestamp()), float(frac) if frac else 0.0


def read_azure_csv(path: Path, source: str) -> list[TraceRequest]:
    """An Azure LLM inference CSV (2023 or 2024 format) as requests; arrival from row 1."""
    stamps: list[tuple[int, float]] = []
    sizes: list[tuple[int, int]] = []
    with open_text(path) as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: not an Azure LLM trace, missing columns {sorted(missing)}")
        for row in reader:
            stamps.append(parse_timestamp(row["TIMESTAMP"]))
            sizes.append((int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    if not stamps:
        return []
    w0, f0 = stamps[0]
    arrivals = [(w - w0) + (fr - f0) for w, fr in stamps]
    order = sorted(range(len(arrivals)), key=arrivals.__getitem__)  # stable
    t0 = arrivals[order[0]]
    return [
        TraceRequest(
            arrival_s=arrivals[i] - t0,
            prompt_tokens=sizes[i][0],
            output_tokens=sizes[i][1],
            source=source,
        )
        for i in order
    ]


register_source(
    TraceFileSource(
        SourceInfo(
            "azure-code-2023",
            "Azure LLM inference 2023, code (Splitwise; 8,819 rows, 1 h)",
            "trace",
        ),
        read_azure_csv,
        "traces/azure/AzureLLMInferenceTrace_code.csv.gz",
    )
)
register_source(
    TraceFileSource(
        SourceInfo(
            "azure-conv-2023",
            "Azure LLM inference 2023, conversation (Splitwise; 19,366 rows, 1 h)",
            "trace",
        ),
        read_azure_csv,
        "traces/azure/AzureLLMInferenceTrace_conv.csv.gz",
    )
)
register_source(
    TraceFileSource(
        SourceInfo(
            "azure-2024",
            "Azure LLM inference 2024 week-long trace (DynamoLLM), code or conv CSV",
            "trace",
            needs_path=True,
        ),
        read_azure_csv,
        None,
    )
)
