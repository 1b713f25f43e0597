"""Several gateway replicas in front of the same backends, in virtual time.

Behind a Kubernetes Service, N gateway replicas each hold their own queue and learn only from
their own completions; a client balancer spreads the requests over them. `simulate_replicas`
runs that: N `policies.Scheduler`s (each a fresh copy of one policy) in front of B engine
models, each replica dispatching only into the backend slots its `admission` allows:

- `independent`: the gateway as it ships. Every replica applies the per-backend cap to its own
  requests as if it were alone: a fixed cap (`max_inflight`, so up to N × cap run on a backend
  and the excess queues inside vLLM, FCFS), or its own self-tuning cap per backend
  (`policies.capacity.CapController`) fed with the backend's metrics (queue, KV, tokens: the
  whole engine's) and its own in-flight and finished counts;
- `split`: each replica gets 1/N of each backend's fixed cap (the operator's division);
- `owned`: backend b's slots belong to replica b mod N, which alone dispatches there (its cap,
  fixed or self-tuning, then sees exactly its own effect, as with one gateway); needs B ≥ N;
- `shared`: one budget per backend shared by every replica (a shared counter: one cap or one
  controller fed with the total in flight), free slots taken by the replicas with a backlog
  in turn;
- `shared-heads`: the shared budget, and each free slot goes to the replica whose best waiting
  request has the lowest policy key (replicas publish their queue heads).

Client balancing (`balancing`): `random` (seeded), `round-robin`, or `least-loaded` (the replica
with the fewest waiting + running requests, as a least-request balancer sees open requests;
ties go to the first replica after the last one picked). A replica routes each dispatch to the
least-loaded backend it may use (in flight / cap, as
`gateway.scheduling.backends.BackendPool.pick`).

Time. Each engine steps on its own clock; a step's result is settled when the global clock
reaches its end. The gateway acts at those settle times and at arrivals: an arrival is
delivered at its own time (on the profile's grid) when some engine is idle, otherwise at the
next step end, as the single-engine loop does; a request dispatched to a busy engine joins its
waiting queue for its next iteration. A step never jumps past the next arrival, and a
completion frees slots only on its own backend, so no engine's step outlives an event that
could change its inputs, except a gateway preemption at an arrival: it takes effect at the
victim engine's current step end (at most one iteration later), and a victim already finished
there is left to finish. With N = B = 1 every mode is exactly `simulate` (a test holds it).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from loadgen.engine.model import Engine, Seq, StepResult
from loadgen.engine.profiles import LatencyProfile, make_profile
from loadgen.schema import TraceRequest
from loadgen.sim.simulator import (
    ARRIVAL_EPS_S,
    Contender,
    SimResult,
    _jobs,
    align_to_grid,
    engine_sample,
    resolve,
    snap_to_grid,
)
from policies.base import Key
from policies.capacity import CapController, CapLaw
from policies.dist import LengthDist
from policies.job import Job
from policies.scheduler import Scheduler

Balancing = Literal["random", "least-loaded", "round-robin"]
Admission = Literal["independent", "split", "owned", "shared", "shared-heads"]
BALANCINGS: tuple[Balancing, ...] = get_args(Balancing)
ADMISSIONS: tuple[Admission, ...] = get_args(Admission)


@dataclass(frozen=True, slots=True)
class Replicas:
    """N gateway replicas in front of B backends: how clients reach them and what each may
    admit into the backends."""

    count: int = 1
    """Gateway replicas (N)."""
    backends: int = 1
    """Backends (B), identical engines."""
    balancing: Balancing = "least-loaded"
    """How the client balancer picks a replica for each request."""
    admission: Admission = "independent"
    """Whose slots a replica may use on each backend (module docstring)."""
    seed: int = 0
    """Seed of `random` balancing."""

    def __post_init__(self) -> None:
        if self.count < 1 or self.backends < 1:
            raise ValueError("need at least one replica and one backend")
        if self.balancing not in BALANCINGS:
            raise ValueError(f"unknown balancing {self.balancing!r}; known: {BALANCINGS}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"unknown admission {self.admission!r}; known: {ADMISSIONS}")
        if self.admission == "owned" and self.backends < self.count:
            raise ValueError("owned admission needs at least as many backends as replicas")

    @property
    def label(self) -> str:
        return f"N={self.count} B={self.backends} {self.balancing} {self.admission}"


class _Budget:
    """One admission budget on one backend: a fixed cap or a self-tuning one, and the requests
    in flight under it (one replica's own view of the backend, or the shared counter)."""

    __slots__ = ("cap", "ctl", "inflight", "next_sample", "released")

    def __init__(self, cap: int | None, law: CapLaw | None) -> None:
        self.cap = cap
        self.ctl = None if law is None else CapController(law, cap or 1)
        self.inflight = 0
        self.released = 0
        """Requests that left the engine (finished or dropped): the controller's turnover."""
        self.next_sample = math.inf if self.ctl is None else self.ctl.interval_s

    def limit(self) -> int | None:
        return self.cap if self.ctl is None else self.ctl.cap

    def room(self) -> bool:
        limit = self.limit()
        return limit is None or self.inflight < limit

    def load(self) -> float:
        limit = self.limit()
        return self.inflight / limit if limit else float(self.inflight)


@dataclass(slots=True, eq=False)
class _Replica:
    index: int
    sched: Scheduler
    budgets: list[_Budget | None] = field(default_factory=list)
    """Per backend: the budget this replica dispatches under (None: not its backend)."""


def _budgets(c: Contender, setup: Replicas) -> list[list[_Budget | None]]:
    """Per replica, per backend: the budget it dispatches under (shared objects when shared)."""
    n, b = setup.count, setup.backends
    cap, law = c.inflight_cap, c.cap_law
    if setup.admission in ("shared", "shared-heads"):
        shared: list[_Budget | None] = [_Budget(cap, law) for _ in range(b)]
        return [list(shared) for _ in range(n)]
    if setup.admission == "split":
        if law is not None or cap is None or cap < n:
            raise ValueError("split admission needs a fixed cap of at least one per replica")
        shares = [cap // n + (1 if r < cap % n else 0) for r in range(n)]
        return [[_Budget(shares[r], None) for _ in range(b)] for r in range(n)]
    owned = setup.admission == "owned"
    return [
        [_Budget(cap, law) if not owned or k % n == r else None for k in range(b)] for r in range(n)
    ]


class _ReplicaRun:
    """State of one run; `run()` is the loop."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        contender: Contender,
        profile: LatencyProfile,
        setup: Replicas,
        sigma: float,
        beliefs: Sequence[LengthDist] | None,
        rank_scores: Sequence[float] | None,
    ) -> None:
        self.c, self.profile, self.setup = contender, profile, setup
        batch = min(contender.inflight_cap or contender.engine.max_seqs, contender.engine.max_seqs)
        cost = profile.cost_profile(batch)
        if contender.policy.holds_starts:
            raise ValueError(
                "engine shares and TPOT objectives (bands:engine_shares, tpot_slos) run in the "
                "gateway and the single-engine simulator; this fleet simulator does not apply them"
            )
        grid = _budgets(contender, setup)
        self.replicas = [
            _Replica(r, Scheduler(contender.policy, cost), grid[r]) for r in range(setup.count)
        ]
        self.engines = [Engine(contender.engine, profile) for _ in range(setup.backends)]
        self.per_backend: list[list[_Budget]] = [
            list({id(b): b for r in grid if (b := r[k]) is not None}.values())
            for k in range(setup.backends)
        ]
        """Per backend: its distinct budgets (one per replica that may use it, or the shared)."""
        policy = self.replicas[0].sched.policy
        if any(r.think_s is not None for r in requests):
            raise ValueError("session turns that follow their previous turn need simulate()")
        self.jobs, self.records = _jobs(requests, policy, sigma, beliefs, rank_scores)
        self.jobs.sort(key=lambda j: (j.arrival_s, j.id))
        self.clock = [0.0] * setup.backends
        """Per engine: the end of its last step (its state is at that time)."""
        self.pending: list[StepResult | None] = [None] * setup.backends
        """Per engine: the step under way, settled when the global clock reaches its end."""
        self.owner: dict[int, _Replica] = {}
        self.held: dict[int, tuple[int, _Budget]] = {}
        """Running job id → (backend, the budget its slot counts against)."""
        self.rng = random.Random(setup.seed)
        self.next_pick = 0
        """Round-robin balancing, and where least-loaded ties start."""
        self.next_grant = 0
        """`shared`: the replica first in line for the next free slot."""
        self.steps = 0
        self.caps: list[float] = []
        """A backend's total cap (over its budgets) after every controller sample."""
        self.peak = 0
        """Most requests in flight on one backend at once."""

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> float:
        """Simulate to the end of the drain. Returns the end time."""
        jobs, n, engines = self.jobs, len(self.jobs), self.engines
        drain_end = (jobs[-1].arrival_s if jobs else 0.0) + self.c.engine.drain_s
        t, i = 0.0, 0
        while True:
            arrived: set[int] = set()
            while i < n and jobs[i].arrival_s <= t + ARRIVAL_EPS_S:
                arrived.add(self._arrive(jobs[i]))
                i += 1
            if arrived or any(r.sched.queue and self._room(r) for r in self.replicas):
                self._gateway(t, arrived)
            if i == n and t >= drain_end - ARRIVAL_EPS_S:
                break
            nxt = jobs[i].arrival_s if i < n else drain_end
            for k, engine in enumerate(engines):
                if engine and self.pending[k] is None:
                    self._start(k, t, nxt)
            ends = [self.clock[k] for k in range(len(engines)) if self.pending[k] is not None]
            if not ends:
                if i == n:
                    break
                t = max(t, align_to_grid(self.profile.grid_s, jobs[i].arrival_s))
                continue
            end = min(ends)
            if i < n and len(ends) < len(engines):  # an idle engine: arrivals come on time
                at = max(t, align_to_grid(self.profile.grid_s, jobs[i].arrival_s))
                if at < end:
                    t = at
                    continue
            t = end
            for k in range(len(engines)):
                if self.pending[k] is not None and self.clock[k] == end:
                    self._settle_step(k, end)
        self._cut_off(t)
        return t

    def _start(self, k: int, t: float, next_arrival: float) -> None:
        """Engine k starts a step at `t` (one iteration, or a jump up to the next event)."""
        sample = min((b.next_sample for b in self.per_backend[k]), default=math.inf)
        res = self.engines[k].step(t, min(next_arrival, sample) - t)
        self.steps += 1
        self.pending[k] = res
        self.clock[k] = snap_to_grid(self.profile.grid_s, t + res.dt_s)

    def _settle_step(self, k: int, t: float) -> None:
        res = self.pending[k]
        assert res is not None
        self.pending[k] = None
        self._sample(k, t)
        for seq in res.dropped:
            self._settle(seq, t, dropped=True, released=True)
        for seq in res.finished:
            self._settle(seq, seq.last_token_s, dropped=False, released=True)

    def _sample(self, k: int, t: float) -> None:
        """Every controller due on backend k reads the engine, as a scrape of /metrics would."""
        e, sample = self.engines[k], None
        for b in self.per_backend[k]:
            if b.ctl is None or t < b.next_sample:
                continue
            if sample is None:
                sample = engine_sample(e)
            b.ctl.observe(t, sample, b.inflight)
            self.caps.append(float(sum(x.limit() or 0 for x in self.per_backend[k])))
            while b.next_sample <= t:  # one reading after an idle gap, as a scrape would see
                b.next_sample += b.ctl.interval_s

    # -- clients ----------------------------------------------------------------------------

    def _arrive(self, job: Job) -> int:
        r = self._balance()
        self.owner[job.id] = r
        r.sched.admit(job, job.arrival_s)
        return r.index

    def _balance(self) -> _Replica:
        reps, n = self.replicas, len(self.replicas)
        if n == 1:
            return reps[0]
        if self.setup.balancing == "random":
            return reps[self.rng.randrange(n)]
        start = self.next_pick
        if self.setup.balancing == "round-robin":
            pick = start % n
        else:
            order = [(start + k) % n for k in range(n)]
            pick = min(order, key=lambda r: len(reps[r].sched.queue) + len(reps[r].sched.running))
        self.next_pick = pick + 1
        return reps[pick]

    # -- gateway ----------------------------------------------------------------------------

    def _room(self, r: _Replica) -> bool:
        return any(b is not None and b.room() for b in r.budgets)

    def _gateway(self, t: float, arrived: set[int]) -> None:
        """Each replica that got a request or has room preempts if its policy wants to; then
        free slots are filled in the admission mode's order."""
        for r in self.replicas:
            if r.index in arrived or (r.sched.queue and self._room(r)):
                self._preempt(r, t)
        if self.setup.admission == "shared":
            self._fill_in_turn(t)
        elif self.setup.admission == "shared-heads":
            self._fill_by_heads(t)
        else:
            for r in self.replicas:
                while r.sched.queue and self._room(r) and self._dispatch(r, t):
                    pass

    def _preempt(self, r: _Replica, t: float) -> None:
        """As the single-engine gateway: when the replica has no room, its best waiting job
        may displace its worst running one (`Scheduler.preemption_victim`)."""
        sched = r.sched
        policy = sched.policy
        wanted = self.c.gateway_preemption and policy.preemptive and not self._room(r)
        if wanted or policy.revalidate_on_pop:
            self._sync(r, t)
        if not wanted:
            return
        for _ in range(len(sched.queue)):
            victim = sched.preemption_victim(t)
            if victim is None:
                break
            k, budget = self.held[victim.id]
            engine = self.engines[k]
            if victim.ctx not in engine.running and victim.ctx not in engine.waiting:
                break  # it finishes (or was dropped) in its engine's current step
            engine.abort(victim.ctx)
            del self.held[victim.id]
            budget.inflight -= 1
            sched.requeue(victim, t, preempted=True)
            self._dispatch(r, t)

    def _fill_in_turn(self, t: float) -> None:
        """`shared`: replicas with a backlog take free slots one at a time, in turn."""
        reps, n = self.replicas, len(self.replicas)
        while True:
            for k in range(n):
                r = reps[(self.next_grant + k) % n]
                if r.sched.queue and self._room(r):
                    break
            else:
                return
            if not self._dispatch(r, t):
                return
            self.next_grant = r.index + 1

    def _fill_by_heads(self, t: float) -> None:
        """`shared-heads`: each free slot goes to the replica whose head has the lowest key."""
        while True:
            best: tuple[tuple[Key, float, int], _Replica] | None = None
            for r in self.replicas:
                if not (r.sched.queue and self._room(r)):
                    continue
                head = r.sched.queue.peek(t)
                if head is None:
                    continue
                rank = (r.sched.queue.key_of(head), head.arrival_s, head.id)
                if best is None or rank < best[0]:
                    best = (rank, r)
            if best is None or not self._dispatch(best[1], t):
                return

    def _dispatch(self, r: _Replica, t: float) -> bool:
        """The replica's best waiting job onto the least-loaded backend it may use."""
        k = self._pick(r)
        if k is None:
            return False
        job = r.sched.dispatch(t)
        if job is None:
            return False
        if self.c.forward_priority:
            job.ctx.priority = r.sched.engine_priority(job, t)
        budget = r.budgets[k]
        assert budget is not None
        budget.inflight += 1
        self.held[job.id] = (k, budget)
        self.engines[k].add(job.ctx)
        self.peak = max(self.peak, sum(b.inflight for b in self.per_backend[k]))
        return True

    @staticmethod
    def _pick(r: _Replica) -> int | None:
        best, best_load = None, math.inf
        for k, b in enumerate(r.budgets):
            if b is not None and b.room() and b.load() < best_load:
                best, best_load = k, b.load()
        return best

    def _sync(self, r: _Replica, t: float) -> None:
        """Report tokens generated since the last report to the replica's scheduler."""
        for job in list(r.sched.running.values()):
            delta = job.ctx.generated - job.generated
            if delta > 0:
                r.sched.progress(job, delta, t)

    # -- settling ---------------------------------------------------------------------------

    def _settle(self, seq: Seq, t: float, *, dropped: bool, released: bool = False) -> None:
        job = seq.job
        sched = self.owner[job.id].sched
        held = self.held.pop(job.id, None)
        if held is not None:
            held[1].inflight -= 1
            held[1].released += released
            delta = seq.generated - job.generated
            if delta > 0:
                sched.progress(job, delta, t)
        sched.finish(job, t)
        rec = self.records[job.id]
        rec.first_token_s = seq.first_token_s
        rec.tokens = seq.generated
        rec.preemptions = job.preemptions + seq.preemptions
        rec.dropped = dropped
        if not dropped:
            rec.finish_s = t

    def _cut_off(self, t: float) -> None:
        """End of the drain: whatever is left is dropped (a step still under way included)."""
        for k, engine in enumerate(self.engines):
            res, self.pending[k] = self.pending[k], None
            for seq in [] if res is None else res.dropped + res.finished:
                self._settle(seq, t, dropped=True)
            for seq in list(engine.running) + list(engine.waiting):
                engine.abort(seq)
                self._settle(seq, t, dropped=True)
        for r in self.replicas:
            for job in list(r.sched.queue):
                self._settle(job.ctx, t, dropped=True)


def simulate_replicas(
    requests: Sequence[TraceRequest],
    contender: Contender | str,
    profile: LatencyProfile | str = "lssp-constant",
    setup: Replicas = Replicas(),
    *,
    belief_sigma: float = 0.2,
    beliefs: Sequence[LengthDist] | None = None,
    rank_scores: Sequence[float] | None = None,
) -> SimResult:
    """Run `requests` (times on the run's clock) through `setup.count` gateway replicas of one
    contender in front of `setup.backends` engines. Predictions as in `simulate`. `extra`
    holds `engine_preemptions` (all engines), `inflight_peak` (most requests in flight on one
    backend at once: above the cap means over-admission) and, with a self-tuning cap,
    `cap_mean` (a backend's total cap over its budgets, averaged over the samples)."""
    c = resolve(contender) if isinstance(contender, str) else contender
    prof = make_profile(profile) if isinstance(profile, str) else profile
    if beliefs is not None and len(beliefs) != len(requests):
        raise ValueError("beliefs must hold one distribution per request")
    if rank_scores is not None and len(rank_scores) != len(requests):
        raise ValueError("rank_scores must hold one score per request")
    wall = time.perf_counter()
    run = _ReplicaRun(requests, c, prof, setup, belief_sigma, beliefs, rank_scores)
    end = run.run()
    return SimResult(
        c.name,
        prof.name,
        run.records,
        sum(e.iterations for e in run.engines),
        run.steps,
        time.perf_counter() - wall,
        False,
        end,
        {
            "engine_preemptions": float(sum(e.preemptions for e in run.engines)),
            "inflight_peak": float(run.peak),
            **({"cap_mean": float(np.mean(run.caps))} if run.caps else {}),
        },
    )


__all__ = ["ADMISSIONS", "BALANCINGS", "Admission", "Balancing", "Replicas", "simulate_replicas"]
