"""OpenTelemetry traces through the gateway, received by a real OTLP/HTTP receiver: the span
tree of the five steps under one request span, the caller's `traceparent` continued, the
attempt's context sent upstream, the GenAI attributes, and a collector that is down costing
nothing but counted spans."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import aiohttp
import openai
from aiohttp import web
from fixtures.gateway_fixtures import StartGateway
from fixtures.otlp_receiver import ReceivedSpan, StartOtlpReceiver
from fixtures.scrape import scrape, total
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from loadgen.emulator import EmulatorConfig, create_app, make_runner
from loadgen.procs import free_port

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
STEPS = ("sagesched.accept", "sagesched.predict", "sagesched.queue", "sagesched.relay",
         "sagesched.settle")  # fmt: skip


async def emulator_recording_headers(seen: list[dict[str, str]]) -> tuple[web.AppRunner, str]:
    """An emulated backend that keeps the headers of every generating request it gets."""
    app = create_app(EmulatorConfig(time_scale=0.05))

    @web.middleware
    async def record(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if request.path.endswith("/completions"):
            seen.append(dict(request.headers))
        return await handler(request)

    app.middlewares.append(record)
    runner, port = await make_runner(app, "127.0.0.1", 0)
    return runner, f"http://127.0.0.1:{port}"


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in spans if s.parent_span_id == parent.span_id}


async def exemplar_trace_ids(url: str) -> set[str]:
    """The trace ids on the TTFT histogram's exemplars (OpenMetrics, as Prometheus asks)."""
    headers = {"Accept": "application/openmetrics-text; version=1.0.0"}
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics", headers=headers) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        text = await r.text()
    return {
        sample.exemplar.labels["trace_id"]
        for family in text_string_to_metric_families(text)
        if family.name == "sagesched_time_to_first_token_seconds"
        for sample in family.samples
        if sample.exemplar is not None
    }


async def test_five_steps_under_the_callers_trace(
    start_gateway: StartGateway, start_otlp_receiver: StartOtlpReceiver, tmp_path: Path
) -> None:
    receiver = await start_otlp_receiver()
    seen: list[dict[str, str]] = []
    runner, backend = await emulator_recording_headers(seen)
    tracing = {"enabled": True, "endpoint": receiver.endpoint, "service_name": "gw-under-test"}
    try:
        gw = await start_gateway([backend], tracing=tracing, capture={"dir": str(tmp_path)})
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as c:
            stream = await c.chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": "Tell me about tea."}],
                max_tokens=12, stream=True, stream_options={"include_usage": True},
                extra_headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
            )  # fmt: skip
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            # a slow request is found from its TTFT bucket: the exemplar is its trace
            assert await exemplar_trace_ids(gw.url) == {CALLER_TRACE}
            await c.completions.create(model="tiny-llama", prompt="Hello", max_tokens=4)
        await gw.stop()  # flushes the spans (bounded), as a stopping gateway does
    finally:
        await runner.cleanup()
    assert usage is not None and usage.completion_tokens > 0
    spans = [s for s in receiver.spans if s.service == "gw-under-test"]
    requests = [s for s in spans if s.name.startswith("POST /v1/")]
    assert sorted(s.name for s in requests) == ["POST /v1/chat/completions", "POST /v1/completions"]
    chat = next(s for s in requests if s.name == "POST /v1/chat/completions")
    # the caller's trace is continued
    assert chat.trace_id == CALLER_TRACE and chat.parent_span_id == CALLER_SPAN
    steps = children(spans, chat)
    assert set(STEPS) <= set(steps), sorted(steps)
    assert all(s.trace_id == CALLER_TRACE for s in steps.values())
    # the steps in order, inside the request
    order = [steps[name] for name in STEPS]
    assert all(a.start_ns <= b.start_ns for a, b in itertools.pairwise(order))
    assert chat.start_ns <= order[0].start_ns and order[-1].end_ns <= chat.end_ns
    attempts = list(children(spans, steps["sagesched.relay"]).values())
    assert [a.name for a in attempts] == ["sagesched.attempt"]
    attempt = attempts[0]
    assert attempt.attributes["sagesched.result"] == "completed"
    # the backend got the attempt's context: its span joins the same trace
    assert seen[0]["traceparent"] == f"00-{CALLER_TRACE}-{attempt.span_id}-01"
    attrs = chat.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "tiny-llama"
    assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attrs["sagesched.outcome"] == "completed" and attrs["http.response.status_code"] == 200
    assert attrs["sagesched.policy"].startswith("sagesched")
    # an idle gateway starts the job on the recent distribution and refines it beside
    assert attrs.get("sagesched.predicted_median_tokens", 1) > 0
    assert attrs["sagesched.queue_depth_at_admit"] == 0 and attrs["sagesched.attempts"] == 1
    # a request without a traceparent starts its own trace
    plain = next(s for s in requests if s.name == "POST /v1/completions")
    assert plain.trace_id != CALLER_TRACE and plain.parent_span_id == ""
    assert plain.attributes["gen_ai.operation.name"] == "text_completion"
    # ... or from its capture record
    records = [
        json.loads(x) for f in tmp_path.glob("capture-*.jsonl") for x in f.read_text().split()
    ]
    assert sorted(r["trace_id"] for r in records) == sorted([CALLER_TRACE, plain.trace_id])


async def test_a_collector_that_is_down_costs_only_counted_spans(
    start_gateway: StartGateway,
) -> None:
    seen: list[dict[str, str]] = []
    runner, backend = await emulator_recording_headers(seen)
    nowhere = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    try:
        gw = await start_gateway([backend], policy="fcfs",
                                 tracing={"enabled": True, "endpoint": nowhere})  # fmt: skip
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as c:
            answers = await asyncio.gather(*(
                c.completions.create(model="tiny-llama", prompt=f"n{i}", max_tokens=4)
                for i in range(5)
            ))  # fmt: skip
        assert all(a.choices[0].text for a in answers)
        tracing = gw.state.tracing
        assert tracing is not None
        await asyncio.to_thread(tracing.force_flush)  # the export fails, on the batch thread
        dropped = total(await scrape(gw.url + "/metrics"), "sagesched_tracing_spans_dropped_total")
        assert dropped >= 5 * len(STEPS)
        assert all("traceparent" in h for h in seen)  # still propagated
    finally:
        await runner.cleanup()


async def test_an_unsampled_request_makes_no_span_but_keeps_its_context_upstream(
    start_gateway: StartGateway, start_otlp_receiver: StartOtlpReceiver
) -> None:
    """At sample ratio 0 a new request is not recorded, yet vLLM is told so (flags 00, not a
    root of its own); a caller's unsampled context passes through as it came; a caller's
    sampled one is still recorded (parent-based)."""
    receiver = await start_otlp_receiver()
    seen: list[dict[str, str]] = []
    runner, backend = await emulator_recording_headers(seen)
    tracing = {"enabled": True, "endpoint": receiver.endpoint, "sample_ratio": 0.0,
               "service_name": "gw-sampling"}  # fmt: skip
    unsampled = f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"
    callers = [None, {"traceparent": unsampled, "tracestate": "vendor=1"},
               {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}]  # fmt: skip
    try:
        gw = await start_gateway([backend], policy="fcfs", tracing=tracing)
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as c:
            for headers in callers:
                answer = await c.completions.create(
                    model="tiny-llama", prompt="Hello", max_tokens=4, extra_headers=headers
                )
                assert answer.choices[0].text
        await gw.stop()
    finally:
        await runner.cleanup()
    new, passed, sampled = seen
    version, trace_id, span_id, flags = new["traceparent"].split("-")
    assert (version, flags) == ("00", "00") and len(trace_id) == 32 and len(span_id) == 16
    assert int(trace_id, 16) and trace_id != CALLER_TRACE
    assert (passed["traceparent"], passed["tracestate"]) == (unsampled, "vendor=1")
    spans = [s for s in receiver.spans if s.service == "gw-sampling"]
    assert {s.trace_id for s in spans} == {CALLER_TRACE}  # only the sampled caller's
    attempt = next(s for s in spans if s.name == "sagesched.attempt")
    assert sampled["traceparent"] == f"00-{CALLER_TRACE}-{attempt.span_id}-01"
