"""`sagesched simulate`: policies side by side on trace windows, in virtual time."""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

from loadgen.engine.profiles import make_profile, profile_names
from loadgen.metrics import summarize
from loadgen.regions import (
    REGIONS,
    compress,
    factor_for_rate,
    factor_for_utilisation,
    region_factor,
)
from loadgen.schema import Window
from loadgen.sim.replicas import ADMISSIONS, BALANCINGS, Replicas, simulate_replicas
from loadgen.sim.simulator import contender_names, resolve, simulate

HEADLINE = (
    "anwg",
    "slo_violation_rate",
    "completion_fraction",
    "ttft_s_mean",
    "ttft_s_p99",
    "ttlt_s_mean",
    "ttlt_s_p99",
    "request_throughput_rps",
    "preemptions",
)


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Simulate policies on trace windows.")
    p.add_argument("--source", required=True, help="trace source, e.g. lssp-azure2024")
    p.add_argument("--windows", default="all", help="'all', a count N (first N) or ids a,b")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--region", choices=list(REGIONS), help="multiple of each window's knee")
    load.add_argument("--factor", type=float, help="explicit time-compression factor")
    load.add_argument("--rate", type=float, help="target mean arrival rate (req/s)")
    load.add_argument("--utilisation", type=float, help="target decode utilisation (0-1)")
    p.add_argument("--profile", default="lssp-constant", choices=profile_names())
    p.add_argument(
        "--policies", default="fcfs", help="comma-separated: " + ", ".join(contender_names())
    )
    p.add_argument(
        "--inflight-cap", type=int, default=-1, help="gateway cap (-1: default, 0: none)"
    )
    p.add_argument(
        "--belief-sigma", type=float, default=0.2, help="σ of the predicted-length belief"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    rep = p.add_argument_group("several gateway replicas (docs/simulator.md)")
    rep.add_argument("--replicas", type=int, default=1, help="gateway replicas, each its own queue")
    rep.add_argument(
        "--backends", type=int, default=1, help="identical backends (the load is per backend)"
    )
    rep.add_argument("--balancing", choices=BALANCINGS, default="least-loaded")
    rep.add_argument("--admission", choices=ADMISSIONS, default="independent")
    rep.add_argument("--seed", type=int, default=0, help="seed of random balancing")
    return p


def _windows(
    source: str, spec: str, path: Path | None = None, n_requests: int = 200
) -> list[Window]:
    """The windows of `source` (its file at `path` for sources that need one) that `spec`
    selects: 'all', a count N (the first N), ids a,b, or 'whole' (every request of the trace
    as one window, e.g. a short capture)."""
    from loadgen.traces import load_requests, load_windows
    from loadgen.traces.windows import rebase

    if spec == "whole":
        requests = load_requests(source, path)
        meta = {"start_index": 0}
        return [Window(source, f"{source}_whole", rebase(requests), meta)] if requests else []
    windows = load_windows(source, n_requests=n_requests, path=path)
    if spec == "all":
        return windows
    if spec.isdigit():
        return windows[: int(spec)]
    wanted = set(spec.split(","))
    return [w for w in windows if w.window_id in wanted]


def _factor(window: Window, args: argparse.Namespace) -> float:
    if args.factor is not None:
        return float(args.factor)
    if args.rate is not None:
        return factor_for_rate(window.requests, args.rate)
    if args.utilisation is not None:
        return factor_for_utilisation(window.requests, args.utilisation, profile=args.profile)
    return region_factor(window, args.region or "KNEE")


def _mean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def run(args: argparse.Namespace) -> dict[str, object]:
    """Every contender on every window; per-contender means over windows."""
    profile = make_profile(args.profile)
    token_s = profile.iteration_s(1, 0, 0)
    cap = None if args.inflight_cap == 0 else args.inflight_cap
    contenders = [resolve(s.strip(), inflight_cap=cap) for s in args.policies.split(",")]
    setup = Replicas(args.replicas, args.backends, args.balancing, args.admission, args.seed)
    plain = setup.count == setup.backends == 1
    windows = _windows(args.source, args.windows)
    if not windows:
        raise SystemExit(f"no windows selected from {args.source}")
    rows: dict[str, list[dict[str, float]]] = {c.name: [] for c in contenders}
    wall = time.perf_counter()
    for w in windows:
        reqs = compress(w.requests, _factor(w, args) * setup.backends)
        for c in contenders:
            if plain:
                res = simulate(reqs, c, profile, belief_sigma=args.belief_sigma)
            else:
                res = simulate_replicas(reqs, c, profile, setup, belief_sigma=args.belief_sigma)
            rows[c.name].append(summarize(res.records, token_s=token_s))
    out: dict[str, object] = {
        "source": args.source,
        "windows": len(windows),
        "load": _load_label(args),
        "profile": profile.name,
        **({} if plain else {"replicas": setup.label}),
        "wall_s": round(time.perf_counter() - wall, 3),
        "contenders": {
            name: {k: _mean([r[k] for r in rs]) for k in rs[0]} for name, rs in rows.items()
        },
    }
    return out


def _load_label(args: argparse.Namespace) -> str:
    for key in ("factor", "rate", "utilisation"):
        if getattr(args, key) is not None:
            return f"{key}={getattr(args, key)}"
    return f"region={args.region or 'KNEE'}"


def _table(out: dict[str, object]) -> str:
    contenders = out["contenders"]
    assert isinstance(contenders, dict)
    width = max(len(n) for n in contenders)
    lines = [
        f"{out['source']}  {out['windows']} windows  {out['load']}  profile {out['profile']}"
        + (f"  {out['replicas']}" if "replicas" in out else "")
        + f"  ({out['wall_s']} s)",
        f"{'contender':<{width}}  " + "  ".join(f"{h:>12.12}" for h in HEADLINE),
    ]
    for name, metrics in contenders.items():
        cells = "  ".join(f"{metrics[h]:>12.4g}" for h in HEADLINE)
        lines.append(f"{name:<{width}}  {cells}")
    return "\n".join(lines)


def main(argv: list[str], prog: str = "sagesched simulate") -> int:
    args = _parser(prog).parse_args(argv)
    try:
        out = run(args)
    except ValueError as exc:
        print(f"{prog}: {exc}")
        return 2
    print(json.dumps(out, indent=2, default=str) if args.json else _table(out))
    return 0
