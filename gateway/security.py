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
- `admin_listen`: the admin routes (`/admin/*`) are served only on their own address (e.g. a
  loopback or cluster-internal one), and the public address answers them 404; the admin
  address answers nothing else. `/metrics` stays on the public address, where the deployments'
  Prometheus scrapes it.
"""

from __future__ import annotations

import hmac
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.errors import HeadersTooLarge, NotFoundRoute, UriTooLong

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


def server_limits(config: GatewayConfig) -> dict[str, Any]:
    """aiohttp's parser limits (keyword arguments of `AppRunner`/`run_app`): twice the
    configured ones, so `limits_middleware` answers first (in JSON) up to twice the limit."""
    size = 2 * config.max_header_bytes
    return {"max_line_size": size, "max_field_size": size, "max_headers": 2 * config.max_headers}


def limits_middleware(config: GatewayConfig) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Header count, header size and request target length, before any handler runs."""
    max_headers, max_bytes = config.max_headers, config.max_header_bytes

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
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
