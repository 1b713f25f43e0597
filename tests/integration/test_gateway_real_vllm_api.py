"""The rest of vLLM's API, prompt counts and preemption + resume through the gateway, against
the real vLLM CPU build serving the tiny model (slow; not timing)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from fixtures.gateway_fixtures import StartGateway
from fixtures.scrape import scrape, total

from loadgen.vllm_real import RealVllm
from predictor import Embedder, LengthPredictor

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LONG = "Write a very long essay about the sea."
SHORT = "Say yes."


async def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


async def test_tokenize_and_other_routes_pass_through(
    real_vllm: RealVllm, start_gateway: StartGateway
) -> None:
    gw = await start_gateway([{"url": real_vllm.url, "max_inflight": 1}], policy="fcfs")
    model = real_vllm.name
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = "Once upon a time, in a land far away"
    status, via = await post(gw.url + "/tokenize", {"model": model, "prompt": prompt})
    _, direct = await post(real_vllm.url + "/tokenize", {"model": model, "prompt": prompt})
    assert status == 200 and via == direct
    status, chat_count = await post(gw.url + "/tokenize", {"model": model, "messages": messages})
    assert status == 200
    status, text = await post(gw.url + "/detokenize", {"model": model, "tokens": via["tokens"]})
    assert status == 200 and "once upon a time" in text["prompt"]
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0) as client:
        # the counts /tokenize gives are the answers' usage.prompt_tokens
        chat = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=2,  # type: ignore[arg-type]
        )
        done = await client.completions.create(model=model, prompt=prompt, max_tokens=2)
        assert chat.usage is not None and chat.usage.prompt_tokens == chat_count["count"]
        assert done.usage is not None and done.usage.prompt_tokens == via["count"]
        with pytest.raises(openai.NotFoundError):  # a generate model serves no embeddings
            await client.embeddings.create(model=model, input="hello")
        answer = await client.responses.create(
            model=model, input="Hello there", max_output_tokens=4
        )
        assert answer.usage is not None and answer.usage.output_tokens == 4
        events = [
            e.type
            async for e in await client.responses.create(
                model=model, input="Hello there", max_output_tokens=4, stream=True
            )
        ]
        assert events[-1] in ("response.completed", "response.incomplete")
        assert "response.output_text.delta" in events
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="completed") == 7
    assert total(samples, "sagesched_requests_total", outcome="upstream_error", code="404") == 1
    assert total(samples, "sagesched_output_tokens_total") >= 2 + 2 + 4 + 4 - 1


async def test_queued_prompt_counted_by_vllm(
    real_vllm: RealVllm, start_gateway: StartGateway
) -> None:
    gw = await start_gateway([{"url": real_vllm.url, "max_inflight": 1}], policy="fcfs")
    model = real_vllm.name
    body: dict[str, Any] = {"model": model, "max_tokens": 1}
    chats = [
        {**body, "messages": [{"role": "user", "content": f"Q{i}: {'x, ' * 40}?"}]}
        for i in range(4)
    ]
    _, exact = await post(
        real_vllm.url + "/tokenize", {"model": model, "messages": chats[0]["messages"]}
    )
    long = {
        **body,
        "max_tokens": 300,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "go"}],
    }
    async with aiohttp.ClientSession() as s:
        hold = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=long))
        while gw.state.pool.backends[0].inflight == 0:
            await asyncio.sleep(0.01)
        answers = await asyncio.gather(
            *(s.post(gw.url + "/v1/chat/completions", json=c) for c in chats)
        )
        usage = [(await a.json())["usage"]["prompt_tokens"] for a in answers]
        (await hold).close()
    assert usage[0] == exact["count"]
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_prompt_counts_total", source="tokenizer") == 4
    assert total(samples, "sagesched_prompt_tokens_total") >= sum(usage)


async def read_events(resp: aiohttp.ClientResponse, started: asyncio.Event) -> list[Any]:
    events: list[Any] = []
    async for line in resp.content:
        if line.startswith(b"data: {"):
            events.append(json.loads(line[6:]))
            if len(events) == 8:
                started.set()
        elif line.startswith(b"data: [DONE]"):
            events.append("[DONE]")
    return events


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_preemption_resumes_on_vllm(
    kind: str, real_vllm: RealVllm, start_gateway: StartGateway, embedder: Embedder
) -> None:
    """A long stream preempted by a short request resumes as a continuation that vLLM
    accepts (chat: `continue_final_message`; completions: the appended prompt), with
    `max_tokens` and `min_tokens` lowered by what was generated."""
    predictor = LengthPredictor(embedder=embedder)
    predictor.observe_many([LONG, SHORT], [1500, 3])
    gw = await start_gateway(
        [{"url": real_vllm.url, "max_inflight": 1}],
        policy="sagesched",
        preemption=True,
        preemption_margin=0.0,
        predictor=predictor,
    )
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"

    def body(text: str, n: int) -> dict[str, Any]:
        b: dict[str, Any] = {
            "model": real_vllm.name,
            "max_tokens": n,
            "min_tokens": n,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if kind == "chat":
            b["messages"] = [{"role": "user", "content": text}]
        else:
            b["prompt"] = text
        return b

    async with aiohttp.ClientSession() as s:
        started = asyncio.Event()
        long_resp = await s.post(gw.url + path, json=body(LONG, 200))
        long_task = asyncio.create_task(read_events(long_resp, started))
        await asyncio.wait_for(started.wait(), 60)
        async with s.post(gw.url + path, json=body(SHORT, 3)) as r:
            short = await r.read()
        long_events = await asyncio.wait_for(long_task, 120)
    assert short.endswith(b"data: [DONE]\n\n")
    assert long_events[-1] == "[DONE]"
    assert not [e for e in long_events if isinstance(e, dict) and "error" in e]
    usage = [e["usage"] for e in long_events if isinstance(e, dict) and e.get("usage")]
    # the cap counts every segment; a token whose text is empty cannot be counted on the fly,
    # so the continuation may ask for a few more than strictly left
    assert usage and 200 <= usage[-1]["completion_tokens"] <= 210
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_preemptions_total") == 1
    assert total(samples, "sagesched_requests_total", outcome="completed") == 2
