"""Routers in the live gateway, side by side in interleaved rounds: multi-turn sessions.

    python bench/routing_live.py --engine emulator --backends 4     # about 4 minutes
    python bench/routing_live.py --engine vllm --rounds 3           # two vLLM CPU servers

Real ShareGPT conversations (`loadgen.replay.sessions`: each turn resends the history, the
recorded answers as assistant turns, a think time between turns) through `sagesched serve`
in front of `--backends` engines with prefix caching, once per router per round. Every round
runs every router on the same conversations, the order rotated each round, each on empty
caches (emulators started afresh; vLLM servers' caches reset through their development
endpoint) and a fresh gateway (fixed cap `--cap` per backend, queue `--policy`). Engines:

- `emulator`: `sagesched emulate` (`cpu-tiny-vllm` at real speed, `--kv-tokens` each);
- `vllm`: two vLLM CPU servers (the tiny model), each pinned to its own CPU, `--kv-blocks`
  128-token blocks each (the gateway and this client share the machine with them).

Per router: mean TTFT and mean end-to-end latency of the turns (median over rounds), the
engines' own prefix-cache hit ratio (hits over queries), the ratios to least-loaded (inside
each round, then the median), and how unevenly the prompt tokens were spread (the busiest
engine's prefix-cache queries over the engines' mean). Prints a table; `--out` writes the
rounds as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.procs import Children, free_port, sagesched  # noqa: E402
from loadgen.replay.sessions import Session, build_sessions, replay_sessions  # noqa: E402
from loadgen.traces.sessions import ThinkTime  # noqa: E402
from loadgen.vllm_real import CACHE, MODEL_NAME, RealVllm  # noqa: E402
from loadgen.vllm_real import prefix_cache_counters as counters  # noqa: E402

ROUTERS = ("least-loaded", "round-robin", "prefix", "sagesched")


@contextmanager
def emulators(n: int, kv_tokens: int, logs: Path) -> Iterator[list[str]]:
    """`n` fresh emulators (empty caches)."""
    with Children(logs) as children:
        urls = []
        for i in range(n):
            port = free_port()
            cmd = sagesched("emulate", "--port", str(port), "--served-model-name", MODEL_NAME,
                            "--kv-tokens", str(kv_tokens))  # fmt: skip
            children.start(f"emulator-{i}", cmd, f"http://127.0.0.1:{port}/health", 60)
            urls.append(f"http://127.0.0.1:{port}")
        yield urls


def reset(url: str) -> None:
    """Empty a vLLM server's prefix cache (needs `VLLM_SERVER_DEV_MODE`)."""
    req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        if not json.loads(r.read()).get("success"):
            raise RuntimeError(f"{url}: prefix cache not reset")


def one_run(
    urls: list[str], routing: str, sessions: Sequence[Session], args: argparse.Namespace,
    logs: Path,
) -> dict[str, Any]:  # fmt: skip
    """One router over `sessions` through a fresh gateway in front of `urls`."""
    before = [counters(u) for u in urls]
    port = free_port()
    backends = [a for u in urls for a in ("--backend", u)]
    cmd = sagesched("serve", *backends, "--routing", routing, "--policy", args.policy,
                    "--max-inflight", str(args.cap), "--no-adaptive-cap", "--port", str(port),
                    "--log-level", "WARNING")  # fmt: skip
    with Children(logs) as children:
        children.start(f"gateway-{routing}", cmd, f"http://127.0.0.1:{port}/ready", 120)
        turns = asyncio.run(replay_sessions(f"http://127.0.0.1:{port}", MODEL_NAME, sessions,
                                            timeout_s=300))  # fmt: skip
    after = [counters(u) for u in urls]
    ok = [t.result for t in turns if t.result.ok]
    per_engine = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    queries = sum(per_engine)
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return {
        "routing": routing,
        "turns": len(turns),
        "failed": len(turns) - len(ok),
        "ttft_mean_s": statistics.fmean(r.ttft_s for r in ok),
        "e2e_mean_s": statistics.fmean(r.ttlt_s for r in ok),
        "hit_ratio": hits / queries if queries else float("nan"),
        "busiest": max(per_engine) / statistics.fmean(per_engine) if queries else float("nan"),
    }


def table(rounds: list[list[dict[str, Any]]], routers: Sequence[str]) -> str:
    """Per router: medians over rounds, and the median of the per-round ratios to the
    first router (least-loaded)."""
    by = [{r["routing"]: r for r in runs} for runs in rounds]
    base = routers[0]
    head = ("| router | mean TTFT ms | mean E2E ms | engines' hit ratio | TTFT / "
            f"{base} | E2E / {base} | busiest / mean | failed |")  # fmt: skip
    lines = [head, "|---|" + "---:|" * 7]
    for name in routers:
        med = {k: statistics.median(b[name][k] for b in by)
               for k in ("ttft_mean_s", "e2e_mean_s", "hit_ratio", "busiest")}  # fmt: skip
        ttft = statistics.median(b[name]["ttft_mean_s"] / b[base]["ttft_mean_s"] for b in by)
        e2e = statistics.median(b[name]["e2e_mean_s"] / b[base]["e2e_mean_s"] for b in by)
        failed = sum(b[name]["failed"] for b in by)
        lines.append(f"| {name} | {med['ttft_mean_s'] * 1000:.1f} | "
                     f"{med['e2e_mean_s'] * 1000:.1f} | {med['hit_ratio']:.3f} | {ttft:.3f} | "
                     f"{e2e:.3f} | {med['busiest']:.2f} | {failed} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("emulator", "vllm"), default="emulator")
    ap.add_argument("--backends", type=int, default=4, help="emulators (vllm: always 2)")
    ap.add_argument("--routers", default=",".join(ROUTERS), help="least-loaded first")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--session-rate", type=float, default=2.0, help="sessions started per s")
    ap.add_argument("--think-median", type=float, default=1.0, help="seconds")
    ap.add_argument("--max-output", type=int, default=32, help="tokens per answer at most")
    ap.add_argument("--cap", type=int, default=8, help="in-flight cap per backend")
    ap.add_argument("--policy", default="fcfs", help="the gateway's queue policy")
    ap.add_argument("--kv-tokens", type=int, default=16_384, help="emulator KV each (tokens)")
    ap.add_argument("--kv-blocks", type=int, default=64, help="vLLM KV each (128-token blocks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    routers = args.routers.split(",")
    if routers[0] != "least-loaded":
        ap.error("--routers starts with least-loaded (the baseline)")
    think = ThinkTime(args.think_median, 1.0, 5 * args.think_median)
    sessions = build_sessions("sharegpt", args.sessions, args.session_rate, think=think,
                              min_turns=3, max_turns=4, max_output=args.max_output,
                              seed=args.seed)  # fmt: skip
    n_turns = sum(len(s.turns) for s in sessions)
    print(f"{len(sessions)} sessions, {n_turns} turns; engine {args.engine}", file=sys.stderr)
    rounds: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        logs = Path(tmp)
        servers: list[RealVllm] = []
        if args.engine == "vllm":
            extra = ("--num-gpu-blocks-override", str(args.kv_blocks), "--enable-prefix-caching")
            servers = [stack.enter_context(RealVllm(cpus={i}, extra_args=extra, dev_mode=True,
                                                    log_path=CACHE / f"vllm-routing-{i}.log"))
                       for i in range(2)]  # fmt: skip
        for k in range(args.rounds):
            order = routers[k % len(routers) :] + routers[: k % len(routers)]
            runs = []
            for routing in order:
                if servers:
                    for s in servers:
                        reset(s.url)
                    runs.append(one_run([s.url for s in servers], routing, sessions, args, logs))
                else:
                    with emulators(args.backends, args.kv_tokens, logs) as urls:
                        runs.append(one_run(urls, routing, sessions, args, logs))
                print(json.dumps({"round": k, **runs[-1]}), file=sys.stderr)
            rounds.append(runs)
    if args.out:
        args.out.write_text(json.dumps(rounds, indent=1) + "\n")
    print(table(rounds, routers))


if __name__ == "__main__":
    main()
