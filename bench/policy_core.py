"""Benchmark the scheduling core: Gittins key evaluation and PolicyQueue operations.

Run: `python bench/policy_core.py` (or `make bench-policies`). Prints one table; numbers are
per operation, median of several repetitions, on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from policies import Job, LengthDist, PolicyQueue, gittins_index, make_policy


def per_op_us(fn: Callable[[], object], ops: int, repeats: int = 5) -> float:
    """Median wall time per operation in microseconds over `repeats` runs of `fn`."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) / ops * 1e6)
    return statistics.median(samples)


def bench_gittins(points: int, rng: np.random.Generator) -> tuple[float, float, float]:
    """Raw index, and a full SageSched key (belief + kv cost + index) for a waiting job and
    for a running one (whose belief is conditioned on its tokens), at `points` support."""
    support = np.sort(rng.choice(np.arange(1, 20_000), points, replace=False)).astype(float)
    probs = rng.random(points)
    probs /= probs.sum()
    n = 2000
    raw = per_op_us(lambda: [gittins_index(support, probs, 0.0) for _ in range(n)], n)
    policy = make_policy("sagesched")
    job = Job(id=0, arrival_s=0.0, prompt_tokens=500, dist=LengthDist(support, probs))
    waiting = per_op_us(lambda: [policy.key(job, 0.0) for _ in range(n)], n)
    job.generated = int(support[points // 4])
    running = per_op_us(lambda: [policy.key(job, 0.0) for _ in range(n)], n)
    return raw, waiting, running


def bench_queue(size: int, rng: np.random.Generator) -> tuple[float, float, float]:
    """push, pop and rekey cost (µs) on a SageSched-keyed queue holding `size` jobs."""
    policy = make_policy("sagesched")
    lengths = rng.lognormal(5, 1, size + 1000) + 1
    jobs = [
        Job(id=i, arrival_s=float(i), prompt_tokens=100, dist=LengthDist.point(lengths[i]))
        for i in range(size + 1000)
    ]
    base, extra = jobs[:size], jobs[size:]
    q = PolicyQueue(policy)
    for j in base:
        q.push(j, 0.0)

    def push_remove() -> None:
        for j in extra:
            q.push(j, 0.0)
        for j in extra:
            q.remove(j)

    push = per_op_us(push_remove, 2 * len(extra))
    rekey = per_op_us(lambda: [q.rekey(j, 0.0) for j in base[:1000]], 1000)
    pops = min(1000, size // 2)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        popped = [q.pop(0.0) for _ in range(pops)]
        samples.append((time.perf_counter() - t0) / pops * 1e6)
        for j in popped:
            assert j is not None
            q.push(j, 0.0)
    return push, statistics.median(samples), rekey


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print("Gittins key evaluation (µs per call)")
    print(f"{'support points':>15} {'gittins_index':>14} {'key, waiting':>13} {'key, running':>13}")
    for points in (16, 64, 256):
        raw, waiting, running = bench_gittins(points, rng)
        print(f"{points:>15} {raw:>14.1f} {waiting:>13.1f} {running:>13.1f}")
    print()
    print("PolicyQueue (µs per operation)")
    print(f"{'jobs queued':>15} {'push':>8} {'pop':>8} {'rekey':>8}")
    for size in (1_000, 10_000, 100_000):
        push, pop, rekey = bench_queue(size, rng)
        print(f"{size:>15,} {push:>8.2f} {pop:>8.2f} {rekey:>8.2f}")


if __name__ == "__main__":
    main()
