"""A streamed response whose client must keep up: bounded buffer, bounded wait, then a cut.

Without it a client that reads a stream slowly blocks its relay in aiohttp's drain for as
long as it likes: upstream reads stop, the backend slot stays held, and nothing ends it. Here
each stream's write buffer (the transport's, in user space) is limited to
`stream_buffer_bytes` (its high-water mark; writing resumes at a quarter of it), and a write
that waits for the client longer than `slow_client_timeout_s` raises `ClientTooSlow`. The
relay lets it propagate: the upstream response is closed (the backend aborts the request),
the slot's exit frees the backend slot, the request's outcome is set to
`Outcome.CLIENT_TOO_SLOW`, and only then is the client connection cut (`cut`: aborted, the
buffered bytes dropped), so that the handler's cancellation on a lost connection cannot
turn the outcome into `cancelled_running` on the way.

The bound is per wait, not per stream: a client that reads slowly but steadily is served at
its own pace (its buffer never grows past the limit); only one that stops reading is cut.
Memory per stream: at most the limit plus one write (an upstream read's events) in user
space, and the socket's kernel send buffer, which is capped at the same limit (Linux doubles
it) instead of autotuning to megabytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_writer import StreamWriter


class ClientTooSlow(Exception):
    """The client did not read the stream for `slow_client_timeout_s`; the connection is cut."""


class BoundedStream(web.StreamResponse):
    """`web.StreamResponse` with a write-buffer limit and a bounded wait for the client.

    The relay writes once per upstream read, so a write costs no timer unless the buffer is
    over the limit: aiohttp's own drain (every 64 KiB written, unbounded) is kept off by
    resetting its byte counter, and this class drains instead, under the timeout, exactly
    when the transport has paused writing (its buffer passed the limit)."""

    def __init__(self, *, limit: int, timeout_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._limit = limit
        self._timeout_s = timeout_s
        self._writer: StreamWriter | None = None
        self._protocol: BaseProtocol | None = None
        self.peak_buffered = 0
        """Most bytes seen in the transport's write buffer after a write (tests, docs)."""

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        writer = await super().prepare(request)
        transport = request.transport
        if transport is not None and isinstance(writer, StreamWriter) and self._writer is None:
            _limit_buffers(transport, self._limit)
            self._writer, self._protocol = writer, request.protocol
        return writer

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        writer, protocol = self._writer, self._protocol
        if writer is None or protocol is None:
            await super().write(data)
            return
        writer.buffer_size = 0  # aiohttp's drain stays off; this one is bounded
        await super().write(data)
        if protocol.writing_paused:
            transport = protocol.transport
            if transport is not None:
                self.peak_buffered = max(self.peak_buffered, transport.get_write_buffer_size())
            await self._bounded(writer.drain())

    async def write_eof(self, data: bytes = b"") -> None:
        await self._bounded(super().write_eof(data))

    def cut(self) -> None:
        """Close the client connection now, dropping what is buffered (a plain close would
        wait for the client to read it)."""
        _abort(None if self._protocol is None else self._protocol.transport)

    async def _bounded(self, step: Awaitable[None]) -> None:
        await _within(step, self._timeout_s)


async def send_whole(
    request: web.BaseRequest, response: web.StreamResponse, *, limit: int, timeout_s: float
) -> None:
    """Write a whole answer (a `web.Response` its handler built) now, under the same bounds
    as a stream: the connection's write buffer limit and kernel send buffer capped at
    `limit`, and at most `timeout_s` waiting for the client to take it, else `ClientTooSlow`
    (the caller counts it and `cut`s the connection). aiohttp would otherwise write it after
    the handler returned, waiting as long as the client likes with the answer's bytes held.
    One timer per answer; nothing waits unless the client's buffers are full."""
    if request.transport is not None:
        _limit_buffers(request.transport, limit)
    await response.prepare(request)
    await _within(response.write_eof(), timeout_s)


def cut(request: web.BaseRequest) -> None:
    """Close a request's connection now, dropping what is buffered (`BoundedStream.cut` for
    an answer written by `send_whole`)."""
    _abort(request.transport)


async def _within(step: Awaitable[None], timeout_s: float) -> None:
    """`step`, or `ClientTooSlow` when the client has not let it finish in `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            await step
    except TimeoutError:
        raise ClientTooSlow(f"the client read nothing for {timeout_s:g} s") from None


def _abort(transport: asyncio.Transport | None) -> None:
    if transport is not None:
        transport.abort()


def _limit_buffers(transport: asyncio.Transport, limit: int) -> None:
    """The write buffer's high-water mark in user space and the kernel's send buffer."""
    transport.set_write_buffer_limits(high=limit)
    _limit_kernel_buffer(transport, limit)


def _limit_kernel_buffer(transport: asyncio.Transport, limit: int) -> None:
    """Cap the socket's kernel send buffer too (Linux doubles the value). Left alone, it
    autotunes up to `net.ipv4.tcp_wmem`'s maximum (4 MiB by default; 2.8 MB measured on
    loopback before the first byte stayed in user space): per slow reader that is memory the
    gateway holds, and minutes of tokens before the wait even starts. A token stream needs
    far less than `limit` in flight (64 KiB at 100 ms round trip is 640 KB/s)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError):  # not a TCP socket: the user-space limit only
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limit)
