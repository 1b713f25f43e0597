"""The emulated vLLM server: an aiohttp app in front of an `EngineLoop`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (streaming and not; `n` ≥ 1 and
batches of prompts, one engine sequence per choice), `POST /v1/responses` (one answer, whole
or as vLLM's event stream), `POST /tokenize`, `/detokenize`, `GET
/v1/models`, `/health`, `/metrics`. A request is validated (`protocol.parse`), submitted to
the engine loop, and answered as its tokens become visible. A client that goes away (the
handler is cancelled, or a write fails) aborts its request in the engine, as vLLM does; run the
app with `handler_cancellation=True` (`make_runner` does) so a waiting request notices too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from loadgen.emulator import protocol, responses
from loadgen.emulator.engine_loop import EmuRequest, EngineLoop, LoopStats
from loadgen.emulator.kv_events import KvEventPublisher, KvEventsConfig
from loadgen.emulator.metrics import EmulatorMetrics
from loadgen.engine.configs import EngineConfig, engine_config
from loadgen.engine.profiles import LatencyProfile, make_profile
from policies.routing.chain import chain_tokens


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
    block_size: int = 16
    """KV block size in tokens (vLLM `--block-size`; the prefix cache hashes prompts in it)."""
    prefix_caching: bool = True
    """Automatic prefix caching (vLLM `--enable-prefix-caching`, on by default in V1)."""
    kv_events: str | None = None
    """vLLM's `--kv-events-config` JSON: publish the prefix cache's stores and evictions on
    ZMQ in vLLM's format (`loadgen.emulator.kv_events`)."""

    def engine_config(self) -> EngineConfig:
        cfg = engine_config(self.engine).with_(
            max_seqs=self.max_num_seqs,
            max_batch_tokens=self.max_num_batched_tokens,
            chunk_tokens=self.max_num_batched_tokens,
            kv_tokens=self.kv_tokens,
            block_tokens=self.block_size,
            prefix_caching=self.prefix_caching,
        )
        if self.priority_scheduling:
            cfg = cfg.with_(priority_scheduling=True, waiting_order="priority")
        return cfg


@dataclass(slots=True)
class AppState:
    config: EmulatorConfig
    loop: EngineLoop
    metrics: EmulatorMetrics
    events: KvEventPublisher | None = None


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
    app.router.add_post("/v1/responses", _responses)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
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

        events = _publisher(config)

        def on_iteration(st: LoopStats) -> None:
            metrics.on_stats(st)
            if events is not None:
                events.flush()

        loop = EngineLoop(
            config.engine_config(),
            profile,
            time_scale=config.time_scale,
            on_tokens=on_tokens,
            on_iteration=on_iteration,
        )
        if events is not None and loop.engine.cache is not None:
            loop.engine.cache.listener = events.note
        app[STATE] = AppState(config, loop, metrics, events)
        await loop.start()
        try:
            yield
        finally:
            await loop.stop()
            if events is not None:
                events.close()

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
    except web.HTTPNotFound:  # FastAPI's answer, as vLLM gives it for a route it lacks
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


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


async def _body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise protocol.ProtocolError("request body is not valid JSON") from None


def _publisher(config: EmulatorConfig) -> KvEventPublisher | None:
    """The KV-event publisher `config.kv_events` asks for, if any."""
    if config.kv_events is None or not config.prefix_caching:
        return None
    events = KvEventsConfig.parse(config.kv_events)
    return KvEventPublisher(events, config.block_size) if events.publishes else None


def _hashes(state: AppState, answer: protocol.Answer) -> tuple[int, ...]:
    """The answer's prompt block-hash chain in the emulator's block size (caching off: none);
    the KV-event publisher learns the blocks' token ids."""
    cfg = state.config
    if not cfg.prefix_caching or answer.prompt is None:
        return ()
    ids = protocol.prompt_ids(answer.prompt)
    chain = chain_tokens(ids, cfg.block_size)
    if state.events is not None:
        state.events.learn(chain, ids)
    return chain


async def _serve(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _body(request)
    cfg = state.config
    p = protocol.parse(
        kind,
        body,
        models={cfg.model},
        max_model_len=cfg.max_model_len,
        priority_on=cfg.priority_scheduling,
        reject_priority=cfg.reject_priority,
    )
    event = asyncio.Event()  # one for all the response's sequences
    reqs = [
        state.loop.submit(
            a.prompt_tokens, a.output_tokens, p.priority, event=event, hashes=_hashes(state, a)
        )
        for a in p.answers
    ]
    try:
        if p.stream:
            return await _stream(request, p, reqs, event)
        return await _answer(p, reqs, event)
    finally:
        # client gone (cancelled handler, failed write) or server stopping: free the engine
        for req in reqs:
            state.loop.abort(req)
            if not req.aborted:
                _record_finish(state, req, p.answers[0].finish_reason)


def _record_finish(state: AppState, req: EmuRequest, finish_reason: str) -> None:
    end = req.last_token_w or req.arrival_w
    queue = None if req.scheduled_w is None else req.scheduled_w - req.arrival_w
    state.metrics.on_finish(end - req.arrival_w, queue, finish_reason)


async def _whole(reqs: list[EmuRequest], event: asyncio.Event) -> None:
    """Until every sequence is done; 503 if the engine stopped first."""
    while not all(req.done for req in reqs):
        await event.wait()
        event.clear()
    if any(req.emitted < req.output_tokens for req in reqs):
        raise protocol.ProtocolError("the engine stopped", 503, "ServiceUnavailableError")


async def _answer(p: protocol.Parsed, reqs: list[EmuRequest], event: asyncio.Event) -> web.Response:
    await _whole(reqs, event)
    texts = [a.text(0, req.emitted) for a, req in zip(p.answers, reqs, strict=True)]
    rid, created = protocol.new_id(p.kind), protocol.now_created()
    n_tokens = sum(req.emitted for req in reqs)
    return web.json_response(protocol.full_body(p, rid, created, texts, n_tokens))


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _stream(
    request: web.Request, p: protocol.Parsed, reqs: list[EmuRequest], event: asyncio.Event
) -> web.StreamResponse:
    """Chunks in the order tokens become visible; within an iteration, by choice index (as
    vLLM sends them), one chunk per token per choice."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    rid, created = protocol.new_id(p.kind), protocol.now_created()
    if p.kind == "chat":
        opening = (
            protocol.chunk(p, rid, created, None, None, index=a.index, role=True) for a in p.answers
        )
        await resp.write(b"".join(_sse(c) for c in opening))
    sent = [0] * len(reqs)
    while True:
        parts = []
        for k, (a, req) in enumerate(zip(p.answers, reqs, strict=True)):
            for i in range(sent[k], req.emitted):
                finish = a.finish_reason if i == req.output_tokens - 1 else None
                c = protocol.chunk(p, rid, created, a.text(i, i + 1), finish, index=a.index)
                parts.append(_sse(c))
            sent[k] = req.emitted
        if parts:
            await resp.write(b"".join(parts))
        if all(req.done for req in reqs):  # finished, or ended early (server stopping)
            break
        await event.wait()
        event.clear()
    if p.include_usage:
        await resp.write(_sse(protocol.usage_chunk(p, rid, created, sum(sent))))
    await resp.write(b"data: [DONE]\n\n")
    with contextlib.suppress(ConnectionError):
        await resp.write_eof()
    return resp


async def _responses(request: web.Request) -> web.StreamResponse:
    """`/v1/responses`: one answer to the chat request the body amounts to."""
    state = request.app[STATE]
    body, cfg = await _body(request), state.config
    p = responses.parse_responses(
        body,
        models={cfg.model},
        max_model_len=cfg.max_model_len,
        priority_on=cfg.priority_scheduling,
        reject_priority=cfg.reject_priority,
    )
    answer, event = p.answers[0], asyncio.Event()
    req = state.loop.submit(
        answer.prompt_tokens, answer.output_tokens, p.priority, event=event,
        hashes=_hashes(state, answer),
    )  # fmt: skip
    rid, msg_id = responses.ids()
    created = protocol.now_created()
    try:
        if not p.stream:
            await _whole([req], event)
            text = answer.text(0, req.emitted)
            obj = responses.response(p, rid, msg_id, created, body, text, req.emitted)
            return web.json_response(obj)
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        seq = itertools.count()

        def sse(event_obj: dict[str, Any]) -> bytes:
            event_obj["sequence_number"] = next(seq)
            name = str(event_obj["type"]).encode()
            return b"event: " + name + b"\n" + _sse(event_obj)

        head = responses.response(p, rid, msg_id, created, body, None, 0)
        await resp.write(b"".join(sse(e) for e in responses.opening_events(head, msg_id)))
        sent = 0
        while True:
            if req.emitted > sent:
                deltas = (
                    responses.delta_event(msg_id, answer.text(i, i + 1))
                    for i in range(sent, req.emitted)
                )
                await resp.write(b"".join(sse(e) for e in deltas))
                sent = req.emitted
            if req.done:
                break
            await event.wait()
            event.clear()
        text = answer.text(0, sent)
        final = responses.response(p, rid, msg_id, created, body, text, sent)
        await resp.write(b"".join(sse(e) for e in responses.closing_events(final, msg_id, text)))
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp
    finally:
        state.loop.abort(req)
        if not req.aborted:
            _record_finish(state, req, answer.finish_reason)


async def _tokenize(request: web.Request) -> web.Response:
    """vLLM's `/tokenize`: a `prompt` string or chat `messages` (with `add_generation_prompt`
    and `continue_final_message`); `count` equals the `prompt_tokens` a completion of the same
    prompt reports."""
    cfg = request.app[STATE].config
    body = await _body(request)
    if isinstance(body, dict) and body.get("model") is not None:
        protocol.check_model(body, {cfg.model})
    if isinstance(body, dict) and isinstance(body.get("messages"), list):
        prompt = protocol.chat_prompt(body)
    elif isinstance(body, dict) and isinstance(body.get("prompt"), str):
        prompt = protocol.completion_prompts(body)[0]
    else:
        raise protocol.ProtocolError("Field required: 'prompt' (a string) or 'messages'")
    ids = protocol.prompt_ids(prompt)
    strs = [protocol.detokenize([t]) for t in ids] if body.get("return_token_strs") else None
    return web.json_response(
        {"count": len(ids), "max_model_len": cfg.max_model_len, "tokens": ids, "token_strs": strs}
    )


async def _detokenize(request: web.Request) -> web.Response:
    """vLLM's `/detokenize`: token ids back to text (the filler vocabulary is exact; other
    ids come back as `<id>`)."""
    cfg = request.app[STATE].config
    body = await _body(request)
    if isinstance(body, dict) and body.get("model") is not None:
        protocol.check_model(body, {cfg.model})
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise protocol.ProtocolError("'tokens' must be a list of non-negative integers")
    return web.json_response({"prompt": protocol.detokenize(tokens)})


async def make_runner(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start `app` on host:port (0: a free port); returns the runner and the bound port."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = [s for s in runner.addresses]
    bound = int(sockets[0][1]) if sockets else port
    return runner, bound
