"""The gateway's per-request shortcuts (issue 17 part 2) keep their meaning: only a
preempting setup keeps continuation text, the relay reports a read's tokens to its slot once,
label lookups hit the same series, the scrape reads the same samples from fewer lines, a
backend without `/metrics` is scraped rarely, and the relay's bulk event path relays and
counts what the general path would. No network: backends are marked healthy by hand and never
contacted, except the one scraped (a real aiohttp server)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from hashlib import sha256
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.config import GatewayConfig, build
from gateway.observability.metrics import GatewayMetrics, RequestTrace, tenant_id
from gateway.scheduling.backends import NO_METRICS_RETRY_S, BackendPool, read_sample
from gateway.scheduling.dispatcher import Dispatcher, LocalSlot
from gateway.serving.openai_api import parse_call
from gateway.serving.relay import TEXT_FOLD_BYTES, Relay, StreamState, _marked_events
from policies import parse_policy

MODEL = "m"


def config(**extra: Any) -> GatewayConfig:
    backends = [{"url": "http://b0:1", "name": "b0", "max_inflight": 4, "models": [MODEL]}]
    return build({"backends": backends, "adaptive_cap": {"enabled": False}, **extra})


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def dispatcher(cfg: GatewayConfig, session: aiohttp.ClientSession) -> Dispatcher:
    pool = BackendPool(cfg.backends, session, health_interval_s=60.0, adaptive=cfg.adaptive_cap)
    for b in pool.backends:
        b.healthy = True
    return Dispatcher(parse_policy(cfg.policy), pool, cfg)


@pytest.mark.parametrize(
    ("policy", "preemption", "expect"),
    [("fcfs", True, False), ("srpt-oracle", True, True), ("srpt-oracle", False, False)],
)
async def test_only_a_preempting_setup_keeps_continuation_text(
    session: aiohttp.ClientSession, policy: str, preemption: bool, expect: bool
) -> None:
    d = dispatcher(config(policy=policy, preemption=preemption), session)
    assert d.may_preempt is expect


class CountingSlot:
    """A real `LocalSlot`, its `tokens` calls counted (the relay's one report per read)."""

    def __init__(self, slot: LocalSlot) -> None:
        self.inner = slot
        self.job = slot.job
        self.reports: list[int] = []

    def tokens(self, n: int) -> None:
        self.reports.append(n)
        self.inner.tokens(n)


def _chunk(content: str | None, compact: int = 1) -> bytes:
    delta = {} if content is None else {"content": content}
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
    return b"data: " + json.dumps(body, separators=(",", ":") if compact else None).encode()


async def _running(cfg: GatewayConfig, session: aiohttp.ClientSession) -> tuple[Relay, LocalSlot]:
    """A chat stream's job, admitted and granted its backend (the relay's state mid-stream)."""
    d = dispatcher(cfg, session)
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    trace = RequestTrace(model=MODEL, arrived=0.0, policy=cfg.policy)
    job = d.new_job(parse_call("chat", body, None), trace, None)
    job.true_output_tokens = 100  # the oracle policies order by it
    slot = d.slot(job)
    await slot.__aenter__()
    await slot.granted()
    return Relay(session, d, cfg), slot


def relay_keeps_text(relay: Relay, slot: LocalSlot) -> bool:
    """What `Relay.serve` decides for the request's `StreamState`."""
    return relay._dispatcher.may_preempt and slot.job.ctx.call.continuable


async def test_a_read_is_reported_to_the_slot_once(session: aiohttp.ClientSession) -> None:
    """Five tokens in one read: one `tokens(5)`, five timed tokens; with preemption allowed
    the continuation text is kept (srpt-oracle), without it not (FCFS)."""
    for policy, kept in (("srpt-oracle", "abcde"), ("fcfs", "")):
        relay, local = await _running(config(policy=policy, preemption=True), session)
        slot = CountingSlot(local)
        state = StreamState(keep_text=relay_keeps_text(relay, local))
        events = [_chunk(t, compact) for t, compact in zip("abcde", [1, 0, 1, 0, 1], strict=True)]
        out, done = relay._events(slot, events, state)  # type: ignore[arg-type]
        assert not done and out == b"".join(e + b"\n\n" for e in events)
        assert slot.reports == [5] and local.job.generated == 5 == state.tokens
        assert len(local.job.ctx.trace.gaps_s) == 4 and state.generated_text() == kept
        out, done = relay._events(slot, [_chunk(None), b"data: [DONE]"], state)  # type: ignore[arg-type]
        assert done and slot.reports == [5]  # no token in that read: no report
        await local.__aexit__(None, None, None)


def test_known_labels_are_the_same_series_as_new_ones() -> None:
    m = GatewayMetrics()
    first = m.requests.labels("m", "fcfs", "completed", "200")
    assert m.requests.labels("m", "fcfs", "completed", "200") is first  # the memoised path
    assert m.requests.labels("m", "fcfs", "completed", 200) is first  # converted, same child
    first.inc()
    m.requests.labels(model="m", policy="fcfs", outcome="completed", code="200").inc()
    text = m.exposition()[0].decode()
    line = 'sagesched_requests_total{code="200",model="m",outcome="completed",policy="fcfs"}'
    assert f"{line} 2.0" in text
    with pytest.raises(ValueError):  # a wrong labelset still fails as prometheus-client's
        m.requests.labels("m", "fcfs")
    assert tenant_id("acme") == tenant_id("acme") == "t-" + sha256(b"acme").hexdigest()[:8]


def test_scrape_parses_only_the_series_it_reads() -> None:
    text = (
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        + "".join(f'vllm:time_to_first_token_seconds_bucket{{le="{i}"}} {i}\n' for i in range(300))
        + "vllm:e2e_request_latency_seconds_bucket{le=oops} not-a-number\n"  # never parsed
        + 'vllm:num_requests_waiting{engine="0"} 2.0\n'
        + 'vllm:num_requests_waiting{engine="1"} 1.0\n'
        + "vllm:kv_cache_usage_perc 0.25\n"
        + "# TYPE vllm:generation_tokens counter\n"
        + "vllm:generation_tokens_total 40.0\n"
        + "vllm:generation_tokens_created 1.7e9\n"
    )
    s = read_sample(text)
    assert (s.waiting, s.kv_usage, s.generation_tokens) == (3.0, 0.25, 40.0)
    with pytest.raises(ValueError):
        read_sample("vllm:num_requests_waiting two\n")


@pytest.mark.parametrize(("status", "rare"), [(404, True), (200, False)])
async def test_a_backend_without_metrics_is_scraped_rarely(
    session: aiohttp.ClientSession, status: int, rare: bool
) -> None:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_waiting 0\n", status=status)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        url = f"http://127.0.0.1:{port}"
        cfg = build({"backends": [{"url": url, "name": "b", "max_inflight": 8}]})
        pool = BackendPool(cfg.backends, session, health_interval_s=60.0, adaptive=cfg.adaptive_cap)
        b = pool.backends[0]
        b.healthy = True
        assert b.controller is not None
        wait_s = await pool._scrape(b)
        assert wait_s == (NO_METRICS_RETRY_S if rare else b.controller.interval_s)
    finally:
        await runner.cleanup()


def test_a_kept_chunk_is_parsed_only_for_a_continuation_or_past_the_memory_bound() -> None:
    """A preemptible stream keeps its token chunks as they came: their JSON is parsed when a
    continuation needs the text, or once `TEXT_FOLD_BYTES` of them wait; the text is the
    same either way."""
    state = StreamState(keep_text=True)
    for t in "abc":
        state.keep_chunk(_chunk(t, 1)[6:])  # the payload, as `_event` gets it
    assert state.text == "" and len(state.chunks) == 3  # nothing parsed yet
    assert state.generated_text() == "abc" and not state.chunks
    big = _chunk("x" * 1000, 1)[6:]
    n = TEXT_FOLD_BYTES // len(big) + 1
    for _ in range(n):
        state.keep_chunk(big)
    assert state.chunk_bytes <= TEXT_FOLD_BYTES and len(state.chunks) < n  # folded on the way
    assert state.generated_text() == "abc" + "x" * 1000 * n


@pytest.mark.parametrize("compact", [1, 0])
async def test_bulk_events_relay_and_count_like_the_general_path(
    session: aiohttp.ClientSession, compact: int
) -> None:
    """One read: the role chunk (empty content), 5 tokens (one of them the text `{}`), the
    finish chunk (empty delta), usage, `[DONE]` with trailing whitespace: 7 events relayed as
    they came, 5 tokens counted, timed and reported once, usage held back and read; with the
    text kept (a preemptible stream), the text of the 5 tokens. The general path (taken when
    an event is of another form, here a leading comment) gives the same bytes, counts and
    text."""
    relayed = [_chunk("", compact), *(_chunk(t, compact) for t in ["a", "b", "{}", "c", "d"])]
    relayed.append(_chunk(None, compact))
    usage = b'data: {"choices":[],"usage":{"completion_tokens":5,"prompt_tokens":3}}'
    seen = []
    for keep_text, lead in ((False, []), (True, []), (True, [b": ping"])):  # bulk, bulk, general
        relay, local = await _running(config(policy="fcfs"), session)
        slot = CountingSlot(local)
        state = StreamState(keep_text=keep_text)
        out, done = relay._events(slot, [*lead, *relayed, usage, b"data: [DONE] "], state)  # type: ignore[arg-type]
        assert done and out == b"\n\n".join(relayed) + b"\n\n"
        assert slot.reports == [5] and state.tokens == 5 == local.job.generated
        trace = local.job.ctx.trace
        assert trace.first_token is not None and len(trace.gaps_s) == 4
        assert state.usage == {"completion_tokens": 5, "prompt_tokens": 3}
        assert state.generated_text() == ("ab{}cd" if keep_text else "")
        seen.append((out, state.tokens, state.usage_raw))
        # an event the bulk path does not take (a comment line) goes the general way
        out, done = relay._events(slot, [b": ping\n" + relayed[1]], state)  # type: ignore[arg-type]
        assert not done and out == relayed[1] + b"\n\n" and state.tokens == 6
        assert state.generated_text() == ("ab{}cda" if keep_text else "")
        await local.__aexit__(None, None, None)
    assert seen[0] == seen[1] == seen[2]


def test_marked_events_maps_marks_to_their_event() -> None:
    events = [_chunk(""), _chunk("x"), _chunk(None), _chunk("y"), _chunk("", 0)]
    assert _marked_events(b"\n\n".join(events), events) == 3
    assert _marked_events(b"", []) == 0
