"""`PolicyQueue`: the waiting jobs, ordered by a policy's key.

A binary heap with lazy invalidation: removing or rekeying a job marks its old entry dead and
(for rekey) pushes a new one; dead entries are skipped when they surface and the heap is
compacted when they outnumber the live ones. Ties break on (arrival, id), so the order is total
and identical in every engine. Two extras serve particular policies, both asked through the
contract: time-based reviews (`Policy.review_at`, e.g. a starvation guard) are applied before
each pop or peek, and for policies whose keys may rise while waiting (`revalidate_on_pop`) the
head is recomputed until its stored key is current.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Protocol

from policies.job import Job

Key = tuple[float, ...]
"""A sort key: lower is served first. The queue breaks ties on (arrival, id)."""


class Ordering(Protocol):
    """What a `PolicyQueue` asks of the policy that orders it (`policies.base.Policy`)."""

    @property
    def revalidate_on_pop(self) -> bool: ...
    def key(self, job: Job, now: float) -> Key: ...
    def review_at(self, job: Job) -> float | None: ...


class WaitingQueue(Protocol):
    """What engines call on the waiting jobs (`Scheduler.queue`): a `PolicyQueue` for most
    policies, or the structure a policy builds itself (`Policy.make_queue`, e.g. the bands of
    `policies.bands`). Not thread-safe."""

    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __contains__(self, job: Job) -> bool: ...
    def __iter__(self) -> Iterator[Job]: ...
    def key_of(self, job: Job) -> Key: ...
    def push(self, job: Job, now: float) -> Key: ...
    def rekey(self, job: Job, now: float) -> Key: ...
    def remove(self, job: Job) -> bool: ...
    def pop(self, now: float, skip: AbstractSet[int] = ...) -> Job | None: ...
    def peek(self, now: float, skip: AbstractSet[int] = ...) -> Job | None: ...
    def snapshot(self, now: float) -> list[tuple[Job, Key]]: ...


_Entry = tuple[Key, float, int, int]
"""Heap entry: (key, arrival_s, job id, sequence). An entry is live while `_live[id]` holds
its sequence; anything else is a leftover of a removal or rekey and is skipped."""


class PolicyQueue:
    """Jobs waiting for a backend, popped in policy order. Not thread-safe (one event loop
    or one simulation owns it)."""

    __slots__ = ("_heap", "_live", "_policy", "_reviews", "_seq")

    def __init__(self, policy: Ordering) -> None:
        self._policy = policy
        self._heap: list[_Entry] = []
        self._live: dict[int, tuple[int, Job, Key]] = {}  # job id -> (sequence, job, key)
        self._reviews: list[tuple[float, int, int]] = []  # (time, sequence, job id)
        self._seq = itertools.count()

    # -- container protocol -------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, job: Job) -> bool:
        rec = self._live.get(job.id)
        return rec is not None and rec[1] is job

    def __iter__(self) -> Iterator[Job]:
        """Waiting jobs in stored-key order (a snapshot; O(n log n))."""
        order = sorted(self._live.values(), key=lambda r: (r[2], r[1].arrival_s, r[1].id))
        return iter([job for _, job, _ in order])

    def key_of(self, job: Job) -> Key:
        """The key the job is stored under."""
        return self._live[job.id][2]

    # -- mutations ----------------------------------------------------------------------

    def push(self, job: Job, now: float) -> Key:
        """Queue `job` under its current key; a job already queued is rekeyed instead."""
        key = self._policy.key(job, now)
        seq = next(self._seq)
        self._live[job.id] = (seq, job, key)
        heapq.heappush(self._heap, (key, job.arrival_s, job.id, seq))
        when = self._policy.review_at(job)
        if when is not None and when > now:  # a review already due was just applied
            heapq.heappush(self._reviews, (when, seq, job.id))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()
        return key

    def rekey(self, job: Job, now: float) -> Key:
        """Recompute a queued job's key (after its prediction or attained service changed)."""
        if job not in self:
            raise KeyError(f"job {job.id} is not queued")
        return self.push(job, now)

    def remove(self, job: Job) -> bool:
        """Take `job` out (client gone, timed out). Returns False if it was not queued."""
        if job not in self:
            return False
        del self._live[job.id]
        return True

    def pop(self, now: float, skip: AbstractSet[int] = frozenset()) -> Job | None:
        """Remove and return the job to serve next, or None when nothing waits. (`skip`: the
        bands to pass over; this queue has none, so it must be empty.)"""
        assert not skip, "a queue without bands has no band to skip"
        if self._head(now) is None:
            return None
        _, _, job_id, _ = heapq.heappop(self._heap)
        return self._live.pop(job_id)[1]

    def peek(self, now: float, skip: AbstractSet[int] = frozenset()) -> Job | None:
        """The job `pop(now)` would return, left in place."""
        assert not skip, "a queue without bands has no band to skip"
        return self._head(now)

    def snapshot(self, now: float) -> list[tuple[Job, Key]]:
        """Every waiting job with its key recomputed at `now`, best first (admin view)."""
        rows = [(self._policy.key(job, now), job) for _, job, _ in self._live.values()]
        rows.sort(key=lambda r: (r[0], r[1].arrival_s, r[1].id))
        return [(job, key) for key, job in rows]

    # -- internals ----------------------------------------------------------------------

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._is_live(e)]
        heapq.heapify(self._heap)

    def _is_live(self, entry: _Entry) -> bool:
        rec = self._live.get(entry[2])
        return rec is not None and rec[0] == entry[3]

    def _head(self, now: float) -> Job | None:
        """The live entry on top of the heap after reviews and revalidation, or None."""
        self._apply_reviews(now)
        heap = self._heap
        while heap:
            top = heap[0]
            if not self._is_live(top):
                heapq.heappop(heap)
                continue
            job = self._live[top[2]][1]
            if self._policy.revalidate_on_pop and self._policy.key(job, now) > top[0]:
                heapq.heappop(heap)
                self.push(job, now)
                continue
            return job
        return None

    def _apply_reviews(self, now: float) -> None:
        reviews = self._reviews
        while reviews and reviews[0][0] <= now:
            _, seq, job_id = heapq.heappop(reviews)
            rec = self._live.get(job_id)
            if rec is not None and rec[0] == seq:
                self.push(rec[1], now)
