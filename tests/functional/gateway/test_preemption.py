"""Preemption: a long running stream is aborted upstream, requeued as a continuation, and the
client still sees one uninterrupted answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import RunningGateway, StartGateway
from fixtures.route_backends import Handler, route_backend, write_words
from fixtures.scrape import scrape, total

from predictor import Embedder, LengthPredictor

LONG = "Write a very long essay about the sea."
SHORT = "Say yes."


def body(kind: str, text: str, n: int) -> dict[str, Any]:
    b: dict[str, Any] = {
        "model": "tiny-llama",
        "max_tokens": n,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "chat":
        b["messages"] = [{"role": "user", "content": text}]
    else:
        b["prompt"] = text
    return b


async def read_events(resp: aiohttp.ClientResponse, started: asyncio.Event) -> list[dict[str, Any]]:
    events = []
    async for line in resp.content:
        if line.startswith(b"data: {"):
            events.append(json.loads(line[6:]))
            if len(events) == 5:
                started.set()
    return events


async def preempting_gateway(
    start_emulator: StartEmulator, start_gateway: StartGateway, embedder: Embedder
) -> tuple[str, RunningGateway]:
    """An emulator behind a one-slot SageSched gateway that preempts, whose predictor knows
    LONG as long and SHORT as short: SHORT arriving while LONG runs preempts it."""
    predictor = LengthPredictor(embedder=embedder)
    predictor.observe_many([LONG, SHORT], [1500, 3])
    backend = await start_emulator(time_scale=0.5)
    gw = await start_gateway(
        [{"url": backend, "max_inflight": 1}],
        policy="sagesched",
        preemption=True,
        preemption_margin=0.0,
        predictor=predictor,
    )
    return backend, gw


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_preempted_stream_continues_seamlessly(
    kind: str, start_emulator: StartEmulator, start_gateway: StartGateway, embedder: Embedder
) -> None:
    _, gw = await preempting_gateway(start_emulator, start_gateway, embedder)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    async with aiohttp.ClientSession() as s:
        started = asyncio.Event()
        long_resp = await s.post(gw.url + path, json=body(kind, LONG, 120))
        long_task = asyncio.create_task(read_events(long_resp, started))
        await asyncio.wait_for(started.wait(), 30)
        async with s.post(gw.url + path, json=body(kind, SHORT, 3)) as r:
            short = await r.read()
        long_events = await asyncio.wait_for(long_task, 60)
    assert short.endswith(b"data: [DONE]\n\n")
    tokens = [e for e in long_events if e.get("choices")]
    texts = [
        (c["choices"][0].get("delta") or {}).get("content") or c["choices"][0].get("text")
        for c in tokens
    ]
    assert len([t for t in texts if t]) == 120  # every token, once, across both segments
    roles = [c for c in tokens if (c["choices"][0].get("delta") or {}).get("role")]
    assert len(roles) <= 1  # the continuation's role chunk was not repeated
    usage = [e["usage"] for e in long_events if not e.get("choices") and e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 120
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_preemptions_total") == 1
    assert total(samples, "sagesched_requests_total", outcome="completed") == 2


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_resumed_answer_is_the_uninterrupted_one(
    kind: str, start_emulator: StartEmulator, start_gateway: StartGateway, embedder: Embedder
) -> None:
    """With `min_tokens` (lowered on the continuation like the token cap; vLLM rejects
    `min_tokens` above `max_tokens`), the preempted answer is word for word the answer the
    backend gives without preemption: the emulator resumes a continuation where it stopped."""
    backend, gw = await preempting_gateway(start_emulator, start_gateway, embedder)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    long_body = body(kind, LONG, 90)
    del long_body["ignore_eos"]
    long_body["min_tokens"] = 90  # longer than the natural answer: only min_tokens makes it 90
    async with aiohttp.ClientSession() as s:
        direct = {**long_body, "stream": False}
        direct.pop("stream_options")
        async with s.post(backend + path, json=direct) as r:
            choice = (await r.json())["choices"][0]
        expected = choice["message"]["content"] if kind == "chat" else choice["text"]
        started = asyncio.Event()
        long_resp = await s.post(gw.url + path, json=long_body)
        long_task = asyncio.create_task(read_events(long_resp, started))
        await asyncio.wait_for(started.wait(), 30)
        async with s.post(gw.url + path, json=body(kind, SHORT, 3)) as r:
            assert r.status == 200
        long_events = await asyncio.wait_for(long_task, 60)
    assert not [e for e in long_events if "error" in e]
    text = "".join(
        (e["choices"][0].get("delta") or {}).get("content") or e["choices"][0].get("text") or ""
        for e in long_events
        if e.get("choices")
    )
    assert len(expected.split()) == 90 and text == expected
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_preemptions_total") == 1


def stalling_backend() -> tuple[Handler, list[str]]:
    """A completions backend whose first answer to LONG streams 5 tokens and then sends
    nothing (a request stalled in vLLM); a continuation and SHORT stream to the end. Records
    `aborted` when a request's connection is closed under it."""
    events: list[str] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = 5 if body["prompt"] == LONG else body["max_tokens"]
        return await write_words(resp, n, events, stall=body["prompt"] == LONG)

    return completions, events


async def test_a_stream_stalled_in_the_backend_is_preempted(
    start_gateway: StartGateway, embedder: Embedder
) -> None:
    """The preemption stops the relay's read of a stream that sends nothing (not only one
    that streams), closes it upstream and resumes it as a continuation."""
    predictor = LengthPredictor(embedder=embedder)
    predictor.observe_many([LONG, SHORT], [1500, 3])
    completions, events = stalling_backend()
    async with route_backend(completions, only="/v1/completions", handler_cancellation=True) as url:
        gw = await start_gateway(
            [{"url": url, "max_inflight": 1}],
            policy="sagesched",
            preemption=True,
            preemption_margin=0.0,
            predictor=predictor,
        )
        async with aiohttp.ClientSession() as s:
            started = asyncio.Event()
            long_resp = await s.post(gw.url + "/v1/completions", json=body("completions", LONG, 20))
            long_task = asyncio.create_task(read_events(long_resp, started))
            await asyncio.wait_for(started.wait(), 30)
            assert events == ["stalled"]
            async with s.post(gw.url + "/v1/completions", json=body("completions", SHORT, 3)) as r:
                assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
            long_events = await asyncio.wait_for(long_task, 30)
        assert events == ["stalled", "aborted"]
        texts = [e["choices"][0]["text"] for e in long_events if e.get("choices")]
        assert len(texts) == 20 and not [e for e in long_events if "error" in e]
        usage = [e["usage"] for e in long_events if not e.get("choices") and e.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == 20
        samples = await scrape(gw.url + "/metrics")
        assert total(samples, "sagesched_preemptions_total") == 1
        assert total(samples, "sagesched_requests_total", outcome="completed") == 2
