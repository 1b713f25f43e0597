"""The dispatcher: the gateway's queue, and who runs next on which backend.

One `policies.Scheduler` per model holds every waiting request for that model (a backend
serving several models offers each freed slot to the models' queue heads in turn); the
scheduler is the same object the simulator drives, so the gateway makes the simulator's
decisions. Time is `time.monotonic()` seconds. Everything here runs on the event loop and
never awaits while it holds no lock: state changes are synchronous, so no locks are needed.

A request's life: `submit` (admit, or 429) → `wait` (until a backend slot is granted, 503 on
timeout, withdrawn if the client leaves) → `progress` per streamed token (at review
points, maybe preempt someone) → `finish`, or `requeue` (preempted / retry elsewhere).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.backends import Backend, BackendPool
from gateway.classes import Admission, Classes
from gateway.config import GatewayConfig, TrafficClass
from gateway.errors import QueueTimeout, UpstreamFailed
from gateway.metrics import GatewayMetrics, RequestTrace
from gateway.openai_api import Call
from policies import Job, LengthDist, Policy, Scheduler


@dataclass(eq=False)
class Ticket:
    """The gateway's side of a job (`Job.ctx`)."""

    call: Call
    trace: RequestTrace
    klass: TrafficClass
    """The request's class (`gateway.classes`; set by `Dispatcher.new_job`): its band is the
    job's priority."""
    future: asyncio.Future[Backend] | None = None
    backend: Backend | None = None
    priority: int | None = None
    """vLLM priority to send with this dispatch, if forwarding is on for the backend."""
    excluded: set[str] = field(default_factory=set)
    """Backends that failed this request before its first byte."""
    preempt_requested: bool = False
    abort_upstream: Callable[[], None] | None = None
    """Closes the current upstream response (set by the relay while streaming)."""
    finished: bool = False
    """`Dispatcher.finish` ran (it must run exactly once)."""
    prompt_vector: Any = None
    """The prompt's embedding once the predictor made it; learning the true length reuses it."""
    refining: asyncio.Task[None] | None = None
    """The prediction running beside the request (a job that could start at once)."""


class Dispatcher:
    """Queues, grants backend slots, and decides preemptions.

    The configured policy runs inside the classes' bands (`Classes.compose`: bands, tenant
    fairness, then the policy), the composition the simulator runs too; metrics keep the
    configured policy's label."""

    def __init__(
        self,
        policy: Policy,
        pool: BackendPool,
        metrics: GatewayMetrics,
        config: GatewayConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.classes = Classes(config.classes)
        self._template = self.classes.compose(policy)
        self._pool = pool
        self._metrics = metrics
        self._config = config
        self._clock = clock
        self._ids = itertools.count(1)
        self._schedulers: dict[str, Scheduler] = {}
        self.label = policy.label()
        self._admission = Admission(
            self.classes, config.max_waiting, config.retry_after_s, self.waiting
        )
        metrics.declare_classes(config.classes.list, config.classes.tenant_labels)

    # -- queries ------------------------------------------------------------------------

    @property
    def needs_prediction(self) -> bool:
        return self._template.needs_prediction

    def waiting(self) -> int:
        return sum(len(s.queue) for s in self._schedulers.values())

    def can_start_now(self, model: str) -> bool:
        """Would a job for `model` be dispatched the moment it is admitted (nothing of that
        model waiting, and a backend with room)?"""
        sched = self._schedulers.get(model)
        return (sched is None or not sched.queue) and self._pool.pick(model) is not None

    def scheduler(self, model: str) -> Scheduler:
        sched = self._schedulers.get(model)
        if sched is None:
            sched = self._schedulers[model] = Scheduler(self._template)
            for b in self._pool.backends:
                if model in b.models:
                    self._metrics.declare(model, b.name, self.label)
        return sched

    def snapshot(self) -> list[dict[str, Any]]:
        """Waiting jobs in policy order, per model, with keys and predictions (admin view)."""
        now = self._clock()
        rows = []
        for model, sched in sorted(self._schedulers.items()):
            for rank, (job, key) in enumerate(sched.queue.snapshot(now)):
                rows.append(_describe(job, model, rank, key, now))
        return rows

    def running_snapshot(self) -> list[dict[str, Any]]:
        """Running jobs in policy order, per model, each keyed at its current attained
        service (`Scheduler.running_key`, never the key it had at dispatch; admin view)."""
        now = self._clock()
        rows = []
        for model, sched in sorted(self._schedulers.items()):
            ranked = sorted(
                ((sched.running_key(j, now), j.arrival_s, j.id, j) for j in sched.running.values()),
                key=lambda r: r[:3],
            )
            for rank, (key, _, _, job) in enumerate(ranked):
                rows.append(_describe(job, model, rank, key, now))
        return rows

    # -- life of a request ----------------------------------------------------------------

    def new_job(
        self,
        call: Call,
        trace: RequestTrace,
        dist: LengthDist | None,
        klass: TrafficClass | None = None,
    ) -> Job:
        """A job of class `klass` (default: the configured default class): its band is the
        class's priority, its tenant the call's."""
        klass = klass or self.classes.default
        trace.klass, trace.tenant = klass.name, call.tenant
        return Job(
            id=next(self._ids),
            arrival_s=trace.arrived,
            prompt_tokens=call.prompt_tokens_estimate,
            max_tokens=call.max_tokens,
            tenant=call.tenant,
            priority=klass.priority,
            dist=dist,
            ctx=Ticket(call=call, trace=trace, klass=klass),
        )

    def submit(self, job: Job) -> None:
        """Admit a new job into its model's queue, or raise `QueueFull` / `Shed`
        (`gateway.classes.Admission`); a full queue may evict a less urgent waiting job."""
        ticket: Ticket = job.ctx
        klass = ticket.klass
        victim = self._admission.admit(job, klass)
        model = ticket.call.model
        try:
            self.scheduler(model).admit(job, self._clock())
        except BaseException:
            self._admission.left(job, klass)
            raise
        job.ctx.future = asyncio.get_running_loop().create_future()
        if victim is not None:  # room made only once the arrival is in
            self._shed(victim)
        self._class_depth(klass)
        self._queue_changed(model)
        self.pump()
        self._consider_preemption(model)

    async def wait(self, job: Job) -> Backend:
        """Until a backend slot is granted. Raises `QueueTimeout`; on cancellation (client
        gone) the job is withdrawn and any slot granted meanwhile is given back."""
        ticket: Ticket = job.ctx
        assert ticket.future is not None
        timeout_s = ticket.klass.queue_timeout_s or self._config.queue_timeout_s
        try:
            await asyncio.wait({ticket.future}, timeout=timeout_s)
        except asyncio.CancelledError:
            self._withdraw(job)
            raise
        if not ticket.future.done():
            self._withdraw(job)
            raise QueueTimeout(f"waited {timeout_s:g} s in the gateway queue without a backend")
        return ticket.future.result()  # raises `Shed` for a job evicted to make room

    def resized(self, job: Job) -> None:
        """`job.prompt_tokens` changed (the backend's tokenizer counted the prompt): a waiting
        job is rekeyed; a running one is compared by its new size from now on."""
        sched = self._schedulers.get(job.ctx.call.model)
        if sched is not None and job in sched.queue:
            sched.queue.rekey(job, self._clock())

    def progress(self, job: Job, tokens: int) -> None:
        """`tokens` more output tokens were relayed for a running job."""
        sched = self.scheduler(job.ctx.call.model)
        if sched.progress(job, tokens, self._clock()):
            self._consider_preemption(job.ctx.call.model)

    def finish(self, job: Job) -> None:
        """The job is over (whatever the outcome); frees its slot if it held one. Idempotent."""
        ticket: Ticket = job.ctx
        if ticket.finished:
            return
        ticket.finished = True
        self._left_waiting(job)
        self.scheduler(ticket.call.model).finish(job, self._clock())
        self._queue_changed(ticket.call.model)
        backend, ticket.backend = ticket.backend, None
        if backend is not None:
            self._pool.release(backend)

    def requeue(self, job: Job, *, preempted: bool) -> None:
        """Give the slot back and wait again (after a preemption)."""
        ticket: Ticket = job.ctx
        backend, ticket.backend = ticket.backend, None
        self.scheduler(ticket.call.model).requeue(job, self._clock(), preempted=preempted)
        ticket.future = asyncio.get_running_loop().create_future()
        ticket.preempt_requested = False
        self._queue_changed(ticket.call.model)
        if backend is not None:
            self._pool.release(backend)  # pumps

    def retry_elsewhere(self, job: Job, *, backend_down: bool) -> None:
        """The backend failed before the first byte: exclude it and queue again, or raise
        `UpstreamFailed` when no other backend serving the model is left."""
        ticket: Ticket = job.ctx
        backend = ticket.backend
        assert backend is not None
        ticket.excluded.add(backend.name)
        if backend_down:
            self._pool.mark_down(backend)
        self._metrics.retries.labels(ticket.call.model, backend.name).inc()
        retries = len(ticket.excluded)
        if retries > self._config.max_retries or not self._pool.candidates(
            ticket.call.model, ticket.excluded
        ):
            raise UpstreamFailed(f"no backend could serve the request (tried {retries})")
        self.requeue(job, preempted=False)

    # -- slot granting ------------------------------------------------------------------

    def pump(self) -> None:
        """Grant free backend slots to the best waiting jobs (called whenever capacity or
        the queue changes)."""
        now = self._clock()
        for model, sched in self._schedulers.items():
            granted = False
            while (job := sched.queue.peek(now)) is not None:
                backend = self._pool.pick(model, job.ctx.excluded)
                if backend is None:
                    break
                sched.dispatch(now)
                self._grant(sched, job, backend)
                granted = True
            if granted:
                self._queue_changed(model)

    def _grant(self, sched: Scheduler, job: Job, backend: Backend) -> None:
        ticket: Ticket = job.ctx
        self._left_waiting(job)
        self._pool.acquire(backend)
        ticket.backend = backend
        ticket.priority = None
        if self._config.forward_priority and backend.config.priority_scheduling:
            # the key itself, not a rank among the jobs running now: vLLM compares it with
            # jobs granted earlier and later, and a rank means nothing across grants
            ticket.priority = sched.engine_priority(job, self._clock())
        assert ticket.future is not None and not ticket.future.done()
        ticket.future.set_result(backend)

    def _shed(self, victim: Job) -> None:
        """Evict a waiting job to make room: its `wait` raises `Shed` (429, Retry-After)."""
        ticket: Ticket = victim.ctx
        assert ticket.future is not None and not ticket.future.done()
        ticket.future.set_exception(self._admission.shed_error(ticket.klass))
        self.finish(victim)

    def _left_waiting(self, job: Job) -> None:
        """`job` no longer waits for its first dispatch (granted, or over)."""
        klass = job.ctx.klass
        self._admission.left(job, klass)
        self._class_depth(klass)

    def _class_depth(self, klass: TrafficClass) -> None:
        self._metrics.class_depth.labels(klass.name).set(self._admission.waiting_of(klass))

    def _withdraw(self, job: Job) -> None:
        """Client gone or timed out while waiting: out of the queue, slot returned if any."""
        self.finish(job)

    def _queue_changed(self, model: str) -> None:
        depth = len(self.scheduler(model).queue)
        self._metrics.queue_depth.labels(model, self.label).set(depth)

    # -- preemption ---------------------------------------------------------------------

    def _consider_preemption(self, model: str) -> None:
        """Preempt the worst running job if the best waiting one beats it by the margin."""
        if not self._config.preemption:
            return
        sched = self.scheduler(model)
        victim = sched.preemption_victim(self._clock(), self._config.preemption_margin)
        if victim is None:
            return
        ticket: Ticket = victim.ctx
        if ticket.preempt_requested or not ticket.call.continuable or ticket.abort_upstream is None:
            return
        ticket.preempt_requested = True
        backend = ticket.backend
        name = backend.name if backend else ""
        self._metrics.preemptions.labels(model, name, self.label).inc()
        ticket.abort_upstream()


def _describe(
    job: Job, model: str, rank: int, key: tuple[float, ...], now: float
) -> dict[str, Any]:
    dist = job.dist
    return {
        "rank": rank,
        "id": job.id,
        "model": model,
        "tenant": job.tenant,
        "waited_s": round(now - job.arrival_s, 6),
        "key": list(key),
        "prompt_tokens": job.prompt_tokens,
        "max_tokens": job.max_tokens,
        "generated": job.generated,
        "preemptions": job.preemptions,
        "predicted_median": None if dist is None else dist.quantile(0.5),
        "predicted_mean": None if dist is None else round(dist.mean(), 3),
        "predicted_p90": None if dist is None else dist.quantile(0.9),
    }
