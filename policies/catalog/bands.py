"""Priority bands, tenant fairness inside a band, an inner policy's order inside a tenant.

A composition of `policies` objects, so the gateway and the simulator run it unchanged: the
waiting jobs live in a `policies.bands.BandQueue` (band → tenant flow → the inner policy's
`PolicyQueue`, see there for the rules), and this policy forwards every hook to the inner one
after charging the tenant's virtual token counter. A job's band is its `Job.priority` (lower
first): the gateway sets it from the request's class, the simulator from the trace.

Keys are (band, *inner key): a running job compares with a waiting one band first, then by the
inner policy. Preemption stays inside a band (the inner policy decides, on the jobs of the
waiting head's band) unless `preempt_lower_bands` lets a waiting job displace a running job of
a lower band. The engine priority sent to vLLM keeps bands apart: band × a stride wider than
any inner priority, plus the inner policy's own.

How much of a backend a band may hold while a more urgent band is active is `start_rule`'s
answer (`engine_shares`, `tpot_slos`: `policies.shares`): the engine asks it before a head
job starts, and a band held there makes way for the next band's head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Self

from policies.bands import BandQueue
from policies.base import Key, Policy, engine_param, param
from policies.capacity import PRIORITY_BOUND
from policies.cost import LinearProfile
from policies.job import Job
from policies.queue import WaitingQueue
from policies.registry import parse_policy, register_policy
from policies.shares import EngineShares, EngineView, Start

BAND_STRIDE = 2 * PRIORITY_BOUND + 1
"""Engine priorities of consecutive bands are this far apart, so they never overlap."""


@register_policy
@dataclass(eq=False)
class Bands(Policy):
    name = "bands"
    description = (
        "Strict priority bands (Job.priority; optional shares), VTC tenant fairness inside a "
        "band, an inner policy (sagesched) inside a tenant."
    )
    needs_prediction = True  # as the default inner policy; each instance says its own
    revalidate_on_pop = True  # the flow chosen moves with shared counters: report progress
    # a field like the others (`param` is `dataclasses.field`); ruff only sees `Policy` as mutable
    inner: str | Policy = param(  # noqa: RUF009
        "sagesched",
        "policy ordering each tenant's jobs: a spec, ';' between its parameters (or, from "
        "code, the policy itself: `gateway.scheduling.classes` wraps the configured one)",
    )
    band_shares: tuple[tuple[int, float], ...] = param(
        (), "band:share;... fraction of the work a waiting band is guaranteed (else strict)"
    )
    tenant_weights: tuple[tuple[str, float], ...] = param((), "tenant:weight;... default 1")
    input_weight: float = param(1.0, "tenant counter charge per prompt token")
    output_weight: float = param(2.0, "tenant counter charge per output token")
    preempt_lower_bands: bool = param(
        False, "a waiting job may displace a running job of a lower band"
    )
    engine_shares: tuple[tuple[int, float], ...] = param(
        (),
        "band:share;... fraction of each backend's slots a band may hold while a more urgent "
        "band is active (policies.shares; else unbounded)",
    )
    tpot_slos: tuple[tuple[int, float], ...] = param(
        (),
        "band:seconds;... time per output token a band is promised: while it is active, less "
        "urgent bands start only while the batch's predicted TPOT stays within it",
    )
    active_window_s: float = param(
        10.0, "a band counts as active while it waits or this long after an arrival"
    )
    engine: LinearProfile | None = engine_param()
    """The engine's cost profile, handed on to the inner policy."""
    _inner: Policy = field(init=False, repr=False, compare=False)
    _queue: BandQueue | None = field(default=None, init=False, repr=False, compare=False)
    _shares: EngineShares = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for band, share in self.band_shares:
            if not 0.0 <= share < 1.0:
                raise ValueError(f"band_shares: band {band}'s share must be in [0, 1)")
        inner = (
            self.inner
            if isinstance(self.inner, Policy)
            else parse_policy(self.inner.replace(";", ","))
        )
        if isinstance(inner, Bands):
            raise ValueError("bands: the inner policy cannot be bands")
        self._inner = (inner if self.engine is None else inner.on_engine(self.engine)).fresh()
        # what the engine asks depends on the inner policy, so answer per instance
        setattr(self, "needs_prediction", self._inner.needs_prediction)  # noqa: B010
        setattr(self, "needs_oracle", self._inner.needs_oracle)  # noqa: B010
        self.preemptive = self._inner.preemptive or self.preempt_lower_bands
        self._shares = EngineShares(
            dict(self.engine_shares), dict(self.tpot_slos), self.active_window_s
        )
        setattr(self, "holds_starts", self._shares.enabled)  # noqa: B010

    @property
    def inner_policy(self) -> Policy:
        """This run's inner policy."""
        return self._inner

    def on_engine(self, cost: LinearProfile) -> Self:
        return self if self.engine is not None else dataclasses.replace(self, engine=cost)

    def make_queue(self) -> WaitingQueue:
        self._queue = BandQueue(self._inner, dict(self.band_shares), dict(self.tenant_weights))
        return self._queue

    # -- ordering -----------------------------------------------------------------------

    def key(self, job: Job, now: float) -> Key:
        return (float(job.priority), *self._inner.key(job, now))

    def engine_priority(self, key: Key) -> int:
        return int(key[0]) * BAND_STRIDE + self._inner.engine_priority(key[1:])

    def next_review(self, job: Job) -> int | None:
        return self._inner.next_review(job)

    def review_at(self, job: Job) -> float | None:
        return self._inner.review_at(job)

    def can_be_preempted(self, job: Job) -> bool:
        """Jobs of the waiting head's band, as the inner policy allows; with
        `preempt_lower_bands`, also any job of a lower band."""
        head = None if self._queue is None else self._queue.head_band
        if head is None or job.priority == head:
            return self._inner.preemptive and self._inner.can_be_preempted(job)
        return self.preempt_lower_bands and job.priority > head

    def preemption_pays(
        self, waiting: Job, victim: Job, running: Sequence[Job], n_waiting: int
    ) -> bool:
        if waiting.priority != victim.priority:
            return self.preempt_lower_bands and waiting.priority < victim.priority
        return self._inner.preemption_pays(waiting, victim, running, n_waiting)

    # -- hooks ----------------------------------------------------------------------------

    def start_rule(self, job: Job, engine: EngineView, now: float) -> Start:
        """The engine shares and TPOT objectives of the bands (`policies.shares`)."""
        return self._shares.start(job.priority, engine, now, self._waiting, job.prompt_tokens)

    def engine_limits(self, engine: EngineView, now: float) -> dict[int, int]:
        """Band → the slots it may hold on `engine` now (`EngineShares.limits`)."""
        return self._shares.limits(engine, now, self._waiting)

    def _waiting(self, band: int) -> int:
        return 0 if self._queue is None else self._queue.waiting_in(band)

    def on_admit(self, job: Job, now: float) -> None:
        if self._shares.enabled:
            self._shares.arrived(job.priority, now)
        self._inner.on_admit(job, now)

    def on_start(self, job: Job, now: float) -> None:
        if self._queue is not None:
            self._queue.charge(job, self.input_weight * job.prompt_tokens)
        self._inner.on_start(job, now)

    def on_progress(self, job: Job, new_tokens: int, now: float) -> None:
        if self._queue is not None:
            self._queue.charge(job, self.output_weight * new_tokens)
        self._inner.on_progress(job, new_tokens, now)

    def on_finish(self, job: Job, now: float) -> None:
        self._inner.on_finish(job, now)
        if self._queue is not None:
            self._queue.finished(job)
