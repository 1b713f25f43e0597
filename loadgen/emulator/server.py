"""The emulated vLLM server: an aiohttp app in front of an `EngineLoop`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (streaming and not), `GET
/v1/models`, `/health`, `/metrics`. A request is validated (`protocol.parse`), submitted to
the engine loop, and answered as its tokens become visible. A client that goes away (the
handler is cancelled, or a write fails) aborts its request in the engine, as vLLM does; run the
app with `handler_cancellation=True` (`make_runner` does) so a waiting request notices too.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from loadgen.emulator import protocol
from loadgen.emulator.engine_loop import EmuRequest, EngineLoop
from loadgen.emulator.metrics import EmulatorMetrics
from loadgen.engine.configs import EngineConfig, engine_config
from loadgen.engine.profiles import LatencyProfile, make_profile


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """What one emulated backend serves and how its engine behaves."""

    profile: str = "cpu-tiny-vllm"
    """Latency profile name (`loadgen.engine.profiles`)."""
    model: str = "tiny-llama"
    """Served model name (`--served-model-name`)."""
    time_scale: float = 1.0
    """Wall seconds per virtual second: 0.1 runs ten times faster than the profile."""
    max_model_len: int = 2048
    """Prompt + output tokens per request (vLLM `--max-model-len`)."""
    priority_scheduling: bool = False
    """vLLM `--scheduling-policy priority`: accept `priority` and order the queue by it."""
    reject_priority: bool = False
    """Answer a non-zero `priority` without priority scheduling with vLLM's (pre-0.32) error
    instead of ignoring it as vLLM 0.32.0 does."""
    engine: str = "vllm-chunked-prefill"
    """Base engine configuration (`loadgen.engine.configs`)."""
    max_num_seqs: int = 128
    """Most running sequences (vLLM `--max-num-seqs`; 128 is the CPU build's default)."""
    max_num_batched_tokens: int = 2048
    """Token budget per iteration and prefill chunk size (vLLM `--max-num-batched-tokens`;
    2048 is the CPU build's default, with chunked prefill on)."""
    kv_tokens: int = 524_288
    """KV capacity in tokens (the tiny model with `VLLM_CPU_KVCACHE_SPACE=1`: 1 GiB / 2 KiB)."""

    def engine_config(self) -> EngineConfig:
        cfg = engine_config(self.engine).with_(
            max_seqs=self.max_num_seqs,
            max_batch_tokens=self.max_num_batched_tokens,
            chunk_tokens=self.max_num_batched_tokens,
            kv_tokens=self.kv_tokens,
        )
        if self.priority_scheduling:
            cfg = cfg.with_(priority_scheduling=True, waiting_order="priority")
        return cfg


@dataclass(slots=True)
class AppState:
    config: EmulatorConfig
    loop: EngineLoop
    metrics: EmulatorMetrics


STATE = web.AppKey("emulator_state", AppState)
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def create_app(config: EmulatorConfig, profile: LatencyProfile | None = None) -> web.Application:
    """The aiohttp app; the engine loop starts and stops with it. `profile` overrides the
    named one (`fit_cpu.emulated` runs fitted coefficients this way)."""
    app = web.Application(middlewares=[_errors])
    app.cleanup_ctx.append(_lifecycle(config, profile or make_profile(config.profile)))
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


def _lifecycle(config: EmulatorConfig, profile: LatencyProfile) -> Any:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        metrics = EmulatorMetrics(config.model)

        def on_tokens(req: EmuRequest, n: int, now_w: float) -> None:
            first = now_w - req.arrival_w if req.first_token_w is None else None
            gap = now_w - req.last_token_w if req.last_token_w is not None else None
            metrics.on_tokens(n, first, gap)

        loop = EngineLoop(
            config.engine_config(),
            profile,
            time_scale=config.time_scale,
            on_tokens=on_tokens,
            on_iteration=metrics.on_stats,
        )
        app[STATE] = AppState(config, loop, metrics)
        await loop.start()
        try:
            yield
        finally:
            await loop.stop()

    return ctx


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except protocol.ProtocolError as e:
        return web.json_response(
            protocol.error_body(e.message, e.status, e.err_type), status=e.status
        )


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[STATE].config
    card = {
        "id": cfg.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": cfg.model,
        "parent": None,
        "max_model_len": cfg.max_model_len,
        "permission": [],
    }
    return web.json_response({"object": "list", "data": [card]})


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion")


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise protocol.ProtocolError("request body is not valid JSON") from None
    cfg = state.config
    p = protocol.parse(
        kind,
        body,
        models={cfg.model},
        max_model_len=cfg.max_model_len,
        priority_on=cfg.priority_scheduling,
        reject_priority=cfg.reject_priority,
    )
    req = state.loop.submit(p.prompt_tokens, p.output_tokens, p.priority)
    try:
        if p.stream:
            return await _stream(request, p, req)
        return await _whole(p, req)
    finally:
        # client gone (cancelled handler, failed write) or server stopping: free the engine
        state.loop.abort(req)
        if not req.aborted:
            _record_finish(state, p, req)


def _record_finish(state: AppState, p: protocol.Parsed, req: EmuRequest) -> None:
    end = req.last_token_w or req.arrival_w
    queue = None if req.scheduled_w is None else req.scheduled_w - req.arrival_w
    state.metrics.on_finish(p.prompt_tokens, end - req.arrival_w, queue, p.finish_reason)


async def _wait_done(req: EmuRequest) -> None:
    while not req.done:
        await req.event.wait()
        req.event.clear()


async def _whole(p: protocol.Parsed, req: EmuRequest) -> web.Response:
    await _wait_done(req)
    if req.emitted < req.output_tokens:
        raise protocol.ProtocolError("the engine stopped", 503, "ServiceUnavailableError")
    text = "".join(protocol.token_text(p.seed, i) for i in range(req.emitted))
    rid, created = protocol.new_id(p.kind), protocol.now_created()
    return web.json_response(
        protocol.full_body(p, rid, created, text, req.emitted, p.finish_reason)
    )


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _stream(request: web.Request, p: protocol.Parsed, req: EmuRequest) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    rid, created = protocol.new_id(p.kind), protocol.now_created()
    if p.kind == "chat":
        await resp.write(_sse(protocol.chunk(p, rid, created, None, None, role=True)))
    sent = 0
    while sent < req.output_tokens:
        if req.emitted == sent:
            if req.done:  # ended early (server stopping)
                break
            await req.event.wait()
            req.event.clear()
            continue
        parts = []
        for i in range(sent, req.emitted):
            last = i == req.output_tokens - 1
            text = protocol.token_text(p.seed, i)
            parts.append(
                _sse(protocol.chunk(p, rid, created, text, p.finish_reason if last else None))
            )
        sent = req.emitted
        await resp.write(b"".join(parts))
    if p.include_usage:
        await resp.write(_sse(protocol.usage_chunk(p, rid, created, sent)))
    await resp.write(b"data: [DONE]\n\n")
    with contextlib.suppress(ConnectionError):
        await resp.write_eof()
    return resp


async def make_runner(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start `app` on host:port (0: a free port); returns the runner and the bound port."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = [s for s in runner.addresses]
    bound = int(sockets[0][1]) if sockets else port
    return runner, bound
