"""Benchmark routing decisions: µs per decision at a realistic index size.

Run: `python bench/routing_speed.py` (defaults: 8 backends, 100,000 indexed blocks each,
prompts of 2–200 blocks). Every prefix-keeping router's index is first filled to the given
size per backend by routing a stream of prompts; then each decision is timed alone: `pick`
over the fleet's states plus `on_route` (the index insertion and `Job.cached_tokens`), the
whole cost the engine pays per routed job. Prompts share prefixes with earlier ones (a random
cut of one of 2,000 200-block documents, then blocks of their own), so matches are partial,
full or empty. Prints median, p99 and max per router, and the median of `pick` alone (the
max includes dropping a forgotten generation of the index, once per capacity window).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Iterator

from policies import Job, LengthDist
from policies.routing import BackendState, Router, make_router, router_names
from policies.routing.base import PrefixRouter

BLOCK_TOKENS = 16
MAX_BLOCKS = 200
"""Longest prompt, in blocks (prompts are 2..MAX_BLOCKS blocks)."""


def prompts(
    rng: random.Random, docs: int = 2000, doc_blocks: int = 200
) -> Iterator[tuple[int, ...]]:
    """Endless chained-hash prompts of 2–200 blocks, each a cut of a shared document (0 to all
    of its blocks) followed by blocks of its own (unique hashes)."""
    library = [tuple(rng.getrandbits(63) for _ in range(doc_blocks)) for _ in range(docs)]
    while True:
        n = rng.randint(2, doc_blocks)
        shared = rng.randint(0, n)
        doc = library[rng.randrange(docs)]
        yield doc[:shared] + tuple(rng.getrandbits(63) for _ in range(n - shared))


def fleet(n: int, blocks: int) -> list[BackendState]:
    """`n` backends whose KV holds exactly `blocks` prompt blocks (the index capacity)."""
    return [
        BackendState(f"b{i}", inflight=0, cap=64, kv_blocks=blocks, block_tokens=BLOCK_TOKENS)
        for i in range(n)
    ]


def make_job(i: int, prefix: tuple[int, ...], rng: random.Random) -> Job:
    return Job(
        id=i,
        arrival_s=float(i),
        prompt_tokens=len(prefix) * BLOCK_TOKENS + rng.randrange(BLOCK_TOKENS),
        prefix=prefix,
        block_tokens=BLOCK_TOKENS,
        session=f"s{rng.randrange(500)}",
        dist=LengthDist.point(rng.randint(1, 1000)),
    )


def fill(router: Router, backends: list[BackendState], blocks: int, rng: random.Random) -> None:
    """Route prompts round-robin until every backend's index is full (an eviction forgets a
    whole insertion, so full is within one prompt, `MAX_BLOCKS`, of `blocks`)."""
    if not isinstance(router, PrefixRouter):
        return
    stream = prompts(rng)
    i = 0
    while min(router.index_size(b) for b in backends) < blocks - MAX_BLOCKS:
        router.on_route(make_job(i, next(stream), rng), backends[i % len(backends)])
        i += 1


def time_decisions(
    router: Router, backends: list[BackendState], decisions: int, rng: random.Random
) -> tuple[list[float], list[float]]:
    """µs per decision (pick + on_route) and per pick alone, `decisions` of each. Jobs and
    the fleet's scraped state (load, engine queue, KV use) are drawn before the clock runs."""
    stream = prompts(rng)
    jobs = [make_job(i, next(stream), rng) for i in range(decisions)]
    scrapes = [
        [(rng.randrange(64), rng.randrange(4), rng.random()) for _ in backends]
        for _ in range(decisions)
    ]
    whole, pick_only = [], []
    clock = time.perf_counter
    for job, scrape in zip(jobs, scrapes, strict=True):
        for b, (inflight, waiting, kv) in zip(backends, scrape, strict=True):
            b.inflight, b.waiting, b.kv_usage = inflight, waiting, kv
        t0 = clock()
        choice = router.pick(job, backends)
        t1 = clock()
        assert choice is not None
        router.on_route(job, choice)
        t2 = clock()
        whole.append((t2 - t0) * 1e6)
        pick_only.append((t1 - t0) * 1e6)
    return whole, pick_only


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=100_000, help="indexed blocks per backend")
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routers", nargs="*", default=None, help="router specs (default: all)")
    args = parser.parse_args()
    specs = args.routers or router_names()
    print(
        f"Routing decisions, {args.backends} backends x {args.blocks:,} indexed blocks, "
        f"prompts of 2-200 blocks ({args.decisions:,} decisions per router; µs)"
    )
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(
        f"{'router':>14} {'median':>8} {'p99':>8} {'max':>8} {'pick median':>12} "
        f"{'index blocks':>13}"
    )
    for spec in specs:
        rng = random.Random(args.seed)
        router = make_router(spec)
        backends = fleet(args.backends, args.blocks)
        fill(router, backends, args.blocks, rng)
        whole, pick_only = time_decisions(router, backends, args.decisions, rng)
        held = (
            min(router.index_size(b) for b in backends) if isinstance(router, PrefixRouter) else 0
        )
        print(
            f"{spec:>14} {statistics.median(whole):>8.1f} {p99(whole):>8.1f} {max(whole):>8.0f} "
            f"{statistics.median(pick_only):>12.1f} {held:>13,}"
        )


if __name__ == "__main__":
    main()
