"""The rest of vLLM's API through the gateway (emulated backend): `/tokenize`, `/detokenize`
and any other route forwarded at once, with chat's auth and body limit, the backend's errors
as OpenAI JSON with their status, one counted outcome per request; `n` > 1 and prompt batches
relayed through the policy queue."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import RunningGateway, StartGateway
from fixtures.scrape import scrape, total

from loadgen.emulator import tokens

KEY = {"Authorization": "Bearer k1"}
MODEL = "tiny-llama"


@pytest.fixture
async def gw(start_emulator: StartEmulator, start_gateway: StartGateway) -> RunningGateway:
    backend = await start_emulator(time_scale=0.1)
    return await start_gateway(
        [{"url": backend, "max_inflight": 2}], policy="fcfs", api_keys=["k1"], max_body_bytes=20_000
    )


async def call(
    gw: RunningGateway, method: str, path: str, body: Any = None, headers: dict[str, str] = KEY
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, gw.url + path, json=body, headers=headers) as r,
    ):
        ctype = r.headers.get("Content-Type", "")
        return r.status, await (r.json() if "json" in ctype else r.text())


def assert_openai_error(data: Any) -> None:
    assert set(data) == {"error"}
    assert set(data["error"]) == {"message", "type", "param", "code"}
    assert isinstance(data["error"]["message"], str) and data["error"]["message"]


async def test_tokenize_and_detokenize_pass_through(gw: RunningGateway) -> None:
    backend = gw.state.pool.backends[0].url
    body = {"model": MODEL, "prompt": "Hello there, how are you?"}
    status, via = await call(gw, "POST", "/tokenize", body)
    async with aiohttp.ClientSession() as s, s.post(backend + "/tokenize", json=body) as r:
        direct = await r.json()
    assert status == 200 and via == direct and via["count"] == len(via["tokens"])
    status, text = await call(gw, "POST", "/detokenize", {"model": MODEL, "tokens": via["tokens"]})
    assert status == 200 and "prompt" in text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    status, counted = await call(gw, "POST", "/tokenize", chat)
    assert status == 200 and counted["count"] > 0
    assert (await call(gw, "POST", "/tokenize", {"prompt": "no model named"}))[0] == 200

    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="completed", code="200") == 4
    assert total(samples, "sagesched_requests_total", model=MODEL) == 3  # the 4th named none


async def test_auth_limits_and_errors(gw: RunningGateway) -> None:
    body = {"model": MODEL, "prompt": "hi"}
    status, data = await call(gw, "POST", "/tokenize", body, headers={})
    assert status == 401 and data["error"]["code"] == "invalid_api_key"
    status, data = await call(gw, "POST", "/tokenize", {"model": MODEL, "prompt": "x" * 30_000})
    assert status == 413
    assert_openai_error(data)
    status, data = await call(gw, "POST", "/tokenize", {"model": "nope", "prompt": "hi"})
    assert status == 404 and data["error"]["code"] == "model_not_found"
    # the backend's own errors keep their status, in OpenAI's form
    status, data = await call(gw, "POST", "/tokenize", {"model": MODEL})
    assert status == 400
    assert_openai_error(data)
    status, data = await call(gw, "POST", "/v1/embeddings", {"model": MODEL, "input": "hi"})
    assert status == 404 and data["error"]["message"] == "Not Found"  # vLLM: no pooling task
    status, data = await call(gw, "GET", "/v1/score")
    assert status in (404, 405)
    assert_openai_error(data)
    # the gateway's own paths are never forwarded
    status, data = await call(gw, "GET", "/v1/chat/completions")
    assert status == 405
    assert_openai_error(data)
    status, data = await call(gw, "POST", "/metrics")
    assert status == 405

    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="rejected", code="401") == 1
    assert total(samples, "sagesched_requests_total", outcome="rejected", code="413") == 1
    assert total(samples, "sagesched_requests_total", outcome="rejected", code="404") == 1
    assert total(samples, "sagesched_requests_total", outcome="upstream_error") == 3
    assert total(samples, "sagesched_requests_total", outcome="rejected", code="405") == 2
    assert total(samples, "sagesched_requests_total") == 8


async def test_openai_client_embeddings_and_batches(gw: RunningGateway) -> None:
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k1", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError):  # the tiny model has no pooling task
            await client.embeddings.create(model=MODEL, input="hello")
        batch = await client.completions.create(
            model=MODEL,
            prompt=["one two", "three"],
            n=2,
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
        assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
        assert batch.usage is not None and batch.usage.completion_tokens == 12
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            n=2,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
    words = {0: 0, 1: 0}
    for c in chunks:
        if c.choices and c.choices[0].delta.content:
            words[c.choices[0].index] += 1
    assert words == {0: 5, 1: 5}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="completed") == 2
    assert total(samples, "sagesched_output_tokens_total") == 22
    assert total(samples, "sagesched_requests_total", outcome="upstream_error", code="404") == 1


async def test_responses_queued_under_the_policy(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    """`/v1/responses` through the official client, whole and streamed: queued like chat (one
    slot, so the second waits), relayed with vLLM's event names, tokens and TTFT counted."""
    backend = await start_emulator(time_scale=0.2)
    gw = await start_gateway([{"url": backend, "max_inflight": 1}], policy="sagesched")
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:

        async def streamed() -> list[str]:
            stream = await client.responses.create(
                model=MODEL, input="Tell me a story.", max_output_tokens=40, stream=True
            )
            return [e.type async for e in stream]

        whole, events = await asyncio.gather(
            client.responses.create(
                model=MODEL, instructions="Be brief.", input="Hello there", max_output_tokens=30
            ),
            streamed(),
        )
    assert whole.usage is not None and whole.usage.output_tokens == 30
    assert whole.status == "incomplete" and len(whole.output_text.split()) == 30
    deltas = min(40, tokens.natural_output_tokens("Tell me a story."))  # ends naturally
    assert events.count("response.output_text.delta") == deltas
    assert events[0] == "response.created" and events[-1] == "response.completed"
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="completed") == 2
    assert total(samples, "sagesched_output_tokens_total") == 30 + deltas
    assert total(samples, "sagesched_time_to_first_token_seconds_count") == 2
    assert total(samples, "sagesched_queue_wait_seconds_count") == 2
