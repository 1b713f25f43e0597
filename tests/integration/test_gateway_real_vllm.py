"""The gateway in front of the real vLLM CPU build serving the tiny model (slow)."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import openai
import pytest
from fixtures.gateway_fixtures import StartGateway
from fixtures.scrape import scrape, total

from gateway.serving import openai_api
from loadgen.vllm_real import RealVllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


async def test_openai_client_through_gateway(
    real_vllm: RealVllm, start_gateway: StartGateway
) -> None:
    gw = await start_gateway([real_vllm.url], policy="sagesched")
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
        chat = await client.chat.completions.create(
            model=real_vllm.name,
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=16,
            extra_body={"ignore_eos": True},
        )
        assert chat.usage is not None and chat.usage.completion_tokens == 16
        stream = await client.chat.completions.create(
            model=real_vllm.name,
            messages=[{"role": "user", "content": "Tell me a story"}],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 15
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
        text = await client.completions.create(
            model=real_vllm.name,
            prompt="Once upon a time",
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        assert text.usage is not None and text.usage.completion_tokens == 8
        pieces = [
            c
            async for c in await client.completions.create(
                model=real_vllm.name,
                prompt="Once upon a time",
                max_tokens=8,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        ]
        assert all(not c.usage for c in pieces)  # usage chunk requested upstream, not shown
        assert sum(1 for c in pieces if c.choices) >= 7
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="completed") == 4
    assert total(samples, "sagesched_time_to_first_token_seconds_count") == 4


async def test_priority_forwarded_to_priority_vllm(
    real_vllm_priority: RealVllm, start_gateway: StartGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[dict[str, Any]] = []
    original = openai_api.upstream_body

    def spy(*args: Any, **kwargs: Any) -> dict[str, Any]:
        body = original(*args, **kwargs)
        sent.append(body)
        return body

    monkeypatch.setattr("gateway.serving.relay.upstream_body", spy)
    gw = await start_gateway(
        [{"url": real_vllm_priority.url, "max_inflight": 4, "priority_scheduling": True}],
        policy="fcfs",
        forward_priority=True,
    )
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
        for _ in range(3):
            r = await client.chat.completions.create(
                model=real_vllm_priority.name,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                extra_body={"ignore_eos": True, "priority": 7},
            )
            assert r.usage is not None and r.usage.completion_tokens == 4
    # The client's own priority (7) is replaced by the level of the policy's key at grant
    # time (`policies.capacity.priority_level`); FCFS keys rise with arrival, so do levels.
    got = [b["priority"] for b in sent]
    assert len(got) == 3 and got == sorted(got) and got != [7, 7, 7]
    assert all(isinstance(p, int) for p in got)


async def test_client_disconnect_aborts_in_vllm(
    real_vllm: RealVllm, start_gateway: StartGateway
) -> None:
    gw = await start_gateway([real_vllm.url], policy="fcfs")
    body = {
        "model": real_vllm.name,
        "messages": [{"role": "user", "content": "Go on"}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gw.url + "/v1/chat/completions", json=body)
        tokens = 0
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content":""' not in line:
                tokens += 1
                if tokens == 3:
                    break
        assert total(await scrape(real_vllm.url + "/metrics"), "vllm:num_requests_running") == 1
        resp.close()
        t0 = time.monotonic()
        while total(await scrape(real_vllm.url + "/metrics"), "vllm:num_requests_running") != 0:
            assert time.monotonic() - t0 < 5.0, "vLLM kept generating for a client that left"
        elapsed = time.monotonic() - t0
    print(f"vLLM running gauge reached 0 {elapsed * 1000:.0f} ms after the client disconnected")
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="cancelled_running") == 1
