"""Slow readers (issue 18 part 4): backpressure with a per-stream buffer limit, then a cut.

Real sockets throughout: the emulated backend and the gateway on this loop, and a raw client
socket whose receive buffer is tiny (SO_RCVBUF) and which reads nothing, or one byte a second.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import RunningGateway, StartGateway
from fixtures.route_backends import route_backend
from fixtures.scrape import scrape, total

from gateway.serving.app import DRAIN

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

LIMIT = 16_384
"""stream_buffer_bytes of these tests."""
WRITE_MAX = 8_192
"""Generous bound on one relay write (one upstream read's events; ~200 bytes per token)."""


def chat(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


@asynccontextmanager
async def slow_reader(
    url: str, body: dict[str, Any], *, rcvbuf: int = 4096, path: str = "/v1/chat/completions"
) -> AsyncIterator[socket.socket]:
    """A streaming request on a raw socket with a tiny receive buffer; the caller reads."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, (host, int(port)))
        raw = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
        )
        await loop.sock_sendall(sock, head.encode() + raw)
        yield sock
    finally:
        sock.close()


async def stream_ttlt(session: aiohttp.ClientSession, url: str, tokens: int) -> float:
    """A normal client's stream, read as fast as it comes: seconds to its last byte."""
    start = time.monotonic()
    async with session.post(url + "/v1/chat/completions", json=chat(tokens)) as r:
        assert r.status == 200
        body = await r.read()
    assert body.endswith(b"data: [DONE]\n\n")
    return time.monotonic() - start


async def read_to_end(sock: socket.socket) -> bytes | None:
    """Everything left until the gateway's close (None: reset); fails if it stays open."""
    loop, out = asyncio.get_running_loop(), b""
    try:
        while data := await asyncio.wait_for(loop.sock_recv(sock, 65536), 5):
            out += data
    except ConnectionResetError:
        return None
    return out


def buffered(gw: RunningGateway) -> int:
    """Largest write buffer among the gateway's client connections now."""
    sizes = [
        c.transport.get_write_buffer_size()
        for c in gw.runner.server.connections  # type: ignore[union-attr]
        if c.transport is not None
    ]
    return max(sizes, default=0)


async def watch_buffers(gw: RunningGateway, peak: list[int]) -> None:
    while True:
        peak[0] = max(peak[0], buffered(gw))
        await asyncio.sleep(0.005)


async def until(cond: Any, timeout_s: float) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def test_slow_reader_is_cut_and_its_slot_freed(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    """One backend slot; a reader that reads nothing holds it until `slow_client_timeout_s`,
    then is cut (`client_too_slow`), its upstream request aborted, and the queued request
    starts. Its write buffer never passes the limit plus one write."""
    emu = await start_emulator(time_scale=0.05)
    gw = await start_gateway(
        [{"url": emu, "max_inflight": 1}], policy="fcfs",
        stream_buffer_bytes=LIMIT, slow_client_timeout_s=1.0,
    )  # fmt: skip
    backend = gw.state.pool.backends[0]
    peak = [0]
    watcher = asyncio.create_task(watch_buffers(gw, peak))
    try:
        async with slow_reader(gw.url, chat(1900)) as sock, aiohttp.ClientSession() as s:
            await until(lambda: backend.inflight == 1, 10)
            started = time.monotonic()
            queued = asyncio.create_task(stream_ttlt(s, gw.url, 20))
            await until(lambda: gw.state.dispatcher.waiting() == 1, 10)
            await queued  # starts only once the slow reader's slot is free
            freed_after = time.monotonic() - started
            samples = await scrape(gw.url + "/metrics")
            emu_samples = await scrape(emu + "/metrics")
            received = await read_to_end(sock)  # what the cut left in the kernel buffers
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    print(f"slot freed after {freed_after:.2f} s, peak write buffer {peak[0]} bytes")
    assert total(samples, "sagesched_requests_total", outcome="client_too_slow", code="200") == 1
    assert total(samples, "sagesched_requests_total", outcome="completed") == 1
    assert total(samples, "sagesched_requests_total") == 2
    # the cut comes after the timeout (1 s) and the time to fill the buffers, not much later
    assert 1.0 <= freed_after < 8.0, freed_after
    assert LIMIT // 2 < peak[0] <= LIMIT + WRITE_MAX, peak[0]
    assert total(emu_samples, "vllm:num_requests_running") == 0  # the upstream was aborted
    assert received is None or b"[DONE]" not in received  # cut (reset), not finished
    assert backend.inflight == 0


async def test_slow_reader_does_not_stall_other_streams(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    """Four normal streams take as long with a reader of one byte a second beside them as
    without it (generous bound: load on a shared box), and that reader's buffer stays
    bounded while it is served (no cut within the test: timeout 60 s)."""
    emu = await start_emulator(time_scale=0.05)
    gw = await start_gateway(
        [{"url": emu, "max_inflight": 8}], policy="fcfs",
        stream_buffer_bytes=LIMIT, slow_client_timeout_s=60.0,
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        await stream_ttlt(s, gw.url, 10)  # warm the connections
        alone = await asyncio.gather(*(stream_ttlt(s, gw.url, 400) for _ in range(4)))
        peak = [0]
        watcher = asyncio.create_task(watch_buffers(gw, peak))
        async with slow_reader(gw.url, chat(1900)) as sock:
            reads = 0

            async def trickle() -> None:
                nonlocal reads
                while True:
                    reads += len(await loop.sock_recv(sock, 1))
                    await asyncio.sleep(1.0)

            reader = asyncio.create_task(trickle())
            await until(lambda: buffered(gw) > LIMIT // 2, 20)  # the slow stream is backed up
            beside = await asyncio.gather(*(stream_ttlt(s, gw.url, 400) for _ in range(4)))
            reader.cancel()
            watcher.cancel()
            await asyncio.gather(reader, watcher, return_exceptions=True)
        samples = await scrape(gw.url + "/metrics")
    print(f"TTLT alone {sorted(alone)}, beside {sorted(beside)}, peak buffer {peak[0]}")
    assert reads >= 1
    assert statistics.median(beside) <= 1.5 * statistics.median(alone) + 0.3, (alone, beside)
    assert peak[0] <= LIMIT + WRITE_MAX, peak[0]
    assert total(samples, "sagesched_requests_total", outcome="client_too_slow") == 0


async def test_passthrough_stream_slow_reader_is_cut_and_upstream_closed(
    start_gateway: StartGateway,
) -> None:
    """A passthrough route (not queued) streams through the same bounded buffer: a reader
    that reads nothing is cut after `slow_client_timeout_s`, counted `client_too_slow`, and
    the gateway closes its upstream request (the backend sees the disconnect)."""
    upstream_gone = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(4000):  # ~4 MB over ~20 s unless cut
                await resp.write(b"data: " + b"x" * 1000 + b"\n\n")
                await asyncio.sleep(0.005)
        except (ConnectionResetError, asyncio.CancelledError):
            upstream_gone.set()
            raise
        return resp

    async with route_backend(handle) as url:
        gw = await start_gateway(
            [{"url": url, "max_inflight": 4}], policy="fcfs",
            stream_buffer_bytes=LIMIT, slow_client_timeout_s=1.0,
        )  # fmt: skip
        started = time.monotonic()
        async with slow_reader(gw.url, {"model": "tiny-llama"}, path="/v1/stream") as sock:
            await asyncio.wait_for(upstream_gone.wait(), 10)
            cut_after = time.monotonic() - started
            received = await read_to_end(sock)
        samples = await scrape(gw.url + "/metrics")
    print(f"passthrough slow reader cut after {cut_after:.2f} s")
    assert 1.0 <= cut_after <= 5.0, cut_after
    assert received is None or len(received) < 1_000_000  # cut, not the whole ~4 MB
    assert total(samples, "sagesched_requests_total", outcome="client_too_slow") == 1
    assert total(samples, "sagesched_requests_total") == 1


async def test_passthrough_stream_broken_by_the_backend_is_cut_not_ended(
    start_gateway: StartGateway,
) -> None:
    """A passthrough stream the backend breaks off mid-way reaches the client as a broken
    connection (the bytes are relayed as they came, so no clean end may follow a truncated
    stream), counted `upstream_broken` once; the next request is served."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/ok":
            return web.json_response({"ok": True})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: a\n\n")
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()  # the backend goes away mid-stream
        return resp

    async with route_backend(handle) as url:
        gw = await start_gateway([{"url": url}], policy="fcfs")
        received = b""
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientPayloadError):
                async with s.post(gw.url + "/v1/stream", json={"model": "tiny-llama"}) as r:
                    assert r.status == 200
                    async for chunk in r.content.iter_any():
                        received += chunk
            async with s.post(gw.url + "/v1/ok", json={"model": "tiny-llama"}) as r:
                assert r.status == 200
        samples = await scrape(gw.url + "/metrics")
    assert received == b"data: a\n\n"
    assert total(samples, "sagesched_requests_total", outcome="upstream_broken") == 1
    assert total(samples, "sagesched_requests_total") == 2


BIG = 4_000_000
"""Bytes of the whole answers below: far more than the socket buffers (client SO_RCVBUF
4 KiB, the gateway's send buffer capped at 2 × LIMIT) can hold."""


@asynccontextmanager
async def whole_answer_backend() -> AsyncIterator[str]:
    """A backend answering a non-streamed chat completion of `BIG` bytes (any other prompt
    than "big": a short one), and a passthrough route `/v1/big` of `BIG` bytes."""

    def answer(content: str) -> dict[str, Any]:
        return {
            "id": "c",
            "object": "chat.completion",
            "model": "tiny-llama",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
        }

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/big":
            return web.Response(body=b"x" * BIG, content_type="application/octet-stream")
        body = await request.json()
        big = body["messages"][0]["content"] == "big"
        return web.json_response(answer("y" * BIG if big else "yes"))

    async with route_backend(handle) as url:
        yield url


async def counted(gw: RunningGateway, outcome: str) -> float:
    return total(await scrape(gw.url + "/metrics"), "sagesched_requests_total", outcome=outcome)


@pytest.mark.parametrize("route", ["chat", "passthrough"])
async def test_whole_answer_never_read_is_cut_once_and_others_served(
    route: str, start_gateway: StartGateway
) -> None:
    """A non-streamed answer far larger than the socket buffers, to a client that reads
    nothing: the gateway's write waits at most `slow_client_timeout_s`, then the connection
    is cut, the request counted once (`client_too_slow`, not `completed`) and its connection,
    buffer and tasks are gone. Meanwhile (one backend slot, already free) a normal request
    is served. Both the queued route and a passthrough route."""
    timeout_s = 2.0
    async with whole_answer_backend() as url:
        gw = await start_gateway(
            [{"url": url, "max_inflight": 1}], policy="fcfs",
            stream_buffer_bytes=LIMIT, slow_client_timeout_s=timeout_s,
        )  # fmt: skip
        big = {"model": "tiny-llama", "messages": [{"role": "user", "content": "big"}]}
        small = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
        path = "/v1/chat/completions" if route == "chat" else "/v1/big"
        async with aiohttp.ClientSession() as s:
            async with s.post(gw.url + "/v1/chat/completions", json=small) as r:  # warm up
                assert r.status == 200
            tasks_before = len(asyncio.all_tasks())
            started = time.monotonic()
            async with slow_reader(gw.url, big, path=path) as sock:
                # the gateway is writing the answer: its connection's buffer holds the rest
                await until(lambda: buffered(gw) > 0, 10)
                held = buffered(gw)
                async with s.post(gw.url + "/v1/chat/completions", json=small) as r:
                    assert r.status == 200
                    assert (await r.json())["choices"][0]["message"]["content"] == "yes"
                served_beside = time.monotonic() - started
                assert await counted(gw, "client_too_slow") == 0  # still waiting for it
                while await counted(gw, "client_too_slow") == 0:
                    assert time.monotonic() - started < timeout_s + 8, "never cut"
                    await asyncio.sleep(0.02)
                cut_after = time.monotonic() - started
                await until(lambda: buffered(gw) == 0, 5)
                received = await read_to_end(sock)
            await until(lambda: len(gw.runner.server.connections) <= 1, 5)  # type: ignore[union-attr]
            tasks_after = len(asyncio.all_tasks())
        samples = await scrape(gw.url + "/metrics")
    print(
        f"{route}: {BIG - held} bytes taken by the kernel, {held} buffered, other request "
        f"served after {served_beside:.2f} s, cut after {cut_after:.2f} s"
    )
    requests = "sagesched_requests_total"
    assert total(samples, requests, outcome="client_too_slow", code="200") == 1
    assert total(samples, requests, outcome="completed") == 2  # the two small ones
    assert total(samples, requests) == 3
    assert timeout_s <= cut_after < timeout_s + 4, cut_after
    assert served_beside < timeout_s, served_beside
    assert BIG - held < 1_000_000, held  # capped kernel buffers: most of it stayed here
    assert received is None or len(received) < BIG // 2  # cut, not delivered
    assert tasks_after <= tasks_before
    assert gw.state.pool.backends[0].inflight == 0


async def test_whole_answer_client_leaving_mid_write_is_counted_once(
    start_gateway: StartGateway,
) -> None:
    """A client that closes its socket while the gateway still writes its whole answer (the
    bounded wait far off: 60 s) ends the write at once; the request is counted once,
    `cancelled_running` (the answer did not reach it), and nothing of it stays."""
    async with whole_answer_backend() as url:
        gw = await start_gateway(
            [{"url": url, "max_inflight": 1}], policy="fcfs",
            stream_buffer_bytes=LIMIT, slow_client_timeout_s=60.0,
        )  # fmt: skip
        big = {"model": "tiny-llama", "messages": [{"role": "user", "content": "big"}]}
        small = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
        async with (  # warm up: the upstream connection
            aiohttp.ClientSession() as s,
            s.post(gw.url + "/v1/chat/completions", json=small) as r,
        ):
            assert r.status == 200
        await until(lambda: not gw.runner.server.connections, 5)  # type: ignore[union-attr]
        tasks_before = len(asyncio.all_tasks())
        async with slow_reader(gw.url, big) as sock:
            await until(lambda: buffered(gw) > 0, 10)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        left = time.monotonic()  # closed with unread data and linger 0: a reset
        while await counted(gw, "cancelled_running") == 0:
            assert time.monotonic() - left < 10, "the write never noticed the client left"
            await asyncio.sleep(0.02)
        noticed_after = time.monotonic() - left
        await until(lambda: not gw.runner.server.connections, 5)  # type: ignore[union-attr]
        tasks_after = len(asyncio.all_tasks())
        samples = await scrape(gw.url + "/metrics")
    print(f"client gone noticed after {noticed_after:.2f} s")
    requests = "sagesched_requests_total"
    assert total(samples, requests, outcome="cancelled_running", code="499") == 1
    assert total(samples, requests) == 2  # and the warm-up, completed
    assert tasks_after <= tasks_before


async def test_whole_answer_cut_by_the_shutdown_mid_write_is_counted_shutdown(
    start_gateway: StartGateway,
) -> None:
    """The drain's grace runs out while the gateway still writes a whole answer to a client
    that reads nothing (bounded wait 60 s, far off): the write is cut at once, the client's
    connection closed, and the request counted once, `shutdown` (code 503), as a stream cut
    by the shutdown is."""
    async with whole_answer_backend() as url:
        gw = await start_gateway(
            [{"url": url, "max_inflight": 1}], policy="fcfs",
            stream_buffer_bytes=LIMIT, slow_client_timeout_s=60.0,
        )  # fmt: skip
        big = {"model": "tiny-llama", "messages": [{"role": "user", "content": "big"}]}
        async with slow_reader(gw.url, big) as sock:
            await until(lambda: buffered(gw) > 0, 10)
            grace_s, started = 0.2, time.monotonic()
            finished, cut = await gw.app[DRAIN].run(grace_s)
            drained_after = time.monotonic() - started
            await until(lambda: not gw.runner.server.connections, 5)  # type: ignore[union-attr]
            received = await read_to_end(sock)
        samples = await scrape(gw.url + "/metrics")
    print(f"drain with a whole answer mid-write: {drained_after:.2f} s")
    assert (finished, cut) == (0, 1)
    assert drained_after < grace_s + 2, drained_after
    assert received is None or len(received) < BIG // 2
    requests = "sagesched_requests_total"
    assert total(samples, requests, outcome="shutdown", code="503") == 1
    assert total(samples, requests) == 1
