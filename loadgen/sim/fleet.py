"""A fleet: one gateway queue and a router in front of B engines with prefix caching.

`simulate_fleet(requests, policy, router, fleet)` runs a workload through one
`policies.Scheduler` (the gateway's queue: any policy) and one `policies.routing.Router` in
front of `fleet.backends` engine models, in virtual time. It is the loop `bench/slot_choice.py`
built for the slot-choice benchmark, made reusable for the routing study (docs/routing.md):

- a job is handed out while some backend has room (`in flight < fleet.cap`). When exactly one
  backend has room and `fleet.slot_first` is set, the scheduler picks the waiting job best
  *there* (`Scheduler.dispatch_for`, its prefix read from the router's index); otherwise the
  best job goes where `Router.pick` says. `Router.on_route` then records it and the job joins
  that engine's waiting queue; `Router.on_finish` when it leaves;
- the router sees each backend as a `BackendState` refreshed from its engine model at every
  step end and every send: in flight (the gateway's count), cap, the engine's waiting queue,
  KV use, KV blocks. The engine's own cache is not shown to the router (`index` None), so
  prefix routers match against what they sent (llm-d's approximate mode), unless
  `fleet.precise` (then `index` reads the engine's cache: llm-d's precise mode);
- session turns (`TraceRequest.think_s`) are released `think_s` after the previous turn's last
  token, as `simulate` does, with the engine chains of `simulator.engine_chains` (a turn's
  answer is cached where it was generated);
- the hit ratio is the engines' own counters (vLLM's `prefix_cache_hits / queries`, tokens).

Time. Each engine steps on its own clock; a step's result is settled when the global clock
reaches its end (ties: arrivals first, then engines in order). A job sent to a busy engine
joins its queue for its next iteration. A step never jumps past the next known arrival, nor
past the shortest think time of the workload from its start, so no released turn can fall
inside a step that started before it was released. A completion frees a slot only on its own
backend, so the only job that can be sent to a busy engine is one sent at an arrival, and it
waits at most one iteration. No gateway preemption; the run goes on until every request has
finished (no drain cut-off), so every record completes unless a prompt can never fit.
"""

from __future__ import annotations

import functools
import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from loadgen.engine.configs import EngineConfig, engine_config
from loadgen.engine.model import Engine, Seq, StepResult
from loadgen.engine.profiles import make_profile
from loadgen.metrics import RequestRecord, ttft, ttlt
from loadgen.schema import TraceRequest
from loadgen.sim.simulator import belief, engine_chains, follow_ups, snap_to_grid
from policies.base import Policy
from policies.dist import LengthDist
from policies.job import Job
from policies.registry import parse_policy
from policies.routing import BackendState, PrefixRouter, Router, parse_router
from policies.scheduler import Scheduler

__all__ = ["Fleet", "FleetResult", "fleet_jobs", "lru_hit_ratio", "simulate_fleet"]


@dataclass(frozen=True, slots=True)
class Fleet:
    """B identical backends and what the gateway lets into each."""

    backends: int = 4
    """Number of engines (B)."""
    engine: EngineConfig = field(default_factory=lambda: engine_config("h200-llama3-8b"))
    """Each engine's batching rules and KV (prefix caching as the config says)."""
    profile: str = "h200-llama3-8b"
    """Latency profile name (iteration times)."""
    cap: int = 32
    """The gateway's in-flight cap per backend (requests)."""
    slot_first: bool = True
    """A slot that frees alone goes to the waiting job best there (`Scheduler.dispatch_for`)."""
    engine_waiting: bool = True
    """Show routers each engine's waiting count (False: None, as if unscraped)."""
    precise: bool = False
    """Show prefix routers each engine's real cache (`BackendState.index`, llm-d's "precise"
    mode, vLLM's KV events) instead of their own record of what they sent."""

    def __post_init__(self) -> None:
        if self.backends < 1 or self.cap < 1:
            raise ValueError("a fleet needs at least one backend and a positive cap")

    @property
    def kv_tokens(self) -> int:
        """KV of the whole fleet (tokens)."""
        return self.backends * self.engine.kv_tokens


@dataclass(slots=True)
class FleetResult:
    """The records of one fleet run and the engines' counters."""

    router: str
    policy: str
    records: list[RequestRecord]
    prefix_cache_queries: int
    """Prompt tokens looked up, summed over the engines (vLLM's counter)."""
    prefix_cache_hits: int
    """Of those, tokens found cached."""
    routed: list[int]
    """Requests sent to each backend."""
    end_s: float
    steps: int
    wall_s: float
    saturated_s: float = 0.0
    """Virtual time during which jobs waited in the gateway queue."""
    saturated_done: int = 0
    """Requests that finished while jobs waited in the gateway queue."""

    @property
    def hit_ratio(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else math.nan

    def summary(self) -> dict[str, float]:
        """Mean and p99 TTFT, mean TTLT (s), hit ratio, throughput (req/s over the makespan),
        imbalance (the busiest backend's share of requests over the mean share)."""
        first, last = ttft(self.records), ttlt(self.records)
        done = [r for r in self.records if r.completed]
        span = max((r.finish_s or 0.0 for r in done), default=0.0) - min(
            (r.arrival_s for r in self.records), default=0.0
        )
        return {
            "ttft_mean": float(np.mean(first)) if first else math.nan,
            "ttft_p99": float(np.percentile(first, 99)) if first else math.nan,
            "ttlt_mean": float(np.mean(last)) if last else math.nan,
            "hit": self.hit_ratio,
            "throughput": len(done) / span if span > 0 else math.nan,
            "completed": float(len(done)),
            "imbalance": max(self.routed) / (sum(self.routed) / len(self.routed))
            if sum(self.routed)
            else math.nan,
            "saturated_throughput": (
                self.saturated_done / self.saturated_s if self.saturated_s > 0 else math.nan
            ),
        }


def fleet_jobs(
    requests: Sequence[TraceRequest],
    sigma: float = 0.2,
    beliefs: Sequence[LengthDist] | None = None,
) -> tuple[list[Job], list[RequestRecord]]:
    """One `Job` (prefix, block size, session, predicted `dist`, engine `Seq` in `ctx`) and
    one record per request. Every job carries a prediction, whatever the queue, because
    routers read it too: `beliefs[i]`, or a log-normal of σ `sigma` around the request's
    frozen prediction (its true length when it has none), as `simulate` builds them."""
    if beliefs is not None and len(beliefs) != len(requests):
        raise ValueError("beliefs must hold one distribution per request")
    chains = engine_chains(requests)
    jobs, records = [], []
    for i, r in enumerate(requests):
        out = max(1, r.output_tokens)
        pred = float(r.predicted_output_tokens or out)
        job = Job(i, r.arrival_s, r.prompt_tokens, deadline_s=r.deadline_s, priority=r.priority)
        job.tenant = r.tenant or job.tenant
        job.prefix, job.block_tokens, job.session = r.block_hashes, r.block_tokens, r.session
        job.dist = belief(pred, sigma) if beliefs is None else beliefs[i]
        job.true_output_tokens = out
        job.ctx = Seq(job, out, pred, hashes=chains[i], hash_tokens=r.block_tokens)
        jobs.append(job)
        records.append(
            RequestRecord(i, r.arrival_s, r.prompt_tokens, out, r.deadline_s, tenant=job.tenant)
        )
    return jobs, records


class _EngineIndex:
    """An engine's prefix cache as a router's `PrefixLookup` (what vLLM's KV events tell)."""

    __slots__ = ("engine",)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def match(self, prefix: Sequence[int]) -> int:
        cache = self.engine.cache
        if cache is None:
            return 0
        n = 0
        for h in prefix:
            if h not in cache.refs:
                break
            n += 1
        return n


class _FleetRun:
    """State of one fleet simulation; `run()` is the loop."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        policy: Policy,
        router: Router,
        fleet: Fleet,
        sigma: float,
        beliefs: Sequence[LengthDist] | None,
    ) -> None:
        self.fleet = fleet
        self.profile = make_profile(fleet.profile)
        cost = self.profile.cost_profile(min(fleet.cap, fleet.engine.max_seqs))
        if policy.holds_starts:
            raise ValueError(
                "engine shares and TPOT objectives (bands:engine_shares, tpot_slos) run in the "
                "gateway and the single-engine simulator; this fleet simulator does not apply them"
            )
        self.sched = Scheduler(policy, cost)
        self.router = router.on_engine(cost).fresh()
        self.engines = [Engine(fleet.engine, self.profile) for _ in range(fleet.backends)]
        self.states = [
            BackendState(
                f"b{i}",
                0,
                fleet.cap,
                kv_blocks=fleet.engine.kv_blocks,
                block_tokens=fleet.engine.block_tokens,
                index=_EngineIndex(e) if fleet.precise else None,
            )
            for i, e in enumerate(self.engines)
        ]
        self.ends = [math.inf] * fleet.backends
        """End time of each engine's step in progress (inf: idle)."""
        self.results: list[StepResult | None] = [None] * fleet.backends
        self.routed = [0] * fleet.backends
        self.jobs, self.records = fleet_jobs(requests, sigma, beliefs)
        self.follow = follow_ups(requests)
        held = {nxt for nxt, _ in self.follow.values()}
        self.pending = [(j.arrival_s, j.id, j) for j in self.jobs if j.id not in held]
        heapq.heapify(self.pending)
        self.min_think_s = min((think for _, think in self.follow.values()), default=math.inf)
        self.steps = 0
        self.saturated_s = 0.0
        self.saturated_done = 0

    def run(self) -> float:
        """Simulate until every request has finished; returns the end time."""
        t = 0.0
        pending, ends = self.pending, self.ends
        while pending or any(math.isfinite(e) for e in ends):
            k = min(range(len(ends)), key=ends.__getitem__)
            nxt = min(pending[0][0] if pending else math.inf, ends[k])
            if self.sched.queue:
                self.saturated_s += nxt - t
            t = nxt
            if pending and pending[0][0] <= ends[k]:
                while pending and pending[0][0] <= t:
                    arrival, _, job = heapq.heappop(pending)
                    self.sched.admit(job, arrival)
            else:
                self._settle(k, t)
            self._fill(t)
            self._start(t)
        return t

    def _start(self, t: float) -> None:
        """Every idle engine with work starts a step at `t`."""
        horizon = min(self.pending[0][0] if self.pending else math.inf, t + self.min_think_s)
        for k, engine in enumerate(self.engines):
            if self.ends[k] == math.inf and len(engine):
                res = engine.step(t, max(horizon - t, 0.0))
                self.steps += 1
                self.results[k] = res
                self.ends[k] = snap_to_grid(self.profile.grid_s, t + res.dt_s)

    def _settle(self, k: int, t: float) -> None:
        """Engine k's step ended at `t`: finished requests leave, their next turns released."""
        res = self.results[k]
        self.ends[k], self.results[k] = math.inf, None
        assert res is not None
        saturated = bool(self.sched.queue)
        for seq in res.finished + res.dropped:
            job = seq.job
            delta = seq.generated - job.generated
            if delta > 0 and job.id in self.sched.running:
                self.sched.progress(job, delta, t)
            self.sched.finish(job, t)
            self.router.on_finish(job, self.states[k])
            self.states[k].inflight -= 1
            rec = self.records[job.id]
            rec.first_token_s, rec.tokens = seq.first_token_s, seq.generated
            rec.preemptions = seq.preemptions
            rec.dropped = seq in res.dropped
            rec.finish_s = None if rec.dropped else seq.last_token_s
            self.saturated_done += saturated and not rec.dropped
            nxt = self.follow.pop(job.id, None)
            if nxt is not None:
                self._release(nxt[0], t + nxt[1])
        self._scrape(k)

    def _release(self, job_id: int, arrival_s: float) -> None:
        """A session's next turn arrives `think_s` after its previous one ended."""
        job = self.jobs[job_id]
        job.arrival_s = self.records[job_id].arrival_s = arrival_s
        heapq.heappush(self.pending, (arrival_s, job_id, job))

    def _fill(self, t: float) -> None:
        """Hand out free slots while jobs wait (module docstring)."""
        sched, states = self.sched, self.states
        while sched.queue:
            free = [b for b in states if b.has_room]
            if not free:
                return
            b: BackendState | None
            if self.fleet.slot_first and len(free) == 1:
                b = free[0]
                job = sched.dispatch_for(t, functools.partial(self._cached, b=b))
            else:
                job = sched.dispatch(t)
                b = self.router.pick(job, states) if job is not None else None
            if job is None or b is None:
                raise RuntimeError("a backend had room but no job or backend was handed out")
            self.router.on_route(job, b)
            self._send(job, states.index(b))

    def _cached(self, job: Job, b: BackendState) -> int:
        router = self.router
        if not isinstance(router, PrefixRouter) or not job.prefix:
            return 0
        return min(router.cached_blocks(job, b) * job.block_tokens, job.prompt_tokens)

    def _send(self, job: Job, k: int) -> None:
        self.engines[k].add(job.ctx)
        self.states[k].inflight += 1
        self.routed[k] += 1
        self._scrape(k)

    def _scrape(self, k: int) -> None:
        """Backend k's state as a router reads vLLM's metrics (fresh at every event)."""
        e, b = self.engines[k], self.states[k]
        b.waiting = len(e.waiting) if self.fleet.engine_waiting else None
        b.kv_usage = e.kv_fraction()


def simulate_fleet(
    requests: Sequence[TraceRequest],
    policy: Policy | str,
    router: Router | str,
    fleet: Fleet | None = None,
    *,
    belief_sigma: float = 0.2,
    beliefs: Sequence[LengthDist] | None = None,
) -> FleetResult:
    """Run `requests` (times on the run's clock) through one queue and one router in front of
    `fleet` (default: 4 × `h200-llama3-8b`, cap 32 each). Policy and router may be specs
    (`sagesched:cost=time`, `prefix:prefix_weight=2`); both are copied fresh for the run."""
    pol = parse_policy(policy) if isinstance(policy, str) else policy
    rt = parse_router(router) if isinstance(router, str) else router
    fl = fleet or Fleet()
    wall = time.perf_counter()
    run = _FleetRun(requests, pol, rt, fl, belief_sigma, beliefs)
    end = run.run()
    return FleetResult(
        rt.label(),
        pol.label(),
        run.records,
        sum(e.prefix_cache_queries for e in run.engines),
        sum(e.prefix_cache_hits for e in run.engines),
        run.routed,
        end,
        run.steps,
        time.perf_counter() - wall,
        run.saturated_s,
        run.saturated_done,
    )


def lru_hit_ratio(requests: Sequence[TraceRequest], capacity_tokens: float) -> float:
    """Prefix hit ratio (tokens, as vLLM counts) of one LRU cache of `capacity_tokens`.

    Requests in the order given (their `arrival_s` order for session turns: the open-loop
    estimate); each looks up its prompt's longest cached block prefix (at most prompt − 1
    tokens, as vLLM), then its whole engine chain (for a session turn, prompt and answer) is
    touched, head most recent, as vLLM frees a request's blocks tail first. Timing and the
    KV that running requests hold are ignored, so with `capacity_tokens` = the fleet's KV no
    router can do better (the capacity bound); `math.inf`: every reuse hits."""
    chains = engine_chains(requests)
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
    cache: OrderedDict[int, None] = OrderedDict()
    queries = hits = 0
    for i in order:
        r, chain = requests[i], chains[i]
        queries += r.prompt_tokens
        if not r.block_tokens:
            continue
        limit = (r.prompt_tokens - 1) // r.block_tokens
        n = 0
        for h in r.block_hashes[:limit]:
            if h not in cache:
                break
            n += 1
        hits += n * r.block_tokens
        room = capacity_tokens // r.block_tokens
        for h in reversed(chain):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > room:
            cache.popitem(last=False)
    return hits / queries if queries else math.nan
