"""`BandQueue`: waiting jobs as priority bands → tenant flows → an inner policy's queue.

The structure behind the `bands` policy (`policies.catalog.bands`), built per run by
`Bands.make_queue` and driven by the `Scheduler` like any `PolicyQueue`:

- **Band**: a job's band is its `Job.priority` (vLLM's convention: lower first). The band with
  the lowest priority that has waiting jobs is served first (strict priority), except that a
  band given a `share` is served first while it is owed work: while it has waiting jobs it
  earns `share` × every unit of work charged to other bands and pays `1 − share` × each unit
  charged to itself while another band waits, so under contention it receives at least that
  fraction of the work and is never starved. Credit does not outlive the band's backlog.
- **Tenant flow**: inside a band, the tenant with the lowest virtual token counter goes next
  (VTC, Sheng et al. OSDI 2024): a tenant is charged `input_weight` per prompt token when a
  job starts and `output_weight` per output token as it streams, divided by its weight. A
  tenant whose flow becomes non-empty is lifted to the band's virtual time (the counter of the
  flow picked last, start-time fair queuing), so idling earns no credit. Counters tie → the
  flows' heads compare by the inner key, so one tenant (or equal counters) is the inner order.
- **Inside a flow**: a `PolicyQueue` of the inner policy (SageSched by default): its keys,
  time reviews and revalidation unchanged.

Work is in the counters' units (prompt × input_weight + output × output_weight). Flows are
picked from a heap of lower bounds (counter, head key): counters and heads only rise between
the events that push a fresh entry (a push, a rekey, an inner time review), so the top entry is
revalidated until it is current. Pop costs O(log flows + log jobs); bands are scanned (few).

Pure: no clocks, no I/O; time is the number passed in. Not thread-safe.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from policies.job import Job
from policies.queue import PolicyQueue

if TYPE_CHECKING:
    from policies.base import Key, Policy

_FlowState = tuple[float, "Key", float, int]
"""(tenant counter, head's inner key, head's arrival, head's id): lower is served first."""


@dataclass(slots=True, eq=False)
class _Band:
    priority: int
    share: float
    flows: dict[str, PolicyQueue] = field(default_factory=dict)
    """Tenant → its waiting jobs (kept while the tenant has a counter)."""
    counters: dict[str, float] = field(default_factory=dict)
    heap: list[tuple[float, Key, float, int, int, str]] = field(default_factory=list)
    """Flow entries (state, sequence, tenant); a flow's latest entry is a lower bound of its
    state, older ones are skipped."""
    latest: dict[str, int] = field(default_factory=dict)
    """Tenant → sequence of its latest entry."""
    reviews: list[tuple[float, int, int]] = field(default_factory=list)
    """(time, sequence, job id): an inner key may fall then, so the flow gets a fresh entry."""
    running: Counter[str] = field(default_factory=Counter)
    waiting: int = 0
    vtime: float = 0.0
    """Counter of the flow picked last: where a tenant re-entering is lifted to."""
    credit: float = 0.0
    """Work owed to the band under its share (> 0: served first)."""


class BandQueue:
    """Bands → tenant flows → inner `PolicyQueue`s; the `WaitingQueue` of `Bands`."""

    __slots__ = ("_bands", "_head_band", "_inner", "_running", "_seq", "_shares", "_weights",
                 "_where")  # fmt: skip

    def __init__(
        self,
        inner: Policy,
        shares: Mapping[int, float] | None = None,
        tenant_weights: Mapping[str, float] | None = None,
    ) -> None:
        """`inner`: the run's copy of the policy that orders each flow; `shares`: band
        priority → guaranteed fraction of the work (absent: strict priority only);
        `tenant_weights`: tenant → weight of its counter (absent: 1)."""
        self._inner = inner
        self._shares = {int(p): float(s) for p, s in (shares or {}).items() if s > 0}
        self._weights = dict(tenant_weights or {})
        self._bands: dict[int, _Band] = {}
        self._where: dict[int, tuple[_Band, str]] = {}  # waiting job id -> (band, tenant)
        self._running: dict[int, tuple[_Band, str]] = {}  # running job id -> (band, tenant)
        self._seq = itertools.count()
        self._head_band: int | None = None

    # -- container protocol -------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._where)

    def __bool__(self) -> bool:
        return bool(self._where)

    def __contains__(self, job: Job) -> bool:
        where = self._where.get(job.id)
        return where is not None and job in where[0].flows[where[1]]

    def __iter__(self) -> Iterator[Job]:
        """Waiting jobs by band, tenant counter, then stored inner key (a snapshot: the exact
        dispatch order also depends on the charges made between pops)."""
        return iter([job for job, _ in self._ordered(None)])

    def key_of(self, job: Job) -> Key:
        """(band, *inner key) as stored: the `Bands` policy's key of a waiting job."""
        band, tenant = self._where[job.id]
        return (float(band.priority), *band.flows[tenant].key_of(job))

    def waiting_in(self, priority: int) -> int:
        """Jobs of band `priority` waiting."""
        band = self._bands.get(priority)
        return 0 if band is None else band.waiting

    @property
    def head_band(self) -> int | None:
        """Band of the job the last `peek` or `pop` returned (None before any)."""
        return self._head_band

    # -- mutations ----------------------------------------------------------------------

    def push(self, job: Job, now: float) -> Key:
        """Queue `job` in its band's tenant flow (a queued job is rekeyed; a running one,
        preempted or retried, waits again)."""
        if job.id in self._where:
            return self.rekey(job, now)
        band = self._band(job.priority)
        tenant = job.tenant
        if self._running.pop(job.id, None) is not None:  # requeued after running
            self._stopped(band, tenant)
        flow = band.flows.get(tenant)
        if flow is None:
            flow = band.flows[tenant] = PolicyQueue(self._inner)
        if not flow:  # the tenant re-enters: no credit for the time it was away
            band.counters[tenant] = max(band.counters.get(tenant, 0.0), band.vtime)
        key = flow.push(job, now)
        self._where[job.id] = (band, tenant)
        band.waiting += 1
        self._note(band, tenant, job, now)
        return (float(band.priority), *key)

    def rekey(self, job: Job, now: float) -> Key:
        """Recompute a queued job's inner key (its prediction or size changed)."""
        if job not in self:
            raise KeyError(f"job {job.id} is not queued")
        band, tenant = self._where[job.id]
        key = band.flows[tenant].rekey(job, now)
        self._note(band, tenant, job, now)
        return (float(band.priority), *key)

    def remove(self, job: Job) -> bool:
        """Take a waiting job out (client gone, timed out, shed). False if not queued."""
        if job not in self:
            return False
        band, tenant = self._where.pop(job.id)
        band.flows[tenant].remove(job)
        self._left_waiting(band)
        return True

    def pop(self, now: float, skip: AbstractSet[int] = frozenset()) -> Job | None:
        """Remove and return the job to serve next, or None when nothing waits (the bands in
        `skip` pass their turn: held at their engine share)."""
        picked = self._pick(now, skip)
        if picked is None:
            return None
        band, tenant = picked
        job = band.flows[tenant].pop(now)
        assert job is not None
        del self._where[job.id]
        band.vtime = max(band.vtime, band.counters[tenant])
        self._running[job.id] = (band, tenant)
        band.running[tenant] += 1
        self._left_waiting(band)
        return job

    def peek(self, now: float, skip: AbstractSet[int] = frozenset()) -> Job | None:
        """The job `pop(now, skip)` would return, left in place."""
        picked = self._pick(now, skip)
        if picked is None:
            return None
        band, tenant = picked
        return band.flows[tenant].peek(now)

    def snapshot(self, now: float) -> list[tuple[Job, Key]]:
        """Every waiting job with its key at `now`, in `__iter__`'s order (admin view)."""
        return self._ordered(now)

    # -- accounting (called by the `Bands` policy's hooks) --------------------------------

    def charge(self, job: Job, work: float) -> None:
        """`work` units were served to `job` (prompt at start, output tokens as they stream)."""
        place = self._running.get(job.id) or self._where.get(job.id)
        if place is None or work <= 0:
            return
        band, tenant = place
        band.counters[tenant] = band.counters.get(tenant, 0.0) + work / self._weights.get(
            tenant, 1.0
        )
        if not self._shares:
            return
        contended = any(b.waiting for b in self._bands.values() if b is not band)
        for b in self._bands.values():
            if b.share <= 0:
                continue
            if b is band:
                if contended:
                    b.credit -= (1.0 - b.share) * work
            elif b.waiting:
                b.credit += b.share * work

    def finished(self, job: Job) -> None:
        """The job left the system (wherever it was)."""
        self.remove(job)
        place = self._running.pop(job.id, None)
        if place is None:
            return
        band, tenant = place
        self._stopped(band, tenant)
        self._forget(band, tenant)

    # -- internals ----------------------------------------------------------------------

    def _band(self, priority: int) -> _Band:
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band(priority, self._shares.get(priority, 0.0))
        return band

    def _note(self, band: _Band, tenant: str, job: Job, now: float) -> None:
        """The flow's state may have fallen (new or rekeyed job): push a fresh entry, and
        remember when the inner policy will review the job's key (it may fall then too)."""
        self._push_entry(band, tenant, now)
        when = self._inner.review_at(job)
        if when is not None and when > now:
            heapq.heappush(band.reviews, (when, next(self._seq), job.id))
        if len(band.heap) > 2 * len(band.flows) + 64:
            self._compact(band)

    def _state(self, band: _Band, tenant: str, now: float) -> _FlowState | None:
        flow = band.flows.get(tenant)
        head = None if flow is None else flow.peek(now)
        if flow is None or head is None:
            return None
        return (band.counters[tenant], flow.key_of(head), head.arrival_s, head.id)

    def _push_entry(self, band: _Band, tenant: str, now: float) -> None:
        state = self._state(band, tenant, now)
        if state is not None:
            seq = band.latest[tenant] = next(self._seq)
            heapq.heappush(band.heap, (*state, seq, tenant))

    def _pick(self, now: float, skip: AbstractSet[int]) -> tuple[_Band, str] | None:
        band = self._pick_band(skip)
        if band is None:
            return None
        self._head_band = band.priority
        return band, self._pick_flow(band, now)

    def _pick_band(self, skip: AbstractSet[int]) -> _Band | None:
        """Owed share bands first (most owed per unit of share), then strict priority."""
        waiting = [b for b in self._bands.values() if b.waiting and b.priority not in skip]
        if not waiting:
            return None
        owed = [b for b in waiting if b.share > 0 and b.credit > 0]
        if owed:
            return max(owed, key=lambda b: (b.credit / b.share, -b.priority))
        return min(waiting, key=lambda b: b.priority)

    def _pick_flow(self, band: _Band, now: float) -> str:
        """The tenant whose flow has the lowest (counter, head) state now."""
        reviews = band.reviews
        while reviews and reviews[0][0] <= now:
            _, _, job_id = heapq.heappop(reviews)
            where = self._where.get(job_id)
            if where is not None and where[0] is band:
                self._push_entry(band, where[1], now)
        heap = band.heap
        while heap:
            top = heap[0]
            tenant = top[-1]
            state = None if band.latest.get(tenant) != top[4] else self._state(band, tenant, now)
            if state is None:  # superseded by a newer entry, or the flow is empty
                heapq.heappop(heap)
            elif state <= top[:4]:
                return tenant
            else:  # counters rose or the head left since the entry: requeue it as it is now
                seq = band.latest[tenant] = next(self._seq)
                heapq.heapreplace(heap, (*state, seq, tenant))
        raise AssertionError(f"band {band.priority} has {band.waiting} waiting but no flow")

    def _compact(self, band: _Band) -> None:
        """Keep the latest entry of each non-empty flow."""
        band.heap = [
            e for e in band.heap if band.latest.get(e[-1]) == e[4] and band.flows.get(e[-1])
        ]
        heapq.heapify(band.heap)

    def _stopped(self, band: _Band, tenant: str) -> None:
        band.running[tenant] -= 1
        if band.running[tenant] <= 0:
            del band.running[tenant]

    def _left_waiting(self, band: _Band) -> None:
        band.waiting -= 1
        if band.waiting == 0:
            band.credit = min(band.credit, 0.0)  # a share's credit does not outlive a backlog
            band.heap.clear()
            band.latest.clear()
            band.reviews.clear()
            if not band.running:  # idle: every counter restarts level
                del self._bands[band.priority]

    def _forget(self, band: _Band, tenant: str) -> None:
        """Drop a tenant with nothing waiting or running whose counter a return would lift
        anyway (bounds memory by the tenants active since the band was last idle)."""
        if band.running.get(tenant) or band.flows.get(tenant):
            return
        if band.counters.get(tenant, 0.0) <= band.vtime:
            band.counters.pop(tenant, None)
            band.flows.pop(tenant, None)
            band.latest.pop(tenant, None)
        if not band.waiting and not band.running and self._bands.get(band.priority) is band:
            del self._bands[band.priority]

    def _ordered(self, now: float | None) -> list[tuple[Job, Key]]:
        rows = []
        for band in self._bands.values():
            for tenant, flow in band.flows.items():
                counter = band.counters.get(tenant, 0.0)
                items = (
                    flow.snapshot(now) if now is not None else [(j, flow.key_of(j)) for j in flow]
                )
                for job, key in items:
                    rows.append(((band.priority, counter, key, job.arrival_s, job.id), job, key))
        rows.sort(key=lambda r: r[0])
        return [(job, (float(order[0]), *key)) for order, job, key in rows]
