"""What the gateway adds to each request, measured side by side in one run.

A zero-compute backend streams OpenAI chat chunks as fast as it can. The same closed-loop load
(C concurrent streams, short or long answers) goes straight at it, through nginx (a plain
streaming reverse proxy: the lower bound), and through the gateway with FCFS and with
SageSched (which also embeds every prompt to predict its length). The backend and the client
share core 1; each proxy gets core 0 to itself, so "req/s" is the proxy's one-core capacity
when the proxy is the bottleneck.

Run: `python bench/gateway_overhead.py [--seconds 3] [--out docs/bench/overhead.json]
[--policies fcfs,sagesched] [--outputs short,long] [--workers 1,2]` (`--workers N`: the
gateway's `serve --workers N` on cores 0..N-1). Needs nginx (`make system-deps`). Prints one
table: TTFT p50/p99, TTFT added over direct, requests/s, and requests/s as a ratio of direct.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp

from loadgen.procs import Children, free_port

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
OUTPUTS = {"short": 16, "long": 256}
CONCURRENCY = (1, 64, 256)
DISTINCT = False
"""`--distinct-prompts`: every request a new text (the predictor's embedding cache never hits);
by default every request repeats one text, as templated traffic would."""

BACKEND = textwrap.dedent(
    """
    import asyncio, json, sys
    from aiohttp import web

    def chunk(i):
        return {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
                "model": "bench", "choices": [{"index": 0, "delta": {"content": f"tok{i} "},
                "logprobs": None, "finish_reason": None}]}

    USAGE = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
             "model": "bench", "choices": [], "usage": None}

    async def chat(request):
        body = await request.json()
        n = int(body.get("max_tokens", 16))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await resp.write(b"data: " + json.dumps(chunk(i)).encode() + b"\\n\\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            counts = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": n + 8}
            u = dict(USAGE, usage=counts)
            await resp.write(b"data: " + json.dumps(u).encode() + b"\\n\\n")
        await resp.write(b"data: [DONE]\\n\\n")
        return resp

    async def health(request):
        return web.json_response({})

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    async def serve(ports):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for port in ports:  # one server, several addresses: several backends to a gateway
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    asyncio.run(serve([int(p) for p in sys.argv[1:]]))
    """
)

NGINX = textwrap.dedent(
    """
    worker_processes 1;
    daemon off;
    pid {dir}/nginx.pid;
    error_log {dir}/error.log;
    events {{ worker_connections 4096; }}
    http {{
        access_log off;
        client_body_temp_path {dir};
        proxy_temp_path {dir};
        upstream backend {{ server 127.0.0.1:{backend}; keepalive 512; }}
        server {{
            listen 127.0.0.1:{port};
            location / {{
                proxy_pass http://backend;
                proxy_http_version 1.1;
                proxy_set_header Connection "";
                proxy_buffering off;
            }}
        }}
    }}
    """
)


@contextmanager
def process(
    cmd: list[str], core: int | str, ready_url: str, env: dict[str, str] | None = None
) -> Iterator[int]:
    """Run `cmd` pinned to `core` (a CPU, or a taskset list such as "0,1") until the block
    ends; wait for `ready_url` to answer. Yields the process id of `cmd` itself (`taskset`
    execs it)."""
    full = ["taskset", "-c", str(core), *cmd] if shutil.which("taskset") else cmd
    with tempfile.TemporaryDirectory() as logs, Children(Path(logs), grace_s=15) as children:
        yield children.start("child", full, ready_url, timeout_s=120, env=env).pid


async def load(
    url: str, concurrency: int, n_tokens: int, seconds: float
) -> tuple[list[float], int]:
    """Closed loop: `concurrency` streams back to back for `seconds`. Returns TTFTs (s) and
    the number of completed requests."""
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": "Benchmark prompt, please answer."}],
        "max_tokens": n_tokens,
        "stream": True,
    }
    sent = itertools.count()
    ttfts: list[float] = []
    done = 0
    failed: Counter[str] = Counter()
    stop = time.monotonic() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < stop:
            text = f"Benchmark prompt {next(sent)}, please answer." if DISTINCT else None
            t0 = time.perf_counter()
            payload = (
                body if text is None else {**body, "messages": [{"role": "user", "content": text}]}
            )
            try:
                async with session.post(url + "/v1/chat/completions", json=payload) as r:
                    first = True
                    async for line in r.content:
                        if first and line.startswith(b"data: {"):
                            ttfts.append(time.perf_counter() - t0)
                            first = False
                    if r.status != 200:
                        failed[f"HTTP {r.status}"] += 1
                        continue
            except aiohttp.ClientError as e:
                failed[f"{type(e).__name__}: {e}"] += 1
                continue
            done += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    if n_failed := sum(failed.values()):  # kept out of the figures, and said
        print(f"{n_failed} of {n_failed + done} requests failed: {dict(failed)}", file=sys.stderr)
    return ttfts, done


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def measure(url: str, seconds: float) -> dict[str, dict[str, float]]:
    out = {}
    for out_name, n in OUTPUTS.items():
        for c in CONCURRENCY:
            asyncio.run(load(url, c, n, min(1.0, seconds)))  # warm-up: connections, caches
            ttfts, done = asyncio.run(load(url, c, n, seconds))
            out[f"{out_name}/{c}"] = {
                "ttft_p50_ms": statistics.median(ttfts) * 1000,
                "ttft_p99_ms": quantile(ttfts, 0.99) * 1000,
                "rps": done / seconds,
            }
    return out


def gateway_cmd(
    backend: int | list[int], port: int, policy: str, workers: int = 1, routing: str | None = None
) -> list[str]:
    """`sagesched serve` in front of the backend's port(s), with `--routing` if given."""
    ports = [backend] if isinstance(backend, int) else backend
    urls = [arg for p in ports for arg in ("--backend", f"http://127.0.0.1:{p}")]
    return [
        PY,
        "-m",
        "sagesched_cli",
        "serve",
        *urls,
        *(["--routing", routing] if routing else []),
        "--max-inflight",
        "4096",
        "--max-waiting",
        "100000",
        "--policy",
        policy,
        "--port",
        str(port),
        "--log-level",
        "WARNING",
        "--workers",
        str(workers),
    ]


def run(
    seconds: float,
    policies: tuple[str, ...] = ("fcfs", "sagesched"),
    workers: tuple[int, ...] = (1,),
) -> dict[str, dict[str, dict[str, float]]]:
    """Direct, nginx (core 0), then the gateway per policy and worker count: one worker on
    core 0; N workers on cores 0..N-1 (beyond core 0 shared with the backend and the client
    on a 2-core machine: the rows then show what the extra process costs and gains there)."""
    results: dict[str, dict[str, dict[str, float]]] = {}
    backend = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with (
        tempfile.TemporaryDirectory() as tmp,
        process([PY, "-c", BACKEND, str(backend)], 1, f"http://127.0.0.1:{backend}/health"),
    ):
        results["direct"] = measure(f"http://127.0.0.1:{backend}", seconds)
        if shutil.which("nginx"):
            port = free_port()
            conf = Path(tmp) / "nginx.conf"
            conf.write_text(NGINX.format(dir=tmp, backend=backend, port=port))
            with process(
                ["nginx", "-c", str(conf), "-p", tmp], 0, f"http://127.0.0.1:{port}/health"
            ):
                results["nginx"] = measure(f"http://127.0.0.1:{port}", seconds)
        for policy in policies:
            for n in workers:
                port = free_port()
                cores = ",".join(str(i) for i in range(n))
                cmd = gateway_cmd(backend, port, policy, n)
                with process(cmd, cores, f"http://127.0.0.1:{port}/ready", env):
                    name = f"gateway-{policy}" + (f"-{n}w" if n > 1 else "")
                    results[name] = measure(f"http://127.0.0.1:{port}", seconds)
    return results


def table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    direct = results["direct"]
    head = ("path", "output", "streams", "TTFT p50 ms", "TTFT p99 ms", "added p50 ms",
            "added p99 ms", "req/s", "req/s vs direct")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for path, cells in results.items():
        for cell, m in cells.items():
            out, c = cell.split("/")
            d = direct[cell]
            added50 = m["ttft_p50_ms"] - d["ttft_p50_ms"]
            added99 = m["ttft_p99_ms"] - d["ttft_p99_ms"]
            lines.append(
                f"| {path} | {out} | {c} | {m['ttft_p50_ms']:.2f} | {m['ttft_p99_ms']:.2f} | "
                f"{added50:+.2f} | {added99:+.2f} | {m['rps']:,.0f} | {m['rps'] / d['rps']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="measurement time per cell")
    parser.add_argument("--out", type=Path, help="also write the raw numbers as JSON here")
    parser.add_argument(
        "--distinct-prompts", action="store_true", help="a new prompt text for every request"
    )
    parser.add_argument("--policies", default="fcfs,sagesched", help="gateway policies to run")
    parser.add_argument("--outputs", default="short,long", help="answer lengths: short, long")
    parser.add_argument("--workers", default="1", help="gateway worker counts, e.g. 1,2")
    args = parser.parse_args()
    global DISTINCT
    DISTINCT = args.distinct_prompts
    for name in set(OUTPUTS) - set(args.outputs.split(",")):
        del OUTPUTS[name]
    workers = tuple(int(n) for n in args.workers.split(","))
    results = run(args.seconds, tuple(args.policies.split(",")), workers)
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
