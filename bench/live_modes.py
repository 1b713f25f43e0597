"""Deploy modes on the real vLLM CPU build, side by side in interleaved rounds.

    python bench/live_modes.py                       # the default arms, 3 rounds
    python bench/live_modes.py --rounds 1 --arms direct,fcfs@16,sagesched@16

The window is the real-engine validation's (`tests/integration/test_validation_real_vllm.py`:
LSSP Azure-2024 window 0, first 80 requests, ShareGPT prompts padded to the trace's lengths,
load factor 1.0). vLLM runs pinned to the first half of the CPUs, this script and the gateways
on the rest, each arm with its own prompt tag and a fresh gateway; every round runs every arm,
the order rotated each round, and each ratio is taken inside a round, then the median over
rounds. Arms:

- `direct`: vLLM alone (FCFS server);
- `fcfs`, `sagesched`: the gateway with shipped defaults (self-tuning cap) on the FCFS server
  (`sagesched` is "hold only");
- `POLICY@N`: the gateway with a fixed cap N (self-tuning off);
- `priority-only`: a server with `--scheduling-policy priority`, the gateway forwarding each
  request's key as vLLM `priority` and holding nothing (cap 1024, self-tuning off);
- `hold+priority`: the same server, the gateway with shipped defaults and priority forwarding.

Prints a table (mean TTLT, ratios to vLLM alone and to gateway FCFS, TTFT, cap at the end)
and writes `--out` (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.replay.cli import run  # noqa: E402
from loadgen.replay.client import ReplayRequest  # noqa: E402
from loadgen.replay.prompts import build_requests, tokenize_counter  # noqa: E402
from loadgen.replay.report import summarize_replay  # noqa: E402
from loadgen.replay.validation import (  # noqa: E402
    LIVE_WINDOW,
    GatewayArm,
    tagged,
    through_gateway,
    warm_up,
    window_trace,
)
from loadgen.vllm_real import CACHE, RealVllm, split_cpus  # noqa: E402

DEFAULT_ARMS = "direct,fcfs,sagesched,fcfs@16,sagesched@16,priority-only,hold+priority"


def arm_spec(name: str) -> tuple[bool, GatewayArm | None]:
    """(runs on the priority server, how it goes through the gateway; None = direct)."""
    if name == "direct":
        return False, None
    if name == "priority-only":
        return True, GatewayArm("sagesched", cap=1024, adaptive=False, priority=True)
    if name == "hold+priority":
        return True, GatewayArm("sagesched", priority=True)
    policy, _, cap = name.partition("@")
    if cap:
        return False, GatewayArm(policy, cap=int(cap), adaptive=False)
    return False, GatewayArm(policy)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=DEFAULT_ARMS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(CACHE / "live_modes.json"))
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    specs = {a: arm_spec(a) for a in arms}
    engine, front = split_cpus()
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        servers = {False: stack.enter_context(RealVllm(cpus=engine))}
        if any(on_priority for on_priority, _ in specs.values()):
            servers[True] = stack.enter_context(RealVllm(priority=True, cpus=engine))
        os.sched_setaffinity(0, front)
        reqs = _requests(list(servers.values()))
        rounds = []
        tags = iter(f"run{i}" for i in range(10_000))
        for i in range(args.rounds):
            order = arms[i % len(arms) :] + arms[: i % len(arms)]
            rounds.append({a: _one(servers[specs[a][0]], reqs, specs[a][1], next(tags))
                           for a in order})  # fmt: skip
            print(f"round {i + 1}/{args.rounds} done ({time.monotonic() - t0:.0f} s)", flush=True)
    report = _report(arms, rounds)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(_table(arms, report))
    print(f"\n({report['wall_s']:.0f} s; written {args.out})")
    return 0


def _requests(servers: list[RealVllm]) -> list[ReplayRequest]:
    """The window's requests (prompts sized by the first server's tokenizer); every server
    warmed up first (a fresh one is slow on its first batch shapes)."""
    count = tokenize_counter(servers[0].url, servers[0].name)
    trace = window_trace(**LIVE_WINDOW)  # type: ignore[arg-type]
    reqs = build_requests(trace, prompts="sample", count_tokens=count, pad=True)
    for s in servers:
        with s.quiet():
            warm_up(s.url, s.name)
    return reqs


def _one(server: RealVllm, reqs: list[ReplayRequest], arm: GatewayArm | None,
         tag: str) -> dict[str, Any]:  # fmt: skip
    sent = tagged(reqs, tag)
    with server.quiet(), tempfile.TemporaryDirectory() as tmp:
        if arm is None:
            results, cap = run(server.url, server.name, sent, progress=False), None
        else:
            results, cap, _ = through_gateway(server.url, server.name, sent, arm, Path(tmp))
    s = summarize_replay(results)
    return {"ttlt_mean_s": s["e2el_s_mean"], "ttft_mean_s": s["ttft_s_mean"],
            "failed": s["failed"], "cap_at_end": cap}  # fmt: skip


def _report(arms: list[str], rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    def med(f: Any) -> float:
        return float(statistics.median(f(r) for r in rounds))

    out: dict[str, Any] = {"window": LIVE_WINDOW, "rounds": rounds, "arms": {}}
    for a in arms:
        row: dict[str, Any] = {
            "ttlt_mean_s": med(lambda r, a=a: r[a]["ttlt_mean_s"]),
            "ttft_mean_s": med(lambda r, a=a: r[a]["ttft_mean_s"]),
            "failed": sum(r[a]["failed"] for r in rounds),
            "cap_at_end": [r[a]["cap_at_end"] for r in rounds],
        }
        for base in ("direct", "fcfs"):
            if base in arms:
                row[f"over_{base}"] = med(
                    lambda r, a=a, b=base: r[a]["ttlt_mean_s"] / r[b]["ttlt_mean_s"]
                )
        out["arms"][a] = row
    return out


def _table(arms: list[str], report: dict[str, Any]) -> str:
    n = len(report["rounds"])
    lines = [
        f"{LIVE_WINDOW['n']} requests, real vLLM CPU build (pinned), {n} interleaved rounds; "
        "medians over rounds",
        "",
        "| arm | TTLT mean s | / vLLM alone | / gateway FCFS | TTFT mean s | cap at end | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in arms:
        r = report["arms"][a]
        caps = ",".join("-" if c is None else str(c) for c in r["cap_at_end"])
        lines.append(
            f"| {a} | {r['ttlt_mean_s']:.2f} | {r.get('over_direct', float('nan')):.3f} | "
            f"{r.get('over_fcfs', float('nan')):.3f} | {r['ttft_mean_s']:.2f} | {caps} | "
            f"{r['failed']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
