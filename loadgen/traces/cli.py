"""`sagesched traces`: list trace sources, their frozen windows and the windows' knees.

Knees come from `loadgen/data/knees/<source>.csv` (columns `window_id,knee`) when that file
exists; a window without one shows `-`. `--freeze` regenerates the shipped frozen windows from
the shared data folder (maintainers only).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from loadgen.schema import Window
from loadgen.traces import frozen, get_source, list_sources, shipped_windows
from loadgen.traces.registry import SourceInfo, TraceDataMissing, package_data_dir


def knees_path(source: str) -> Path:
    """`loadgen/data/knees/<source>.csv`."""
    return package_data_dir() / "knees" / f"{source}.csv"


def read_knees(source: str) -> dict[str, str]:
    """window_id → knee (as written) from the source's knee manifest; {} if there is none."""
    path = knees_path(source)
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return {r["window_id"]: r["knee"] for r in rows if r.get("window_id") and r.get("knee")}


def format_knee(knee: str) -> str:
    """A knee for the table: 5 significant digits if numeric, else as written."""
    try:
        return f"{float(knee):.5g}"
    except ValueError:
        return knee


def availability(info: SourceInfo) -> str:
    """Where the source's data comes from on this machine."""
    if info.needs_path:
        return "user path"
    if info.kind == "frozen":
        return "shipped"
    try:
        resolve = getattr(get_source(info.name), "resolve", None)
        if resolve is not None:
            resolve(None)
        return "shared"
    except TraceDataMissing:
        return "shipped only" if frozen.read_manifest_or_none(info.name) else "missing"


def _window_row(w: Window, knees: dict[str, str]) -> dict[str, object]:
    duration = w.requests[-1].arrival_s if w.requests else 0.0
    n = len(w)
    return {
        "window_id": w.window_id,
        "requests": n,
        "duration_s": round(duration, 3),
        "rate_rps": round(n / duration, 3) if duration > 0 else None,
        "mean_prompt": round(sum(r.prompt_tokens for r in w.requests) / max(n, 1), 1),
        "mean_output": round(sum(r.output_tokens for r in w.requests) / max(n, 1), 1),
        "knee": knees.get(w.window_id, "-"),
    }


def _print_sources(infos: list[SourceInfo]) -> None:
    width = max(len(i.name) for i in infos)
    print(f"{'source':<{width}}  {'kind':<9}  {'data':<12}  {'windows':>7}  {'knees':>5}  about")
    for i in infos:
        n_win = len(shipped_windows(i.name))
        n_knee = len(read_knees(i.name))
        data = availability(i)
        print(
            f"{i.name:<{width}}  {i.kind:<9}  {data:<12}  {n_win:>7}  {n_knee:>5}  {i.description}"
        )


def _print_windows(source: str, rows: list[dict[str, object]]) -> None:
    print(f"\n{source}: {len(rows)} shipped windows")
    if not rows:
        return
    width = max(len(str(r["window_id"])) for r in rows)
    print(
        f"  {'window':<{width}}  {'n':>4}  {'dur_s':>10}  {'req/s':>8}  {'prompt':>7}  "
        f"{'output':>7}  knee"
    )
    for r in rows:
        rate = "-" if r["rate_rps"] is None else f"{r['rate_rps']:.3f}"
        knee = format_knee(str(r["knee"]))
        print(
            f"  {r['window_id']!s:<{width}}  {r['requests']:>4}  {r['duration_s']:>10.3f}  "
            f"{rate:>8}  {r['mean_prompt']:>7}  {r['mean_output']:>7}  {knee}"
        )


def _print_capture(path: Path, as_json: bool, prog: str) -> int:
    from loadgen.traces.capture import capture_summary

    try:
        summary = capture_summary(path)
    except (OSError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(summary, indent=2))
        return 0
    for key, value in summary.items():
        print(f"{key:>20}: {value}")
    return 0


def main(argv: list[str], prog: str = "sagesched traces") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="List trace sources, their shipped frozen windows and knees."
    )
    parser.add_argument(
        "sources", nargs="*", help="list these sources' windows (default: the source table)"
    )
    parser.add_argument("--windows", action="store_true", help="list every source's windows")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--freeze", action="store_true", help="regenerate the shipped windows from shared data"
    )
    parser.add_argument(
        "--capture", metavar="PATH", type=Path, help="summarise a capture: file or folder"
    )
    args = parser.parse_args(argv)
    if args.capture is not None:
        return _print_capture(args.capture, args.json, prog)
    if args.freeze:
        for source in frozen.FROZEN_SPEC:
            print(f"{source}: {len(frozen.write_frozen_from_shared(source))} windows")
        return 0
    infos = list_sources()
    known = {i.name for i in infos}
    unknown = [s for s in args.sources if s not in known]
    if unknown:
        print(f"{prog}: unknown source(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    chosen = args.sources or ([i.name for i in infos] if args.windows else [])
    if args.json:
        out = [
            {
                "name": i.name,
                "kind": i.kind,
                "description": i.description,
                "data": availability(i),
                "windows": [_window_row(w, read_knees(i.name)) for w in shipped_windows(i.name)],
            }
            for i in infos
            if not chosen or i.name in chosen
        ]
        print(json.dumps(out, indent=2))
        return 0
    if not chosen:
        _print_sources(infos)
        return 0
    for source in chosen:
        knees = read_knees(source)
        _print_windows(source, [_window_row(w, knees) for w in shipped_windows(source)])
    return 0
