"""Several gateway replicas (issue 17 part 3), in simulation: what splitting the queue costs
mean TTLT, and which fix recovers one gateway's figures (docs/benchmarks.md).

    python bench/replicas.py                                  # Azure 2024, both caps (5 min)
    python bench/replicas.py --workload sharegpt --size 30    # ShareGPT (15 min)
    python bench/replicas.py --check-preemption               # shipped vs non-preemptive

Workloads (`--size` × 200 requests per run, another stream and random balancing per seed):
`azure2024`, the shipped Azure 2024 conversation windows (`lssp-azure2024`: real arrivals and
lengths, the paper's frozen predictions and SLO deadlines) chained end to end in a seeded
order; `sharegpt`, the shipped ShareGPT sample with Poisson arrivals, predictions true ×
exp(N(0, 0.5²)) and the paper's SLO deadline. `BACKENDS` identical backends: vLLM with chunked
prefill (`vllm-chunked-prefill`: 64 sequences, 4,096-token budget) on the `h200-llama3-8b`
profile, drained until every request finishes. Load: the stream's knee on one backend
(`loadgen.regions.find_knee`: where vLLM alone, FCFS, misses 0.5% of the SLOs) times the number
of backends, at KNEE and HIGH_PRESSURE (1.5×).

Contenders: FCFS and SageSched (`sagesched:preemptive=false`: the shipped policy preempts only
when the swap pays, which on Azure it never does (identical records) and on ShareGPT rarely
(mean TTLT within 4%), at a fraction of the cost: `--check-preemption`) behind the caps as
shipped: a fixed `max_inflight` of 64 per backend (vLLM's `max_num_seqs`) and the
self-tuning cap (the default, starting at 8). Each replica is its own `policies.Scheduler` with
its own view of every backend (`loadgen.sim.replicas`).

Table 1, the cost: N = 1, 2, 4, 8 independent replicas (the gateway as it ships) × client
balancing. Table 2, the fixes: split caps, owned backends (b mod N), a shared budget, and (at
N = 8, equal to N = 1 by construction) a shared budget granted by queue heads. Ratios are to
N = 1 under the same cap, load and policy (mean of the per-seed ratios); "peak in flight" is the
most requests on one backend at once (above 64: over-admission), "cap per backend" the mean of
a backend's summed self-tuned caps.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import json
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing import Pool
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.engine.configs import engine_config  # noqa: E402
from loadgen.metrics import summarize  # noqa: E402
from loadgen.regions import REGIONS, compress, find_knee, slo_deadline  # noqa: E402
from loadgen.schema import TraceRequest  # noqa: E402
from loadgen.sim.replicas import Replicas, simulate_replicas  # noqa: E402
from loadgen.sim.simulator import Contender  # noqa: E402
from loadgen.traces import shipped_windows  # noqa: E402
from policies.capacity import CapLaw  # noqa: E402
from policies.registry import parse_policy  # noqa: E402

PROFILE = "h200-llama3-8b"
BACKENDS = 8
ENGINE = engine_config("vllm-chunked-prefill").with_(drain_s=36_000.0)
LOADS = ("KNEE", "HIGH_PRESSURE")
POLICIES = {"FCFS": "fcfs", "SageSched": "sagesched:preemptive=false"}
CAPS = {"fixed 64": (64, False), "self-tuning": (8, True)}
"""Cap name → (fixed cap or where the self-tuning cap starts, self-tuning)."""
REPLICAS = (2, 4, 8)
SHAREGPT_ERROR = 0.5
"""ShareGPT predictions: true length × exp(N(0, 0.5²)), belief σ 0.5 (`bench/cap_priority.py`)."""


def azure(seed: int, size: int) -> list[TraceRequest]:
    """`size` shipped Azure 2024 windows chained in a seeded order: each starts one mean gap
    after the previous one's last arrival (deadlines move with their requests)."""
    pool = shipped_windows("lssp-azure2024")
    order = np.random.default_rng([seed, 17]).permutation(len(pool))[:size]
    out: list[TraceRequest] = []
    offset = 0.0
    for k in order:
        reqs = pool[k].requests
        for r in reqs:
            deadline = None if r.deadline_s is None else r.deadline_s + offset
            out.append(dataclasses.replace(r, arrival_s=r.arrival_s + offset, deadline_s=deadline))
        offset += reqs[-1].arrival_s * len(reqs) / (len(reqs) - 1)
    return out


def sharegpt(seed: int, size: int) -> list[TraceRequest]:
    """`size` × 200 requests of the shipped ShareGPT sample, Poisson arrivals (1 s mean gap on
    the raw clock), noisy predictions, the paper's SLO deadline (`loadgen.regions`)."""
    with gzip.open(ROOT / "loadgen/data/prompts/sharegpt-400.jsonl.gz", "rt") as fh:
        records = [json.loads(line) for line in fh]
    n = 200 * size
    rng = np.random.default_rng([seed, 18])
    idx = rng.choice(len(records), size=n)
    arrivals = np.cumsum(rng.exponential(1.0, size=n))
    noise = np.exp(rng.normal(0.0, SHAREGPT_ERROR, size=n))
    out = []
    for i, at, z in zip(idx, arrivals - arrivals[0], noise, strict=True):
        prompt = max(1, min(int(records[i]["prompt_tokens"]), 4096))
        output = max(1, min(int(records[i]["output_tokens"]), 4096))
        predicted = max(1, round(output * z))
        deadline = slo_deadline(float(at), prompt, predicted)
        out.append(
            TraceRequest(
                float(at),
                prompt,
                output,
                "sharegpt-400",
                predicted_output_tokens=predicted,
                deadline_s=deadline,
            )
        )
    return out


WORKLOADS: dict[str, tuple[Callable[[int, int], list[TraceRequest]], float]] = {
    "azure2024": (azure, 0.2),
    "sharegpt": (sharegpt, SHAREGPT_ERROR),
}
"""Workload → (stream builder (seed, size in 200-request units), belief σ)."""


def knee(workload: str, seed: int, size: int) -> float:
    """The stream's knee on one backend: vLLM alone (FCFS, no gateway cap)."""
    alone = Contender("vllm", parse_policy("fcfs"), ENGINE.with_(drain_s=50.0), None)
    reqs = WORKLOADS[workload][0](seed, size)
    return find_knee(reqs, profile=PROFILE, contender=alone, lo=0.01, hi=100.0, steps=16)


@functools.lru_cache(maxsize=4)
def requests(workload: str, seed: int, size: int, factor: float) -> list[TraceRequest]:
    return compress(WORKLOADS[workload][0](seed, size), factor)


def contender(policy: str, cap: str, spec: str | None = None) -> Contender:
    start, tuned = CAPS[cap]
    law = CapLaw() if tuned else None
    return Contender(policy, parse_policy(spec or POLICIES[policy]), ENGINE, start, cap_law=law)


def check_preemption(workload: str, size: int, caps: list[str]) -> None:
    """The shipped (preemptive) SageSched against `sagesched:preemptive=false` on seed 0 at
    HIGH_PRESSURE: are the records identical (no preemption ever paid)?"""
    factor = knee(workload, 0, size) * REGIONS["HIGH_PRESSURE"] * BACKENDS
    reqs = requests(workload, 0, size, factor)
    sigma = WORKLOADS[workload][1]
    for cap in caps:
        for setup in (
            Replicas(1, BACKENDS),
            Replicas(4, BACKENDS, "least-loaded"),
            Replicas(4, BACKENDS, "least-loaded", "owned"),
        ):
            runs = [
                simulate_replicas(
                    reqs, contender("SageSched", cap, spec), PROFILE, setup, belief_sigma=sigma
                )
                for spec in ("sagesched", POLICIES["SageSched"])
            ]
            same = [dataclasses.astuple(r) for r in runs[0].records] == [
                dataclasses.astuple(r) for r in runs[1].records
            ]
            pre = sum(r.preemptions for r in runs[0].records)
            ttlt = [summarize(r.records)["ttlt_s_mean"] for r in runs]
            print(
                f"{workload} {cap} {setup.label}: identical {same}, mean TTLT {ttlt[0]:.3f} s "
                f"vs {ttlt[1]:.3f} s (preemptions in the records, gateway + engine: {pre})"
            )


def setups(cap: str) -> Iterator[tuple[int, Replicas]]:
    """(table, setup) for one cap: table 1 the shipped independent replicas, table 2 fixes."""
    yield 1, Replicas(1, BACKENDS)
    for n in REPLICAS:
        for bal in ("random", "least-loaded", "round-robin"):
            yield 1, Replicas(n, BACKENDS, bal, "independent")
    for n in REPLICAS:
        if not CAPS[cap][1]:
            yield 2, Replicas(n, BACKENDS, "random", "split")
            yield 2, Replicas(n, BACKENDS, "least-loaded", "split")
        yield 2, Replicas(n, BACKENDS, "random", "owned")
        yield 2, Replicas(n, BACKENDS, "least-loaded", "owned")
        yield 2, Replicas(n, BACKENDS, "random", "shared")
    yield 2, Replicas(REPLICAS[-1], BACKENDS, "random", "shared-heads")  # N = 1 by construction


Task = tuple[str, int, int, float, str, str, str, Replicas]
"""(workload, seed, size, factor, load, policy, cap, setup)."""


def measure(task: Task) -> tuple[Task, dict[str, float]]:
    workload, seed, size, factor, _load, policy, cap, setup = task
    setup = dataclasses.replace(setup, seed=seed)
    reqs = requests(workload, seed, size, factor)
    sigma = WORKLOADS[workload][1]
    res = simulate_replicas(reqs, contender(policy, cap), PROFILE, setup, belief_sigma=sigma)
    s = summarize(res.records)
    return task, {
        "ttlt": s["ttlt_s_mean"],
        "p99": s["ttlt_s_p99"],
        "ttft": s["ttft_s_mean"],
        "done": s["completion_fraction"],
        "peak": res.extra["inflight_peak"],
        "cap": res.extra.get("cap_mean", float("nan")),
    }


Key = tuple[str, str, str, Replicas]
"""(load, cap, policy, setup without its seed)."""


def collect(results: list[tuple[Task, dict[str, float]]]) -> dict[Key, list[dict[str, float]]]:
    """Per (load, cap, policy, setup): one metrics row per seed, in seed order."""
    out: dict[Key, list[dict[str, float]]] = {}
    for task, row in sorted(results, key=lambda tr: tr[0][1]):
        _w, _seed, _n, _f, load, policy, cap, setup = task
        out.setdefault((load, cap, policy, setup), []).append(row)
    return out


def table(rows: dict[Key, list[dict[str, float]]], load: str, which: int, caps: list[str]) -> str:
    head = (
        "| cap | replicas | balancing | admission |"
        + "".join(f" {p} TTLT s | ×N=1 | p99 s | TTFT s |" for p in POLICIES)
        + " peak in flight | cap per backend |"
    )
    lines = [head, "|---|---:|---|---|" + "---:|" * (4 * len(POLICIES) + 2)]
    for cap in caps:
        for t, setup in setups(cap):
            if t != which and setup.count > 1:
                continue
            cells = []
            for policy in POLICIES:
                runs = rows[(load, cap, policy, setup)]
                base = rows[(load, cap, policy, Replicas(1, BACKENDS))]
                ratio = np.mean([r["ttlt"] / b["ttlt"] for r, b in zip(runs, base, strict=True)])
                m = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
                cells += [f"{m['ttlt']:.2f}", f"{ratio:.2f}", f"{m['p99']:.1f}", f"{m['ttft']:.2f}"]
            sage = rows[(load, cap, "SageSched", setup)]
            peak = max(r["peak"] for r in sage)
            tuned = float(np.mean([r["cap"] for r in sage]))
            bal = setup.balancing if setup.count > 1 else "-"
            adm = setup.admission if setup.count > 1 else "-"
            lines.append(
                f"| {cap} | {setup.count} | {bal} | {adm} | "
                + " | ".join(cells)
                + f" | {peak:.0f} | {'-' if np.isnan(tuned) else f'{tuned:.0f}'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=list(WORKLOADS), default="azure2024")
    ap.add_argument("--caps", default=",".join(CAPS), help="comma-separated: " + ", ".join(CAPS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--size", type=int, default=20, help="requests per run, in units of 200")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument(
        "--check-preemption", action="store_true", help="only compare preemptive SageSched"
    )
    args = ap.parse_args(argv)
    caps = args.caps.split(",")
    if args.check_preemption:
        check_preemption(args.workload, args.size, caps)
        return
    wall = time.perf_counter()
    knees = {s: knee(args.workload, s, args.size) for s in range(args.seeds)}
    tasks: list[Task] = [
        (args.workload, s, args.size, knees[s] * REGIONS[load] * BACKENDS, load, policy, cap, setup)
        for s in range(args.seeds)
        for load in LOADS
        for cap in caps
        for _t, setup in setups(cap)
        for policy in POLICIES
    ]
    with Pool(args.jobs) as pool:
        results = list(pool.imap_unordered(measure, tasks, chunksize=4))
    rows = collect(results)
    done = min(r["done"] for rs in rows.values() for r in rs)
    print(
        f"{args.workload}: {args.size * 200} requests per run, {args.seeds} seeds, {BACKENDS} "
        f"backends {ENGINE.name} on {PROFILE}; knee per backend (factor) "
        f"{', '.join(f'{k:.3f}' for k in knees.values())}; least completion {done:.3f}"
    )
    for which, title in ((1, "the cost (as shipped)"), (2, "the fixes")):
        for load in LOADS:
            print(f"\nTable {which}, {title}: {load} ({REGIONS[load]}x knee)\n")
            print(table(rows, load, which, caps))
    print(f"\n({time.perf_counter() - wall:.0f} s, {len(tasks)} runs)")


if __name__ == "__main__":
    main()
