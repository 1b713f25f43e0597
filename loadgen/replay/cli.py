"""`sagesched replay` and `sagesched compare`: open-loop trace replay against live servers.

```
sagesched replay --target http://127.0.0.1:8080 --source lssp-azure2024 --windows 1 \
    --region KNEE --prompts sample --slo e2el:20000 --out results.jsonl
sagesched replay --target URL --dataset sample --num-prompts 200 --request-rate 20
sagesched compare --target fcfs=http://gw-a:8080 --target sagesched=http://gw-b:8080 \
    --source lssp-azure2024 --windows 1 --region KNEE
sagesched replay --target URL --source capture --path CAPTURE_DIR --windows whole \
    --factor 1 --prompts nearest
sagesched replay --target URL --sessions sharegpt --num-sessions 20 --session-rate 1
```
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from loadgen.regions import REGIONS, compress
from loadgen.replay.client import ReplayRequest, ReplayResult, replay
from loadgen.replay.prompts import build_requests, dataset_requests, http_json, tokenize_counter
from loadgen.replay.report import comparison, failures, parse_slos, summarize_replay, table
from loadgen.schema import TraceRequest, Window

if TYPE_CHECKING:
    from loadgen.replay.nearest import NearestPrompts, Vectors
    from loadgen.replay.sessions import Session, TurnResult

    Nearest = tuple[list[Vectors | None], NearestPrompts]

T = TypeVar("T")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags shared by replay, compare and the validation script."""
    p.add_argument("--source", help="trace source (see `sagesched traces`), e.g. capture")
    p.add_argument("--path", type=Path,
                   help="the source's file or folder (capture: a file or folder)")  # fmt: skip
    p.add_argument("--windows", default="1",
                   help="'all', a count N (first N), ids a,b, 'whole' (one window)")  # fmt: skip
    p.add_argument("--window-requests", type=int, default=200, help="requests per window")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--region", choices=list(REGIONS), help="multiple of each window's knee")
    load.add_argument("--factor", type=float, help="explicit time-compression factor")
    load.add_argument("--rate", type=float, help="target mean arrival rate of a window (req/s)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="extra factor on the load")
    p.add_argument("--first", type=int, help="replay only the first N requests of each window")
    p.add_argument("--sessions", choices=("sharegpt", "mt-bench"),
                   help="no trace: multi-turn chat sessions of this dataset, each turn resending "
                   "the history (docs/replay.md)")  # fmt: skip
    p.add_argument("--num-sessions", type=int, default=20, help="with --sessions")
    p.add_argument("--session-rate", type=float, default=1.0,
                   help="with --sessions: sessions started per second (Poisson)")  # fmt: skip
    p.add_argument("--think-median", type=float, default=5.0,
                   help="with --sessions: median think time between turns (s)")  # fmt: skip
    p.add_argument("--think-max", type=float, default=60.0, help="cap on one think time (s)")
    p.add_argument("--max-turns", type=int, help="with --sessions: turns per session at most")
    p.add_argument("--min-turns", type=int, default=1,
                   help="with --sessions: skip conversations with fewer turns")  # fmt: skip
    p.add_argument("--dataset", help="no trace: prompts from 'sample' or a JSONL path")
    p.add_argument("--num-prompts", type=int, default=200, help="with --dataset")
    p.add_argument("--request-rate", type=float, default=10.0, help="with --dataset (req/s)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    p.add_argument("--prompts", default="ids",
                   help="ids | text (exact via /tokenize) | sample | PATH.jsonl | nearest "
                   "(a capture's embeddings' nearest shipped prompts)")  # fmt: skip
    p.add_argument("--pad-prompts", action="store_true",
                   help="pad real prompts to the trace's length (needs /tokenize)")  # fmt: skip
    p.add_argument("--max-output", type=int, help="cap output lengths (tokens)")
    p.add_argument("--max-prompt", type=int, help="cap prompt lengths (tokens), e.g. to fit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="served model name (default: the target's first model)")
    p.add_argument("--slo", action="append", default=[],
                   help="goodput SLO, ttft|tpot|e2el:MS (repeatable)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout (s)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true")


def workloads(
    args: argparse.Namespace, count_url: str | None = None, model: str = ""
) -> list[tuple[str, list[ReplayRequest]]]:
    """(label, requests) per selected window, or one dataset workload."""
    if args.source is None:
        if args.dataset is None:
            raise ValueError("give --source (a trace) or --dataset (prompts at --request-rate)")
        reqs = dataset_requests(args.num_prompts, args.request_rate * args.rate_scale,
                                path=args.dataset, burstiness=args.burstiness, seed=args.seed,
                                max_output=args.max_output)  # fmt: skip
        return [(f"{args.dataset}@{args.request_rate * args.rate_scale:g}rps", reqs)]
    from loadgen.sim.cli import _factor, _windows

    args.utilisation = None  # the simulator's load flags that replay does not offer
    out = []
    wants_count = args.prompts == "text" or args.pad_prompts
    counter = tokenize_counter(count_url, model) if wants_count and count_url else None
    nearest = _nearest(args) if args.prompts == "nearest" else None
    for w in _windows(args.source, args.windows, args.path, args.window_requests):
        trace = list(w.requests[: args.first] if args.first else w.requests)
        if args.max_prompt:
            trace = [dataclasses.replace(r, prompt_tokens=min(r.prompt_tokens, args.max_prompt))
                     for r in trace]  # fmt: skip
        factor = _factor(w, args) * args.rate_scale
        label = f"{w.source}/{w.window_id}@x{factor:.3g}"
        if nearest is None:
            reqs = build_requests(compress(trace, factor), prompts=args.prompts, seed=args.seed,
                                  count_tokens=counter, max_output=args.max_output,
                                  pad=args.pad_prompts)  # fmt: skip
        else:
            reqs = _nearest_requests(w, compress(trace, factor), nearest, args, counter, label)
        out.append((label, reqs))
    if not out:
        raise ValueError(f"no windows selected from {args.source}")
    return out


def _nearest(args: argparse.Namespace) -> Nearest:
    """A capture's embeddings (in `read_capture` order) and the shipped prompts to match."""
    if args.source != "capture" or args.path is None:
        raise ValueError("--prompts nearest needs --source capture --path FILE_OR_DIR")
    from loadgen.replay.nearest import shipped_prompts
    from loadgen.traces.capture import capture_embeddings

    return capture_embeddings(args.path), shipped_prompts()


def _nearest_requests(
    window: Window, trace: list[TraceRequest], nearest: Nearest,
    args: argparse.Namespace, counter: Callable[[str], int] | None, label: str,
) -> list[ReplayRequest]:  # fmt: skip
    """The window's requests with the nearest shipped prompts; says how many fell back."""
    from loadgen.replay.nearest import nearest_requests

    embeddings, prompts = nearest
    start = int(window.meta.get("start_index", 0))
    reqs, fell_back = nearest_requests(
        trace, embeddings[start : start + len(trace)], prompts, seed=args.seed,
        count_tokens=counter, max_output=args.max_output, pad=args.pad_prompts,
    )  # fmt: skip
    print(f"{label}: {len(reqs) - fell_back} nearest shipped prompts, {fell_back} synthetic "
          "(no recorded embedding)", file=sys.stderr)  # fmt: skip
    return reqs


def served_model(url: str) -> str:
    """The target's first served model (`GET /v1/models`)."""
    return str(http_json(url.rstrip("/") + "/v1/models")["data"][0]["id"])


def run(
    url: str, model: str, requests: Sequence[ReplayRequest], *, timeout_s: float = 600.0,
    progress: bool = True, desc: str = "replay",
) -> list[ReplayResult]:  # fmt: skip
    """Replay `requests` against `url` in a fresh event loop, with a progress bar."""
    bar = None
    if progress:
        from tqdm import tqdm  # type: ignore[import-untyped]

        bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr)
    try:
        on_done = None if bar is None else (lambda _r: bar.update(1))
        return _run_loop(replay(url, model, requests, timeout_s=timeout_s, on_done=on_done))
    finally:
        if bar is not None:
            bar.close()


def _run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop where installed (less loop overhead per callback, smaller lag)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def write_jsonl(path: str, label: str, target: str, results: Sequence[ReplayResult]) -> None:
    with Path(path).open("a", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps({"workload": label, "target": target, **r.as_dict()}) + "\n")


def _clean(d: dict[str, float]) -> dict[str, float | None]:
    return {k: None if math.isnan(v) else v for k, v in d.items()}


def _replay_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Replay a trace open-loop against a server.")
    p.add_argument("--target", required=True, help="server base URL (gateway or vLLM)")
    p.add_argument("--out", help="append per-request records to this JSONL")
    add_workload_args(p)
    return p


def session_workload(args: argparse.Namespace) -> list[Session]:
    """The `--sessions` workload (`loadgen.replay.sessions`)."""
    from loadgen.replay.sessions import build_sessions
    from loadgen.traces.sessions import ThinkTime

    think = ThinkTime(median_s=args.think_median, sigma=1.67, max_s=args.think_max)
    return build_sessions(args.sessions, args.num_sessions, args.session_rate, think=think,
                          max_turns=args.max_turns, min_turns=args.min_turns,
                          max_output=args.max_output, seed=args.seed)  # fmt: skip


def run_sessions(
    url: str, model: str, sessions: Sequence[Session], *, timeout_s: float = 600.0,
    progress: bool = True, desc: str = "sessions",
) -> list[TurnResult]:  # fmt: skip
    """Replay `sessions` against `url` in a fresh event loop, with a progress bar."""
    from loadgen.replay.sessions import replay_sessions

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(s.turns) for s in sessions), desc=desc, unit="turn",
                   file=sys.stderr)  # fmt: skip
    try:
        on_done = None if bar is None else (lambda _r: bar.update(1))
        return _run_loop(replay_sessions(url, model, sessions, timeout_s=timeout_s,
                                         on_done=on_done))  # fmt: skip
    finally:
        if bar is not None:
            bar.close()


def _sessions_main(args: argparse.Namespace, model: str, slos: dict[str, float]) -> int:
    from loadgen.replay.sessions import by_turn, turn_table

    sessions = session_workload(args)
    label = f"sessions-{args.sessions}x{len(sessions)}@{args.session_rate:g}/s"
    turns = run_sessions(args.target, model, sessions, timeout_s=args.timeout,
                         progress=not args.no_progress, desc=label)  # fmt: skip
    results = [t.result for t in turns]
    if args.out:
        write_jsonl(args.out, label, args.target, results)
    summary, errors, per_turn = summarize_replay(results, slos), failures(results), by_turn(turns)
    if args.json:
        print(json.dumps({label: {"summary": _clean(summary), "failures": errors,
                                  "by_turn": {k: _clean(v) for k, v in per_turn.items()}}},
                         indent=1))  # fmt: skip
    else:
        print(table(summary, errors, title=label))
        print(turn_table(per_turn))
    return 1 if errors else 0


def main(argv: list[str], prog: str = "sagesched replay") -> int:
    args = _replay_parser(prog).parse_args(argv)
    if args.sessions:
        try:
            slos = parse_slos(args.slo)
            model = args.model or served_model(args.target)
            return _sessions_main(args, model, slos)
        except (ValueError, OSError, KeyError) as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
    try:
        slos = parse_slos(args.slo)
        model = args.model or served_model(args.target)
        loads = workloads(args, args.target, model)
    except (ValueError, OSError, KeyError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    report: dict[str, object] = {}
    failed = 0
    for label, reqs in loads:
        results = run(args.target, model, reqs, timeout_s=args.timeout,
                      progress=not args.no_progress, desc=label)  # fmt: skip
        if args.out:
            write_jsonl(args.out, label, args.target, results)
        summary, errors = summarize_replay(results, slos), failures(results)
        failed += sum(errors.values())
        report[label] = {"summary": _clean(summary), "failures": errors}
        if not args.json:
            print(table(summary, errors, title=label))
            for status, first in _first_errors(results).items():
                print(f"  first {status} error: {first}")
    if args.json:
        print(json.dumps(report, indent=1))
    return 1 if failed else 0


def _first_errors(results: Sequence[ReplayResult]) -> dict[str, str]:
    out: dict[str, str] = {}
    for r in results:
        if not r.ok and r.status not in out:
            out[r.status] = r.error or ""
    return out


def compare_main(argv: list[str], prog: str = "sagesched compare") -> int:
    """The same workload against several targets in turn; side-by-side ratios."""
    p = argparse.ArgumentParser(prog=prog, description="A/B the same replay across targets.")
    p.add_argument("--target", action="append", required=True, metavar="[NAME=]URL",
                   help="repeatable; the first is the baseline")  # fmt: skip
    p.add_argument("--out", help="append per-request records to this JSONL")
    add_workload_args(p)
    args = p.parse_args(argv)
    targets = [t.split("=", 1) if "=" in t else [t, t] for t in args.target]
    try:
        slos = parse_slos(args.slo)
        model = args.model or served_model(targets[0][1])
        loads = workloads(args, targets[0][1], model)
    except (ValueError, OSError, KeyError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    all_out: dict[str, object] = {}
    failed = 0
    for label, reqs in loads:
        summaries = {}
        for name, url in targets:
            results = run(url, model, reqs, timeout_s=args.timeout,
                          progress=not args.no_progress, desc=f"{name} {label}")  # fmt: skip
            if args.out:
                write_jsonl(args.out, label, name, results)
            summaries[name] = summarize_replay(results, slos)
            failed += int(summaries[name]["failed"])
        all_out[label] = {n: _clean(s) for n, s in summaries.items()}
        if not args.json:
            print(f"== {label}")
            print(comparison(summaries))
    if args.json:
        print(json.dumps(all_out, indent=1))
    return 1 if failed else 0
