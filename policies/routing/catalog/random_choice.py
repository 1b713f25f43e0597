"""`random`: a uniformly random backend among those with room, from a seeded stream.

The stream belongs to the run (rebuilt by `fresh()` from `seed`), so two runs with the same
seed and the same decisions route the same way.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from policies.base import param
from policies.job import Job
from policies.routing.base import BackendState, Router, open_backends
from policies.routing.registry import register_router


@register_router
@dataclass(eq=False)
class RandomChoice(Router):
    name = "random"
    description = "a uniformly random backend with room (seeded)"
    seed: int = param(0, "seed of the run's random stream")
    _rng: random.Random = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def pick(self, job: Job, backends: Sequence[BackendState]) -> BackendState | None:
        candidates = open_backends(backends)
        if not candidates:
            return None
        return candidates[self._rng.randrange(len(candidates))]
