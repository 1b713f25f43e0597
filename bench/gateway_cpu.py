"""The gateway's CPU time per request at a fixed open-loop rate, FCFS and SageSched side by side.

A zero-compute backend (the one of `gateway_overhead.py`) answers 16 streamed tokens; requests
with distinct short prompts arrive at `--rates` per second for `--seconds`; the gateway (pinned
to core 0, one torch thread) is charged the user + system CPU time its process used, divided
by the requests sent. SageSched's extra is the predictor: one embedding per prompt (MiniLM),
the neighbour query and learning the true length.

Run: `python bench/gateway_cpu.py [--rates 20,40] [--seconds 8]` (about a minute). To compare
two versions of the gateway, run it from a `git worktree` of each (the gateway process imports
the code of the current directory).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from loadgen.procs import free_port

sys.path.insert(0, str(Path(__file__).parent))
from gateway_overhead import BACKEND, PY, gateway_cmd, process

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def open_loop(url: str, rate: float, seconds: float) -> int:
    """Send `rate` × `seconds` requests on schedule (distinct prompts); wait for all."""
    n = int(rate * seconds)

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        body = {
            "model": "bench",
            "max_tokens": 16,
            "stream": True,
            "messages": [
                {"role": "user", "content": f"Question {i}: tell me about item {i * 7}, please."}
            ],
        }
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            await r.read()
            assert r.status == 200

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0, tasks = time.monotonic(), []
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(s, i)))
        await asyncio.gather(*tasks)
    return n


def measure(policy: str, backend: int, rates: list[float], seconds: float) -> dict[float, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    port = free_port()
    out = {}
    with process(gateway_cmd(backend, port, policy), 0, f"http://127.0.0.1:{port}/ready", env):
        found = subprocess.run(["pgrep", "-f", f"sagesched_cli serve.*--port {port}"],
                               capture_output=True, text=True, check=True)  # fmt: skip
        pid = int(found.stdout.split()[0])
        url = f"http://127.0.0.1:{port}"
        asyncio.run(open_loop(url, rates[0], 2.0))  # warm-up
        for rate in rates:
            time.sleep(2.0)  # background work of the previous step settles
            before = cpu_s(pid)
            n = asyncio.run(open_loop(url, rate, seconds))
            time.sleep(2.0)  # learning runs after the responses
            out[rate] = (cpu_s(pid) - before) * 1000 / n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="20,40", help="requests per second, comma-separated")
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    backend = free_port()
    with process([PY, "-c", BACKEND, str(backend)], 1, f"http://127.0.0.1:{backend}/health"):
        got = {p: measure(p, backend, rates, args.seconds) for p in ("fcfs", "sagesched")}
    print("| rate req/s | FCFS CPU ms/request | SageSched CPU ms/request | SageSched / FCFS |")
    print("|---:|---:|---:|---:|")
    for r in rates:
        f, s = got["fcfs"][r], got["sagesched"][r]
        print(f"| {r:g} | {f:.2f} | {s:.2f} | {s / f:.2f} |")


if __name__ == "__main__":
    main()
