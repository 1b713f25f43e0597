"""The emulated backend against the official `openai` client: routes, streaming, usage, errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from fixtures.emulator_fixtures import VLLM_SERIES

from loadgen.emulator import protocol

MODEL = "tiny-llama"


@pytest.fixture
async def c(emulator_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=emulator_url + "/v1", api_key="none", max_retries=0
    ) as client:
        yield client


async def test_chat_non_streaming_usage_and_length(c: openai.AsyncOpenAI) -> None:
    r = await c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story about a cat."}],
        max_tokens=7,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion"
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.completion_tokens == 7
    assert len((r.choices[0].message.content or "").split()) == 7
    # 8 words and punctuation × 1.3 → 11, plus 4 per message and 2 for the generation prompt
    assert r.usage.prompt_tokens == 11 + 4 + 2
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


async def test_chat_stream_with_usage_chunk(c: openai.AsyncOpenAI) -> None:
    stream = await c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_completion_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [ch async for ch in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) == 5
    assert content[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in content[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5
    assert len({ch.id for ch in chunks}) == 1


async def test_stream_without_include_usage_has_no_usage_chunk(c: openai.AsyncOpenAI) -> None:
    stream = await c.completions.create(
        model=MODEL, prompt="abc", max_tokens=3, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [ch async for ch in stream]
    assert len(chunks) == 3
    assert all(ch.usage is None and len(ch.choices) == 1 for ch in chunks)


async def test_completions_non_streaming_and_streaming(c: openai.AsyncOpenAI) -> None:
    r = await c.completions.create(
        model=MODEL, prompt=[101, 2023, 2003, 102], max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (4, 4)
    stream = await c.completions.create(
        model=MODEL,
        prompt="one two three",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [ch async for ch in stream]
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert len(texts) == 6 and all(t.startswith(" ") for t in texts)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("emulator_url", [{"time_scale": 0.05}], indirect=True)
async def test_natural_length_is_a_function_of_the_prompt(c: openai.AsyncOpenAI) -> None:
    prompts = [f"question number {i} about scheduling" for i in range(6)]
    for text in prompts:
        want = protocol.natural_output_tokens(text)
        r = await c.completions.create(model=MODEL, prompt=text, max_tokens=2000)
        assert r.usage is not None and r.usage.completion_tokens == want
        assert r.choices[0].finish_reason == "stop"
    lengths = {protocol.natural_output_tokens(t) for t in prompts}
    assert len(lengths) > 1  # the rule spreads prompts over lengths
    capped = await c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=1)
    assert capped.usage is not None and capped.usage.completion_tokens == 1
    assert capped.choices[0].finish_reason == "length"


async def test_errors(c: openai.AsyncOpenAI, emulator_url: str) -> None:
    with pytest.raises(openai.NotFoundError):
        await c.completions.create(model="nope", prompt="x", max_tokens=1)
    # vLLM 0.32.0 accepts (and ignores) a priority without priority scheduling
    r = await c.completions.create(
        model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 3}
    )
    assert r.usage is not None and r.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await c.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    async with (
        aiohttp.ClientSession() as s,
        s.post(emulator_url + "/v1/completions", data=b"{not json") as resp,
    ):
        assert resp.status == 400
        body = await resp.json()
        assert body["error"]["code"] == 400


async def test_models_health_metrics(c: openai.AsyncOpenAI, emulator_url: str) -> None:
    models = await c.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await c.completions.create(model=MODEL, prompt="x", max_tokens=2)
    async with aiohttp.ClientSession() as s:
        async with s.get(emulator_url + "/health") as resp:
            assert resp.status == 200
        async with s.get(emulator_url + "/metrics") as resp:
            text = await resp.text()
    for name in VLLM_SERIES:
        assert name + "{" in text, name
    assert 'model_name="tiny-llama"' in text
    assert 'vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny-llama"} 1.0' in text


@pytest.mark.parametrize("emulator_url", [{"reject_priority": True}], indirect=True)
async def test_priority_rejected_like_older_vllm(c: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="Priority scheduling is not enabled"):
        await c.completions.create(
            model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 3}
        )
    r = await c.completions.create(
        model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 0}
    )
    assert r.usage is not None and r.usage.completion_tokens == 1
