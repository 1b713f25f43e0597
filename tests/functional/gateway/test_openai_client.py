"""The official `openai` client works through the gateway unchanged (emulated backend)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import StartGateway

EMU = {"time_scale": 0.05}


@pytest.fixture
async def client(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> AsyncIterator[openai.AsyncOpenAI]:
    backend = await start_emulator(**EMU)
    gw = await start_gateway([backend], policy="sagesched")
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


async def test_chat_non_streaming(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=12,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.content
    assert r.usage is not None and r.usage.completion_tokens == 12


async def test_chat_streaming_with_and_without_usage(client: openai.AsyncOpenAI) -> None:
    for want_usage in (True, False):
        stream = await client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "Count to ten."}],
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True} if want_usage else None,
            extra_body={"ignore_eos": True},
        )
        text, usage_chunks = "", []
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage_chunks.append(chunk.usage)
        assert text
        # The gateway always asks upstream for usage; the client sees it only if it asked.
        assert len(usage_chunks) == (1 if want_usage else 0)
        if want_usage:
            assert usage_chunks[0].completion_tokens == 9


async def test_completions_streaming_and_not(client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(
        model="tiny-llama", prompt="Once upon a time", max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].text and whole.usage is not None
    assert whole.usage.completion_tokens == 7
    stream = await client.completions.create(
        model="tiny-llama",
        prompt="Once upon a time",
        max_tokens=7,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [c.choices[0].text async for c in stream if c.choices]
    assert len([p for p in pieces if p]) == 7


async def test_models_health_ready(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    backend = await start_emulator(**EMU)
    gw = await start_gateway([backend], policy="fcfs")
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused") as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/health") as r:
            assert r.status == 200
        async with s.get(gw.url + "/ready") as r:
            assert r.status == 200


async def test_ready_turns_200_once_a_backend_is_healthy(
    start_emulator: StartEmulator, start_gateway: StartGateway, unused_tcp_port: int
) -> None:
    gw = await start_gateway([f"http://127.0.0.1:{unused_tcp_port}"], policy="fcfs")
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/ready") as r:
            assert r.status == 503
        async with s.get(gw.url + "/health") as r:
            assert r.status == 200
        # Bring a backend up on that port; the health loop (0.5 s) notices it.
        from loadgen.emulator import EmulatorConfig, create_app, make_runner

        runner, _ = await make_runner(
            create_app(EmulatorConfig(**EMU)), "127.0.0.1", unused_tcp_port
        )
        try:
            for _ in range(50):
                async with s.get(gw.url + "/ready") as r:
                    if r.status == 200:
                        break
                await gw.state.pool.check(gw.state.pool.backends[0])
            assert r.status == 200
        finally:
            await runner.cleanup()
