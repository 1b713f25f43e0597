"""Live trace replay: open-loop, streaming, through the official `openai` async client.

`client` sends and records (`ReplayRequest` → `ReplayResult`, whose `record()` is the shared
`loadgen.metrics.RequestRecord`); `prompts` builds what is sent (token ids, exact synthetic
text, or real prompts matched to the trace's output lengths); `report` turns results into the
`vllm bench serve`-style table and side-by-side comparisons; `cli` is `sagesched replay` and
`sagesched compare`. Depends on `loadgen.traces`, `loadgen.regions`, `loadgen.metrics`,
`openai` (and its HTTP library); never on the gateway.
"""

from loadgen.replay.client import ReplayRequest, ReplayResult, replay
from loadgen.replay.prompts import build_requests, dataset_requests, synthetic_window
from loadgen.replay.report import comparison, medians, summarize_replay, table
from loadgen.schema import TraceRequest


async def replay_window(
    url: str, model: str, window: list[TraceRequest], seed: int = 0
) -> list[ReplayResult]:
    """Replay a window with seeded token-id prompts (exact lengths, no prefix-cache hits)."""
    return await replay(url, model, build_requests(window, prompts="ids", seed=seed))


__all__ = [
    "ReplayRequest",
    "ReplayResult",
    "build_requests",
    "comparison",
    "dataset_requests",
    "medians",
    "replay",
    "replay_window",
    "summarize_replay",
    "synthetic_window",
    "table",
]
