"""The real vLLM CPU build joins the gateway's trace: started with `--otlp-traces-endpoint`
pointing at the same OTLP receiver as the gateway, its span of the request has the caller's
trace id and the gateway's attempt span as its parent (slow: its own vLLM server)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from fixtures.gateway_fixtures import StartGateway
from fixtures.otlp_receiver import StartOtlpReceiver

from loadgen.vllm_real import RealVllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


async def test_vllm_span_joins_the_gateway_trace(
    start_gateway: StartGateway, start_otlp_receiver: StartOtlpReceiver
) -> None:
    receiver = await start_otlp_receiver()
    # vLLM exports over OTLP/HTTP here (its default is gRPC), promptly (batch delay 0.2 s)
    otel = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    server = RealVllm(extra_args=("--otlp-traces-endpoint", receiver.endpoint), env=otel)
    await asyncio.to_thread(server.start)
    try:
        tracing = {"enabled": True, "endpoint": receiver.endpoint, "service_name": "gw"}
        gw = await start_gateway([server.url], policy="fcfs", tracing=tracing)
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as c:
            answer = await c.chat.completions.create(
                model=server.name, messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=8, extra_headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
            )  # fmt: skip
        assert answer.choices[0].message.content is not None
        await gw.stop()  # the gateway's spans leave now
        engine = await receiver.wait_for(
            lambda s: s.service != "gw" and s.trace_id == CALLER_TRACE, timeout_s=60
        )
    finally:
        await asyncio.to_thread(server.stop)
    attempt = next(s for s in receiver.spans if s.name == "sagesched.attempt")
    assert attempt.trace_id == CALLER_TRACE
    # vLLM continued the context the gateway sent with the attempt
    assert engine.parent_span_id == attempt.span_id, (engine.name, engine.attributes)
    # and it is the engine's record of this request
    assert answer.usage is not None
    assert engine.attributes.get("gen_ai.usage.completion_tokens") == answer.usage.completion_tokens
