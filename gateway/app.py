"""The aiohttp application: routes, error rendering, and paired start/stop of resources.

Request flow (`completion`, the generating routes): authenticate → read the body (413 beyond
the limit) → validate (400) → resolve the model (404) → if the job must queue, count its
prompt with the backend's tokenizer (`gateway.prompts`) beside the prediction → predict the
output-length distribution (timed; part of TTFT when queued) → `Relay.serve` (queue,
dispatch, relay) → settle metrics and, on completion, teach the predictor the true length in
the background. Every other path goes to `passthrough` (`gateway.passthrough`: forwarded
first come, first served). Every request records exactly one `Outcome`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from gateway import passthrough as fwd
from gateway import shared_learning
from gateway.backends import BackendPool
from gateway.capture import CaptureWriter
from gateway.classes import CLASS_HEADER
from gateway.config import GatewayConfig, as_dict
from gateway.dispatcher import Dispatcher, Ticket
from gateway.errors import (
    GatewayError,
    MethodNotAllowed,
    ModelNotFound,
    NotFoundRoute,
    Outcome,
    PayloadTooLarge,
    Unauthorized,
)
from gateway.metrics import CONTENT_TYPE, GatewayMetrics, RequestTrace
from gateway.openai_api import Kind, parse_body, parse_call
from gateway.prompts import PromptCounter
from gateway.relay import Relay
from policies import Job, parse_policy

if TYPE_CHECKING:
    from predictor import LengthPredictor

log = logging.getLogger("sagesched.gateway")

UNKNOWN_MODEL = "unknown"
MAX_PENDING_OBSERVATIONS = 1024  # bounds memory if the predictor falls behind the traffic
TENANT_HEADER = "X-SageSched-Tenant"


@dataclass
class GatewayState:
    """Everything the handlers share; built in `lifecycle`, one per app."""

    config: GatewayConfig
    metrics: GatewayMetrics
    pool: BackendPool
    dispatcher: Dispatcher
    relay: Relay
    predictor: LengthPredictor | None
    background: set[asyncio.Task[None]] = field(default_factory=set)
    """Predictor work running beside requests (refinements, learning); bounded."""
    counter: PromptCounter | None = None
    """Counts queued prompts with the backends' tokenizers (None: characters / 4 only)."""
    capture: CaptureWriter | None = None
    """Records every settled request to files (`serve --capture DIR`; None: off)."""


STATE = web.AppKey("sagesched_state", GatewayState)
CONFIG = web.AppKey("sagesched_config", GatewayConfig)
PREDICTOR = web.AppKey("sagesched_predictor", object)
TICKET = web.RequestKey("sagesched_ticket", Ticket)
"""A generating request's ticket, once its job exists (the capture reads its embedding)."""


def render(error: GatewayError) -> web.Response:
    """The one place a `GatewayError` becomes an HTTP response."""
    return web.json_response(error.body(), status=error.status, headers=error.headers())


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own HTTP errors (unknown route, wrong method) in OpenAI's format."""
    try:
        return await handler(request)
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
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[error_middleware])
    app[CONFIG] = config
    if predictor is not None:
        app[PREDICTOR] = predictor
    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", _completion("chat"))
    app.router.add_post("/v1/completions", _completion("completions"))
    app.router.add_post("/v1/responses", _completion("responses"))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/admin/queue", admin_queue)
    app.router.add_get("/admin/backends", admin_backends)
    app.router.add_route("*", "/{tail:.*}", _counted(_passthrough))  # last: everything else
    return app


async def lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Start the HTTP client, backend pool and predictor; stop them in reverse order."""
    config = app[CONFIG]
    policy = parse_policy(config.policy)
    log.info("effective config: %s", as_dict(config))
    metrics = GatewayMetrics()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    holder: list[Dispatcher] = []
    pool = BackendPool(
        config.backends,
        session,
        metrics,
        on_capacity=lambda: holder[0].pump() if holder else None,
        health_interval_s=config.health_interval_s,
        adaptive=config.adaptive_cap,
    )
    dispatcher = Dispatcher(policy, pool, metrics, config)
    holder.append(dispatcher)
    predictor = await _start_predictor(app, config, policy.needs_prediction)
    if predictor is not None:
        cache = predictor.embedder.cache
        metrics.watch_embedding_cache(lambda: (cache.hits, cache.misses))
    shared = await shared_learning.start(config, predictor, metrics)
    state = GatewayState(
        config, metrics, pool, dispatcher, Relay(session, dispatcher, config), predictor
    )
    if config.tokenizer.enabled:
        state.counter = PromptCounter(pool, session, config.tokenizer)
    writer: asyncio.Task[None] | None = None
    if config.capture.dir is not None:
        state.capture = CaptureWriter(config.capture, metrics.count_capture)
        if config.capture.embeddings and predictor is None:
            log.warning("capture.embeddings is on but the predictor is off: no embeddings")
        writer = asyncio.create_task(state.capture.run())
    app[STATE] = state
    await pool.start()
    saver = _start_saver(state)
    try:
        yield
    finally:
        if saver is not None:
            saver.cancel()
        # predictor work first: a capture record waiting for its prompt's embedding gets it
        await asyncio.gather(*state.background, return_exceptions=True)
        if writer is not None:  # after the last request settled: flushes what is queued
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        await pool.stop()
        if shared is not None:  # publishes what is buffered, before the last snapshot
            await shared.stop()
        await _stop_predictor(app, state)
        await session.close()


# -- the completion handler -----------------------------------------------------------


Serve = Callable[["GatewayState", web.Request, RequestTrace], Awaitable[web.StreamResponse]]


def _completion(kind: Kind) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def serve(
        state: GatewayState, request: web.Request, trace: RequestTrace
    ) -> web.StreamResponse:
        return await _serve(state, request, kind, trace)

    return _counted(serve)


def _counted(serve: Serve) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A handler that records exactly one outcome for whatever `serve` does."""

    async def handler(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        trace = RequestTrace(
            model=UNKNOWN_MODEL, arrived=time.monotonic(), policy=state.dispatcher.label
        )
        try:
            return await serve(state, request, trace)
        except GatewayError as exc:
            trace.outcome, trace.status = exc.outcome, exc.status
            return render(exc)
        except asyncio.CancelledError:
            if trace.outcome is None:
                running = trace.dispatched is not None
                trace.outcome = Outcome.CANCELLED_RUNNING if running else Outcome.CANCELLED_WAITING
                trace.status = 499
            raise
        except Exception:
            log.exception("internal error on %s", request.path)
            trace.outcome, trace.status = Outcome.INTERNAL_ERROR, 500
            return render(GatewayError("internal error in the gateway"))
        finally:
            state.metrics.settle(trace)
            if state.capture is not None:
                state.capture.offer(trace, request.get(TICKET))

    return handler


async def _read(state: GatewayState, request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds {state.config.max_body_bytes} bytes") from None


async def _serve(
    state: GatewayState, request: web.Request, kind: Kind, trace: RequestTrace
) -> web.StreamResponse:
    _authorize(request, state.config.api_keys)
    klass = state.dispatcher.classes.resolve(request.headers.get(CLASS_HEADER), _token(request))
    raw = await _read(state, request)
    call = parse_call(kind, parse_body(raw), request.headers.get(TENANT_HEADER))
    if not state.pool.serves(call.model):
        raise ModelNotFound(f"the model '{call.model}' does not exist", param="model")
    trace.model = call.model
    job = state.dispatcher.new_job(call, trace, None, klass)
    request[TICKET] = job.ctx  # the capture reads the prompt's embedding from it
    counting = _start_count(state, job)
    try:
        await _predict(state, job, call.text_body)
        response = await state.relay.serve(request, job)
    finally:
        if counting is not None and not counting.done():
            counting.cancel()
    if (
        trace.outcome is Outcome.COMPLETED
        and state.predictor is not None
        and trace.output_tokens > 0
    ):
        _learn(state, job, trace.output_tokens)
    return response


def _start_count(state: GatewayState, job: Job) -> asyncio.Task[None] | None:
    """Count the prompt with the backend's tokenizer when the job must queue (its size can
    then change the order); a job that starts at once keeps the estimate until its usage
    reports the true count. Nothing waits for the count: it runs beside the prediction, and
    if it lands after the job was queued it rekeys the job (`Dispatcher.resized`)."""
    counter, call = state.counter, job.ctx.call
    if counter is None or state.dispatcher.can_start_now(call.model):
        return None

    async def count() -> None:
        job.prompt_tokens, job.ctx.trace.prompt_count_source = await counter.count(call)
        state.dispatcher.resized(job)

    return asyncio.create_task(count())


async def _predict(state: GatewayState, job: Job, body: dict[str, Any]) -> None:
    """Give `job` its predicted length distribution.

    When the job would start at once (nothing of its model waiting, a backend free), the
    prediction cannot change any decision yet, so the job starts on the recent global
    distribution and the semantic prediction runs beside it (it still feeds the running key,
    the admin view and the prediction-error metric): an idle gateway adds no embedding time to
    TTFT. Otherwise the prediction orders the queue, so the job waits for it.
    """
    predictor = state.predictor
    if predictor is None:
        return
    ticket: Ticket = job.ctx
    call = ticket.call
    if state.dispatcher.can_start_now(call.model):
        dist = predictor.global_dist(job.prompt_tokens, model=call.model)
        job.dist = dist if call.max_tokens is None else dist.truncate(call.max_tokens)
        ticket.refining = _background(state, _refine(state, job, body))
        return
    await _refine(state, job, body)


async def _refine(state: GatewayState, job: Job, body: dict[str, Any]) -> None:
    from predictor import request_text

    assert state.predictor is not None
    ticket: Ticket = job.ctx
    call, trace = ticket.call, ticket.trace
    start = time.monotonic()
    ticket.prompt_vector = vec = await state.predictor.embed_async(request_text(body))
    # the prompt count runs beside the embedding and is never waited for: if it is done,
    # `job.prompt_tokens` is the backend's count; if not, it rekeys the queued job when it is
    dist = await state.predictor.predict_vector_async(
        vec, prompt_tokens=job.prompt_tokens, max_tokens=call.max_tokens, model=call.model
    )
    job.rank_score = await asyncio.to_thread(
        state.predictor.rank_score, vec, job.prompt_tokens, call.model
    )
    trace.predictor_s = time.monotonic() - start
    trace.predicted_median = dist.quantile(0.5)
    job.dist = dist


def _learn(state: GatewayState, job: Job, output_tokens: int) -> None:
    """Teach the predictor the true length, in the background."""
    if state.predictor is not None:
        _background(state, _observe(state.predictor, job.ctx, output_tokens))


async def _observe(predictor: LengthPredictor, ticket: Ticket, output_tokens: int) -> None:
    """Learn with the prompt's embedding from the prediction: wait for a prediction still
    running beside the request rather than embed the prompt a second time (if the prediction
    failed or was shed, the prompt is embedded now)."""
    from predictor import request_text

    if ticket.refining is not None:
        await asyncio.wait([ticket.refining])
    call = ticket.call
    prompt_tokens = ticket.trace.prompt_tokens or call.prompt_tokens_estimate  # usage's, if any
    await predictor.observe_async(
        request_text(call.text_body), output_tokens, prompt_tokens, vector=ticket.prompt_vector,
        model=call.model,
    )  # fmt: skip


def _background(state: GatewayState, work: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run predictor work beside the request; bounded, so a predictor that falls behind the
    traffic sheds work instead of growing memory. The task, or None if shed."""
    if len(state.background) >= MAX_PENDING_OBSERVATIONS:
        work.close()
        return None
    task = asyncio.create_task(work)
    state.background.add(task)
    task.add_done_callback(_forget(state))
    return task


def _forget(state: GatewayState) -> Callable[[asyncio.Task[None]], None]:
    def done(task: asyncio.Task[None]) -> None:
        state.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background predictor work failed: %r", task.exception())

    return done


def _token(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    return header[7:] if header.startswith("Bearer ") else ""


def _authorize(request: web.Request, keys: tuple[str, ...]) -> None:
    if keys and _token(request) not in keys:
        raise Unauthorized("missing or invalid API key")


# -- other routes -----------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        _authorize(request, state.config.api_keys)
    except GatewayError as exc:
        return render(exc)
    return web.json_response({"object": "list", "data": state.pool.model_cards()})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    if request.app[STATE].pool.ready():
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "no healthy backend"}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _admin(request: web.Request) -> GatewayState:
    state = request.app[STATE]
    key = state.config.admin_key
    if key is None:
        raise web.HTTPNotFound()
    if request.headers.get("Authorization", "") != f"Bearer {key}":
        raise _Render(Unauthorized("admin routes need the admin key"))
    return state


class _Render(Exception):
    def __init__(self, error: GatewayError) -> None:
        self.error = error


async def admin_queue(request: web.Request) -> web.Response:
    try:
        state = _admin(request)
    except _Render as exc:
        return render(exc.error)
    return web.json_response(
        {
            "policy": state.dispatcher.label,
            "waiting": state.dispatcher.waiting(),
            "jobs": state.dispatcher.snapshot(),
            "running": state.dispatcher.running_snapshot(),
        }
    )


async def admin_backends(request: web.Request) -> web.Response:
    try:
        state = _admin(request)
    except _Render as exc:
        return render(exc.error)
    rows = [
        {
            "name": b.name,
            "url": b.url,
            "healthy": b.healthy,
            "inflight": b.inflight,
            "cap": b.cap,
            "models": sorted(b.models),
            "priority_scheduling": b.config.priority_scheduling,
        }
        for b in state.pool.backends
    ]
    return web.json_response({"backends": rows})


async def _passthrough(
    state: GatewayState, request: web.Request, trace: RequestTrace
) -> web.StreamResponse:
    """Any other route: forwarded to a backend at once (`gateway.passthrough`)."""
    if fwd.reserved(request.path):
        raise fwd.method_not_allowed(request)
    _authorize(request, state.config.api_keys)
    raw = await _read(state, request)
    model = fwd.body_model(raw, request.content_type)
    backends = fwd.candidates(state.pool, model)
    trace.model = model or UNKNOWN_MODEL
    relay = state.relay
    return await fwd.forward(
        request, raw, backends, relay.session, relay.timeout, state.config.max_retries, trace
    )


# -- predictor lifecycle ------------------------------------------------------------------


async def _start_predictor(
    app: web.Application, config: GatewayConfig, needed: bool
) -> LengthPredictor | None:
    settings = config.predictor
    enabled = needed if settings.enabled is None else settings.enabled
    if needed and not enabled:
        raise ValueError(f"policy {config.policy!r} needs the predictor; do not disable it")
    if not enabled:
        return None
    given = app.get(PREDICTOR)
    if given is not None:
        return given  # type: ignore[return-value]
    return await asyncio.to_thread(_load_predictor, config)


def _load_predictor(config: GatewayConfig) -> LengthPredictor:
    from predictor import LengthPredictor

    settings = config.predictor
    path = settings.snapshot_path
    if path and os.path.exists(path):
        log.info("predictor: loading snapshot %s", path)
        return LengthPredictor.load(path)
    predictor = LengthPredictor()
    if settings.warm_start_jsonl:
        n = predictor.warm_start(settings.warm_start_jsonl)
        log.info("predictor: warm start learned %d requests", n)
    return predictor


def _start_saver(state: GatewayState) -> asyncio.Task[None] | None:
    settings = state.config.predictor
    if state.predictor is None or not settings.snapshot_path or settings.save_interval_s <= 0:
        return None

    async def loop() -> None:
        assert state.predictor is not None and settings.snapshot_path
        while True:
            await asyncio.sleep(settings.save_interval_s)
            await asyncio.to_thread(state.predictor.save, settings.snapshot_path)

    return asyncio.create_task(loop(), name="predictor-saver")


async def _stop_predictor(app: web.Application, state: GatewayState) -> None:
    predictor = state.predictor
    if predictor is None:
        return
    path = state.config.predictor.snapshot_path
    if path:
        await asyncio.to_thread(predictor.save, path)
    # The async embedder is bound to this loop; a shared predictor makes a new one lazily.
    with contextlib.suppress(Exception):
        await predictor.aclose()
