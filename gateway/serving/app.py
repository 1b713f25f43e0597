"""The aiohttp application: routes, the one error middleware, paired start/stop of resources.

A generating request (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`) takes five
named steps (`_serve`; docs/ARCHITECTURE.md):

1. accept — `accept`: auth (401), class (400), body (413), validation (400), model (404);
2. predict — `Prediction.predict` (`gateway.prediction.predict`; the prompt sized beside it by
   `Prediction.size`);
3. queue — `Dispatcher.slot` (`gateway.scheduling.dispatcher`): admitted (429) and granted a backend
   slot (503 on timeout);
4. relay — `Relay.serve` (`gateway.serving.relay`): attempts against backends, retries before the
   first byte, continuations after preemption;
5. settle — `settle`: the metrics (`GatewayMetrics.settle`), the capture, and on completion
   the predictor learns the true length (`Prediction.learn`).

Every other path goes to `passthrough` (`gateway.serving.passthrough`: forwarded first come, first
served). Every request records exactly one `Outcome` (`_counted`). Handlers raise
`GatewayError`s; `error_middleware` alone turns them into HTTP responses.

Stopping and reloading (`gateway.serving.drain`): SIGTERM drains the requests in flight for
`shutdown_grace_s` and ends the rest cleanly (`_drain`, `_cut`); SIGHUP re-reads the keys
when the app was given its config's source (`KEY_SOURCE`, set by `sagesched serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import aiohttp
from aiohttp import web

from gateway.config import GatewayConfig, as_dict
from gateway.errors import (
    GatewayError,
    MethodNotAllowed,
    ModelNotFound,
    NotFoundRoute,
    Outcome,
    PayloadTooLarge,
    ShuttingDown,
    Unauthorized,
    sse_error_event,
)
from gateway.observability.capture import CaptureWriter
from gateway.observability.metrics import GatewayMetrics, RequestTrace
from gateway.prediction.predict import Prediction, Predicts
from gateway.scheduling.backends import BackendPool, curve_view
from gateway.scheduling.classes import CLASS_HEADER
from gateway.scheduling.dispatcher import Dispatcher
from gateway.scheduling.prompts import PromptCounter
from gateway.scheduling.routing import SESSION_HEADER, session_key
from gateway.serving import backpressure
from gateway.serving import passthrough as fwd
from gateway.serving.drain import Drain, KeySource, reload_keys
from gateway.serving.openai_api import Kind, parse_body, parse_call
from gateway.serving.relay import SSE_HEADERS, Relay
from gateway.serving.security import (
    CUT_COUNTER,
    AdminListener,
    admin_middleware,
    key_matches,
    limits_middleware,
)
from policies import Job, Policy, parse_policy
from policies.routing import parse_router

if TYPE_CHECKING:
    from gateway.observability.tracing import Tracing
    from predictor import LengthPredictor

log = logging.getLogger("sagesched.gateway")

UNKNOWN_MODEL = "unknown"
TENANT_HEADER = "X-SageSched-Tenant"


@dataclass
class GatewayState:
    """Everything the handlers share; built in `lifecycle`, one per app."""

    config: GatewayConfig
    metrics: GatewayMetrics
    pool: BackendPool
    dispatcher: Dispatcher
    relay: Relay
    prediction: Prediction
    counter: PromptCounter | None = None
    """Counts queued prompts with the backends' tokenizers (None: characters / 4 only)."""
    capture: CaptureWriter | None = None
    """Records every settled request to files (`serve --capture DIR`; None: off)."""
    tracing: Tracing | None = None
    """OpenTelemetry spans of every request (`tracing:`; None: off)."""

    @property
    def predictor(self) -> LengthPredictor | None:
        """The predictor this process owns (None in a worker of `serve --workers N`)."""
        return self.prediction.local

    @property
    def background(self) -> set[asyncio.Task[None]]:
        """Predictor work running beside requests (`Prediction.background`)."""
        return self.prediction.background


class Remote(Protocol):
    """Where a worker's pool and dispatcher come from (`gateway.workers.remote.AuthorityLink`)."""

    def attach(
        self, session: aiohttp.ClientSession, policy: Policy, config: GatewayConfig
    ) -> tuple[BackendPool, Dispatcher]: ...

    async def host_predictor(self) -> Predicts:
        """The worker's view of the host's one predictor."""
        ...


STATE = web.AppKey("sagesched_state", GatewayState)
REMOTE = web.AppKey("sagesched_remote", Remote)
CONFIG = web.AppKey("sagesched_config", GatewayConfig)
PREDICTOR = web.AppKey("sagesched_predictor", object)
ADMIN = web.AppKey("sagesched_admin_listener", AdminListener)
"""Where the admin address listens, once bound (`gateway.serving.security.admin_socket`)."""
JOB = web.RequestKey("sagesched_job", Job)
"""A generating request's job, once it exists (settling reads its ticket)."""
DRAIN = web.AppKey("sagesched_drain", Drain)
"""The requests in flight and the SIGTERM drain (`gateway.serving.drain`)."""
KEY_SOURCE = web.AppKey("sagesched_key_source", KeySource)
"""Where the config came from: set by `sagesched serve` so that SIGHUP reloads the keys."""
RESPONSE = web.RequestKey("sagesched_response", web.StreamResponse)
"""The response once prepared (a request cut at shutdown ends its stream with an event)."""


def render(error: GatewayError) -> web.Response:
    """A `GatewayError` as OpenAI's JSON error response (used by `error_middleware` only)."""
    return web.json_response(error.body(), status=error.status, headers=error.headers())


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The one place errors become HTTP responses: every `GatewayError` a handler raises, and
    aiohttp's own HTTP errors (unknown route, wrong method, body too large) in OpenAI's
    format. (A stream that already started reports its error in-band: `gateway.serving.relay`.)"""
    try:
        return await handler(request)
    except GatewayError as exc:
        return render(exc)
    except web.HTTPNotFound:
        return render(NotFoundRoute(f"no route {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed:
        return render(MethodNotAllowed(f"{request.method} is not allowed on {request.path}"))
    except web.HTTPRequestEntityTooLarge as exc:
        return render(PayloadTooLarge(exc.text or "request body too large"))


def create_app(
    config: GatewayConfig, *, predictor: LengthPredictor | None = None
) -> web.Application:
    """Build the gateway app. Pass `predictor` to share a loaded one (tests, embedding)."""
    listener = AdminListener()
    middlewares = [error_middleware, limits_middleware(config), admin_middleware(listener)]
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[CONFIG] = config
    app[ADMIN] = listener
    app[DRAIN] = Drain()
    if predictor is not None:
        app[PREDICTOR] = predictor
    app.cleanup_ctx.append(lifecycle)
    app.cleanup_ctx.append(_sighup)
    app.on_shutdown.append(_drain)
    app.on_response_prepare.append(_remember_response)
    app.router.add_post("/v1/chat/completions", _completion("chat"))
    app.router.add_post("/v1/completions", _completion("completions"))
    app.router.add_post("/v1/responses", _completion("responses"))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/queue", admin_queue)
    app.router.add_get("/admin/backends", admin_backends)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_route("*", "/{tail:.*}", _counted(_passthrough))  # last: everything else
    return app


async def lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Start the HTTP client, backend pool, predictor and capture; stop them in reverse."""
    config = app[CONFIG]
    policy = parse_policy(config.policy)
    log.info("effective config: %s", as_dict(config))
    metrics = GatewayMetrics()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    remote = app.get(REMOTE)
    if remote is None:
        pool = BackendPool(
            config.backends,
            session,
            health_interval_s=config.health_interval_s,
            adaptive=config.adaptive_cap,
            memory_path=config.adaptive_cap.memory_file(config.predictor.snapshot_path),
            router=parse_router(config.routing),
        )
        dispatcher = Dispatcher(policy, pool, config)  # listens to the pool's capacity
        metrics.watch_engine_shares(dispatcher)
    else:  # a worker of `serve --workers N`: the authority's pool and queue
        pool, dispatcher = remote.attach(session, policy, config)
    metrics.declare_classes(config.classes.list, config.classes.tenant_labels)
    metrics.watch(pool, dispatcher)
    counter = PromptCounter(pool, session, config.tokenizer) if config.tokenizer.enabled else None
    given = app.get(PREDICTOR)
    host = None if remote is None else remote.host_predictor
    prediction = Prediction(config, dispatcher, counter, given=given, host=host)  # type: ignore[arg-type]
    await prediction.start()
    if prediction.predictor is not None:
        cache = prediction.predictor.embedder.cache
        metrics.watch_embedding_cache(lambda: (cache.hits, cache.misses))
    if prediction.shared is not None:
        metrics.watch_shared_learning(prediction.shared.stats)
    relay = Relay(session, dispatcher, config)
    state = GatewayState(config, metrics, pool, dispatcher, relay, prediction, counter)
    if config.tracing.enabled:
        from gateway.observability.tracing import Tracing

        state.tracing = relay.tracing = tracer = Tracing(config.tracing)
        metrics.watch_tracing(lambda: tracer.dropped)
    writer: asyncio.Task[None] | None = None
    if config.capture.dir is not None:
        state.capture = CaptureWriter(config.capture, metrics.count_capture)
        if config.capture.embeddings and prediction.predictor is None:
            log.warning("capture.embeddings is on but the predictor is off: no embeddings")
        writer = asyncio.create_task(state.capture.run())
    app[STATE] = state
    app[CUT_COUNTER] = metrics.count_cut
    await pool.start()
    try:
        yield
    finally:
        # predictor work first: a capture record waiting for its prompt's embedding gets it
        await prediction.stop()
        if writer is not None:  # after the last request settled: flushes what is queued
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        await pool.stop()
        await session.close()
        if state.tracing is not None:  # the last spans, bounded, off the loop
            await asyncio.to_thread(state.tracing.shutdown)


async def _drain(app: web.Application) -> None:
    """SIGTERM, after the listeners closed (aiohttp's `on_shutdown`): the requests in flight
    get `shutdown_grace_s`, then the rest are cut (`gateway.serving.drain`)."""
    await app[DRAIN].run(app[CONFIG].shutdown_grace_s)


async def _remember_response(request: web.Request, response: web.StreamResponse) -> None:
    request[RESPONSE] = response


async def _sighup(app: web.Application) -> AsyncIterator[None]:
    """With `KEY_SOURCE` (a served process, not an app in a test): SIGHUP reloads the keys.
    A worker of `serve --workers N` also reads them once its handler is in place: it was given
    the keys its parent started with, and a SIGHUP sent before it could hear one (while it
    started, or before a restart) must not leave it on keys the file no longer has."""
    source = app.get(KEY_SOURCE)
    if source is None:
        yield
        return
    loop = asyncio.get_running_loop()

    def reload(why: str = "SIGHUP") -> None:
        state = app[STATE]
        updated = reload_keys(state.config, source, why)
        if updated is None:
            return
        state.config = updated  # the handlers read the keys from here, per request
        state.dispatcher.classes.rekey(updated.classes)

    loop.add_signal_handler(signal.SIGHUP, reload)
    if app.get(REMOTE) is not None:
        reload("worker start")
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)


# -- the completion handler: five steps -----------------------------------------------


Serve = Callable[["GatewayState", web.Request, RequestTrace], Awaitable[web.StreamResponse]]


def _completion(kind: Kind) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def serve(
        state: GatewayState, request: web.Request, trace: RequestTrace
    ) -> web.StreamResponse:
        return await _serve(state, request, kind, trace)

    return _counted(serve)


async def _serve(
    state: GatewayState, request: web.Request, kind: Kind, trace: RequestTrace
) -> web.StreamResponse:
    job = await accept(state, request, kind, trace)  # 1
    request[JOB] = job  # settling reads it (step 5)
    trace.accepted = time.monotonic()
    sizing = state.prediction.size(job)  # beside steps 2 and 3
    try:
        await state.prediction.predict(job)  # 2
        trace.predicted = time.monotonic()
        return await state.relay.serve(request, job)  # 3 (Dispatcher.slot) and 4
    finally:
        if sizing is not None and not sizing.done():
            sizing.cancel()


def _counted(serve: Serve) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A handler that records exactly one outcome for whatever `serve` does, and settles
    (step 5). Errors propagate to `error_middleware`; anything unexpected becomes a logged
    internal error."""

    async def handler(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        trace = RequestTrace(
            model=UNKNOWN_MODEL, arrived=time.monotonic(), policy=state.dispatcher.label
        )
        if state.tracing is not None:
            state.tracing.begin(trace, request.headers, f"{request.method} {request.path}")
        drain, task = request.app[DRAIN], asyncio.current_task()
        if task is not None:
            drain.active.add(task)
        try:
            response = await serve(state, request, trace)
            if not response.prepared:  # a whole answer: written here, bounded, then counted
                await _send_whole(state.config, request, response, trace)
            return response
        except GatewayError as exc:
            trace.outcome, trace.status = exc.outcome, exc.status
            raise
        except asyncio.CancelledError:
            if drain.was_cut(task):
                assert task is not None
                task.uncancel()
                return await _cut(request, trace)
            if trace.outcome is None:
                running = trace.dispatched is not None
                trace.outcome = Outcome.CANCELLED_RUNNING if running else Outcome.CANCELLED_WAITING
                trace.status = 499
            raise
        except Exception as exc:
            log.exception("internal error on %s", request.path)
            trace.outcome, trace.status = Outcome.INTERNAL_ERROR, 500
            raise GatewayError("internal error in the gateway") from exc
        finally:
            if task is not None:
                drain.active.discard(task)
            settle(state, trace, request.get(JOB))

    return handler


async def _send_whole(
    config: GatewayConfig, request: web.Request, response: web.StreamResponse, trace: RequestTrace
) -> None:
    """Write a whole (non-streamed) answer before the request is counted, with a stream's
    bounds (`backpressure.send_whole`): a client that does not take it within
    `slow_client_timeout_s` is cut and the answer counted `client_too_slow` instead of
    `completed` (one outcome either way: settling comes after). A client that left meanwhile
    turns a completion into `cancelled_running`. A request cancelled mid-write has its
    connection cut (headers and part of a body went out; no clean end can follow) and is
    counted by the cancellation's cause, as a stream would be (`shutdown` when the drain cut
    it, else `cancelled_running`): the answer did not reach the client."""
    try:
        await backpressure.send_whole(
            request,
            response,
            limit=config.stream_buffer_bytes,
            timeout_s=config.slow_client_timeout_s,
        )
    except backpressure.ClientTooSlow:
        if trace.outcome is Outcome.COMPLETED:
            trace.outcome = Outcome.CLIENT_TOO_SLOW
        backpressure.cut(request)
    except ConnectionResetError:
        if trace.outcome is Outcome.COMPLETED:
            trace.outcome, trace.status = Outcome.CANCELLED_RUNNING, 499
    except asyncio.CancelledError:
        if trace.outcome is Outcome.COMPLETED:
            trace.outcome = None
        backpressure.cut(request)
        raise


async def _cut(request: web.Request, trace: RequestTrace) -> web.StreamResponse:
    """End a request the shutdown grace ran out on: a started stream gets an SSE error event
    and `[DONE]`, a request not answered yet a 503 (both counted `shutdown`, code 503)."""
    error = ShuttingDown("the gateway is shutting down; retry the request")
    if trace.outcome is None:
        trace.outcome, trace.status = error.outcome, error.status
    response: web.StreamResponse | None = request.get(RESPONSE)
    if response is None or not response.prepared:
        raise error
    with contextlib.suppress(ConnectionResetError, RuntimeError):  # RuntimeError: eof was sent
        if response.content_type == SSE_HEADERS["Content-Type"]:
            await response.write(sse_error_event(error))
        await response.write_eof()
    return response


async def accept(state: GatewayState, request: web.Request, kind: Kind, trace: RequestTrace) -> Job:
    """Step 1: a generating request → its job, or a `GatewayError` (401, 400, 413, 404)."""
    _authorize(request, state.config.api_keys)
    klass = state.dispatcher.classes.resolve(request.headers.get(CLASS_HEADER), _token(request))
    raw = await _read(state, request)
    call = parse_call(kind, parse_body(raw), request.headers.get(TENANT_HEADER))
    if not state.pool.serves(call.model):
        raise ModelNotFound(f"the model '{call.model}' does not exist", param="model")
    trace.model = call.model
    session = session_key(request.headers.get(SESSION_HEADER))
    return state.dispatcher.new_job(call, trace, None, klass, session)


def settle(state: GatewayState, trace: RequestTrace, job: Job | None) -> None:
    """Step 5: record the request's one outcome (metrics, capture); after a completion the
    predictor learns the true length."""
    state.metrics.settle(trace)
    if state.capture is not None:
        state.capture.offer(trace, None if job is None else job.ctx)
    if job is not None and trace.outcome is Outcome.COMPLETED:
        state.prediction.learn(job)
    if state.tracing is not None:
        state.tracing.finish(trace, job)


async def _read(state: GatewayState, request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds {state.config.max_body_bytes} bytes") from None


def _token(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    return header[7:] if header.startswith("Bearer ") else ""


def _authorize(request: web.Request, keys: tuple[str, ...]) -> None:
    if keys and not key_matches(_token(request), keys):
        raise Unauthorized("missing or invalid API key")


# -- other routes -----------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _authorize(request, state.config.api_keys)
    return web.json_response({"object": "list", "data": state.pool.model_cards()})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 while a backend is healthy; 503 without one, and from SIGTERM on (draining)."""
    if request.app[DRAIN].draining:
        return web.json_response({"status": "draining"}, status=503)
    if request.app[STATE].pool.ready():
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "no healthy backend"}, status=503)


async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI document of the gateway's own routes (`gateway.serving.openapi`)."""
    from gateway.serving.openapi import document

    return web.json_response(document())


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text; OpenMetrics (with the TTFT exemplars) when tracing is on and the
    scraper asks for it."""
    state = request.app[STATE]
    openmetrics = state.tracing is not None and "openmetrics" in request.headers.get("Accept", "")
    body, content_type = state.metrics.exposition(openmetrics)
    return web.Response(body=body, headers={"Content-Type": content_type})


def _admin(request: web.Request) -> GatewayState:
    state = request.app[STATE]
    key = state.config.admin_key
    if key is None:
        raise web.HTTPNotFound()
    if not key_matches(request.headers.get("Authorization", ""), (f"Bearer {key}",)):
        raise Unauthorized("admin routes need the admin key")
    return state


async def admin_queue(request: web.Request) -> web.Response:
    state = _admin(request)
    return web.json_response(
        {
            "policy": state.dispatcher.label,
            "waiting": state.dispatcher.waiting(),
            "jobs": state.dispatcher.snapshot(),
            "running": state.dispatcher.running_snapshot(),
        }
    )


async def admin_backends(request: web.Request) -> web.Response:
    state = _admin(request)
    rows = [
        {
            "name": b.name,
            "url": b.url,
            "healthy": b.healthy,
            "inflight": b.inflight,
            "cap": b.cap,
            "models": sorted(b.models),
            "priority_scheduling": b.config.priority_scheduling,
            **curve_view(b),
        }
        for b in state.pool.backends
    ]
    return web.json_response({"backends": rows})


async def _passthrough(
    state: GatewayState, request: web.Request, trace: RequestTrace
) -> web.StreamResponse:
    """Any other route: forwarded to a backend at once (`gateway.serving.passthrough`)."""
    if fwd.reserved(request.path):
        raise fwd.method_not_allowed(request)
    _authorize(request, state.config.api_keys)
    raw = await _read(state, request)
    model = fwd.body_model(raw, request.content_type)
    backends = fwd.candidates(state.pool, model)
    trace.model = model or UNKNOWN_MODEL
    relay = state.relay
    return await fwd.forward(
        request, raw, backends, relay.session, relay.timeout, state.config, trace
    )
