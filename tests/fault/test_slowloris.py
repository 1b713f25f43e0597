"""Slowloris (issue 18 part 4): request heads that never finish are cut after
`header_timeout_s`, bodies after `body_timeout_s`; normal requests are served meanwhile.

A real gateway (`security.GuardedRunner`, as `serve` and its workers build it) on a free
port, the emulated backend, and raw client sockets.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.scrape import scrape, total

from gateway.config import build
from gateway.serving.app import create_app
from gateway.serving.security import GuardedRunner
from gateway.workers.authority import Authority
from gateway.workers.remote import AuthorityLink, create_worker_app
from predictor import Embedder, LengthPredictor

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

HEADER_S = 1.0
BODY_S = 1.0
SLACK_S = 1.0
"""Generous: the timers are exact, the box is shared."""
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
BODY = json.dumps(
    {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
).encode()


@dataclass
class Gateway:
    url: str
    host: str
    port: int
    runner: GuardedRunner


@pytest.fixture
async def gateway(start_emulator: StartEmulator, embedder: Embedder) -> AsyncIterator[Gateway]:
    emu = await start_emulator(time_scale=0.05)
    cfg = build({
        "backends": [{"url": emu, "max_inflight": 8}], "port": 1, "policy": "fcfs",
        "adaptive_cap": {"enabled": False}, "health_interval_s": 0.5,
        "header_timeout_s": HEADER_S, "body_timeout_s": BODY_S,
    })  # fmt: skip
    app = create_app(cfg, predictor=LengthPredictor(embedder=embedder))
    runner = GuardedRunner(app, cfg, handler_cancellation=True, access_log=None)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
    port = int(runner.addresses[0][1])
    try:
        yield Gateway(f"http://127.0.0.1:{port}", "127.0.0.1", port, runner)
    finally:
        await runner.cleanup()


async def closed_after(reader: asyncio.StreamReader, start: float) -> float:
    """Seconds from `start` until the server closes the connection (EOF or reset)."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        pass
    return time.monotonic() - start


async def trickle(gw: Gateway, data: bytes, every_s: float) -> float:
    """Connect and send `data` a byte every `every_s` (never finishing): seconds to the cut."""
    reader, writer = await asyncio.open_connection(gw.host, gw.port)
    start = time.monotonic()
    closed = asyncio.create_task(closed_after(reader, start))
    try:
        for byte in data:
            if closed.done():
                break
            writer.write(bytes([byte]))
            await asyncio.sleep(every_s)
        return await closed
    except ConnectionError:
        return await closed
    finally:
        writer.close()


async def chat(session: aiohttp.ClientSession, gw: Gateway) -> float:
    start = time.monotonic()
    async with session.post(gw.url + "/v1/chat/completions", data=BODY) as r:
        assert r.status == 200, await r.text()
        await r.read()
    return time.monotonic() - start


async def test_200_slowloris_connections_are_cut_and_normal_requests_served(
    gateway: Gateway,
) -> None:
    """200 connections sending their head a byte every 0.1 s (100 of them) or nothing (100):
    each is cut between `header_timeout_s` and it plus the slack; requests sent meanwhile
    over other connections are answered; the cuts are counted, not as requests."""
    gw = gateway
    async with aiohttp.ClientSession() as s:
        await chat(s, gw)  # warm up
        before = await scrape(gw.url + "/metrics")
        lorises = [asyncio.create_task(trickle(gw, HEAD, 0.1)) for _ in range(100)]
        lorises += [asyncio.create_task(trickle(gw, b"", 0.1)) for _ in range(100)]
        served = [await chat(s, gw) for _ in range(10)]  # while the 200 hang on
        cut_after = await asyncio.gather(*lorises)
        after = await scrape(gw.url + "/metrics")
    print(f"cut after {min(cut_after):.2f}-{max(cut_after):.2f} s; served in {max(served):.3f} s")
    assert all(HEADER_S - 0.05 <= t <= HEADER_S + SLACK_S for t in cut_after), cut_after
    assert max(served) < HEADER_S  # answered while the slow heads were still open
    cuts = total(after, "sagesched_connections_cut_total", reason="header_timeout")
    assert cuts - total(before, "sagesched_connections_cut_total", reason="header_timeout") == 200
    requests = total(after, "sagesched_requests_total") - total(before, "sagesched_requests_total")
    assert requests == 10
    assert gw.runner.guard.cuts["header_timeout"] == 200


async def test_keep_alive_connection_header_deadline(gateway: Gateway) -> None:
    """After a response, an idle keep-alive connection stays open past `header_timeout_s`;
    the next request's head, once begun, must finish within it."""
    gw = gateway
    reader, writer = await asyncio.open_connection(gw.host, gw.port)
    try:
        for _ in range(2):  # two complete requests on the connection, idle between them
            writer.write(HEAD + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)
            status = await reader.readline()
            assert status.startswith(b"HTTP/1.1 200"), status
            length = 0
            while (line := await reader.readline()) != b"\r\n":
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            assert json.loads(await reader.readexactly(length))["object"] == "chat.completion"
            await asyncio.sleep(HEADER_S + 0.5)  # idle: not a slow head
        start = time.monotonic()
        closed = asyncio.create_task(closed_after(reader, start))
        writer.write(HEAD[:10])  # a third head begun and never finished
        assert HEADER_S - 0.05 <= await closed <= HEADER_S + SLACK_S
    finally:
        writer.close()
    assert gw.runner.guard.cuts["header_timeout"] == 1


async def test_slow_body_gets_408_and_is_counted(gateway: Gateway) -> None:
    """A head that announces 100 bytes and sends 10: 408 `body_timeout` (JSON) after
    `body_timeout_s`, counted as a rejected request, and the connection closed."""
    gw = gateway
    reader, writer = await asyncio.open_connection(gw.host, gw.port)
    start = time.monotonic()
    try:
        writer.write(HEAD + b"Content-Length: 100\r\n\r\n" + BODY[:10])
        answer = await asyncio.wait_for(reader.read(), BODY_S + SLACK_S + 5)
        took = time.monotonic() - start
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(body)["error"]["code"] == "body_timeout"
    assert BODY_S - 0.05 <= took <= BODY_S + SLACK_S, took
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="rejected", code="408") == 1
    assert gw.runner.guard.cuts["header_timeout"] == 0


async def test_workers_cut_slow_heads_and_count_them_in_the_merged_metrics(
    start_emulator: StartEmulator, embedder: Embedder, tmp_path: Path
) -> None:
    """`serve --workers 2` in process, each worker on `GuardedRunner` (as `workers._worker`
    builds it): slow heads to both workers are cut in time, a normal request is served, and
    the authority's merged `/metrics` counts every cut once."""
    emu = await start_emulator(time_scale=0.05)
    cfg = build({
        "backends": [{"url": emu, "max_inflight": 8}], "port": 1, "policy": "fcfs",
        "adaptive_cap": {"enabled": False}, "health_interval_s": 0.5, "workers": 2,
        "header_timeout_s": HEADER_S,
    })  # fmt: skip
    path = str(tmp_path / "authority.sock")
    authority = Authority(cfg)
    await authority.start(path)
    links: list[AuthorityLink] = []
    workers: list[Gateway] = []
    try:
        for i in range(2):
            link = await AuthorityLink.connect(path, i, cfg)
            links.append(link)
            app = create_worker_app(cfg, link, embedder=embedder)
            runner = GuardedRunner(app, cfg, handler_cancellation=True, access_log=None)
            await runner.setup()
            await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
            port = int(runner.addresses[0][1])
            workers.append(Gateway(f"http://127.0.0.1:{port}", "127.0.0.1", port, runner))
            link.ready()
        assert await authority.wait_workers(2, 10)
        lorises = [asyncio.create_task(trickle(w, HEAD, 0.1)) for w in workers for _ in range(5)]
        async with aiohttp.ClientSession() as s:
            served = await chat(s, workers[1])
        cut_after = await asyncio.gather(*lorises)
        samples = await scrape(workers[0].url + "/metrics")  # every process's, merged
    finally:
        for w in workers:
            await w.runner.cleanup()
        for link in links:
            await link.close()
        await authority.stop()
    assert served < HEADER_S
    assert all(HEADER_S - 0.05 <= t <= HEADER_S + SLACK_S for t in cut_after), cut_after
    assert [w.runner.guard.cuts["header_timeout"] for w in workers] == [5, 5]
    assert total(samples, "sagesched_connections_cut_total", reason="header_timeout") == 10
