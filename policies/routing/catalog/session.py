"""`session`: sticky by session key, by rendezvous (highest-random-weight) hashing.

A job with `Job.session` goes to the backend with room whose hash of (session, backend name)
is highest: the same backend for every turn while it has room, the next one in that
session's own order when it has none, and back once it has room again; adding or removing a
backend moves only the sessions that hashed to it. A job without a session key goes to the
least-loaded backend. After vLLM production-stack's `session` router (a consistent hash ring
over the session id; no id → the lowest-QPS engine). Stateless: nothing to record per run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from policies.job import Job
from policies.routing.base import BackendState, Router, least_loaded, open_backends
from policies.routing.registry import register_router


def rendezvous_weight(session: str, backend: str) -> int:
    """A 64-bit weight of (session, backend), stable across processes and runs."""
    digest = hashlib.blake2b(f"{session}\x00{backend}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@register_router
@dataclass(eq=False)
class Session(Router):
    name = "session"
    description = "sticky by session key (rendezvous hashing); no key: least-loaded"

    def pick(self, job: Job, backends: Sequence[BackendState]) -> BackendState | None:
        candidates = open_backends(backends)
        if job.session is None or not candidates:
            return least_loaded(candidates)
        session = job.session
        return max(candidates, key=lambda b: rendezvous_weight(session, b.name))
