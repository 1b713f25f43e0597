"""Simulator speed benchmark; `--write` updates the table of docs/benchmarks.md's "Simulator".

Run: `python bench/simulator.py [--write]`. Three measurements, wall time on this machine:
1. one 200-request LSSP window at its knee in `lssp-constant` mode (FCFS and SageSched), median
   over repeats, and the median over all 119 frozen windows;
2. a 10,000-request ShareGPT-like workload (log-normal lengths, Poisson arrivals, LSSP-style
   deadlines) at its FCFS knee on `h200-llama3-8b`;
3. simulated requests per second for both.
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.regions import compress, find_knee, read_knees  # noqa: E402
from loadgen.schema import TraceRequest  # noqa: E402
from loadgen.sim.simulator import simulate  # noqa: E402
from loadgen.traces import load_windows  # noqa: E402

SOURCES = ("lssp-azure2024", "lssp-bailian", "lssp-burstgpt")
DOC = ROOT / "docs" / "benchmarks.md"


def sharegpt_like(n: int, seed: int = 0) -> list[TraceRequest]:
    """n requests: prompt ~ logN(ln 150, 1.2) in [4, 4096], output ~ logN(ln 200, 1.0) in
    [1, 2048], Poisson arrivals at 1 req/s, deadline = arrival + 20·(0.0004·prompt + 0.02·pred)
    with pred = output × logN(0, 0.2) (the LSSP synthesis)."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(150), 1.2, n), 4, 4096).astype(int)
    out = np.clip(rng.lognormal(np.log(200), 1.0, n), 1, 2048).astype(int)
    pred = np.maximum(1, np.rint(out * rng.lognormal(0.0, 0.2, n))).astype(int)
    arrival = np.cumsum(rng.exponential(1.0, n)) - 1.0
    arrival[0] = 0.0
    return [
        TraceRequest(
            float(a), int(p), int(o), "sharegpt-like", predicted_output_tokens=int(q),
            deadline_s=float(a) + 20 * (0.0004 * p + 0.02 * q),
        )
        for a, p, o, q in zip(arrival, prompt, out, pred, strict=True)
    ]  # fmt: skip


def _timed(fn: object, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return times


def bench_window(repeats: int) -> list[tuple[str, str]]:
    win = load_windows("lssp-azure2024")[0]
    reqs = compress(win.requests, read_knees(win.source)[win.window_id])
    rows = []
    for policy in ("fcfs", "sagesched"):
        ms = statistics.median(_timed(lambda p=policy: simulate(reqs, p), repeats)) * 1000
        rows.append((f"one 200-request window ({win.window_id}, KNEE), {policy}", f"{ms:.1f} ms"))
    per_window = []
    for source in SOURCES:
        knees = read_knees(source)
        for w in load_windows(source):
            r = compress(w.requests, knees[w.window_id])
            per_window += _timed(lambda r=r: simulate(r, "fcfs"), 1)
    med = statistics.median(per_window) * 1000
    worst = max(per_window) * 1000
    rows.append(
        ("all 119 frozen windows at KNEE, fcfs: median / max", f"{med:.1f} / {worst:.1f} ms")
    )
    rows.append(("simulated requests per second (119 windows, fcfs)",
                 f"{200 * len(per_window) / sum(per_window):,.0f}"))  # fmt: skip
    return rows


def bench_sharegpt(n: int) -> list[tuple[str, str]]:
    reqs = sharegpt_like(n)
    t = time.perf_counter()
    knee = find_knee(reqs, profile="h200-llama3-8b")
    knee_s = time.perf_counter() - t
    scaled = compress(reqs, knee)
    rate = n / scaled[-1].arrival_s
    label = f"{n:,}-request ShareGPT-like workload: FCFS knee on h200-llama3-8b"
    rows = [(label, f"λ = {knee:.3g} ({rate:.1f} req/s; bisection {knee_s:.0f} s)")]
    for policy in ("fcfs", "sagesched", "vllm-fcfs"):
        res = simulate(scaled, policy, "h200-llama3-8b")
        rows.append((f"{n:,} requests at the knee, h200-llama3-8b, {policy}",
                     f"{res.wall_s:.2f} s ({n / res.wall_s:,.0f} req/s, "
                     f"{res.iterations:,} iterations in {res.engine_steps:,} steps)"))  # fmt: skip
    return rows


def render(rows: list[tuple[str, str]]) -> str:
    """The "Latest run" line and the table of docs/benchmarks.md's Simulator section."""
    lines = [
        f"Latest run: {time.strftime('%Y-%m-%d')}, {platform.machine()}, Python "
        f"{platform.python_version()}.",
        "",
        "| measurement | result |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
    ]
    return "\n".join(lines) + "\n"


TABLE = re.compile(r"^Latest run: .*?\n\n\| measurement \| result \|\n(?:\|.*\|\n)+", re.M)
"""The part of the Simulator section `--write` replaces (the text around it stays)."""


def write_section(table: str) -> None:
    text = DOC.read_text()
    section = re.search(r"^## Simulator\n.*?(?=^## |\Z)", text, re.S | re.M)
    if section is None or not TABLE.search(section.group(0)):
        raise SystemExit(f"{DOC}: no Simulator section with a 'Latest run' table to update")
    new = TABLE.sub(lambda _: table, section.group(0), count=1)
    DOC.write_text(text[: section.start()] + new + text[section.end() :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--n", type=int, default=10_000)
    args = ap.parse_args()
    rows = bench_window(args.repeats) + bench_sharegpt(args.n)
    section = render(rows)
    print(section)
    if args.write:
        write_section(section)


if __name__ == "__main__":
    main()
