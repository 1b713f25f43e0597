"""`simulate`: one workload through gateway + engine in virtual time.

The loop is short: deliver the arrivals due, let the gateway `Scheduler` hand out what the
in-flight cap allows (preempting when the policy says so), run one engine step (one iteration,
or several identical decode iterations up to the next arrival), then settle what finished.
Ties break on time, then on the fixed order arrivals → gateway → engine, then on request id.
A later turn of a session (`TraceRequest.think_s` set) is held back until the session's
previous request ends (last token, or dropped) and arrives `think_s` after that.
Nothing here is random: prediction beliefs are a deterministic function of the trace's frozen
prediction, so a run is a pure function of its inputs.
"""

from __future__ import annotations

import functools
import heapq
import math
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from loadgen.engine.configs import CONTINUOUS, EngineConfig, engine_config, engine_names
from loadgen.engine.model import Engine, Seq
from loadgen.engine.profiles import LatencyProfile, make_profile
from loadgen.metrics import DEADLINE_EPS_S, RequestRecord
from loadgen.schema import TraceRequest
from policies.base import Policy
from policies.capacity import CapController, CapLaw, EngineSample
from policies.dist import LengthDist
from policies.job import Job
from policies.registry import parse_policy, policy_names
from policies.scheduler import Scheduler
from policies.shares import EngineView, Start

ARRIVAL_EPS_S = 1e-9
"""An arrival within this of an iteration start is seen by that iteration."""
BELIEF_POINTS = 16
_Z = np.array([NormalDist().inv_cdf((i + 0.5) / BELIEF_POINTS) for i in range(BELIEF_POINTS)])


@dataclass(frozen=True, slots=True)
class Contender:
    """What runs: a gateway policy, an engine configuration and the gateway's in-flight cap."""

    name: str
    policy: Policy
    engine: EngineConfig
    inflight_cap: int | None
    """Most requests inside the engine at once (None: the gateway forwards everything)."""
    gateway_preemption: bool = True
    """Let a preemptive policy displace an in-flight request (aborted, requeued, resumed)."""
    cap_law: CapLaw | None = None
    """Tune the cap with `policies.capacity.CapController` (starting at `inflight_cap`),
    sampling the engine model's queue, KV use and token counter every `interval_s`."""
    forward_priority: bool = False
    """Send each request to the engine with its policy key at dispatch quantised to vLLM's
    integer priority (`Policy.engine_priority`); matters on an engine with priority scheduling."""
    cap_memory: dict[str, Any] | None = None
    """A previous run's `SimResult.cap_memory`: the self-tuning cap starts from that curve (a
    gateway restarted in front of a known engine), not cold."""


def contender_names() -> list[str]:
    """Queue-level policies and engine-level configurations, sorted (disjoint name sets)."""
    return sorted(set(policy_names()) | set(engine_names()) - {CONTINUOUS.name})


def resolve(spec: str, *, inflight_cap: int | None = -1) -> Contender:
    """A contender from a name: an engine configuration (with its own gateway policy and cap),
    or a `policies` spec run on the `continuous` engine with the gateway capped at its
    `max_seqs` (so the gateway holds the backlog). `inflight_cap` overrides the cap (None: no
    cap; -1: the default)."""
    if spec in engine_names() and spec != CONTINUOUS.name:
        cfg = engine_config(spec)
        cap = cfg.inflight_cap if inflight_cap == -1 else inflight_cap
        return Contender(spec, parse_policy(cfg.gateway), cfg, cap)
    policy = parse_policy(spec)
    cap = CONTINUOUS.max_seqs if inflight_cap == -1 else inflight_cap
    return Contender(policy.label(), policy, CONTINUOUS, cap)


@dataclass(slots=True)
class SimResult:
    """The records of one run plus run-level facts."""

    contender: str
    profile: str
    records: list[RequestRecord]
    iterations: int
    engine_steps: int
    wall_s: float
    stopped_early: bool = False
    """The run stopped at `stop_after_violations` (records are then incomplete)."""
    end_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    cap_memory: dict[str, Any] | None = None
    """The self-tuning cap's curve at the end (`CapController.memory`), if it tuned."""


def engine_sample(e: Engine) -> EngineSample:
    """The engine model's state as the gateway reads vLLM's `/metrics`."""
    return EngineSample(
        waiting=float(len(e.waiting)),
        kv_usage=e.kv_fraction(),
        generation_tokens=float(e.generated_tokens),
        running=float(len(e.running)),
        prompt_tokens=float(e.prompt_tokens),
        iterations=float(e.iterations),
        kv_capacity_tokens=float(e.cfg.kv_tokens),
        token_gap_s=e.token_gap_s,
        token_gaps=float(e.token_gaps),
    )


@functools.lru_cache(maxsize=4096)
def belief(predicted: float, sigma: float) -> LengthDist:
    """Log-normal belief (σ = `sigma`) centred on a frozen prediction, 16 equal-mass points.

    Cached: `LengthDist` is immutable, so jobs with the same prediction share one object."""
    if sigma <= 0:
        return LengthDist.point(predicted)
    return LengthDist.from_samples(np.maximum(predicted * np.exp(sigma * _Z), 1.0))


def _jobs(
    requests: Sequence[TraceRequest],
    policy: Policy,
    sigma: float,
    beliefs: Sequence[LengthDist] | None = None,
    rank_scores: Sequence[float] | None = None,
) -> tuple[list[Job], list[RequestRecord]]:
    jobs, records = [], []
    chains = engine_chains(requests)
    for i, r in enumerate(requests):
        out = max(1, r.output_tokens)
        pred = float(r.predicted_output_tokens or out)
        job = Job(i, r.arrival_s, r.prompt_tokens, deadline_s=r.deadline_s, priority=r.priority)
        job.tenant = r.tenant or job.tenant
        if policy.needs_prediction:
            job.dist = belief(pred, sigma) if beliefs is None else beliefs[i]
            job.rank_score = None if rank_scores is None else rank_scores[i]
        if policy.needs_oracle:
            job.true_output_tokens = out
        job.ctx = Seq(job, out, pred, hashes=chains[i], hash_tokens=r.block_tokens)
        jobs.append(job)
        records.append(
            RequestRecord(i, r.arrival_s, r.prompt_tokens, out, r.deadline_s, tenant=job.tenant)
        )
    return jobs, records


def engine_chains(requests: Sequence[TraceRequest]) -> list[tuple[int, ...]]:
    """Each request's hash chain for the engine model: its prompt's, and for a session turn
    whose next turn re-sends it (the next chain starts with this one, same block size) also
    the blocks of its answer, taken from the next turn's chain: the next turn's prompt is this
    prompt followed by this answer, as the model generated it, so the engine caches those
    blocks when it generates them (vLLM caches decode blocks too)."""
    chains = [r.block_hashes for r in requests]
    for i, (j, _) in follow_ups(requests).items():
        r, nxt = requests[i], requests[j]
        n = len(r.block_hashes)
        same_size = r.block_tokens and nxt.block_tokens == r.block_tokens
        if same_size and nxt.block_hashes[:n] == r.block_hashes:
            upto = (r.prompt_tokens + r.output_tokens) // r.block_tokens
            chains[i] = nxt.block_hashes[: max(n, upto)]
    return chains


def follow_ups(requests: Sequence[TraceRequest]) -> dict[int, tuple[int, float]]:
    """Index of a request → (index of the session's next turn, its think time in seconds),
    for every later turn (`think_s` set): it follows the previous request of its session."""
    last: dict[str, int] = {}
    out: dict[int, tuple[int, float]] = {}
    for i, r in enumerate(requests):
        if r.think_s is not None:
            prev = last.get(r.session) if r.session is not None else None
            if prev is None:
                raise ValueError(f"request {i} follows a turn but its session has none before")
            out[prev] = (i, r.think_s)
        if r.session is not None:
            last[r.session] = i
    return out


class _Run:
    """State of one simulation; `run()` is the loop."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        contender: Contender,
        profile: LatencyProfile,
        sigma: float,
        stop_after: int | None,
        beliefs: Sequence[LengthDist] | None = None,
        rank_scores: Sequence[float] | None = None,
    ) -> None:
        self.c = contender
        self.profile = profile
        batch = min(contender.inflight_cap or contender.engine.max_seqs, contender.engine.max_seqs)
        self.sched = Scheduler(contender.policy, profile.cost_profile(batch))
        self.engine = Engine(contender.engine, profile)
        self.jobs, self.records = _jobs(requests, self.sched.policy, sigma, beliefs, rank_scores)
        self.follow = follow_ups(requests)
        """Job id → (the session's next job id, think time s), until that turn is released."""
        held = {nxt for nxt, _ in self.follow.values()}
        self.pending = [(j.arrival_s, j.id, j) for j in self.jobs if j.id not in held]
        """Arrivals not yet delivered, a heap on (arrival s, id)."""
        heapq.heapify(self.pending)
        self.last_arrival_s = max((a for a, _, _ in self.pending), default=0.0)
        self.stop_after = stop_after
        self.violations = 0
        self.steps = 0
        law = contender.cap_law
        self.ctl = (
            None
            if law is None
            else CapController(law, contender.inflight_cap or 1, memory=contender.cap_memory)
        )
        self.next_sample = math.inf if self.ctl is None else self.ctl.interval_s
        self.caps: list[int] = []
        """The tuned cap after every sample."""
        self.released = 0
        """Sequences that left the engine (finished or dropped): the cap's turnover count."""

    def run(self) -> tuple[float, bool]:
        """Simulate to the end (or the violation limit). Returns (end time, stopped early)."""
        engine, pending = self.engine, self.pending
        t = 0.0
        while True:
            changed = False
            while pending and pending[0][0] <= t + ARRIVAL_EPS_S:
                arrival, _, job = heapq.heappop(pending)
                self.sched.admit(job, arrival)
                changed = True
            if changed or (self.sched.queue and self._room()):
                self._gateway(t)
            drain_end = self.last_arrival_s + self.c.engine.drain_s
            if not pending and t >= drain_end - ARRIVAL_EPS_S:
                break
            if not engine:
                if not pending:
                    break
                t = max(t, align_to_grid(self.profile.grid_s, pending[0][0]))
                continue
            horizon = min(pending[0][0] if pending else drain_end, self.next_sample) - t
            res = engine.step(t, horizon)
            self.steps += 1
            t = snap_to_grid(self.profile.grid_s, t + res.dt_s)
            if t >= self.next_sample:
                self._sample(t)
            self.released += len(res.dropped) + len(res.finished)
            for seq in res.dropped:
                self._settle(seq, t, dropped=True)
            for seq in res.finished:
                self._settle(seq, seq.last_token_s, dropped=False)
            if self.stop_after is not None and self.violations >= self.stop_after:
                return t, True
        self._cut_off(t)
        return t, False

    def _room(self) -> bool:
        cap = self.c.inflight_cap if self.ctl is None else self.ctl.cap
        return cap is None or len(self.sched.running) < cap

    def _sample(self, t: float) -> None:
        """The cap controller reads the engine model as the gateway reads vLLM's /metrics."""
        assert self.ctl is not None
        sample = engine_sample(self.engine)
        self.caps.append(self.ctl.observe(t, sample, len(self.sched.running)))
        while self.next_sample <= t:  # one reading after an idle gap, as a scrape would see
            self.next_sample += self.ctl.interval_s

    def _gateway(self, t: float) -> None:
        """Preempt if the policy wants to, then fill the engine up to the cap."""
        sched, engine = self.sched, self.engine
        policy = sched.policy
        victims_wanted = self.c.gateway_preemption and policy.preemptive and not self._room()
        if victims_wanted or policy.revalidate_on_pop:
            # running keys (review points) matter only for a victim search, and shared
            # counters only for policies that declare their waiting keys may move
            self._sync(t)
        if victims_wanted:
            for _ in range(len(sched.queue)):
                victim = sched.preemption_victim(t)
                if victim is None:
                    break
                engine.abort(victim.ctx)
                sched.requeue(victim, t, preempted=True)
                self._dispatch(t)
        if not sched.policy.holds_starts:
            while sched.queue and self._room():
                self._dispatch(t)
            return
        held: set[int] = set()  # bands the start rule holds (engine shares)
        while self._room() and (job := sched.peek(t, held)) is not None:
            if sched.start_rule(job, self._view(), t) is Start.HELD:
                held.add(job.priority)
            else:
                self._dispatch(t, held)

    def _view(self) -> EngineView:
        """The engine as the start rule sees it: its running jobs, the cap, and its iteration
        time at a batch of B at the recent mix, as the gateway's fitted curve reads it: the
        running jobs' mean context, and each running request's share of the prefill (the
        prompt tokens the engine computed per output token it generated, so far)."""
        running = list(self.sched.running.values())
        context = sum(j.prompt_tokens + j.ctx.generated for j in running) // max(1, len(running))
        cap = self.c.inflight_cap if self.ctl is None else self.ctl.cap
        e, profile = self.engine, self.profile
        prefill = e.prompt_tokens / max(1, e.generated_tokens)
        return EngineView(
            running,
            cap or self.c.engine.max_seqs,
            lambda b: profile.iteration_s(b, b * context, round(b * prefill)),
            float(self.c.engine.kv_tokens),
        )

    def _dispatch(self, t: float, held: AbstractSet[int] = frozenset()) -> None:
        job = self.sched.dispatch(t, held)
        if job is not None:
            if self.c.forward_priority:
                job.ctx.priority = self.sched.engine_priority(job, t)
            self.engine.add(job.ctx)

    def _sync(self, t: float) -> None:
        """Report tokens generated since the last report to the scheduler (review points)."""
        for job in list(self.sched.running.values()):
            delta = job.ctx.generated - job.generated
            if delta > 0:
                self.sched.progress(job, delta, t)

    def _settle(self, seq: Seq, t: float, *, dropped: bool) -> None:
        job = seq.job
        self._sync_one(job, t)
        self.sched.finish(job, t)
        rec = self.records[job.id]
        rec.first_token_s = seq.first_token_s
        rec.tokens = seq.generated
        rec.preemptions = job.preemptions + seq.preemptions
        rec.dropped = dropped
        if not dropped:
            rec.finish_s = t
        if not rec.met_slo():
            self.violations += 1
        nxt = self.follow.pop(job.id, None)
        if nxt is not None:
            self._release(nxt[0], t + nxt[1])

    def _release(self, job_id: int, arrival_s: float) -> None:
        """A session's next turn arrives `think_s` after its previous one ended."""
        job = self.jobs[job_id]
        job.arrival_s = self.records[job_id].arrival_s = arrival_s
        heapq.heappush(self.pending, (arrival_s, job_id, job))
        self.last_arrival_s = max(self.last_arrival_s, arrival_s)

    def _sync_one(self, job: Job, t: float) -> None:
        delta = job.ctx.generated - job.generated
        if delta > 0 and job.id in self.sched.running:
            self.sched.progress(job, delta, t)

    def _cut_off(self, t: float) -> None:
        """End of the drain: whatever is left is dropped."""
        for seq in list(self.engine.running) + list(self.engine.waiting):
            self.engine.abort(seq)
            self._settle(seq, t, dropped=True)
        for job in list(self.sched.queue):
            self._settle(job.ctx, t, dropped=True)
        while self.pending:  # turns released by the drops above never arrive
            _, job_id, _ = heapq.heappop(self.pending)
            self.records[job_id].dropped = True
            self.violations += not self.records[job_id].met_slo()
            nxt = self.follow.pop(job_id, None)
            if nxt is not None:
                self._release(nxt[0], t + nxt[1])


def simulate(
    requests: Sequence[TraceRequest],
    contender: Contender | str,
    profile: LatencyProfile | str = "lssp-constant",
    *,
    belief_sigma: float = 0.2,
    stop_after_violations: int | None = None,
    beliefs: Sequence[LengthDist] | None = None,
    rank_scores: Sequence[float] | None = None,
) -> SimResult:
    """Run `requests` (times on the run's clock, already compressed) through one contender.

    Prediction-driven policies get a log-normal belief of σ = `belief_sigma` around each
    request's frozen `predicted_output_tokens` (the true length when there is none); oracle
    policies get the true length. With `stop_after_violations`, the run stops as soon as that
    many requests have missed their deadline (used by the knee search). `beliefs`, one per
    request in order, replaces the log-normal belief with a predictor's own distributions;
    `rank_scores`, one per request, become `Job.rank_score` (the `ltr` policy's ranking model).
    """
    if beliefs is not None and len(beliefs) != len(requests):
        raise ValueError("beliefs must hold one distribution per request")
    if rank_scores is not None and len(rank_scores) != len(requests):
        raise ValueError("rank_scores must hold one score per request")
    c = resolve(contender) if isinstance(contender, str) else contender
    prof = make_profile(profile) if isinstance(profile, str) else profile
    wall = time.perf_counter()
    run = _Run(requests, c, prof, belief_sigma, stop_after_violations, beliefs, rank_scores)
    end, stopped = run.run()
    return SimResult(
        c.name,
        prof.name,
        run.records,
        run.engine.iterations,
        run.steps,
        time.perf_counter() - wall,
        stopped,
        end,
        {
            "engine_preemptions": float(run.engine.preemptions),
            **({"cap_mean": float(np.mean(run.caps))} if run.caps else {}),
            **(_prefix_counters(run.engine) if any(r.block_tokens for r in requests) else {}),
        },
        None if run.ctl is None else run.ctl.memory(),
    )


__all__ = ["DEADLINE_EPS_S", "Contender", "SimResult", "belief", "resolve", "simulate"]


def _prefix_counters(engine: Engine) -> dict[str, float]:
    """The engine's prefix-cache counters (tokens), for workloads that carry block hashes."""
    return {
        "prefix_cache_queries": float(engine.prefix_cache_queries),
        "prefix_cache_hits": float(engine.prefix_cache_hits),
    }


def align_to_grid(grid: float | None, t: float) -> float:
    """The first grid point at or after `t` (profiles that step on a fixed grid)."""
    return t if grid is None else math.ceil(t / grid - 1e-6) * grid


def snap_to_grid(grid: float | None, t: float) -> float:
    """The grid point nearest `t` (no grid: `t`)."""
    return t if grid is None else round(t / grid) * grid
