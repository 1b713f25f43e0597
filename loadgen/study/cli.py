"""`sagesched study`: the portability study (`--mode lssp`) and the SageSched evaluation
(`--mode sagesched`), each one command writing a tidy CSV, a markdown report and plots."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from loadgen.study import grid

MODES = ("lssp", "sagesched")


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--windows", type=int, help="first N windows per source (default: all)")
    p.add_argument(
        "--axes", default="knee,util", help="lssp load axes: knee (the paper's), util (ours)"
    )
    p.add_argument("--regions", help="lssp: comma-separated load points (default: all six)")
    p.add_argument("--policies", help="lssp: comma-separated paper policy names (default: 13)")
    p.add_argument("--executor", choices=list(grid.EXECUTORS), default="process")
    p.add_argument("--workers", type=int, help="worker processes (default: min(2, CPUs))")
    p.add_argument("--boot", type=int, default=2000, help="bootstrap resamples")
    p.add_argument(
        "--rows", type=Path, help="reuse a tidy CSV (lssp) or sagesched.csv instead of simulating"
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--small", action="store_true", help="sagesched: the seconds-long grid (tests, CI)"
    )
    what = p.add_argument_group("what-if on your traffic (lssp mode with --trace)")
    what.add_argument("--trace", type=Path, help="a capture file or folder (serve --capture)")
    what.add_argument("--profile", default="lssp-constant", help="engine latency profile")
    what.add_argument("--window-requests", type=int, default=200, help="requests per window")
    what.add_argument(
        "--public-windows", type=int, default=10, help="frozen windows per public source"
    )
    return p


def _whatif(args: argparse.Namespace) -> dict[str, object]:
    from loadgen.engine.profiles import profile_names
    from loadgen.study import whatif

    if args.profile not in profile_names():
        raise ValueError(f"unknown profile {args.profile!r}; known: {profile_names()}")
    return whatif.run_whatif(
        args.trace,
        args.out,
        profile=args.profile,
        window_requests=args.window_requests,
        public_per_source=args.public_windows,
        regions=args.regions.split(",") if args.regions else None,
        policies=tuple(args.policies.split(",")) if args.policies else whatif.POLICIES,
        executor=args.executor,
        workers=args.workers,
        n_boot=args.boot,
        progress=not args.no_progress,
    )


def _lssp(args: argparse.Namespace) -> dict[str, object]:
    from loadgen.study import report

    axes = tuple(a for a in args.axes.split(",") if a)
    regions: dict[str, Sequence[str]] | None = None
    if args.regions:
        wanted = args.regions.split(",")
        regions = {a: tuple(r for r in grid.AXES[a] if r in wanted) for a in axes}
    policies = tuple(args.policies.split(",")) if args.policies else tuple(grid.POLICIES)
    unknown = set(policies) - set(grid.POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; known: {list(grid.POLICIES)}")
    meta: dict[str, object] = {
        "mode": "lssp",
        "axes": list(axes),
        "windows": args.windows,
        "policies": list(policies),
        "executor": args.executor,
        "workers": args.workers,
        "boot": args.boot,
        "python": platform.python_version(),
    }
    if args.rows:
        rows = grid.read_rows(args.rows)
        meta["rows_from"] = str(args.rows)
    else:
        chunks = grid.plan(windows=args.windows, axes=axes, regions=regions, policies=policies)
        timings: dict[str, float] = {}
        rows = []
        for axis in axes:
            part = [c for c in chunks if c.axis == axis]
            t0 = time.perf_counter()
            rows += grid.run_grid(
                part, executor=args.executor, workers=args.workers, progress=not args.no_progress
            )
            timings[axis] = round(time.perf_counter() - t0, 1)
            meta[f"cells_{axis}"] = sum(c.cells for c in part)
        meta["grid_wall_s"] = timings
        grid.write_rows(rows, args.out / "tidy.csv.gz")
    t0 = time.perf_counter()
    summary = report.write_lssp(rows, args.out, meta, n_boot=args.boot, plots=not args.no_plots)
    meta["stats_wall_s"] = round(time.perf_counter() - t0, 1)
    summary["meta"] = meta
    return summary


def _sagesched(args: argparse.Namespace) -> dict[str, object]:
    """Run the evaluation (or read its rows back with `--rows`), write `out/sagesched.csv`
    and `out/report.md`; return a summary."""
    import csv
    import dataclasses

    from loadgen.study import sagesched_eval as ev
    from loadgen.study import sagesched_report

    out: Path = args.out
    plots = not args.no_plots
    if args.rows is not None:
        meta = json.loads((args.rows.parent / "config.json").read_text())
        return sagesched_report.write(
            ev.read_results(args.rows), out, meta, n_boot=args.boot, plots=plots
        )
    config = ev.SMALL if args.small else ev.EvalConfig()
    t0 = time.perf_counter()
    rows = ev.run_all(config, workers=args.workers, progress=not args.no_progress)
    wall = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    with (out / "sagesched.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(ev.Result._fields)
        w.writerows([*r[:6], repr(r.value)] for r in rows)
    regimes = {r.name: dataclasses.asdict(r) for r in (ev.COMPUTE, ev.MEMORY)}
    meta = {"config": dataclasses.asdict(config), "wall_s": round(wall, 1), "regimes": regimes}
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return sagesched_report.write(rows, out, meta, n_boot=args.boot, plots=plots)


def main(argv: list[str], prog: str = "sagesched study") -> int:
    args = _parser(prog).parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        if args.trace is not None and args.mode != "lssp":
            raise ValueError("--trace runs the portability grid: use it with --mode lssp")
        if args.trace is not None:
            summary = _whatif(args)
        else:
            summary = _lssp(args) if args.mode == "lssp" else _sagesched(args)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"wrote {args.out / 'report.md'}")
    return 0
