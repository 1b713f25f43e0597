"""Who goes where a slot frees (issue 29 part 4), measured on a simulated fleet with prefix
caching: "best job first, then best backend" against `Scheduler.dispatch_for`.

Needs the engine model's prefix cache (issue 29 part 2, `Seq.hashes`). Run:
`python bench/slot_choice.py` (defaults: 4 `h200-llama3-8b` backends with 870,000 KV tokens,
chunked prefill, cap 32 per backend, a synthetic multi-turn workload). Both arms keep the same
SageSched queue (`cost=time`) and the same router; they differ only in who takes a free slot:

- `job-first`: `Scheduler.dispatch` hands out the best waiting job, the router places it;
- `slot-first`: when one backend has room (a slot freed, the usual case under load)
  `dispatch_for` hands out the waiting job best *there*, its prefix read from the router's
  index; when several have room the router places the best job, as in `job-first`.

Workload: sessions of 2-8 turns sharing one of 20 system prompts (1,000-3,000 tokens); a turn
re-sends the conversation so far plus 50-400 new tokens; turns arrive in order, a session's
next turn 1-20 s after its previous one arrives (open loop); outputs log-normal, predicted by a
noisy oracle. Reports mean TTFT and TTLT, the fleet's prefix hit ratio and throughput.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

import numpy as np

from loadgen.engine.configs import engine_config
from loadgen.engine.model import Engine, Seq
from loadgen.engine.profiles import make_profile
from policies import Job, LengthDist, Scheduler, parse_policy
from policies.routing import BackendState, PrefixRouter, Router, parse_router

BLOCK = 16


def workload(n_sessions: int, rate: float, seed: int) -> list[Job]:
    """Multi-turn sessions; chained hashes of 16-token blocks; open-loop arrivals."""
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    systems = [tuple(rng.getrandbits(62) for _ in range(rng.randint(60, 190))) for _ in range(20)]
    jobs: list[Job] = []
    t = 0.0
    for s in range(n_sessions):
        t += rng.expovariate(rate)
        chain = systems[rng.randrange(len(systems))]
        at = t
        for _ in range(rng.randint(2, 8)):
            chain = chain + tuple(rng.getrandbits(62) for _ in range(rng.randint(3, 25)))
            true = max(1, int(nprng.lognormal(5.0, 0.9)))
            jobs.append(
                Job(
                    id=len(jobs),
                    arrival_s=at,
                    prompt_tokens=len(chain) * BLOCK,
                    prefix=chain,
                    block_tokens=BLOCK,
                    session=f"s{s}",
                    dist=LengthDist.noisy_oracle(true, 0.5, nprng),
                    true_output_tokens=true,
                    max_tokens=4096,
                )
            )
            chain = chain + tuple(rng.getrandbits(62) for _ in range(true // BLOCK))
            at += rng.uniform(1.0, 20.0)
    jobs.sort(key=lambda j: (j.arrival_s, j.id))
    for i, j in enumerate(jobs):
        j.id = i
    return jobs


@dataclass
class Result:
    ttft: float
    ttlt: float
    hit: float
    throughput: float


class Fleet:
    """B engines behind one `Scheduler` and one router, in virtual time."""

    def __init__(self, args: argparse.Namespace, router: Router, slot_first: bool) -> None:
        profile = make_profile(args.profile)
        cfg = engine_config("vllm-chunked-prefill").with_(
            kv_tokens=args.kv_tokens, max_seqs=max(args.cap, 64)
        )
        self.engines = [Engine(cfg, profile) for _ in range(args.backends)]
        cost = profile.cost_profile(args.cap)
        self.sched = Scheduler(parse_policy(args.policy), cost)
        self.router = router.on_engine(cost).fresh()
        self.states = [
            BackendState(f"b{i}", 0, args.cap, kv_blocks=cfg.kv_blocks, block_tokens=BLOCK)
            for i in range(args.backends)
        ]
        self.busy_until = [float("inf")] * args.backends
        self.slot_first = slot_first
        self.where: dict[int, int] = {}

    def fill(self, t: float) -> None:
        """Hand out free slots while jobs wait."""
        while self.sched.queue and any(b.has_room for b in self.states):
            free = [b for b in self.states if b.has_room]
            if self.slot_first and len(free) == 1:  # one slot: the job best there
                b = free[0]
                job = self.sched.dispatch_for(t, lambda j, b=b: self._cached(j, b))
            else:  # several free slots (or job-first): the best job, placed by the router
                job = self.sched.dispatch(t)
                b = self.router.pick(job, self.states) if job is not None else None
            assert job is not None and b is not None
            self.router.on_route(job, b)
            k = self.states.index(b)
            self._send(job, k, t)

    def _cached(self, job: Job, b: BackendState) -> int:
        router = self.router
        if not isinstance(router, PrefixRouter):
            return 0
        return min(router.cached_blocks(job, b) * job.block_tokens, job.prompt_tokens)

    def _send(self, job: Job, k: int, t: float) -> None:
        seq = Seq(job, job.true_output_tokens or 1, job.predicted_tokens(), hashes=job.prefix,
                  hash_tokens=BLOCK)  # fmt: skip
        self.engines[k].add(seq)
        self.states[k].inflight += 1
        self.where[job.id] = k
        if self.busy_until[k] == float("inf"):
            self.busy_until[k] = t

    def run(self, jobs: list[Job]) -> Result:
        t, i = 0.0, 0
        done: list[tuple[Job, float, float]] = []
        while i < len(jobs) or any(len(e) for e in self.engines):
            next_arrival = jobs[i].arrival_s if i < len(jobs) else float("inf")
            k = min(range(len(self.engines)), key=lambda k: self.busy_until[k])
            if next_arrival <= self.busy_until[k]:
                t = next_arrival
                self.sched.admit(jobs[i], t)
                i += 1
                self.fill(t)
                continue
            t = self.busy_until[k]
            res = self.engines[k].step(t, max(next_arrival - t, 0.0))
            end = t + res.dt_s
            for seq in res.finished:
                job = seq.job
                done.append((job, seq.first_token_s or end, end))
                self.sched.finish(job, end)
                self.router.on_finish(job, self.states[k])
                self.states[k].inflight -= 1
            self.busy_until[k] = end if len(self.engines[k]) else float("inf")
            self._scrape(k)
            self.fill(end)
        queries = sum(e.prefix_cache_queries for e in self.engines)
        hits = sum(e.prefix_cache_hits for e in self.engines)
        span = max(f for _, _, f in done) - jobs[0].arrival_s
        return Result(
            statistics.fmean(ft - j.arrival_s for j, ft, _ in done),
            statistics.fmean(f - j.arrival_s for j, _, f in done),
            hits / queries if queries else 0.0,
            len(done) / span,
        )

    def _scrape(self, k: int) -> None:
        e, b = self.engines[k], self.states[k]
        b.waiting = len(e.waiting)
        b.kv_usage = e.kv_fraction()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", type=int, default=4)
    parser.add_argument("--cap", type=int, default=32)
    parser.add_argument("--kv-tokens", type=int, default=870_000)
    parser.add_argument("--profile", default="h200-llama3-8b")
    parser.add_argument("--policy", default="sagesched:cost=time")
    parser.add_argument("--routers", nargs="*", default=["sagesched", "prefix", "least-loaded"])
    parser.add_argument("--sessions", type=int, default=1500)
    parser.add_argument("--rates", type=float, nargs="*", default=[6.0, 9.0, 12.0])
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.backends} x {args.profile}, cap {args.cap}, KV {args.kv_tokens:,} tokens, "
          f"{args.policy} in the queue; means over {args.seeds} seeds")  # fmt: skip
    print(f"{'sessions/s':>10} {'router':>13} {'arm':>10} {'TTFT s':>8} {'TTLT s':>8} "
          f"{'hit':>6} {'req/s':>7}")  # fmt: skip
    for rate in args.rates:
        for spec in args.routers:
            for slot_first in (False, True):
                rows = [
                    Fleet(args, parse_router(spec), slot_first).run(
                        workload(args.sessions, rate, seed)
                    )
                    for seed in range(args.seeds)
                ]
                arm = "slot-first" if slot_first else "job-first"
                print(
                    f"{rate:>10.1f} {spec:>13} {arm:>10} "
                    f"{statistics.fmean(r.ttft for r in rows):>8.3f} "
                    f"{statistics.fmean(r.ttlt for r in rows):>8.3f} "
                    f"{statistics.fmean(r.hit for r in rows):>6.3f} "
                    f"{statistics.fmean(r.throughput for r in rows):>7.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
