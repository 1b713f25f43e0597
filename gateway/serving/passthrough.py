"""Every other route of the backends, proxied: `/tokenize`, `/detokenize`, `/v1/embeddings`,
`/v1/score`, `/v1/rerank`, `/pooling`, `/classify`, `/version`, … whatever the server serves.

These routes generate no tokens, so no policy can order them better than arrival order, and
vLLM's own queue is FCFS: they are admitted first come, first served, i.e. forwarded at once
to the least-loaded healthy backend that serves the body's `model` (any healthy backend when
the body names none), without taking one of the in-flight slots that hold the generation
backlog. (The generating routes, `/v1/chat/completions`, `/v1/completions` and
`/v1/responses`, are queued under the policy by `gateway.serving.app` and `gateway.serving.relay`.)
Auth and
the body limit are those of chat; a connection failure or a 5xx before any byte is retried on
another backend (`max_retries`); the backend's other answers pass through with their status,
errors in OpenAI's JSON form (`UpstreamRejected`). The handler records one `Outcome`.
"""

from __future__ import annotations

import json
import logging

import aiohttp
from aiohttp import web

from gateway.config import GatewayConfig
from gateway.errors import (
    MethodNotAllowed,
    ModelNotFound,
    NoBackend,
    Outcome,
    UpstreamBroken,
    UpstreamFailed,
    UpstreamRejected,
)
from gateway.observability.metrics import RequestTrace
from gateway.scheduling.backends import Backend, BackendPool
from gateway.serving.backpressure import BoundedStream, ClientTooSlow

GATEWAY_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
        "/openapi.json",
    }
)
"""Paths the gateway answers itself: another method on them is a 405, never proxied."""
FORWARDED_HEADERS = ("Content-Type", "Accept")
"""Client headers sent on (the backend's own key replaces the client's Authorization)."""
HOP_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
)

log = logging.getLogger("sagesched.gateway.serving.passthrough")


def reserved(path: str) -> bool:
    """Is `path` one the gateway serves itself (other methods answer 405)?"""
    return path in GATEWAY_PATHS or path.startswith("/admin/")


def body_model(raw: bytes, content_type: str) -> str | None:
    """The `model` named by a JSON body, if any."""
    if not raw or "json" not in content_type:
        return None
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None  # the backend answers bad JSON (or JSON nested too deeply) in its own words
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


def candidates(pool: BackendPool, model: str | None) -> list[Backend]:
    """Healthy backends for `model` (any when None), least loaded first; `ModelNotFound` or
    `NoBackend` when there is none."""
    if model is not None and not pool.serves(model):
        raise ModelNotFound(f"the model '{model}' does not exist", param="model")
    serving = [b for b in pool.backends if model is None or model in b.models]
    healthy = [b for b in serving if b.healthy]
    if not healthy:
        raise NoBackend("no healthy backend to forward the request to")
    return sorted(healthy, key=lambda b: b.inflight / max(b.cap, 1))


async def forward(
    request: web.Request,
    raw: bytes,
    backends: list[Backend],
    session: aiohttp.ClientSession,
    timeout: aiohttp.ClientTimeout,
    config: GatewayConfig,
    trace: RequestTrace,
) -> web.StreamResponse:
    """Send the request to the first backend that answers (at most `max_retries` more after
    one fails before any byte) and relay its answer. Sets the trace's outcome. What failed is
    logged; the client's error says only how many backends were tried (as the queued
    routes' do)."""
    max_retries = config.max_retries
    headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
    failures = []
    for backend in backends[: max_retries + 1]:
        trace.backend = backend.name
        url = backend.url + request.rel_url.path_qs
        try:
            resp = await session.request(
                request.method,
                url,
                data=raw or None,
                headers={**headers, **backend.headers()},
                timeout=timeout,
            )
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            log.warning("passthrough to %s failed before answering: %s", backend.name, repr(exc))
            failures.append(backend.name)
            continue
        async with resp:
            if resp.status >= 500 and len(failures) < max_retries:
                log.warning("passthrough to %s answered %d", backend.name, resp.status)
                failures.append(backend.name)
                continue
            if resp.status >= 400:
                raise UpstreamRejected(resp.status, await resp.read())
            trace.dispatched = trace.dispatched or trace.arrived
            return await relay_bytes(request, resp, trace, config)
    raise UpstreamFailed(f"no backend could serve the request (tried {len(failures)})")


async def relay_bytes(
    request: web.Request, resp: aiohttp.ClientResponse, trace: RequestTrace, config: GatewayConfig
) -> web.StreamResponse:
    """The backend's answer as it came: read whole, or copied chunk by chunk when it streams
    (server-sent events, through a `BoundedStream`, as the queued routes). Sets the outcome:
    completed, or, once bytes went out, broken (the backend failed; the stream is cut),
    cancelled (the client left) or too slow (the client stopped reading: upstream closed,
    then the client cut)."""
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
    if "text/event-stream" not in resp.headers.get("Content-Type", ""):
        try:
            body = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("passthrough answer broken off: %s", repr(exc))
            raise UpstreamBroken(
                "the backend closed the connection before its answer was complete"
            ) from None
        trace.outcome = Outcome.COMPLETED
        return web.Response(body=body, status=resp.status, headers=headers)
    out = BoundedStream(
        limit=config.stream_buffer_bytes,
        timeout_s=config.slow_client_timeout_s,
        status=resp.status,
        headers=headers,
    )
    try:
        await out.prepare(request)
        async for data in resp.content.iter_any():
            await out.write(data)
        await out.write_eof()
        trace.outcome = Outcome.COMPLETED
    except ConnectionResetError:
        trace.outcome, trace.status = Outcome.CANCELLED_RUNNING, 499
    except ClientTooSlow:
        trace.outcome = Outcome.CLIENT_TOO_SLOW
        resp.close()  # the backend aborts the request
        out.cut()
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("passthrough stream broken off: %s", repr(exc))
        trace.outcome = Outcome.UPSTREAM_BROKEN
        out.cut()  # bytes as they came: no clean end after a truncated stream
    return out


def method_not_allowed(request: web.Request) -> MethodNotAllowed:
    return MethodNotAllowed(f"{request.method} is not allowed on {request.path}")
