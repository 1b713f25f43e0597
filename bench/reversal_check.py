"""Do the study's simulated reversals hold on a real engine? (issue 19, part 4)

    python bench/reversal_check.py --rows results/lssp/tidy.csv.gz            # ~10 min
    python bench/reversal_check.py --rows results/lssp/tidy.csv.gz --dry-run  # simulation only

Two policy pairs: (a) the strongest supported ANWG reversal of the study's grid (`--rows`, a
`sagesched study --mode lssp` tidy table; `loadgen.replay.reversal_check.supported_reversals`)
and (b) the paper's pair, `slai_faithful` vs `vllm_faithful`. Each source of (a) gives one
window (its paired difference nearest the source's median), at (a)'s region; (b) is checked on
the same two windows and region (`--paper-region` must match, else the paper pair's windows are
picked the same way and added).

Each case is scaled down (first `--first` requests, prompts ≤ `--max-prompt`, outputs ≤
`--max-output`, the paper's SLO recomputed on the capped lengths) and put at the same multiple
of its knee on the real engine as the study's region (the knee found on the `cpu-tiny-vllm`
profile with vLLM's CPU defaults as the reference, `cpu_load_factor`). The engine-level
contenders run on the real vLLM CPU build with the flags of `VLLM_ARMS` (one server each,
pinned to half the CPUs, this client on the other half, every other server suspended while one
is measured); every round runs every (case, contender) once, the order rotated, fresh random
prompt ids each run (no prefix-cache reuse); medians over rounds. Side by side: the study's
own simulation (full window, `lssp-constant`, the study's load point) and the simulation of
the scaled case on `cpu-tiny-vllm`, both of the contender as the study defines it and of what
vLLM actually plays of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.engine.profiles import LatencyProfile, Scaled, make_profile  # noqa: E402
from loadgen.metrics import summarize  # noqa: E402
from loadgen.regions import compress  # noqa: E402
from loadgen.replay.cli import run  # noqa: E402
from loadgen.replay.client import ReplayRequest  # noqa: E402
from loadgen.replay.prompts import build_requests  # noqa: E402
from loadgen.replay.reversal_check import (  # noqa: E402
    VLLM_ARMS,
    cpu_load_factor,
    flip_holds,
    representative_window,
    scaled_trace,
    supported_reversals,
    window_diffs,
)
from loadgen.replay.validation import warm_up  # noqa: E402
from loadgen.schema import TraceRequest, Window  # noqa: E402
from loadgen.sim.simulator import Contender, simulate  # noqa: E402
from loadgen.study.grid import SOURCE_LABELS, cell_metrics, read_rows, windows_of  # noqa: E402
from loadgen.vllm_real import CACHE, RealVllm, split_cpus  # noqa: E402
from policies.registry import parse_policy  # noqa: E402

PAPER_PAIR = ("slai_faithful", "vllm_faithful")
PAPER_SOURCES = ("lssp-azure2024", "lssp-burstgpt")
"""The paper's hardware check: its predicted Azure/BurstGPT slai-vs-vllm reversal."""


Case = tuple[str, str, str]
"""(source, window id, region)."""


def pick_cases(rows: list[Any], paper_region: str) -> tuple[dict[str, Any], list[Case]]:
    """The strongest reversal (as a dict) and the cases to replay."""
    anwg = [r for r in rows if r.axis == "knee" and r.metric == "anwg"]
    best = supported_reversals(anwg)[0]
    cases: list[Case] = []
    for source in (best.source_a, best.source_b):
        diffs = window_diffs(anwg, source, best.region, best.first, best.second)
        cases.append((source, representative_window(diffs), best.region))
    if paper_region != best.region or {best.source_a, best.source_b} != set(PAPER_SOURCES):
        for source in PAPER_SOURCES:
            diffs = window_diffs(anwg, source, paper_region, *PAPER_PAIR)
            cases.append((source, representative_window(diffs), paper_region))
    return dataclasses.asdict(best), cases


def _window(source: str, wid: str) -> Window:
    return next(w for w in windows_of(source) if w.window_id == wid)


METRICS = {"anwg": "anwg", "latency": "ttlt_s_mean"}
"""What each case reports: ANWG (the study's primary, higher better) and mean latency (the
study's `latency_s_mean`, lower better; never tied, so it orders a case where ANWG cannot)."""


def _values(records: list[Any]) -> dict[str, float]:
    s = summarize(records)
    return {k: float(s[v]) for k, v in METRICS.items()}


def _sim(
    trace: list[TraceRequest], contender: str, as_played: bool, profile: LatencyProfile
) -> dict[str, float]:
    cfg = VLLM_ARMS[contender].simulated(as_played=as_played)
    res = simulate(trace, Contender(contender, parse_policy(cfg.gateway), cfg, None), profile)
    return _values(res.records)


def _profile(name: str, speed: float) -> LatencyProfile:
    return make_profile(name) if speed == 1.0 else Scaled(make_profile(name), speed)


def prepare(
    cases: list[Case], args: argparse.Namespace, profile: LatencyProfile
) -> list[dict[str, Any]]:
    """Per case: the scaled trace at its load point on `profile` (the real engine's latency
    profile at its measured speed) and every simulated value."""
    out = []
    for source, wid, region in cases:
        window = _window(source, wid)
        trace = scaled_trace(window, args.first, args.max_prompt, args.max_output)
        factor = cpu_load_factor(trace, region, profile)
        cpu_trace = compress(trace, factor)
        case: dict[str, Any] = {"source": source, "window": wid, "region": region,
                                "cpu_factor": factor, "trace": cpu_trace,
                                "span_s": cpu_trace[-1].arrival_s, "arms": {}}  # fmt: skip
        for name in args.arms:
            study = cell_metrics(window, "knee", region, VLLM_ARMS[name].paper)
            case["arms"][name] = {
                "study": {"anwg": study["anwg"], "latency": study["latency_s_mean"]},
                "cpu_sim": _sim(cpu_trace, name, False, profile),
                "cpu_sim_played": _sim(cpu_trace, name, True, profile),
                "rounds": [],
            }
        out.append(case)
        print(f"case {source} {wid} {region}: {len(trace)} requests over "
              f"{case['span_s']:.1f} s (factor {factor:.3f})", flush=True)  # fmt: skip
    return out


def _requests(trace: list[TraceRequest], contender: str, seed: int) -> list[ReplayRequest]:
    reqs = build_requests(trace, prompts="ids", seed=seed)
    if VLLM_ARMS[contender].priority_by_prompt:
        reqs = [dataclasses.replace(r, priority=r.prompt_tokens) for r in reqs]
    return reqs


@contextlib.contextmanager
def vllm_servers(args: argparse.Namespace) -> Iterator[dict[str, RealVllm]]:
    """One warmed-up real vLLM server per contender (pinned to the engine half of the CPUs;
    this process moves to the other half)."""
    engine, front = split_cpus()
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        servers = {}
        for name in args.arms:
            servers[name] = stack.enter_context(
                RealVllm(extra_args=VLLM_ARMS[name].flags, cpus=engine,
                         log_path=CACHE / f"vllm-reversal-{name}.log")
            )  # fmt: skip
            print(f"server {name} ready ({time.monotonic() - t0:.0f} s)", flush=True)
        os.sched_setaffinity(0, front)
        for s in servers.values():
            with s.quiet():
                warm_up(s.url, s.name)
        yield servers


def engine_speed(server: RealVllm, profile: str) -> float:
    """How slow `server` is now against `profile` (`fit_cpu.speed_factor`, ~4 s)."""
    from loadgen.engine.fit_cpu import profile_probe, speed_factor

    reference = asyncio.run(profile_probe(profile))
    with server.quiet():
        return asyncio.run(speed_factor(server.url, server.name, reference))


def measure(
    cases: list[dict[str, Any]], args: argparse.Namespace, servers: dict[str, RealVllm]
) -> None:
    """Interleaved rounds, every (case, contender) once a round (results into `cases`)."""
    t0 = time.monotonic()
    runs = [(i, name) for i in range(len(cases)) for name in args.arms]
    seed = 1000
    for k in range(args.rounds):
        shift = k % len(runs)
        for i, name in runs[shift:] + runs[:shift]:
            seed += 1
            server = servers[name]
            with server.quiet():
                res = run(server.url, server.name, _requests(cases[i]["trace"], name, seed),
                          progress=False)  # fmt: skip
            row = _values([r.record() for r in res])
            row["failed"] = sum(not r.ok for r in res)
            cases[i]["arms"][name]["rounds"].append(row)
        print(f"round {k + 1}/{args.rounds} done ({time.monotonic() - t0:.0f} s)", flush=True)
    for c in cases:
        for a in c["arms"].values():
            a["measured"] = {m: _med([r[m] for r in a["rounds"]]) for m in METRICS}


def _med(v: list[float]) -> float:
    return float(statistics.median(v)) if v else float("nan")


SOURCES_SHOWN = ("study", "cpu_sim", "cpu_sim_played", "measured")


def table(cases: list[dict[str, Any]], pairs: list[tuple[str, str]]) -> str:
    """The values table and, per pair and case, whether the measured order follows the study's
    simulation and the real engine's (ANWG, and mean latency)."""
    lines = [
        "| case | contender | ANWG: study sim / CPU sim / as played / measured | "
        "latency s: study sim / CPU sim / as played / measured |",
        "|---|---|---|---|",
    ]
    for c in cases:
        label = f"{SOURCE_LABELS[c['source']]} {c['window'].rsplit('_', 1)[-1]} {c['region']}"
        for name, a in c["arms"].items():
            cells = [" / ".join(f"{a[k][m]:.3f}" if k in a else "-" for k in SOURCES_SHOWN)
                     for m in METRICS]  # fmt: skip
            lines.append(f"| {label} | {name} | {cells[0]} | {cells[1]} |")
    by_paper = {arm.paper: name for name, arm in VLLM_ARMS.items()}
    lines += ["", "| pair | case | Δ ANWG: study sim / CPU sim as played / measured | measured "
              "follows: study / CPU sim | Δ latency s: same | follows |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for first, second in pairs:
        f, s = by_paper[first], by_paper[second]
        for c in cases:
            if f not in c["arms"] or s not in c["arms"]:
                continue
            a, b = c["arms"][f], c["arms"][s]
            cells = []
            for m in METRICS:
                keys = [k for k in ("study", "cpu_sim_played", "measured") if k in a]
                cells.append(" / ".join(f"{a[k][m] - b[k][m]:+.3f}" for k in keys))
                if "measured" not in a:
                    cells.append("-")
                    continue
                measured = {f: a["measured"][m], s: b["measured"][m]}
                cells.append(" / ".join(
                    _yes(flip_holds({f: a[k][m], s: b[k][m]}, measured, f, s))
                    for k in ("study", "cpu_sim_played")
                ))  # fmt: skip
            lines.append(f"| {f} − {s} | {SOURCE_LABELS[c['source']]} {c['region']} | "
                         + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines)


def _yes(v: bool | None) -> str:
    return "tie" if v is None else ("yes" if v else "no")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=Path, default=ROOT / "results" / "lssp" / "tidy.csv.gz")
    ap.add_argument("--arms", default=",".join(VLLM_ARMS), help="contenders (VLLM_ARMS)")
    ap.add_argument("--first", type=int, default=200, help="first N requests of each window")
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default="cpu-tiny-vllm")
    ap.add_argument("--paper-region", default="HIGH_PRESSURE")
    ap.add_argument("--dry-run", action="store_true", help="simulate only (no vLLM)")
    ap.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="dry run: the engine's speed factor (measured when not a dry run)",
    )
    ap.add_argument("--out", type=Path, default=CACHE / "reversal_check.json")
    ap.add_argument("--table-from", type=Path, help="print the tables of a run's --out JSON")
    args = ap.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if args.table_from:
        saved = json.loads(args.table_from.read_text())
        r = saved["reversal"]
        print(table(saved["cases"], [(r["first"], r["second"]), PAPER_PAIR]))
        return 0
    started = time.monotonic()
    best, picked = pick_cases(read_rows(args.rows), args.paper_region)
    print(f"strongest supported reversal: {best['first']} vs {best['second']} "
          f"({best['source_a']}–{best['source_b']}, {best['region']}; "
          f"{best['diff_a']:+.3f} / {best['diff_b']:+.3f})", flush=True)  # fmt: skip
    if args.dry_run:
        cases = prepare(picked, args, _profile(args.profile, args.speed))
    else:
        with vllm_servers(args) as servers:
            args.speed = engine_speed(servers[args.arms[0]], args.profile)
            print(f"engine speed: {args.speed:.3f} x {args.profile}", flush=True)
            cases = prepare(picked, args, _profile(args.profile, args.speed))
            measure(cases, args, servers)
    pairs = [(best["first"], best["second"]), PAPER_PAIR]
    print()
    print(table(cases, pairs))
    report = {"reversal": best, "args": {k: str(v) for k, v in vars(args).items()},
              "cases": [{k: v for k, v in c.items() if k != "trace"} for c in cases],
              "wall_s": round(time.monotonic() - started, 1)}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\n({report['wall_s']:.0f} s; written {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
