"""`least-loaded`: the gateway's rule so far (`gateway/scheduling/backends.py` `BackendPool.pick`).

Among the backends with room, the lowest in-flight/cap; the earlier backend on ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.job import Job
from policies.routing.base import BackendState, Router, least_loaded, open_backends
from policies.routing.registry import register_router


@register_router
@dataclass(eq=False)
class LeastLoaded(Router):
    name = "least-loaded"
    description = "lowest in-flight/cap among backends with room (the gateway's rule so far)"

    def pick(self, job: Job, backends: Sequence[BackendState]) -> BackendState | None:
        return least_loaded(open_backends(backends))
