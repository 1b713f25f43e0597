"""The dispatcher: the gateway's queue, and who runs next on which backend.

One `policies.Scheduler` per model holds every waiting request for that model (a backend
serving several models offers each freed slot to the models' queue heads in turn); the
scheduler is the same object the simulator drives, so the gateway makes the simulator's
decisions. Time is `time.monotonic()` seconds. Everything here runs on the event loop and
never awaits while it changes state: state changes are synchronous, so no locks are needed.

A request's whole life in the queue is one `LocalSlot` (`dispatcher.slot(job)`, the contract
is `gateway.scheduling.slot.Slot`): enter = admit (or 429), `granted()` = wait for a backend slot
(503 on
timeout, 429 if shed), `tokens(n)` = progress (at review points, maybe preempt someone),
`ended(...)` = the attempt's outcome (completed, preempted, retry elsewhere), exit = finish.
The dispatcher never calls the relay: a preemption stops the victim's `PreemptWindow`.

What it counts for the metrics is plain data (`preemptions`, `retries`, `queue_depths`,
`class_depths`), read by `gateway.observability.metrics` when Prometheus scrapes.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from gateway.config import GatewayConfig, TrafficClass
from gateway.errors import QueueTimeout, UpstreamFailed
from gateway.observability.metrics import RequestTrace
from gateway.scheduling.backends import Backend, BackendPool
from gateway.scheduling.classes import Admission, Classes
from gateway.scheduling.routing import request_prefix
from gateway.scheduling.slot import Attempt, Grant, PreemptWindow
from gateway.serving.openai_api import Call
from policies import Job, LengthDist, Policy, Scheduler
from policies.catalog.bands import Bands
from policies.routing import parse_router
from policies.shares import EngineView, Start

RECHECK_SLACK_S = 0.05
"""A held job is looked at again this long after the activity window could have ended."""


@dataclass(eq=False)
class Ticket:
    """The gateway's side of a job (`Job.ctx`): what the request is and what it recorded."""

    call: Call
    trace: RequestTrace
    klass: TrafficClass
    """The request's class (`gateway.scheduling.classes`; set by `Dispatcher.new_job`): its band is
    the
    job's priority."""
    prompt_vector: Any = None
    """The prompt's embedding once the predictor made it; learning the true length reuses it."""
    refining: asyncio.Task[None] | None = None
    """The prediction running beside the request (a job that could start at once)."""
    token_chain: tuple[int, ...] | None = None
    """The prompt's chain over its token ids in the block size of engines that publish KV
    events (`gateway.scheduling.prompts`, `gateway.scheduling.kv_events`), once the backend's
    tokenizer counted it."""


class LocalSlot:
    """A `gateway.scheduling.slot.Slot` of a dispatcher in this process (the contract is there).

    Holds the job's queue state: the pending grant, the backend it holds, the backends that
    failed it, the open preemption window. Every call goes straight to the dispatcher (no
    message, no copy), so `tokens` costs one `Scheduler.progress`. A scheduling authority
    serving relays in other processes can drive one of these per remote request."""

    __slots__ = (
        "_dispatcher",
        "backend",
        "excluded",
        "finished",
        "future",
        "job",
        "review_at",
        "window",
    )

    def __init__(self, dispatcher: Dispatcher, job: Job) -> None:
        self._dispatcher = dispatcher
        self.job = job
        self.review_at: int | None = None
        self.future: asyncio.Future[Grant] | None = None
        """The next grant (or the `Shed` error of an evicted job)."""
        self.backend: Backend | None = None
        """The backend slot held now."""
        self.excluded: set[str] = set()
        """Backends that failed this request before its first byte."""
        self.window: PreemptWindow | None = None
        """The current attempt's preemption window (open while the relay reads a stream)."""
        self.finished = False
        """The dispatcher let the job go (it must, exactly once)."""

    async def __aenter__(self) -> LocalSlot:
        self._dispatcher._admit(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._dispatcher._finish(self)

    async def granted(self) -> Grant:
        return await self._dispatcher._granted(self)

    def tokens(self, n: int) -> None:
        self._dispatcher._progress(self, n)

    def preemptible(self) -> PreemptWindow:
        self.window = PreemptWindow()
        return self.window

    def ended(self, attempt: Attempt, *, backend_down: bool = False) -> None:
        self._dispatcher._ended(self, attempt, backend_down)


class Dispatcher:
    """Queues, grants backend slots, and decides preemptions.

    The configured policy runs inside the classes' bands (`Classes.compose`: bands, tenant
    fairness, then the policy), the composition the simulator runs too; metrics keep the
    configured policy's label. Listens to the pool's capacity changes (`BackendPool.listen`)."""

    def __init__(
        self,
        policy: Policy,
        pool: BackendPool,
        config: GatewayConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.classes = Classes(config.classes)
        self._template = self.classes.compose(policy)
        self._pool = pool
        self._config = config
        self._clock = clock
        self._ids = itertools.count(1)
        self._schedulers: dict[str, Scheduler] = {}
        self._slots: dict[int, LocalSlot] = {}
        """Admitted jobs not yet finished, by job id."""
        self.label = policy.label()
        self._chains = parse_router(config.routing).uses_prefix and len(config.backends) > 1
        """The router reads prompts' block chains and has a choice to make: each job gets one
        (`gateway.scheduling.routing`)."""
        self._admission = Admission(
            self.classes, config.max_waiting, config.retry_after_s, self.waiting
        )
        self.preemptions: dict[tuple[str, str], int] = {}
        """(model, backend) → running requests preempted; at zero once the model has a
        scheduler."""
        self.retries: dict[tuple[str, str], int] = {}
        """(model, backend) → requests retried elsewhere after the backend failed them."""
        self.share_lent: dict[str, int] = {c: 0 for c in self.classes.by_name}
        """Class → jobs started beyond their band's engine share (lent: no more urgent band
        was active)."""
        self.share_held: dict[str, int] = {c: 0 for c in self.classes.by_name}
        """Class → jobs held back as their band's head at its share (or an urgent band's TPOT
        bound) while a backend had room, each once: the share taken back by not granting."""
        self._held: set[int] = set()
        """Jobs counted in `share_held` (each once)."""
        self._running_on: dict[str, dict[int, Job]] = {}
        """Backend name → the jobs running there (what the start rule sees)."""
        self._recheck: asyncio.TimerHandle | None = None
        pool.listen(self.pump)

    # -- queries ------------------------------------------------------------------------

    @property
    def needs_prediction(self) -> bool:
        return self._template.needs_prediction

    @property
    def may_preempt(self) -> bool:
        """Can a running job ever be preempted (allowed by config, and the composed policy
        preempts)? If not, the relay keeps no continuation text."""
        return self._config.preemption and self._template.preemptive

    def waiting(self) -> int:
        return sum(len(s.queue) for s in self._schedulers.values())

    def queue_depths(self) -> dict[str, int]:
        """Waiting requests per model (models that have a scheduler)."""
        return {model: len(s.queue) for model, s in self._schedulers.items()}

    def class_depths(self) -> dict[str, int]:
        """Requests of each configured class waiting for their first dispatch."""
        return {name: self._admission.waiting_of(c) for name, c in self.classes.by_name.items()}

    def can_start_now(self, model: str) -> bool:
        """Would a job for `model` be dispatched the moment it is admitted (nothing of that
        model waiting, and a backend with room)?"""
        sched = self._schedulers.get(model)
        return (sched is None or not sched.queue) and self._pool.pick(model) is not None

    def scheduler(self, model: str) -> Scheduler:
        sched = self._schedulers.get(model)
        if sched is None:
            # the engine's cost as its self-tuning cap fitted it (a remembered curve at a
            # restart): the `time` cost model and the preemption rule price with it
            cost = self._pool.engine_profile(model)
            sched = self._schedulers[model] = Scheduler(self._template, cost)
            for b in self._pool.backends:
                if model in b.models:  # counted from zero, so the first event is an increase
                    self.preemptions.setdefault((model, b.name), 0)
                    self.retries.setdefault((model, b.name), 0)
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
        session: str | None = None,
    ) -> Job:
        """A job of class `klass` (default: the configured default class): its band is the
        class's priority, its tenant the call's; its prompt's block chain when the router
        reads prefixes, and the client's conversation key `session`."""
        klass = klass or self.classes.default
        trace.klass, trace.tenant = klass.name, call.tenant
        prefix, block_tokens = request_prefix(call) if self._chains else ((), 0)
        return Job(
            id=next(self._ids),
            arrival_s=trace.arrived,
            prompt_tokens=call.prompt_tokens_estimate,
            max_tokens=call.max_tokens,
            tenant=call.tenant,
            priority=klass.priority,
            dist=dist,
            prefix=prefix,
            block_tokens=block_tokens,
            session=session,
            ctx=Ticket(call=call, trace=trace, klass=klass),
        )

    def slot(self, job: Job) -> LocalSlot:
        """`job`'s slot: `async with dispatcher.slot(job) as slot` admits it
        (`gateway.scheduling.slot`)."""
        return LocalSlot(self, job)

    def resized(self, job: Job) -> None:
        """`job.prompt_tokens` changed (the backend's tokenizer counted the prompt): a waiting
        job is rekeyed; a running one is compared by its new size from now on."""
        sched = self._schedulers.get(job.ctx.call.model)
        if sched is not None and job in sched.queue:
            sched.queue.rekey(job, self._clock())

    def _admit(self, slot: LocalSlot) -> None:
        """Admit a new job into its model's queue, or raise `QueueFull` / `Shed`
        (`gateway.scheduling.classes.Admission`); a full queue may evict a less urgent waiting
        job."""
        job = slot.job
        ticket: Ticket = job.ctx
        klass = ticket.klass
        victim = self._admission.admit(job, klass)
        model = ticket.call.model
        scheduler = self.scheduler(model)
        ticket.trace.queue_depth = len(scheduler.queue)
        try:
            scheduler.admit(job, self._clock())
        except BaseException:
            self._admission.left(job, klass)
            raise
        slot.future = asyncio.get_running_loop().create_future()
        self._slots[job.id] = slot
        if victim is not None:  # room made only once the arrival is in
            self._shed(self._slots[victim.id])
        self.pump()
        self._consider_preemption(model)

    async def _granted(self, slot: LocalSlot) -> Grant:
        """Until a backend slot is granted. Raises `QueueTimeout`, or `Shed` for a job evicted
        to make room; the slot's exit withdraws the job (also when the client leaves)."""
        future = slot.future
        assert future is not None
        if not future.done():
            klass: TrafficClass = slot.job.ctx.klass
            timeout_s = klass.queue_timeout_s or self._config.queue_timeout_s
            await asyncio.wait({future}, timeout=timeout_s)
            if not future.done():
                raise QueueTimeout(f"waited {timeout_s:g} s in the gateway queue without a backend")
        return future.result()

    def _progress(self, slot: LocalSlot, tokens: int) -> None:
        """`tokens` more output tokens were relayed for a running job."""
        job = slot.job
        model = job.ctx.call.model
        sched = self._schedulers[model]
        if sched.progress(job, tokens, self._clock()):
            slot.review_at = sched.review_at(job)
            self._consider_preemption(model)

    def _ended(self, slot: LocalSlot, attempt: Attempt, backend_down: bool) -> None:
        if attempt is Attempt.COMPLETED:
            self._finish(slot)
        elif attempt is Attempt.PREEMPTED:
            self._requeue(slot, preempted=True)
        else:
            self._retry_elsewhere(slot, backend_down=backend_down)

    def _finish(self, slot: LocalSlot) -> None:
        """The job is over (whatever the outcome); frees its slot if it held one. Idempotent."""
        if slot.finished:
            return
        slot.finished = True
        job = slot.job
        ticket: Ticket = job.ctx
        self._slots.pop(job.id, None)
        self._admission.left(job, ticket.klass)
        self._held.discard(job.id)
        self.scheduler(ticket.call.model).finish(job, self._clock())
        self._release(slot)

    def _requeue(self, slot: LocalSlot, *, preempted: bool) -> None:
        """Give the backend slot back and wait again (after a preemption or a failure)."""
        job = slot.job
        self.scheduler(job.ctx.call.model).requeue(job, self._clock(), preempted=preempted)
        slot.future = asyncio.get_running_loop().create_future()
        slot.window = None
        self._release(slot)

    def _release(self, slot: LocalSlot) -> None:
        """Give back the backend slot `slot` holds, if any (the pool then pumps)."""
        backend, slot.backend = slot.backend, None
        if backend is not None:
            job = slot.job
            self._running_on.get(backend.name, {}).pop(job.id, None)
            self._pool.release(backend, job.ctx.call.model, job)

    def _retry_elsewhere(self, slot: LocalSlot, *, backend_down: bool) -> None:
        """The backend failed before the first byte: exclude it and queue again, or raise
        `UpstreamFailed` when no other backend serving the model is left."""
        backend = slot.backend
        assert backend is not None
        model = slot.job.ctx.call.model
        slot.excluded.add(backend.name)
        if backend_down:
            self._pool.mark_down(backend)
        key = (model, backend.name)
        self.retries[key] = self.retries.get(key, 0) + 1
        retries = len(slot.excluded)
        if retries > self._config.max_retries or not self._pool.candidates(model, slot.excluded):
            raise UpstreamFailed(f"no backend could serve the request (tried {retries})")
        self._requeue(slot, preempted=False)

    # -- slot granting ------------------------------------------------------------------

    def pump(self) -> None:
        """Grant free backend slots to the best waiting jobs (called whenever capacity or
        the queue changes). A head the policy's start rule holds on every backend with room
        (its band at its engine share, `policies.shares`) passes its band's turn."""
        now = self._clock()
        for model, sched in self._schedulers.items():
            held: set[int] = set()
            while (job := sched.peek(now, held)) is not None:
                verdicts: dict[str, Start] = {}
                allow = None
                if sched.policy.holds_starts:
                    allow = functools.partial(self._may_start, sched, job, now, verdicts)
                backend = self._pool.pick(model, self._slots[job.id].excluded, job, allow)
                if backend is None:
                    if Start.HELD not in verdicts.values():
                        break  # no room: nothing else can start either
                    self._recheck_later()
                    held.add(job.priority)
                    if job.id not in self._held:
                        self._held.add(job.id)
                        self.share_held[job.ctx.klass.name] += 1
                    continue
                sched.dispatch(now, held)
                if verdicts.get(backend.name) is Start.LENT:
                    self.share_lent[job.ctx.klass.name] += 1
                self._grant(sched, job, backend)

    def _recheck_later(self) -> None:
        """A job was held: pump again once the urgent band's activity window may have ended
        (a held band is lent the slots then, even if nothing else happens)."""
        if self._recheck is None:
            loop = asyncio.get_running_loop()
            window = self._config.classes.active_window_s
            self._recheck = loop.call_later(window + RECHECK_SLACK_S, self._rechecked)

    def _rechecked(self) -> None:
        self._recheck = None
        self.pump()

    def _may_start(
        self, sched: Scheduler, job: Job, now: float, verdicts: dict[str, Start], b: Backend
    ) -> bool:
        """The start rule for `job` on `b` (a backend without room is the router's to pass
        over); each verdict is kept in `verdicts`."""
        if not b.has_room():
            return True
        verdict = verdicts[b.name] = sched.start_rule(job, self._engine_view(b), now)
        return verdict is not Start.HELD

    def _engine_view(self, b: Backend) -> EngineView:
        """`b` as the start rule sees it: its running jobs, its cap, once its self-tuning cap
        trusts a fitted curve its iteration time by batch, and its KV size once scraped."""
        curve = None if b.controller is None else b.controller.iteration_curve()
        kv = None if b.sample is None else b.sample.kv_capacity_tokens
        return EngineView(list(self._running_on.get(b.name, {}).values()), b.cap, curve, kv)

    def engine_shares(self) -> dict[tuple[str, str], int]:
        """(class, backend) → the slots the class's band may hold there now: its engine share
        or what a more urgent class's TPOT objective leaves while that class is active, else
        the backend's cap (metrics)."""
        now = self._clock()
        bounded = [s.policy for s in self._schedulers.values()
                   if isinstance(s.policy, Bands) and s.policy.holds_starts]  # fmt: skip
        out: dict[tuple[str, str], int] = {}
        for b in self._pool.backends:
            limits = [p.engine_limits(self._engine_view(b), now) for p in bounded]
            for name, klass in self.classes.by_name.items():
                out[(name, b.name)] = min([b.cap, *(m[klass.priority] for m in limits
                                                    if klass.priority in m)])  # fmt: skip
        return out

    def _grant(self, sched: Scheduler, job: Job, backend: Backend) -> None:
        slot = self._slots[job.id]
        self._admission.left(job, job.ctx.klass)
        self._held.discard(job.id)
        self._pool.acquire(backend)
        self._pool.routed(job.ctx.call.model, job, backend)
        self._running_on.setdefault(backend.name, {})[job.id] = job
        slot.backend = backend
        priority = None
        if self._config.forward_priority and backend.config.priority_scheduling:
            # the key itself, not a rank among the jobs running now: vLLM compares it with
            # jobs granted earlier and later, and a rank means nothing across grants
            priority = sched.engine_priority(job, self._clock())
        slot.review_at = sched.review_at(job)
        assert slot.future is not None and not slot.future.done()
        slot.future.set_result(Grant(backend, priority))

    def _shed(self, victim: LocalSlot) -> None:
        """Evict a waiting job to make room: its `granted` raises `Shed` (429, Retry-After)."""
        assert victim.future is not None and not victim.future.done()
        victim.future.set_exception(self._admission.shed_error(victim.job.ctx.klass))
        self._finish(victim)

    # -- preemption ---------------------------------------------------------------------

    def _consider_preemption(self, model: str) -> None:
        """Preempt the worst running job if the best waiting one beats it by the margin."""
        if not self._config.preemption:
            return
        sched = self.scheduler(model)
        victim = sched.preemption_victim(self._clock(), self._config.preemption_margin)
        if victim is None:
            return
        slot = self._slots.get(victim.id)
        window = None if slot is None else slot.window
        if window is None or not window.open or not victim.ctx.call.continuable:
            return  # not streaming now (connecting, whole answer, responses), or stopping
        assert slot is not None
        key = (model, slot.backend.name if slot.backend else "")
        self.preemptions[key] = self.preemptions.get(key, 0) + 1
        window.preempt()


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
