"""What protects the gateway from its clients: key checks, header limits, the admin listener.

- Keys are compared in constant time (`hmac.compare_digest`, every configured key compared,
  no early exit), so response timing does not reveal how much of a guessed key was right.
  Keys are never logged: the effective-config line masks them (`config.as_dict`) and no error
  message quotes a header.
- Header limits: aiohttp's parser refuses a request whose header line is longer than
  `max_line_size`/`max_field_size` or that has more than `max_headers` headers with a plain
  400 that no middleware sees. So the parser's limits are set to twice the configured ones
  (`server_limits`) and `limits_middleware` enforces the configured ones first, as OpenAI-style
  JSON errors: 431 for too many or too large headers, 414 for a too long request target.
  Beyond twice the limit the parser's plain 400 (connection closed) is all a client gets.
- Slow clients (slowloris): a connection must finish a request's line and headers within
  `header_timeout_s` of opening, or of the first byte of a later request on it
  (`GuardedRunner`: aiohttp's server has no header read timeout of its own; its keep-alive
  timer only closes idle connections, and only after `KEEPALIVE_S`). Such a cut is not a
  request: logged at DEBUG and counted in `sagesched_connections_cut_total{reason}`. A body
  must arrive within `body_timeout_s` of its headers (`limits_middleware`): that is a
  request, answered 408 `body_timeout` (outcome rejected), and its connection is closed.
  Slow readers of a stream: `gateway.serving.backpressure`.
- `admin_listen`: the admin routes (`/admin/*`) are served only on their own address (e.g. a
  loopback or cluster-internal one), and the public address answers them 404; the admin
  address answers nothing else. `/metrics` stays on the public address, where the deployments'
  Prometheus scrapes it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gateway.config import GatewayConfig
from gateway.errors import BodyTimeout, HeadersTooLarge, NotFoundRoute, UriTooLong

log = logging.getLogger("sagesched.gateway.serving.security")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ADMIN_PREFIX = "/admin/"


def key_matches(given: str, keys: tuple[str, ...]) -> bool:
    """Is `given` one of `keys`? Constant time in the key's content: every key is compared
    (bytes, so a non-ASCII header cannot raise), no early exit."""
    raw = given.encode("utf-8", "surrogateescape")
    found = False
    for key in keys:
        found |= hmac.compare_digest(raw, key.encode("utf-8"))
    return found


KEEPALIVE_S = 75.0
"""An idle keep-alive connection is closed after this (`run_app`'s default; `AppRunner`'s
own is an hour)."""


def server_limits(config: GatewayConfig) -> dict[str, Any]:
    """aiohttp's parser limits (keyword arguments of `AppRunner`/`run_app`): twice the
    configured ones, so `limits_middleware` answers first (in JSON) up to twice the limit;
    and the idle keep-alive timeout."""
    size = 2 * config.max_header_bytes
    return {
        "max_line_size": size,
        "max_field_size": size,
        "max_headers": 2 * config.max_headers,
        "keepalive_timeout": KEEPALIVE_S,
    }


def limits_middleware(config: GatewayConfig) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Header count, header size and request target length, before any handler runs."""
    max_headers, max_bytes = config.max_headers, config.max_header_bytes

    body_timeout_s = config.body_timeout_s

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        deadline = _body_deadline(request, body_timeout_s)
        try:
            return await _check_limits(request, handler)
        finally:
            if deadline is not None:
                deadline.cancel()

    async def _check_limits(request: web.Request, handler: Handler) -> web.StreamResponse:
        if len(request.raw_path) > max_bytes:
            raise UriTooLong(f"the request target is longer than {max_bytes} bytes")
        raw = request.raw_headers
        if len(raw) > max_headers:
            raise HeadersTooLarge(f"more than {max_headers} request headers")
        for name, value in raw:
            if len(name) + len(value) > max_bytes:
                raise HeadersTooLarge(f"a request header is larger than {max_bytes} bytes")
        return await handler(request)

    return middleware


def _body_deadline(request: web.Request, timeout_s: float) -> asyncio.TimerHandle | None:
    """After `timeout_s`, a body not yet complete fails its readers with `BodyTimeout`."""
    content = request.content
    if content.is_eof():
        return None

    def expire() -> None:
        if not content.is_eof():
            content.set_exception(BodyTimeout(f"the request body took longer than {timeout_s:g} s"))

    return asyncio.get_running_loop().call_later(timeout_s, expire)


# -- slowloris: the header deadline ----------------------------------------------------------

CUT_REASONS = ("header_timeout",)
"""Labels of `sagesched_connections_cut_total`."""


@dataclass
class ConnectionGuard:
    """The header deadline's settings and what it cut (counts, and the metrics' hook)."""

    header_timeout_s: float
    cuts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CUT_REASONS, 0))
    on_cut: Callable[[str], None] | None = None

    def cut(self, reason: str, peer: object) -> None:
        self.cuts[reason] += 1
        log.debug("connection from %s cut: %s", peer, reason)
        if self.on_cut is not None:
            self.on_cut(reason)


class _GuardedHandler(RequestHandler):
    """aiohttp's per-connection protocol plus the header deadline: armed when the connection
    opens and at the first byte of each later request, disarmed once a request's headers are
    parsed (aiohttp counts them in `_request_count`) and while a request is handled. An idle
    keep-alive connection (no byte since the last response) is left to `KEEPALIVE_S`."""

    __slots__ = ("_guard", "_handling", "_header_timer")

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._header_timer: asyncio.TimerHandle | None = None
        self._handling = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and self._header_timer is None and not self._handling:
            self._arm()  # the first bytes of a later request's head
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:
            self._disarm()

    async def _handle_request(self, *args: Any, **kwargs: Any) -> Any:
        self._disarm()
        self._handling = True
        try:
            return await super()._handle_request(*args, **kwargs)
        finally:
            self._handling = False

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._header_timer = loop.call_later(self._guard.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self._handling or self.transport is None:
            return
        self._guard.cut("header_timeout", self.transport.get_extra_info("peername"))
        self.force_close()


class _GuardedServer(web.Server):
    """aiohttp's server, making `_GuardedHandler`s."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=self._loop, guard=self.guard, **self._kwargs)


CUT_COUNTER: web.AppKey[Callable[[str], None]] = web.AppKey("sagesched_cut_counter")
"""Where the app puts its metrics' counter of connections cut (by reason) for the runner."""


class GuardedRunner(web.AppRunner):
    """The gateway's `web.AppRunner` (single process and each worker): connections with the
    header deadline, `server_limits` (parser limits, keep-alive timeout); `kwargs` as
    `web.AppRunner`'s. Cuts are counted in the app's metrics once it has started."""

    def __init__(self, app: web.Application, config: GatewayConfig, **kwargs: Any) -> None:
        super().__init__(app, **{**server_limits(config), **kwargs})
        self.guard = ConnectionGuard(config.header_timeout_s)

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        count = self.app.get(CUT_COUNTER)
        if count is not None:
            self.guard.on_cut = count
        return _GuardedServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=asyncio.get_running_loop(),
            guard=self.guard,
            **plain._kwargs,
        )


@dataclass
class AdminListener:
    """The admin address's bound port once it listens (None: no admin address)."""

    port: int | None = None


def admin_address(config: GatewayConfig) -> tuple[str, int] | None:
    """`admin_listen` as (host, port), or None when the admin routes share the main address."""
    if config.admin_listen is None:
        return None
    host, _, port = config.admin_listen.rpartition(":")
    return host.strip("[]"), int(port)


def admin_socket(config: GatewayConfig, listener: AdminListener, *, reuse_port: bool = False
                 ) -> socket.socket | None:  # fmt: skip
    """Bind the admin address (None when not configured) and note its port in `listener`.
    `reuse_port`: every worker of `serve --workers N` binds it, as the main port."""
    address = admin_address(config)
    if address is None:
        return None
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    listener.port = int(sock.getsockname()[1])
    return sock


def admin_middleware(listener: AdminListener) -> Callable[..., Awaitable[web.StreamResponse]]:
    """With an admin address: `/admin/*` only there, and only `/admin/*` there (404 else)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if listener.port is None:
            return await handler(request)
        name = request.transport.get_extra_info("sockname") if request.transport else None
        on_admin = isinstance(name, tuple) and len(name) >= 2 and name[1] == listener.port
        if on_admin != request.path.startswith(ADMIN_PREFIX):
            raise NotFoundRoute(f"no route {request.method} {request.path}")
        return await handler(request)

    return middleware
