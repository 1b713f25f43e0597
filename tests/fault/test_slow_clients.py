"""Slow readers (issue 18 part 4): backpressure with a per-stream buffer limit, then a cut.

Real sockets throughout: the emulated backend and the gateway on this loop, and a raw client
socket whose receive buffer is tiny (SO_RCVBUF) and which reads nothing, or one byte a second.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import RunningGateway, StartGateway
from fixtures.scrape import scrape, total

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
async def slow_reader(url: str, body: dict[str, Any], *, rcvbuf: int = 4096
                      ) -> AsyncIterator[socket.socket]:  # fmt: skip
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
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
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
