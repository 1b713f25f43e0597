"""Routing study: every router, FCFS and SageSched queues, on a simulated fleet
with prefix caching; writes docs/routing.md.

Run (one process; each run is cached in `--runs`, so an interrupted sweep resumes and
`--report-only` rewrites the report from what is there):

    PYTHONPATH=. python bench/routing_study.py --workloads sessions mooncake-synthetic \\
        mooncake-conversation --loads 0.6 0.9 1.2 --seeds 3 --requests 1000

Fleet: `--backends` × `--engine` (default `h200-llama3-8b`: the engine config and latency
profile of that name, vLLM V1's H200 defaults, chunked prefill, 870,400 KV tokens, prefix
caching; `h200-qwen3-32b`: 245,760 KV tokens), the gateway's cap 32 in flight per backend, one
gateway queue (`loadgen.sim.fleet.simulate_fleet`). Workloads, per seed:

- `sessions`: ShareGPT multi-turn chat sessions (`loadgen.traces.sessions`), real token ids in
  16-token blocks, think times log-normal with the BurstGPT fit's σ (1.67) and its median
  divided by `--think-scale` (default 20: 6.8 s, capped at 120 s), so that the later turns
  of a window of a few hundred sessions arrive while its first turns still load the fleet;
- `mooncake-synthetic`, `mooncake-conversation`: `--requests` consecutive requests of the
  Mooncake trace (512-token block hashes), seed s starting s × `--requests` in, rebased to 0.

Load. The knee of a workload is its fleet's saturated throughput with FCFS and `least-loaded`:
every request of seed 0's window arrives at once (session turns as independent requests,
without their think times), and the knee is the completions per second in the second half of
the time jobs wait at the gateway (the first half holds the start-up transient, when the
first batch is still in prefill and nothing completes). Load x then means arrivals at x × knee
requests per second: Mooncake windows are time-scaled to that mean rate; sessions start at
the rate (found by bisection, `at_load`) at which their turns' estimated arrivals (start plus
think times) come at x × knee over the middle 80% of the window; the turns really arrive a
think time after their previous answer, so closed sessions offer less once the fleet queues.

Predictions: a noisy oracle (log-normal, 50% relative error, seeded) for every job, which both
SageSched and the `sagesched` router read. The capacity bound is `lru_hit_ratio` of the window
(one LRU cache of the whole fleet's KV, timing ignored), also at 4× and 16× and unbounded.
Means over seeds with 95% t-intervals; ratios are paired per seed. Tables: "load seen" is the
arrival rate over the middle 80% of a run's arrivals over the knee; "busiest / mean" the
requests the busiest backend got over the mean per backend.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy import stats as sps

from loadgen.engine.configs import engine_config
from loadgen.metrics import RequestRecord
from loadgen.schema import TraceRequest
from loadgen.sim.fleet import Fleet, lru_hit_ratio, simulate_fleet
from loadgen.traces import load_requests
from loadgen.traces.sessions import ThinkTime, session_workload
from policies import LengthDist
from policies.routing import router_names

QUEUES = {"fcfs": "fcfs", "sagesched": "sagesched:cost=time"}
WORKLOADS = ("sessions", "mooncake-synthetic", "mooncake-conversation")
OURS, LLMD, BASE = "sagesched", "prefix", "least-loaded"
REL_ERROR = 0.5
MAX_THINK_S = 60.0
MAX_TURNS = 8
METRICS = ("ttft_mean", "ttft_p99", "ttlt_mean", "hit", "throughput", "load_seen", "imbalance")
DIGITS = (3, 2, 3, 3, 2, 2, 2)


# -- workloads ------------------------------------------------------------------------------


def sessions_window(n_requests: int, seed: int, think_scale: float) -> list[TraceRequest]:
    """ShareGPT sessions, about `n_requests` turns, starting at one session per second."""
    think = ThinkTime(median_s=135.7 / think_scale, sigma=1.67, max_s=MAX_THINK_S)
    n_sessions = max(1, round(n_requests / 3.2))  # ShareGPT, ≤ 8 turns: 3.2 turns a session
    return session_workload("sharegpt", n_sessions, 1.0, think=think, max_turns=MAX_TURNS,
                            seed=seed)  # fmt: skip


def at_rate(requests: Sequence[TraceRequest], rate: float) -> list[TraceRequest]:
    """`requests` with arrivals rescaled to a mean of `rate` requests (session starts: sessions)
    per second; later session turns keep their think times (their `arrival_s` is re-estimated)."""
    firsts = [r for r in requests if r.think_s is None]
    span = firsts[-1].arrival_s - firsts[0].arrival_s if len(firsts) > 1 else 0.0
    factor = 0.0 if span <= 0 or math.isinf(rate) else (len(firsts) - 1) / span / rate
    out: list[TraceRequest] = []
    start: dict[str, tuple[float, float]] = {}  # session → (old start, new start)
    for r in requests:
        if r.think_s is None:
            new = r.arrival_s * factor
            if r.session is not None:
                start[r.session] = (r.arrival_s, new)
        else:
            assert r.session is not None
            old0, new0 = start[r.session]
            new = new0 + r.arrival_s - old0
        out.append(replace(r, arrival_s=new))
    out.sort(key=lambda r: r.arrival_s)  # stable: a session's turns keep their order
    return out


def arrival_rate(times: Sequence[float]) -> float:
    """Arrivals per second over the middle 80% of the arrival `times`."""
    a = np.sort(times)
    lo, hi = a[len(a) // 10], a[9 * len(a) // 10]
    return 0.8 * len(a) / (hi - lo) if hi > lo else math.inf


def at_load(requests: Sequence[TraceRequest], rate: float) -> list[TraceRequest]:
    """`requests` offering `rate` requests per second over the middle 80% of their arrivals.
    Without sessions: `at_rate`. With sessions the later turns trail their session's start by
    think times, so starting sessions at `rate` / turns-per-session offers less than `rate` in
    a finite window: the session start rate is found by bisection on the arrivals estimated at
    build time (start + think times; the served turns' own times, a few seconds per session,
    are left out)."""
    per_first = turns_per_first(requests)
    if per_first == 1.0 or math.isinf(rate):
        return at_rate(requests, rate / per_first)
    lo, hi = rate / per_first / 64, rate * 64
    for _ in range(40):  # geometric bisection on the session start rate
        mid = math.sqrt(lo * hi)
        seen = arrival_rate([r.arrival_s for r in at_rate(requests, mid)])
        lo, hi = (mid, hi) if seen < rate else (lo, mid)
    return at_rate(requests, math.sqrt(lo * hi))


@functools.lru_cache(maxsize=2)
def window(workload: str, n: int, seed: int, think_scale: float) -> tuple[TraceRequest, ...]:
    """Seed `seed`'s window of `workload` at its own arrival times."""
    if workload == "sessions":
        return tuple(sessions_window(n, seed, think_scale))
    rows = load_requests(workload)
    lo = min(seed * n, max(len(rows) - n, 0))
    part = rows[lo : lo + n]
    t0 = part[0].arrival_s
    return tuple(replace(r, arrival_s=r.arrival_s - t0) for r in part)


def size(args: argparse.Namespace, workload: str) -> int:
    """Requests in a window of `workload` (sessions: turns, about)."""
    return int(args.session_requests if workload == "sessions" else args.requests)


def turns_per_first(requests: Sequence[TraceRequest]) -> float:
    """Requests per session start (1 for traces without sessions)."""
    return len(requests) / max(1, sum(r.think_s is None for r in requests))


def beliefs(requests: Sequence[TraceRequest], seed: int) -> list[LengthDist]:
    rng = np.random.default_rng(10_000 + seed)
    return [LengthDist.noisy_oracle(max(1, r.output_tokens), REL_ERROR, rng) for r in requests]


# -- runs -------------------------------------------------------------------------------------


class Runs:
    """Cached run summaries (one JSON object a line), keyed by their condition."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[str, dict[str, float]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                row = json.loads(line)
                self.rows[row["key"]] = row

    def get(self, key: str) -> dict[str, float] | None:
        return self.rows.get(key)

    def put(self, key: str, row: dict[str, float]) -> None:
        self.rows[key] = row
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"key": key, **row}) + "\n")


def key(*parts: object) -> str:
    return "|".join(map(str, parts))


ENGINES = ("h200-llama3-8b", "h200-qwen3-32b")
"""The fleets' engines (configuration and latency profile of that name): Llama-3.1-8B with the
KV it holds at vLLM's default memory share (870,400 tokens), Qwen3-32B (245,760)."""


def engine_tag(args: argparse.Namespace) -> str:
    """Key suffix of a fleet of another engine than the first (none for the default)."""
    return "" if args.engine == ENGINES[0] else f"|{args.engine}"


def fleet_for(args: argparse.Namespace, backends: int) -> Fleet:
    engine = engine_config(args.engine)
    return Fleet(backends, engine, args.engine, args.cap, precise=args.precise,
                 engine_waiting=not args.hide_waiting)  # fmt: skip


def run_key(args: argparse.Namespace, workload: str, backends: int, load: float, seed: int,
            queue: str, router: str) -> str:  # fmt: skip
    """The cache key of one run: its condition, the experiments' fleet variant, and for
    sessions the load's definition (`at_load`)."""
    k = key("run", workload, backends, size(args, workload), args.cap, args.think_scale, load,
            seed, queue, router, args.precise)  # fmt: skip
    k += "|no-waiting" if args.hide_waiting else ""
    return k + ("|at-load" if workload == "sessions" else "") + engine_tag(args)


def load_seen(records: Sequence[RequestRecord], knee_rps: float) -> float:
    """Arrivals per second over the middle 80% of the run's arrivals, over the knee: the load
    a window really offers (session turns arrive by think time, so it ramps up and down)."""
    rate = arrival_rate([r.arrival_s for r in records])
    return rate / knee_rps if math.isfinite(rate) else math.nan


def knee(args: argparse.Namespace, runs: Runs, workload: str, backends: int) -> float:
    """Saturated throughput (req/s) of FCFS + least-loaded, seed 0's window all at once."""
    k = key("knee", workload, backends, size(args, workload), args.cap, args.think_scale)
    k += engine_tag(args)
    row = runs.get(k)
    if row is None:
        base = window(workload, size(args, workload), 0, args.think_scale)
        reqs = at_rate([replace(r, think_s=None) for r in base], math.inf)
        res = simulate_fleet(reqs, "fcfs", BASE, fleet_for(args, backends),
                             beliefs=beliefs(reqs, 0))  # fmt: skip
        half = res.saturated_s / 2  # the queue is non-empty from 0 to saturated_s
        late = sum(half <= (r.finish_s or -1.0) <= res.saturated_s for r in res.records)
        row = {**res.summary(), "wall_s": res.wall_s, "knee": late / half if half else math.nan}
        if math.isnan(row["knee"]):
            raise ValueError(
                f"{workload}: a window of {size(args, workload)} never fills the fleet"
            )
        runs.put(k, row)
        print(f"knee {workload} B={backends}: {row['knee']:.2f} req/s "
              f"({res.wall_s:.1f} s)", flush=True)  # fmt: skip
    return float(row["knee"])


def sweep(args: argparse.Namespace, runs: Runs) -> None:
    """Every condition not yet in `runs`, one process, in a fixed order."""
    for workload in args.workloads:
        for backends in args.backends:
            mu = knee(args, runs, workload, backends)
            for seed in range(args.seeds):
                base = window(workload, size(args, workload), seed, args.think_scale)
                bound_key = key(
                    "bound", workload, backends, size(args, workload), seed, args.think_scale
                ) + engine_tag(args)
                if runs.get(bound_key) is None:
                    cap = fleet_for(args, backends).kv_tokens
                    bounds = {f"x{m}": lru_hit_ratio(base, cap * m) for m in (0.5, 1, 4, 16)}
                    runs.put(bound_key, bounds | {"inf": lru_hit_ratio(base, math.inf)})
                for load in args.loads:
                    reqs = at_load(base, load * mu)
                    bel = beliefs(reqs, seed)
                    for queue in args.queues:
                        for router in args.routers:
                            k = run_key(args, workload, backends, load, seed, queue, router)
                            if runs.get(k) is not None:
                                continue
                            fleet = fleet_for(args, backends)
                            res = simulate_fleet(reqs, QUEUES[queue], router, fleet, beliefs=bel)
                            s = res.summary() | {"load_seen": load_seen(res.records, mu)}
                            runs.put(k, {**s, "wall_s": res.wall_s})
                            print(f"{workload} B={backends} load {load} seed {seed} {queue:>9} "
                                  f"{router:>12}: TTFT {s['ttft_mean']:.3f} TTLT "
                                  f"{s['ttlt_mean']:.3f} hit {s['hit']:.3f} "
                                  f"({res.wall_s:.1f} s)", flush=True)  # fmt: skip


# -- report -----------------------------------------------------------------------------------


def ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (NaN half-width for one value)."""
    v = [x for x in values if not math.isnan(x)]
    if not v:
        return math.nan, math.nan
    m = statistics.fmean(v)
    if len(v) < 2:
        return m, math.nan
    half = float(sps.t.ppf(0.975, len(v) - 1)) * statistics.stdev(v) / math.sqrt(len(v))
    return m, half


def fmt(values: Sequence[float], digits: int = 3) -> str:
    m, h = ci(values)
    if math.isnan(m):
        return "–"
    return f"{m:.{digits}f}" if math.isnan(h) else f"{m:.{digits}f} ± {h:.{digits}f}"


class Report:
    """Reads the cached runs of one invocation's grid."""

    def __init__(self, args: argparse.Namespace, runs: Runs) -> None:
        self.args, self.runs = args, runs

    def metric(self, workload: str, b: int, load: float, queue: str, router: str,
               name: str) -> list[float]:  # fmt: skip
        a, out = self.args, []
        for seed in range(a.seeds):
            row = self.runs.get(run_key(a, workload, b, load, seed, queue, router))
            out.append(math.nan if row is None else float(row[name]))
        return out

    def bound(self, workload: str, b: int, which: str) -> list[float]:
        a = self.args
        rows = [self.runs.get(key("bound", workload, b, size(a, workload), s, a.think_scale)
                              + engine_tag(a))
                for s in range(a.seeds)]  # fmt: skip
        return [math.nan if r is None else float(r[which]) for r in rows]

    def ratio(self, num: list[float], den: list[float]) -> list[float]:
        return [x / y if y else math.nan for x, y in zip(num, den, strict=True)]

    def tables(self) -> list[str]:
        a, lines = self.args, []
        for workload in a.workloads:
            for b in a.backends:
                k = self.runs.get(
                    key("knee", workload, b, size(a, workload), a.cap, a.think_scale)
                    + engine_tag(a)
                )
                mu = math.nan if k is None else k["knee"]
                lines += [f"### {workload}, {b} backends (knee {mu:.2f} req/s)", ""]
                bounds = ", ".join(f"{w}: {fmt(self.bound(workload, b, w))}"
                                   for w in ("x0.5", "x1", "x4", "x16", "inf"))  # fmt: skip
                lines += [f"Hit ratio of one LRU cache of the fleet's KV × 0.5, × 1 (the "
                          f"capacity bound), × 4, × 16, unbounded — {bounds}", ""]  # fmt: skip
                for load in a.loads:
                    lines += [f"Load {load} ({load * mu:.2f} req/s):", "",
                              "| queue | router | mean TTFT s | p99 TTFT s | mean TTLT s | "
                              "hit ratio | req/s | load seen | busiest / mean |",
                              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
                    for q in a.queues:
                        for r in a.routers:
                            m = [self.metric(workload, b, load, q, r, n) for n in METRICS]
                            cells = " | ".join(fmt(v, d) for v, d in zip(m, DIGITS, strict=True))
                            lines.append(f"| {q} | {r} | {cells} |")
                    lines.append("")
        return lines

    def targets(self) -> list[str]:
        """Each issue target beside its figure (4 backends, loads ≥ 0.9)."""
        a = self.args
        b = 4 if 4 in a.backends else a.backends[0]
        lines = ["| workload | load | target | figure (mean ± 95% CI over seeds) | met |",
                 "|---|---|---|---|---|"]  # fmt: skip

        def row(w: str, load: float, target: str, vals: list[float], ok: bool) -> None:
            lines.append(f"| {w} | {load} | {target} | {fmt(vals)} | {'yes' if ok else 'no'} |")

        def cut(w: str, load: float, metric: str, q: str = "sagesched") -> list[float]:
            ours = self.metric(w, b, load, q, OURS, metric)
            return [1 - x for x in self.ratio(ours, self.metric(w, b, load, q, BASE, metric))]

        for load in [x for x in a.loads if x >= 0.9]:
            for w in a.workloads:
                if w == "sessions":
                    v = cut(w, load, "ttft_mean")
                    row(w, load, "ours vs least-loaded: mean TTFT ≥ 40% lower", v,
                        ci(v)[0] >= 0.40)  # fmt: skip
                    v = cut(w, load, "ttlt_mean")
                    row(w, load, "ours vs least-loaded: mean TTLT ≥ 10% lower", v,
                        ci(v)[0] >= 0.10)  # fmt: skip
                else:
                    hit = self.metric(w, b, load, "sagesched", OURS, "hit")
                    v = self.ratio(hit, self.bound(w, b, "x1"))
                    row(w, load, "hit ratio ≥ 90% of the capacity bound", v, ci(v)[0] >= 0.9)
                    need = 0.20 if w == "mooncake-synthetic" else 0.10
                    v = cut(w, load, "ttft_mean")
                    row(w, load, f"ours vs least-loaded: mean TTFT ≥ {need:.0%} lower", v,
                        ci(v)[0] >= need)  # fmt: skip
                ours = self.metric(w, b, load, "sagesched", OURS, "ttlt_mean")
                llmd = self.metric(w, b, load, "fcfs", LLMD, "ttlt_mean")
                v = [1 - x for x in self.ratio(ours, llmd)]
                row(w, load, "ours+SageSched vs prefix+FCFS: mean TTLT ≥ 10% lower", v,
                    ci(v)[0] >= 0.10)  # fmt: skip
                for metric in ("ttft_mean", "ttlt_mean"):
                    v = self.ratio(self.metric(w, b, load, "sagesched", OURS, metric),
                                   self.metric(w, b, load, "sagesched", LLMD, metric))  # fmt: skip
                    row(w, load, f"same queue: ours ≤ 1.02 × prefix ({metric})", v,
                        ci(v)[0] <= 1.02)  # fmt: skip
        return lines


def plot(rep: Report, path: Path) -> None:
    """Mean TTFT and TTLT against load, one line per router (SageSched queue), per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = rep.args
    b = 4 if 4 in a.backends else a.backends[0]
    fig, axes = plt.subplots(2, len(a.workloads), figsize=(4.2 * len(a.workloads), 6.4),
                             squeeze=False)  # fmt: skip
    for col, w in enumerate(a.workloads):
        for row, metric in enumerate(("ttft_mean", "ttlt_mean")):
            ax = axes[row][col]
            for r in a.routers:
                means = [ci(rep.metric(w, b, x, "sagesched", r, metric)) for x in a.loads]
                ax.errorbar(a.loads, [m for m, _ in means], yerr=[h for _, h in means],
                            label=r, marker="o", capsize=2)  # fmt: skip
            ax.set_title(f"{w}, {b} backends")
            ax.set_xlabel("load (× knee)")
            ax.set_ylabel(f"mean {metric.split('_')[0].upper()} s (SageSched queue)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(args: argparse.Namespace, runs: Runs, command: str) -> None:
    rep = Report(args, runs)
    beside = args.out.parent.name == "routing"  # an experiment's report in docs/study/routing
    figure = (
        args.out.with_suffix(".png")
        if beside
        else args.out.parent / "study" / "routing" / (args.out.stem + ".png")
    )
    plot(rep, figure)
    walls = [float(r["wall_s"]) for r in runs.rows.values() if "wall_s" in r]
    head = [
        "# Routing study",
        "",
        "Made by:",
        "",
        "```",
        command,
        "```",
        "",
        (__doc__ or "").split("\n\n", 3)[3].strip(),
        "",
        f"Seeds: {args.seeds}; windows of {args.requests} Mooncake requests and "
        f"{args.session_requests} session turns (about); cap {args.cap} per backend; "
        f"{len(walls)} cached runs, {sum(walls):.0f} s of simulation.",
        "",
        "## Targets (4 backends, SageSched in the queue unless said)",
        "",
        *rep.targets(),
        "",
        *([args.notes.read_text().strip(), ""] if args.notes and args.notes.exists() else []),
        "## Tables",
        "",
        f"![mean TTFT and TTLT against load]({figure.relative_to(args.out.parent)})",
        "",
        *rep.tables(),
    ]
    args.out.write_text("\n".join(head) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--backends", nargs="*", type=int, default=[4])
    ap.add_argument("--engine", default=ENGINES[0], choices=ENGINES, help="the backends' engine")
    ap.add_argument("--loads", nargs="*", type=float, default=[0.6, 0.9, 1.2])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--cap", type=int, default=32)
    ap.add_argument("--think-scale", type=float, default=20.0)
    ap.add_argument("--session-requests", type=int, default=6000)
    ap.add_argument("--precise", action="store_true", help="routers read the engines' caches")
    ap.add_argument("--hide-waiting", action="store_true", help="routers see no engine queue")
    ap.add_argument("--queues", nargs="*", default=list(QUEUES), choices=list(QUEUES))
    ap.add_argument("--routers", nargs="*", default=router_names())
    ap.add_argument("--runs", type=Path, default=Path("docs/study/routing/runs.jsonl"))
    ap.add_argument("--out", type=Path, default=Path("docs/routing.md"))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--notes", type=Path, help="a Markdown file put after the targets")
    args = ap.parse_args(argv)
    runs = Runs(args.runs)
    wall = time.perf_counter()
    if not args.report_only:
        sweep(args, runs)
    command = "PYTHONPATH=. python bench/routing_study.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only"
    )
    write_report(args, runs, command)
    print(f"wrote {args.out} ({time.perf_counter() - wall:.0f} s)")


if __name__ == "__main__":
    main()
