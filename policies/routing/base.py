"""The routing contract: which backend a job goes to, and nothing more.

Beside the policy contract (`policies.base`: *who* goes next), a router answers *where*: given
a job and the state of every backend that could serve it, `pick` names one. The engine (the
simulator's fleet, the gateway's pool) calls only these methods and never asks which router it
holds. A router is a dataclass of typed parameters; what it learns during a run (the index of
what was sent where, a round-robin cursor, a random stream) lives in fields that `fresh()`
rebuilds, so the configured object is a template and every run works on its own copy.

Calls, in order, for one job: `pick(job, backends)` once per decision → the engine sends the
job to the backend picked → (`reason(job, backend, backends)` if it labels decisions) →
`on_route(job, backend)` (the router records it: prefix index
insertion, `job.cached_tokens`) → … → `on_finish(job, backend)` when it leaves that backend.
`on_evict` forwards evictions an engine reports. Sizes are tokens or blocks, no clock, no I/O.

When no backend has room `pick` returns None; the engine then keeps the job waiting and asks
again when a slot frees. A router never returns None while a backend has room (routing is
work-conserving; the queue policy, not the router, decides who waits).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, Self

from policies.base import Parametrised, state
from policies.cost import LinearProfile
from policies.job import Job
from policies.routing.prefix_index import PrefixIndexes, capacity_blocks

__all__ = [
    "AFFINITY",
    "BALANCE",
    "FALLBACK",
    "REASONS",
    "BackendState",
    "PrefixLookup",
    "PrefixRouter",
    "Router",
    "least_loaded",
    "open_backends",
]


class PrefixLookup(Protocol):
    """What an engine may say a backend really holds ("precise" mode: vLLM's KV events)."""

    def match(self, prefix: Sequence[int]) -> int:
        """Leading blocks of `prefix` cached on the backend."""
        ...


@dataclass(slots=True)
class BackendState:
    """One backend as a router sees it at a decision; the engine builds it, the router reads it.

    Counts are requests; `kv_usage` is a fraction of the KV cache (vLLM's `kv_cache_usage_perc`);
    fields an engine does not know stay None and routers treat them as neutral.
    """

    name: str
    """Stable backend name (the index is kept by it)."""
    inflight: int
    """Requests the gateway has in flight there (running or waiting in the engine)."""
    cap: int
    """In-flight cap: the backend has room while `inflight < cap`."""
    serving: bool = True
    """Healthy and serving the job's model; a router never picks one that is not."""
    waiting: int | None = None
    """Requests waiting inside the engine (vLLM `num_requests_waiting`), if known."""
    kv_usage: float | None = None
    """KV-cache use in [0, 1], if known."""
    kv_blocks: int | None = None
    """KV capacity in engine blocks (vLLM `cache_config_info` num blocks), if known."""
    block_tokens: int = 16
    """Tokens per engine KV block (vLLM's `block_size`)."""
    index: PrefixLookup | None = None
    """What the engine reports the backend caches, if it does; prefix routers then match
    against it instead of their own record of what they sent."""

    @property
    def has_room(self) -> bool:
        """May a job be sent here now?"""
        return self.serving and self.inflight < self.cap

    @property
    def load(self) -> float:
        """In flight over cap (the gateway's least-loaded measure)."""
        return self.inflight / self.cap if self.cap > 0 else float("inf")

    @property
    def kv_tokens(self) -> int | None:
        """KV capacity in tokens, if known."""
        return None if self.kv_blocks is None else self.kv_blocks * self.block_tokens


@dataclasses.dataclass(eq=False)
class Router(Parametrised, abc.ABC):
    """Base class of every router. Subclasses are dataclasses registered by name.

    Class attributes: `name` (CLI, label, report), `description` (one line), `uses_prefix`
    (reads `Job.prefix`: the engine must fill it for the router to be of use), `reads_engine`
    (reads what only the engine knows, `BackendState.waiting`, `kv_usage` and `kv_blocks`: an
    engine must keep them current for the router to decide as designed).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    uses_prefix: ClassVar[bool] = False
    reads_engine: ClassVar[bool] = False

    @abc.abstractmethod
    def pick(self, job: Job, backends: Sequence[BackendState]) -> BackendState | None:
        """The backend `job` should go to: one of `backends` with room, or None if none has.

        Called once per routing decision, whose result the engine uses; it may advance the
        router's own per-run counters (a cursor, a seeded random stream), never the index
        (that is `on_route`'s). Deterministic for the same state and inputs; ties go to the
        earlier backend in `backends` unless the rule says otherwise. Tens of µs.
        """

    def on_route(self, job: Job, backend: BackendState) -> None:
        """`job` was sent to `backend` (after `pick`, or the engine's own choice)."""

    def reason(self, job: Job, chosen: BackendState, backends: Sequence[BackendState]) -> str:
        """Why `chosen` (the metrics' label), asked after `pick` and before `on_route`: one of
        `REASONS`. A router that keeps no view of caches balances load."""
        return BALANCE

    def on_finish(self, job: Job, backend: BackendState) -> None:
        """`job` left `backend` (completed, failed, preempted or cancelled)."""

    def on_evict(self, backend: str, block_hashes: Iterable[int]) -> None:
        """The engine reports `backend` evicted these blocks (leaf first)."""

    def on_engine(self, cost: LinearProfile) -> Self:
        """This router on backends whose per-request cost `cost` describes. Default: unchanged."""
        return self


AFFINITY, BALANCE, FALLBACK = "affinity", "balance", "fallback"
REASONS = (AFFINITY, BALANCE, FALLBACK)
"""Why a job went where it went: `affinity`, to the backend expected to hold the most of its
prefix; `balance`, elsewhere, for load; `fallback`, no backend was expected to hold any of
it (or it has no prefix), so load alone placed it."""


def open_backends(backends: Sequence[BackendState]) -> list[BackendState]:
    """The backends a job may be sent to now, in the engine's order."""
    return [b for b in backends if b.has_room]


def least_loaded(candidates: Sequence[BackendState]) -> BackendState | None:
    """Lowest in-flight/cap, the earlier on ties (the gateway's `BackendPool.pick` rule)."""
    return min(candidates, key=_load, default=None)


def _load(b: BackendState) -> float:
    return b.load


@dataclasses.dataclass(eq=False)
class PrefixRouter(Router):
    """A router that keeps llm-d's approximate index of what it sent where (per run).

    `cached_blocks` answers from the engine's report (`BackendState.index`) when there is one,
    otherwise from this router's own index, sized to each backend's KV (`kv_blocks`, or
    `prefix_index.DEFAULT_KV_TOKENS`). `on_route` sets `job.cached_tokens` to what the chosen
    backend is expected to hold, then records the prompt there.
    """

    uses_prefix = True
    reads_engine = True  # the index is sized from `kv_blocks`
    _sent: PrefixIndexes = state(PrefixIndexes)
    _decision: Job | None = state(lambda: None)
    """The job whose matches `_matched` holds (the decision under way)."""
    _matched: dict[str, int] = state(dict)

    def match(self, prefix: Sequence[int], backend: BackendState) -> int:
        """Leading blocks of `prefix` expected cached on `backend`."""
        if not prefix:
            return 0
        if backend.index is not None:
            return backend.index.match(prefix)
        return self._sent.match(backend.name, prefix)

    def cached_blocks(self, job: Job, backend: BackendState) -> int:
        """Leading blocks of `job.prefix` expected cached on `backend` (remembered for the
        job's decision, so `on_route` does not match the chosen backend again)."""
        if self._decision is not job:
            self._decision = job
            self._matched.clear()
        blocks = self._matched.get(backend.name)
        if blocks is None:
            blocks = self._matched[backend.name] = self.match(job.prefix, backend)
        return blocks

    def reason(self, job: Job, chosen: BackendState, backends: Sequence[BackendState]) -> str:
        mine = self.cached_blocks(job, chosen)  # (full ones count: a full backend is load)
        others = (self.cached_blocks(job, b) for b in backends if b.serving and b is not chosen)
        best = max(mine, max(others, default=0))
        if best == 0:
            return FALLBACK
        return AFFINITY if mine >= best else BALANCE

    def index_size(self, backend: BackendState) -> int:
        """Blocks this router remembers sending to `backend`."""
        return self._sent.size(backend.name)

    def on_route(self, job: Job, backend: BackendState) -> None:
        if not job.prefix:
            job.cached_tokens = 0
            self._decision = None
            return
        blocks = self.cached_blocks(job, backend)
        job.cached_tokens = min(blocks * job.block_tokens, job.prompt_tokens)
        size = capacity_blocks(backend.kv_tokens, job.block_tokens)
        sent = None if backend.index is not None else blocks  # what this index holds
        self._sent.insert(backend.name, job.prefix, size, sent)
        self._decision = None  # the index changed: the next decision matches afresh

    def on_evict(self, backend: str, block_hashes: Iterable[int]) -> None:
        self._sent.remove(backend, block_hashes)
        self._decision = None
