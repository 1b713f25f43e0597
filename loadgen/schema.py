"""The one normalised request schema every trace reader produces.

Times are seconds on the trace's own clock, relative to the start of its window; sizes are
tokens as recorded in the trace. Readers fill what their source has and leave the rest None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload trace."""

    arrival_s: float
    """Arrival time (seconds, window-relative once windowed)."""
    prompt_tokens: int
    """Input length in tokens."""
    output_tokens: int
    """True output length in tokens (what the replay enforces with max_tokens + ignore_eos)."""
    source: str
    """Registered source name, e.g. `azure-conv-2023`, `lssp-bailian`."""
    tenant: str | None = None
    """Client / tenant / model the request belongs to, if the trace says."""
    session: str | None = None
    """Conversation or session id, if the trace says."""
    predicted_output_tokens: int | None = None
    """A frozen prediction shipped with the trace (LSSP windows), if any."""
    deadline_s: float | None = None
    """Absolute SLO deadline for the last token, on the same clock as `arrival_s`."""
    priority: int = 0
    """Priority class (vLLM's convention, lower first; the `bands` policy's band). Traces
    carry none: 0, unless a workload assigns classes (`bench/classes.py`)."""
    block_hashes: tuple[int, ...] = ()
    """The prompt's chained block hashes (`policies.routing.chain`): entry k identifies the
    prefix of blocks 0..k, so two requests share a cached prefix of k blocks iff their first k
    entries are equal; full blocks only; ints in [0, 2**63). Empty: no prefix information."""
    block_tokens: int = 0
    """Tokens per block of `block_hashes` (0: no prefix information)."""
    think_s: float | None = None
    """Multi-turn sessions: None for a request that arrives at `arrival_s` (every trace
    request, and a session's first turn). A number marks a later turn that follows the
    previous request of the same `session` (the one before it in the workload): it arrives
    `think_s` seconds after that request's last token (or its drop), and `arrival_s` is then
    only an estimate made when the workload was built (what an open-loop replay would use).
    Its prompt re-sends the previous turn's prompt and answer first (the simulator's engine
    then finds the answer's blocks cached, as a server that generated them would)."""


@dataclass(frozen=True, slots=True)
class Window:
    """N consecutive requests of one source, rebased so the first arrives at t = 0."""

    source: str
    window_id: str
    requests: tuple[TraceRequest, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    """Source-specific facts (e.g. LSSP's published `lambda_ref`, our measured knee)."""

    def __len__(self) -> int:
        return len(self.requests)
