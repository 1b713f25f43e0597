"""Round trip of a worker's admission to the host's scheduling authority (`serve --workers N`).

The authority runs here (its pool health-checks a stub backend that answers `/health` and
`/v1/models`; nothing is ever sent to it); a spawned worker process connects over the Unix
socket and, one request at a time on an idle queue, enters a `RemoteSlot` (admit), waits for
its grant and reports the attempt completed: the admit→grant round trip is what a request
that starts at once pays for the authority. `--concurrent K` keeps K requests in flight
(admit → grant → completed, each in its own task) and reports the messages per second one
authority sustains.

Run: `python bench/authority_rtt.py [--requests 5000] [--concurrent 64]` (a few seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time

import aiohttp
from aiohttp import web

from gateway.config import build
from gateway.observability.metrics import RequestTrace
from gateway.scheduling.slot import Attempt
from gateway.serving.openai_api import parse_call
from gateway.workers.authority import REQUEST_OPS, Authority


async def stub_backend() -> tuple[web.AppRunner, str]:
    app = web.Application()

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def config_for(url: str):  # type: ignore[no-untyped-def]
    return build({"backends": [{"url": url, "max_inflight": 100_000}], "policy": "fcfs",
                  "adaptive_cap": {"enabled": False}})  # fmt: skip


def run(coro):  # type: ignore[no-untyped-def]
    """On uvloop, as `sagesched serve` runs."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def worker(path: str, url: str, requests: int, concurrent: int, out: object) -> None:
    run(_worker(path, url, requests, concurrent, out))


async def _worker(path: str, url: str, requests: int, concurrent: int, out: object) -> None:
    from gateway.workers.remote import AuthorityLink
    from policies import parse_policy

    config = config_for(url)
    link = await AuthorityLink.connect(path, 0, config)
    async with aiohttp.ClientSession() as session:
        _, dispatcher = link.attach(session, parse_policy("fcfs"), config)
    call = parse_call("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 16, "stream": True})  # fmt: skip

    async def one() -> float:
        trace = RequestTrace(model="m", arrived=time.monotonic(), policy="fcfs")
        job = dispatcher.new_job(call, trace, None)
        t0 = time.perf_counter()
        async with dispatcher.slot(job) as slot:
            await slot.granted()
            rtt = time.perf_counter() - t0
            slot.tokens(16)
            slot.ended(Attempt.COMPLETED)
        return rtt

    for _ in range(200):  # warm-up
        await one()
    rtts = [await one() for _ in range(requests)]
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(concurrent)

    async def bounded() -> float:
        async with sem:
            return await one()

    await asyncio.gather(*(bounded() for _ in range(requests)))
    elapsed = time.perf_counter() - t0
    view = await link.call("queue")  # the authority's counts of this connection's messages
    out.put((rtts, requests / elapsed, view["workers"][0]))  # type: ignore[attr-defined]
    await link.close()


async def main(requests: int, concurrent: int) -> None:
    runner, url = await stub_backend()
    folder = tempfile.mkdtemp(prefix="sagesched-rtt-")
    path = os.path.join(folder, "authority.sock")
    authority = Authority(config_for(url))
    await authority.start(path)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=worker, args=(path, url, requests, concurrent, out))
    proc.start()
    rtts, rate, conn = await asyncio.to_thread(out.get)
    await asyncio.to_thread(proc.join)
    admitted = conn["admitted"]
    per_request = sum(conn["received"].get(op, 0) for op in REQUEST_OPS) / admitted
    answers = sum(conn["sent"].get(op, 0) for op in ("admitted", "grant", "review", "error"))
    await authority.stop()
    await runner.cleanup()
    us = sorted(r * 1e6 for r in rtts)
    print(f"admit→grant on an idle queue, {requests} requests one at a time:")
    print(f"  median {statistics.median(us):.0f} µs, p90 {us[int(0.9 * len(us))]:.0f} µs, "
          f"p99 {us[int(0.99 * len(us))]:.0f} µs")  # fmt: skip
    print(f"{concurrent} in flight: {rate:,.0f} requests/s through one authority; per request "
          f"{per_request:.2f} messages to it, {answers / admitted:.2f} back")  # fmt: skip


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--concurrent", type=int, default=64)
    a = p.parse_args()
    run(main(a.requests, a.concurrent))
