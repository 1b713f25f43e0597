"""Request classes: which class a request is, the policy they compose, and overload shedding.

A class (`config.TrafficClass`) names a band (its `priority`, lower first), optional TTFT/TTLT
objectives, a queue bound and timeout, and whether it may be shed. A request's class comes from
its API key (`api_keys` of a class: that class at most, so a client cannot promote itself) or
the `x-sagesched-class` header, else `classes.default`; an unknown name is a 400 naming the
choices.

Ordering is not decided here: `compose` wraps the configured policy in the `bands` policy
(`policies.catalog.bands`: strict bands with the classes' shares, tenant fairness inside a
band, the policy inside a tenant; the classes' engine shares and TPOT objectives bound how much
of a backend a band holds, `policies.shares`), the same object the simulator runs. What is
gateway-only is admission under overload (`Admission`): a class at its own bound gets 429;
when the whole queue is full a sheddable arrival gets 429 first, otherwise the oldest waiting
request of a sheddable class, then the lowest band's oldest (if less urgent than the arrival),
is evicted with 429 and Retry-After to make room. Every such request ends as `Outcome.SHED`,
counted per class.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.config import ClassesSettings, TrafficClass
from gateway.errors import QueueFull, Shed, UnknownClass
from policies import Job, Policy
from policies.catalog.bands import Bands

CLASS_HEADER = "X-SageSched-Class"


class Classes:
    """The configured classes, looked up by name and by client key."""

    def __init__(self, settings: ClassesSettings) -> None:
        self.settings = settings
        self.by_name = {c.name: c for c in settings.list}
        self._by_key = {k: c for c in settings.list for k in c.api_keys}
        self.default = self.by_name[settings.default]

    def rekey(self, settings: ClassesSettings) -> None:
        """Take the client keys of `settings` (a SIGHUP reload: same classes, new keys); the
        class objects, and so the queues' bands, stay."""
        self._by_key = {k: self.by_name[c.name] for c in settings.list for k in c.api_keys}

    def resolve(self, header: str | None, token: str | None) -> TrafficClass:
        """The class of a request with this header value and bearer token. A key mapped to a
        class caps it: a header may only name a class of the same or a less urgent band."""
        keyed = self._by_key.get(token) if token else None
        named = None
        if header is not None and self.settings.header:
            named = self.by_name.get(header.strip())
            if named is None:
                raise UnknownClass(
                    f"unknown class {header.strip()!r} in {CLASS_HEADER}; "
                    f"choose one of: {', '.join(self.by_name)}"
                )
        if keyed is not None:
            return named if named is not None and named.priority >= keyed.priority else keyed
        return named or self.default

    def compose(self, policy: Policy) -> Policy:
        """The gateway's policy: `bands` over the configured one, with the classes' shares
        (a policy that is already `bands` is used as it is)."""
        if isinstance(policy, Bands):
            return policy
        classes = self.settings.list
        shares = tuple(sorted({(c.priority, c.share) for c in classes if c.share > 0}))
        engine = tuple(sorted({(c.priority, c.engine_share) for c in classes
                               if c.engine_share is not None}))  # fmt: skip
        # a band's TPOT objective is its most demanding class's
        tpot: dict[int, float] = {}
        for c in classes:
            if c.tpot_slo_s is not None:
                tpot[c.priority] = min(c.tpot_slo_s, tpot.get(c.priority, c.tpot_slo_s))
        # the object itself, not its label as a spec: pair parameters (`tenant_weights=a:2;b:1`)
        # do not survive nesting in `bands:inner=...` text
        return Bands(inner=policy, band_shares=shares, engine_shares=engine,
                     tpot_slos=tuple(sorted(tpot.items())),
                     active_window_s=self.settings.active_window_s)  # fmt: skip


class Admission:
    """Per-class bounds and shedding over the requests waiting for their first dispatch.

    Only requests that never started are counted and sheddable (a preempted one has answered
    already). Requests of a class are kept in arrival order, so the oldest is O(1) to find.
    """

    def __init__(
        self, classes: Classes, max_waiting: int, retry_after_s: int, waiting: Callable[[], int]
    ) -> None:
        """`waiting()`: every request queued in the gateway now (the global bound's count)."""
        self._classes = classes
        self._max_waiting = max_waiting
        self._retry_after_s = retry_after_s
        self._waiting = waiting
        self._queued: dict[str, dict[int, Job]] = {c: {} for c in classes.by_name}

    def waiting_of(self, klass: TrafficClass) -> int:
        """Requests of `klass` waiting for their first dispatch."""
        return len(self._queued[klass.name])

    def admit(self, job: Job, klass: TrafficClass) -> Job | None:
        """Count `job` in: raise `QueueFull` (its class is at its bound, or the queue is full
        and nothing less urgent waits) or `Shed` (a sheddable arrival into a full queue);
        otherwise return the waiting job to evict to make room, if the queue is full."""
        queued = self._queued[klass.name]
        if klass.max_waiting is not None and len(queued) >= klass.max_waiting:
            raise QueueFull(
                f"class {klass.name!r} has {len(queued)} requests waiting, its bound; retry later",
                retry_after_s=self._retry_after_s,
            )
        victim = None
        if self._waiting() >= self._max_waiting:
            if klass.sheddable:
                raise Shed(
                    f"the gateway queue is full ({self._max_waiting} waiting) and class "
                    f"{klass.name!r} is shed first; retry later",
                    retry_after_s=self._retry_after_s,
                )
            victim = self._victim(klass)
            if victim is None:
                raise QueueFull(
                    f"the gateway queue is full ({self._max_waiting} waiting); retry later",
                    retry_after_s=self._retry_after_s,
                )
        queued[job.id] = job
        return victim

    def shed_error(self, victim: TrafficClass) -> Shed:
        """What an evicted request of class `victim` answers."""
        return Shed(
            f"the gateway queue is full: this {victim.name!r} request was shed for a more "
            "urgent one; retry later",
            retry_after_s=self._retry_after_s,
        )

    def left(self, job: Job, klass: TrafficClass) -> None:
        """`job` started (first dispatch) or ended while waiting."""
        self._queued[klass.name].pop(job.id, None)

    def _victim(self, arrival: TrafficClass) -> Job | None:
        """The oldest waiting request of a sheddable class (least urgent band first), else
        the oldest of the least urgent band if it is less urgent than `arrival`."""
        waiting = [c for c in self._classes.by_name.values() if self._queued[c.name]]
        for candidates in (
            [c for c in waiting if c.sheddable],
            [c for c in waiting if c.priority > arrival.priority],
        ):
            if candidates:
                band = max(c.priority for c in candidates)
                heads = (next(iter(self._queued[c.name].values())) for c in candidates
                         if c.priority == band)  # fmt: skip
                return min(heads, key=lambda j: (j.arrival_s, j.id))
        return None
