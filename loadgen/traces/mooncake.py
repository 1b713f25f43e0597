"""Mooncake FAST'25 traces (Moonshot AI Kimi): arrivals, lengths and prompt block hashes.

Sources `mooncake-conversation` and `mooncake-synthetic`, read from the shared data folder
(`traces/mooncake/{conversation,synthetic}_trace.jsonl.gz`, kvcache-ai/Mooncake, Apache-2.0;
see shared/data/SOURCES.md). One JSON object per line:

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ..., 13]}

`timestamp` is milliseconds from the trace start; lengths are tokens; `hash_ids` holds one id
per 512-token prompt block (the last one partial unless the prompt is a multiple of 512), and
two requests whose first k ids are equal share a reusable KV prefix of k blocks.

Mapping: `arrival_s` = timestamp / 1000; `prompt_tokens` = input_length; `output_tokens` =
output_length; `block_tokens` = 512; `block_hashes` = the chain (`policies.routing.chain.chain_ids`)
over the ids of the prompt's full blocks (the first input_length // 512). The files carry no
session or tenant. Rows are stably sorted by timestamp (they already are).
"""

from __future__ import annotations

import json
from pathlib import Path

from loadgen.schema import TraceRequest
from loadgen.traces.base import TraceFileSource
from loadgen.traces.registry import SourceInfo, open_text, register_source
from policies.routing.chain import chain_ids

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per `hash_ids` entry in the Mooncake traces."""


def read_mooncake_jsonl(path: Path, source: str) -> list[TraceRequest]:
    """A Mooncake trace JSONL file (`.jsonl` or `.jsonl.gz`) as requests with block hashes."""
    requests: list[TraceRequest] = []
    with open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            rec = json.loads(line)
            try:
                arrival = float(rec["timestamp"]) / 1000.0
                prompt, output = int(rec["input_length"]), int(rec["output_length"])
                ids = rec["hash_ids"]
            except KeyError as exc:
                raise ValueError(f"{path}:{line_no}: missing field {exc}") from None
            full = ids[: prompt // MOONCAKE_BLOCK_TOKENS]
            requests.append(
                TraceRequest(
                    arrival,
                    prompt,
                    output,
                    source,
                    block_hashes=chain_ids(full),
                    block_tokens=MOONCAKE_BLOCK_TOKENS,
                )
            )
    requests.sort(key=lambda r: r.arrival_s)
    return requests


for _name, _file, _about in (
    ("conversation", "conversation_trace.jsonl.gz", "one hour of Kimi chat requests"),
    ("synthetic", "synthetic_trace.jsonl.gz", "built from public datasets, Poisson arrivals"),
):
    register_source(
        TraceFileSource(
            SourceInfo(
                f"mooncake-{_name}",
                f"Mooncake FAST'25 {_name} trace ({_about}), with 512-token prompt block hashes",
                "trace",
            ),
            read_mooncake_jsonl,
            f"traces/mooncake/{_file}",
        )
    )
