"""A stream the gateway preempted and that then ends without its continuation is counted by
what ended it: the queue's own outcome when the gateway ended it (no backend failed), and
`upstream_broken` only when a backend did (docs/reliability.md, issue 18).

The order is forced, not timed: a real aiohttp backend streams LONG's first tokens and then
holds it; SHORT arrives, preempts it, and is held by the backend until the test releases it,
so LONG's continuation can only wait in the queue (timeout) or, once released, reach a
backend that fails it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fixtures.gateway_fixtures import RunningGateway, StartGateway
from fixtures.route_backends import route_backend, write_words
from fixtures.scrape import scrape, total

from predictor import Embedder, LengthPredictor

pytestmark = pytest.mark.timeout(60)

LONG = "Write a very long essay about the sea."
SHORT = "Say yes."
QUEUE_TIMEOUT_S = 1.0
"""The gateway's queue timeout here. SHORT needs a few event-loop turns to be granted (far
below it); LONG's continuation waits for as long as the test holds SHORT."""


@dataclass
class HoldingBackend:
    """A completions backend: LONG's first request streams 5 tokens then stalls until it is
    aborted; SHORT waits for `release`, then streams; LONG's continuation (its prompt plus
    text) is answered 500 when `fail_continuation`, else streamed."""

    url: str = ""
    fail_continuation: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)
    events: list[str] = field(default_factory=list)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        if prompt.startswith(LONG) and prompt != LONG:
            self.events.append("continuation")
            if self.fail_continuation:
                return web.json_response({"error": {"message": "engine dead"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if prompt == SHORT:
            self.events.append("short")
            await self.release.wait()
        n = 5 if prompt == LONG else body["max_tokens"]
        return await write_words(resp, n, self.events, stall=prompt == LONG)


@asynccontextmanager
async def holding_backend(fail_continuation: bool) -> AsyncIterator[HoldingBackend]:
    backend = HoldingBackend(fail_continuation=fail_continuation)
    async with route_backend(
        backend.completions, only="/v1/completions", handler_cancellation=True
    ) as backend.url:
        try:
            yield backend
        finally:
            backend.release.set()


async def preempting_gateway(
    url: str, start_gateway: StartGateway, embedder: Embedder
) -> RunningGateway:
    """One slot, SageSched with preemption, a predictor that knows LONG as long and SHORT as
    short: SHORT arriving while LONG runs preempts it."""
    predictor = LengthPredictor(embedder=embedder)
    predictor.observe_many([LONG, SHORT], [1500, 3])
    return await start_gateway(
        [{"url": url, "max_inflight": 1}],
        policy="sagesched",
        preemption=True,
        preemption_margin=0.0,
        predictor=predictor,
        queue_timeout_s=QUEUE_TIMEOUT_S,
    )


def body(text: str, n: int) -> dict[str, Any]:
    return {"model": "tiny-llama", "prompt": text, "max_tokens": n, "stream": True}


async def read_events(resp: aiohttp.ClientResponse, started: asyncio.Event) -> list[bytes]:
    """Every `data:` payload of a stream (`[DONE]` included); `started` after 5 tokens."""
    payloads = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            payloads.append(line[6:].strip())
            if sum(p.startswith(b'{"choices"') for p in payloads) == 5:
                started.set()
    return payloads


async def fetch(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> bytes:
    async with session.post(url + "/v1/completions", json=payload) as r:
        assert r.status == 200
        return await r.read()


async def run_preempted_long(
    gw: RunningGateway, backend: HoldingBackend, *, release_short: bool
) -> tuple[list[bytes], float, bytes]:
    """LONG starts and is preempted by SHORT; SHORT is let through at once (`release_short`)
    or only after LONG's stream ended. Returns LONG's payloads, the seconds from the
    preemption to the end of LONG's stream, and SHORT's body."""
    async with aiohttp.ClientSession() as s:
        started = asyncio.Event()
        long_resp = await s.post(gw.url + "/v1/completions", json=body(LONG, 40))
        long_task = asyncio.create_task(read_events(long_resp, started))
        await asyncio.wait_for(started.wait(), 30)
        assert backend.events == ["stalled"]
        if release_short:
            backend.release.set()
        preempted_at = time.monotonic()
        short_task = asyncio.create_task(fetch(s, gw.url, body(SHORT, 3)))
        long_payloads = await asyncio.wait_for(long_task, 30)
        ended_after = time.monotonic() - preempted_at
        backend.release.set()
        short = await asyncio.wait_for(short_task, 30)
    return long_payloads, ended_after, short


async def test_preempted_stream_timing_out_in_the_queue_counts_queue_timeout(
    start_gateway: StartGateway, embedder: Embedder
) -> None:
    """LONG's first tokens, then an SSE error event `queue_timeout` and `[DONE]`; counted
    `queue_timeout` once (not `upstream_broken`); SHORT completes; the continuation never
    reached the backend."""
    async with holding_backend(fail_continuation=False) as backend:
        gw = await preempting_gateway(backend.url, start_gateway, embedder)
        # SHORT is held until LONG's stream ended: LONG can only wait in the queue
        long_payloads, ended_after, short = await run_preempted_long(
            gw, backend, release_short=False
        )
        samples = await scrape(gw.url + "/metrics")
        events = list(backend.events)
    print(f"preempted stream ended {ended_after:.2f} s after the preemption")
    tokens = [p for p in long_payloads if p.startswith(b'{"choices"')]
    assert [json.loads(p)["choices"][0]["text"] for p in tokens] == [f"w{i} " for i in range(5)]
    error = json.loads(long_payloads[-2])["error"]
    assert error["code"] == "queue_timeout" and error["type"] == "server_error"
    assert long_payloads[-1] == b"[DONE]" and len(long_payloads) == 7
    assert ended_after >= QUEUE_TIMEOUT_S, ended_after
    assert short.endswith(b"data: [DONE]\n\n") and short.count(b'"text"') == 3
    assert sorted(events) == ["aborted", "short", "stalled"]  # no continuation was sent
    requests = "sagesched_requests_total"
    assert total(samples, "sagesched_preemptions_total") == 1
    assert total(samples, requests, outcome="queue_timeout", code="200") == 1
    assert total(samples, requests, outcome="upstream_broken") == 0
    assert total(samples, requests, outcome="completed") == 1
    assert total(samples, requests) == 2
    assert gw.state.pool.backends[0].inflight == 0 and gw.state.dispatcher.waiting() == 0


async def test_preempted_stream_whose_continuation_fails_counts_upstream_broken(
    start_gateway: StartGateway, embedder: Embedder
) -> None:
    """The counterpart: the continuation reaches the backend, which fails it (500, and no
    other backend): a backend failure after the start, counted `upstream_broken`; the event
    carries the error's own code (`upstream_failed`)."""
    async with holding_backend(fail_continuation=True) as backend:
        gw = await preempting_gateway(backend.url, start_gateway, embedder)
        long_payloads, _, short = await run_preempted_long(gw, backend, release_short=True)
        samples = await scrape(gw.url + "/metrics")
        events = list(backend.events)
    assert len([p for p in long_payloads if p.startswith(b'{"choices"')]) == 5
    assert json.loads(long_payloads[-2])["error"]["code"] == "upstream_failed"
    assert long_payloads[-1] == b"[DONE]"
    assert short.endswith(b"data: [DONE]\n\n")
    assert sorted(events) == ["aborted", "continuation", "short", "stalled"]
    requests = "sagesched_requests_total"
    assert total(samples, requests, outcome="upstream_broken", code="200") == 1
    assert total(samples, requests, outcome="queue_timeout") == 0
    assert total(samples, requests, outcome="completed") == 1
    assert total(samples, requests) == 2
