"""CPU time per request at a fixed open-loop rate: nginx, the gateway with FCFS (and SageSched).

A zero-compute backend (the one of `gateway_overhead.py`) answers 16 streamed tokens; requests
with distinct short prompts arrive at `--rates` per second for `--seconds`. Each proxy in turn
(nginx with `proxy_buffering off` and upstream keepalive, one worker: the lower bound for a
streaming proxy; then the gateway, one torch thread) is pinned to core 0, the backend and this
client to core 1 (`--client-core`; every write to the client then wakes a process on the other
core, which costs the proxy more than a wake-up on its own core), and the proxy is charged the
user + system CPU time of its processes (nginx: master and worker; the gateway: its one
process) over the requests sent. CPU time, unlike wall-clock latency, moves little when other
work shares the machine, so the figures compare across runs; `--repeat` measures each rate
that many times per proxy and prints the range. The proxies run side by side and take turns,
one measurement each, so a slow spell of the machine falls on all of them. SageSched's extra
is the predictor: one embedding per prompt (MiniLM), the neighbour query and learning the
true length.

Run: `python bench/gateway_cpu.py [--rates 20,40] [--seconds 8] [--repeat 3]
[--policies fcfs,sagesched] [--client-core 1]` (about a minute per proxy and repeat).
What routing costs: `--routings least-loaded,prefix,sagesched --backends 8 --prompts shared
--policies fcfs` runs the gateway once per router in front of 8 backend addresses (one
zero-compute server) and prints each router's CPU per request and what it adds over
least-loaded (the prompt's chain, the decision over 8 backends, the index update). To
compare two versions of the gateway, run it from a `git worktree` of each (the gateway process
imports the code of the current directory). What tracing costs: `--tracings off,1,0.01
--policies fcfs` runs the gateway with tracing off, then on at each sample ratio, exporting over
OTLP/HTTP to a receiver on the client's core (`RECEIVER`: reads each export, answers 200), and
prints each one's CPU per request and its ratio to tracing off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import aiohttp

from loadgen.procs import free_port

sys.path.insert(0, str(Path(__file__).parent))
from gateway_overhead import BACKEND, NGINX, PY, gateway_cmd, process


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of process `pid`: the scheduler's own count
    (`schedstat`, nanoseconds), not the 10 ms ticks of `/proc/PID/stat`, which undercount a
    proxy that runs in short bursts between ticks."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds of process `pid`, all its live threads."""
    return sum(thread_cpu_s(pid).values())


def tree(pid: int) -> list[int]:
    """`pid` and its live descendants (nginx: the master and its workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            todo.extend(int(c) for c in (task / "children").read_text().split())
    return out


def tree_cpu_s(pid: int) -> float:
    return sum(cpu_s(p) for p in tree(pid))


def short_prompt(i: int) -> list[dict[str, str]]:
    """A distinct one-line question (no full 64-character block: nothing for a prefix index)."""
    return [{"role": "user", "content": f"Question {i}: tell me about item {i * 7}, please."}]


SYSTEMS = 16
"""Distinct system prompts of `shared_prompt`."""


def shared_prompt(i: int) -> list[dict[str, str]]:
    """One of `SYSTEMS` system prompts of about 1,300 characters (about 20 blocks of 64),
    then a distinct question: what a prefix router indexes and matches, request after
    request (agents, RAG templates)."""
    system = f"You are assistant {i % SYSTEMS}. " + "Answer briefly and cite sources. " * 40
    return [{"role": "system", "content": system}, *short_prompt(i)]


def repeated_prompt(i: int) -> list[dict[str, str]]:
    """The same question every time: each embedding after the first is a cache hit, so what
    SageSched costs beyond the embedder's forward pass shows."""
    return short_prompt(0)


PROMPTS = {"short": short_prompt, "shared": shared_prompt, "repeated": repeated_prompt}


SENT = itertools.count()
"""Requests sent by this process: each request's prompt is `prompt(next(SENT))`, so no two in
a run are the same (a repeated one would be an embedding-cache hit)."""


async def open_loop(
    url: str, rate: float, seconds: float, prompt: Callable[[int], Any] = short_prompt
) -> int:
    """Send `rate` × `seconds` requests on schedule, each with a prompt not sent before in this
    run; wait for all."""
    n = int(rate * seconds)

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        body = {"model": "bench", "max_tokens": 16, "stream": True, "messages": prompt(i)}
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            await r.read()
            assert r.status == 200

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0, tasks = time.monotonic(), []
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(s, next(SENT))))
        await asyncio.gather(*tasks)
    return n


Proxy = Callable[[], tuple[int, AbstractContextManager[int]]]
"""Starts a proxy: its port, and the block that runs it (yielding its process id)."""


def measure(
    proxies: dict[str, Proxy],
    rates: list[float],
    seconds: float,
    repeat: int,
    prompt: Callable[[int], Any] = short_prompt,
) -> dict[str, dict[float, list[float]]]:
    """CPU ms per request of each proxy's process tree, `repeat` times at each rate. The
    proxies run side by side (an idle one costs nothing) and take turns, measurement by
    measurement, so that a slow spell of the machine falls on all of them alike."""
    out: dict[str, dict[float, list[float]]] = {name: {r: [] for r in rates} for name in proxies}
    with ExitStack() as stack:
        running = {}
        for name, start in proxies.items():
            port, proxy = start()
            running[name] = (f"http://127.0.0.1:{port}", stack.enter_context(proxy))
        for url, _ in running.values():
            asyncio.run(open_loop(url, rates[0], 2.0, prompt))  # warm-up: connections, caches
        for _ in range(repeat):
            for rate in rates:
                for name, (url, pid) in running.items():
                    time.sleep(2.0)  # background work of the previous step settles
                    before = tree_cpu_s(pid)
                    n = asyncio.run(open_loop(url, rate, seconds, prompt))
                    time.sleep(2.0)  # the gateway's learning runs after the responses
                    out[name][rate].append((tree_cpu_s(pid) - before) * 1000 / n)
    return out


def nginx(backend: int, tmp: str) -> Proxy:
    def start() -> tuple[int, AbstractContextManager[int]]:
        port = free_port()
        conf = Path(tmp) / "nginx.conf"
        conf.write_text(NGINX.format(dir=tmp, backend=backend, port=port))
        ready = f"http://127.0.0.1:{port}/health"
        return port, process(["nginx", "-c", str(conf), "-p", tmp], 0, ready)

    return start


def gateway(
    backend: int | list[int],
    policy: str,
    routing: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> Proxy:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(extra_env or {})}

    def start() -> tuple[int, AbstractContextManager[int]]:
        port = free_port()
        ready = f"http://127.0.0.1:{port}/ready"
        cmd = gateway_cmd(backend, port, policy, routing=routing)
        return port, process(cmd, 0, ready, env)

    return start


def span(xs: list[float]) -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}"


def table(got: dict[str, dict[float, list[float]]], rates: list[float]) -> str:
    """One row per rate: each proxy's ms/request (range over repeats) and the ratios of the
    medians to nginx (FCFS) and to FCFS (SageSched)."""
    med = {p: {r: sorted(v)[len(v) // 2] for r, v in cells.items()} for p, cells in got.items()}
    head = ["rate req/s", "nginx CPU ms/request", "FCFS CPU ms/request", "FCFS / nginx"]
    if "sagesched" in got:
        head += ["SageSched CPU ms/request", "SageSched / FCFS"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rates:
        row = [f"{r:g}", span(got["nginx"][r]), span(got["fcfs"][r])]
        row.append(f"{med['fcfs'][r] / med['nginx'][r]:.2f}")
        if "sagesched" in got:
            row += [span(got["sagesched"][r]), f"{med['sagesched'][r] / med['fcfs'][r]:.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def against_baseline(
    got: dict[str, dict[float, list[float]]],
    rates: list[float],
    baseline: str,
    label: Callable[[str], str],
    compare: Callable[[float, float], str],
    heading: str,
) -> str:
    """One row per rate: the baseline's CPU ms/request and each other variant's (ranges over
    repeats, headed `label(name)`), each with `compare(its median, the baseline's)` under
    `heading` (formatted with `name` and `base`)."""
    med = {p: {r: sorted(v)[len(v) // 2] for r, v in cells.items()} for p, cells in got.items()}
    others = [name for name in got if name != baseline]
    head = ["rate req/s", f"{label(baseline)} CPU ms/request"]
    for name in others:
        head += [f"{label(name)} CPU ms/request", heading.format(name=name, base=baseline)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rates:
        row = [f"{r:g}", span(got[baseline][r])]
        for name in others:
            row += [span(got[name][r]), compare(med[name][r], med[baseline][r])]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def added_us(value: float, base: float) -> str:
    return f"{(value - base) * 1000:+.0f}"


def ratio(value: float, base: float) -> str:
    return f"{value / base:.3f}"


def routing_table(got: dict[str, dict[float, list[float]]], rates: list[float]) -> str:
    """Each router's gateway CPU ms/request and what it adds over `least-loaded` (difference
    of the medians, µs/request)."""
    return against_baseline(
        got, rates, "least-loaded", lambda name: name, added_us, "{name} − {base} µs"
    )


RECEIVER = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Receiver(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Receiver).serve_forever()
"""
"""An OTLP/HTTP endpoint that takes every export and answers 200 (a collector's cheapest)."""


def tracing_env(ratio: str, receiver: int) -> dict[str, str]:
    """The gateway's environment for tracing `ratio` ("off" or a sample ratio)."""
    if ratio == "off":
        return {}
    endpoint = f"http://127.0.0.1:{receiver}/v1/traces"
    return {"SAGESCHED_TRACING": "true", "OTEL_TRACES_SAMPLER_ARG": ratio,
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}  # fmt: skip


def tracing_table(got: dict[str, dict[float, list[float]]], rates: list[float]) -> str:
    """CPU ms/request with tracing off and at each sample ratio, and each ratio's median over
    tracing off's."""
    return against_baseline(
        got, rates, "off", lambda name: "tracing off" if name == "off" else f"sample {name}",
        ratio, "{name} / {base}",
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="20,40", help="requests per second, comma-separated")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--repeat", type=int, default=1, help="measurements per rate and proxy")
    ap.add_argument("--policies", default="fcfs,sagesched", help="gateway policies (fcfs first)")
    ap.add_argument("--client-core", type=int, default=1, help="this client's core (-1: any)")
    ap.add_argument("--routings", help="compare these routers (least-loaded first) behind "
                    "the first policy instead of nginx and the policies")  # fmt: skip
    ap.add_argument("--tracings", help="compare tracing off and these sample ratios (off "
                    "first, e.g. off,1,0.01) behind the first policy")  # fmt: skip
    ap.add_argument("--backends", type=int, default=1, help="backend addresses (one server)")
    ap.add_argument("--prompts", choices=sorted(PROMPTS), default="short",
                    help="short: distinct one-liners; shared: 16 system prompts of ~1,300 "
                    "characters, then a distinct question; repeated: one question every time "
                    "(embedding-cache hits)")  # fmt: skip
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    policies = args.policies.split(",")
    routings = args.routings.split(",") if args.routings else []
    tracings = args.tracings.split(",") if args.tracings else []
    if routings and routings[0] != "least-loaded":
        ap.error("--routings starts with least-loaded (the baseline)")
    if tracings and tracings[0] != "off":
        ap.error("--tracings starts with off (the baseline)")
    if not (routings or tracings) and ("fcfs" not in policies or not shutil.which("nginx")):
        ap.error("needs nginx (`make system-deps`) and fcfs among --policies")
    if args.client_core >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.client_core})  # beside the backend: core 0 is the proxy's
    ports = [free_port() for _ in range(args.backends)]
    health = f"http://127.0.0.1:{ports[0]}/health"
    prompt = PROMPTS[args.prompts]
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    receiver = free_port()
    with (
        tempfile.TemporaryDirectory() as tmp,
        process([PY, "-c", BACKEND, *map(str, ports)], 1, health),
        process([PY, "-c", RECEIVER, str(receiver)], 1, f"http://127.0.0.1:{receiver}/"),
    ):
        if tracings:
            proxies = {t: gateway(ports[0], policies[0], None, tracing_env(t, receiver))
                       for t in tracings}  # fmt: skip
        elif routings:
            proxies = {r: gateway(ports, policies[0], r) for r in routings}
        else:
            proxies = {"nginx": nginx(ports[0], tmp)}
            proxies.update({p: gateway(ports[0], p) for p in policies})
        got = measure(proxies, rates, args.seconds, args.repeat, prompt)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if tracings:
        print(tracing_table(got, rates))
    else:
        print(routing_table(got, rates) if routings else table(got, rates))


if __name__ == "__main__":
    main()
