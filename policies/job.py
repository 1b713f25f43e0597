"""The job record every engine hands to a policy.

A `Job` is one request as the scheduler sees it: sizes in tokens, times in seconds of the
caller's clock (wall time in the gateway, virtual time in the simulator). It carries no I/O
handles; an engine that needs to attach its own object uses `ctx`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policies.dist import LengthDist

DEFAULT_TENANT = "default"


@dataclass(slots=True, eq=False)
class Job:
    """One request in a scheduling queue.

    Identity is the object itself (`eq=False`); `id` is the engine's stable integer id, used
    as the last tie-break so every order is total and reproducible.
    """

    id: int
    """Engine-assigned id, unique within a run; the final tie-break."""
    arrival_s: float
    """When the request arrived, in the engine's clock (seconds)."""
    prompt_tokens: int
    """Input length in tokens (for a continuation: the original prompt)."""
    max_tokens: int | None = None
    """Client's output cap in tokens, or None for the server's limit."""
    generated: int = 0
    """Output tokens produced so far (attained service); rises while streaming."""
    tenant: str = DEFAULT_TENANT
    """Who the request is billed to; fair-share policies group by it."""
    priority: int = 0
    """Client priority class, vLLM's convention: lower is more urgent."""
    deadline_s: float | None = None
    """Absolute SLO deadline for the last token (engine clock), if any."""
    dist: LengthDist | None = None
    """Predicted distribution of the *total* output length (tokens), if a predictor ran."""
    rank_score: float | None = None
    """A learned ranking score of the prompt (higher = predicted longer; only its order
    matters), if a ranking model ran; the `ltr` policy orders by it."""
    true_output_tokens: int | None = None
    """The real output length; known only to oracles, simulators and replays."""
    preemptions: int = 0
    """How often the job was taken off a backend and requeued."""
    prefix: tuple[int, ...] = ()
    """The prompt's chained block hashes (63-bit ints): entry k identifies the whole prefix of
    blocks 0..k, so two prompts share k cached blocks iff their first k entries are equal; full
    blocks only (`TraceRequest.block_hashes`). Empty when unknown."""
    block_tokens: int = 0
    """Tokens per block of `prefix` (0 when `prefix` is empty)."""
    session: str | None = None
    """A conversation's key (sticky routing), if the client or the trace gave one."""
    cached_tokens: int = 0
    """Prompt tokens expected to be cached on the backend the job was routed to, set by the
    router at routing time (`policies.routing`); the `time` cost model does not charge their
    prefill. 0 (the default) charges the whole prompt."""
    ctx: Any = field(default=None, repr=False)
    """Engine-private attachment (the gateway's request state, the simulator's record)."""

    def predicted_tokens(self) -> float:
        """Point prediction of the total output length: the distribution's median.

        Falls back to the true length (oracle) and then to `max_tokens`; raises when the job
        carries none of them, since a prediction-driven policy cannot order it.
        """
        if self.dist is not None:
            return self.dist.quantile(0.5)
        if self.true_output_tokens is not None:
            return float(self.true_output_tokens)
        if self.max_tokens is not None:
            return float(self.max_tokens)
        raise ValueError(f"job {self.id} has no prediction, true length or max_tokens")

    def remaining_dist(self) -> LengthDist:
        """The predicted total length conditioned on what was generated already."""
        if self.dist is None:
            raise ValueError(f"job {self.id} has no predicted distribution")
        return self.dist.condition(self.generated)
