"""`round-robin`: each decision goes to the next backend with room after the last one chosen.

Positions are the engine's order of `backends`; a backend without room is skipped, not
waited for (vLLM production-stack's `roundrobin`, which also never waits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.base import state
from policies.job import Job
from policies.routing.base import BackendState, Router
from policies.routing.registry import register_router


@register_router
@dataclass(eq=False)
class RoundRobin(Router):
    name = "round-robin"
    description = "the next backend with room, cycling through them in order"
    _next: int = state(int)
    """Position to try first at the next decision (per run)."""

    def pick(self, job: Job, backends: Sequence[BackendState]) -> BackendState | None:
        n = len(backends)
        for k in range(n):
            i = (self._next + k) % n
            if backends[i].has_room:
                self._next = i + 1
                return backends[i]
        return None
