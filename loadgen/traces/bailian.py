"""Alibaba Bailian (Qwen) usage traces, `qwen_traceB_blksz_16.jsonl` format (user path only).

Source `bailian-traceb`. The per-request traces of alibaba-edu/qwen-bailian-usagetraces-anon
(Apache-2.0; Git LFS objects, not shared or shipped here) are JSON Lines, one request each:

    {"chat_id": 159, "parent_chat_id": 55, "timestamp": 61.114, "input_length": 521,
     "output_length": 132, "type": "text", "turn": 2, "hash_ids": [1089, 1090, ...]}

Assumptions (from that repository's README as we know it; no copy could be checked here):
- `timestamp` is seconds since the trace start (millisecond resolution, as the LSSP windows
  taken from this file confirm); `input_length` / `output_length` are token counts;
- `chat_id` identifies the request and `parent_chat_id` the previous turn of the same
  conversation (-1 or absent for a first turn); `hash_ids` are 16-token KV block hashes (the
  `blksz_16` in the name); `type` is the request kind (text, image, search, file).

Mapping: `arrival_s` = timestamp; `prompt_tokens` = input_length; `output_tokens` =
output_length; `session` = the conversation's first `chat_id` (followed through
`parent_chat_id`; a parent not in the file starts the chain), as a string. `type`, `turn` and
`hash_ids` are not in the schema and are dropped. Only `timestamp`, `input_length` and
`output_length` are required; rows are stably sorted by timestamp. Rows with 0 output tokens
are kept (the format records no failures). The same reader reads the sibling files
(`qwen_traceA_blksz_16.jsonl`, `qwen_coder_...`, `qwen_thinking_...`), which share the format.
"""

from __future__ import annotations

import json
from pathlib import Path

from loadgen.schema import TraceRequest
from loadgen.traces.base import TraceFileSource
from loadgen.traces.registry import SourceInfo, open_text, register_source

_ROOT_PARENTS = (None, -1, "-1", "")
"""`parent_chat_id` values that mean "first turn"."""


def read_bailian_jsonl(path: Path, source: str) -> list[TraceRequest]:
    """A Bailian usage-trace JSONL file (`.jsonl` or `.jsonl.gz`) as requests."""
    roots: dict[object, object] = {}  # chat_id → the first chat_id of its conversation
    requests: list[TraceRequest] = []
    with open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            rec = json.loads(line)
            try:
                arrival = float(rec["timestamp"])
                prompt, output = int(rec["input_length"]), int(rec["output_length"])
            except KeyError as exc:
                raise ValueError(f"{path}:{line_no}: missing field {exc}") from None
            session = None
            chat = rec.get("chat_id")
            if chat is not None:
                parent = rec.get("parent_chat_id")
                root = chat if parent in _ROOT_PARENTS else roots.get(parent, parent)
                roots[chat] = root
                session = str(root)
            requests.append(TraceRequest(arrival, prompt, output, source, session=session))
    requests.sort(key=lambda r: r.arrival_s)
    return requests


register_source(
    TraceFileSource(
        SourceInfo(
            "bailian-traceb",
            "Alibaba Bailian Qwen usage trace B (qwen_traceB_blksz_16.jsonl), JSONL",
            "trace",
            needs_path=True,
        ),
        read_bailian_jsonl,
        None,
    )
)
