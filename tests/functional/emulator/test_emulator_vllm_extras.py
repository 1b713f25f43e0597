"""What vLLM serves beyond one choice of one prompt: `n` > 1, batches of prompts, `min_tokens`,
`/tokenize` and `/detokenize`, and resuming an answer (`continue_final_message` for chat,
the appended prompt for completions), through the official `openai` client where it has a
method."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from loadgen.emulator import protocol, tokens

MODEL = "tiny-llama"


@pytest.fixture
async def c(emulator_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=emulator_url + "/v1", api_key="x", max_retries=0
    ) as client:
        yield client


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("emulator_url", [{"time_scale": 0.1}], indirect=True)
async def test_n_and_prompt_batches(c: openai.AsyncOpenAI) -> None:
    r = await c.completions.create(
        model=MODEL,
        prompt=["Hello there", "Bye now"],
        n=2,
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert all(len(ch.text.split()) == 3 for ch in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 12
    # prompts counted once each, whatever n (as vLLM's usage)
    one = await c.completions.create(model=MODEL, prompt="Hello there", max_tokens=1)
    two = await c.completions.create(model=MODEL, prompt="Bye now", max_tokens=1)
    assert one.usage and two.usage
    assert r.usage.prompt_tokens == one.usage.prompt_tokens + two.usage.prompt_tokens
    # choice 0 of prompt 0 is the n = 1 answer; the other draws differ
    assert (
        r.choices[0].text
        == (await c.completions.create(model=MODEL, prompt="Hello there", max_tokens=3))
        .choices[0]
        .text
    )
    assert len({ch.text for ch in r.choices}) > 1
    ids = await c.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=1)
    assert ids.usage is not None and ids.usage.prompt_tokens == 5 and len(ids.choices) == 2

    stream = await c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        n=3,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [ch async for ch in stream]
    roles = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role]
    assert roles == [0, 1, 2]  # one opening chunk per choice
    text: dict[int, str] = {}
    for ch in chunks:
        if ch.choices and ch.choices[0].delta.content:
            text[ch.choices[0].index] = (
                text.get(ch.choices[0].index, "") + ch.choices[0].delta.content
            )
    assert sorted(text) == [0, 1, 2] and all(len(t.split()) == 4 for t in text.values())
    finals = [
        ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
    ]
    assert finals == ["length"] * 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError, match="n must be at least 1"):
        await c.completions.create(model=MODEL, prompt="x", max_tokens=1, n=0)


@pytest.mark.parametrize("emulator_url", [{"time_scale": 0.1}], indirect=True)
async def test_min_tokens(c: openai.AsyncOpenAI) -> None:
    prompt = next(
        p for p in (f"Question {i}?" for i in range(100)) if tokens.natural_output_tokens(p) < 40
    )
    r = await c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=60, extra_body={"min_tokens": 50}
    )
    assert r.usage is not None and r.usage.completion_tokens == 50
    with pytest.raises(openai.BadRequestError, match="min_tokens must be less than or equal"):
        await c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, extra_body={"min_tokens": 6}
        )


async def test_tokenize_matches_usage(c: openai.AsyncOpenAI, emulator_url: str) -> None:
    prompt = "The quick brown fox, jumping over the lazy dog!"
    status, tok = await post(emulator_url + "/tokenize", {"model": MODEL, "prompt": prompt})
    assert status == 200 and set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
    done = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert done.usage is not None and tok["count"] == done.usage.prompt_tokens == len(tok["tokens"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    status, tok = await post(emulator_url + "/tokenize", {"model": MODEL, "messages": messages})
    chat = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert status == 200 and chat.usage is not None and tok["count"] == chat.usage.prompt_tokens
    # model may be omitted, as vLLM allows; an unknown one is vLLM's 404
    assert (await post(emulator_url + "/tokenize", {"prompt": "hi"}))[0] == 200
    status, err = await post(emulator_url + "/tokenize", {"model": "nope", "prompt": "hi"})
    assert status == 404 and err["error"]["code"] == 404
    status, err = await post(emulator_url + "/tokenize", {"model": MODEL})
    assert status == 400 and err["error"]["type"] == "BadRequestError"
    # detokenize inverts the answer vocabulary
    answer = tokens.answer_text(12345, 0, 5)
    status, tok = await post(emulator_url + "/tokenize", {"prompt": answer})
    status, back = await post(
        emulator_url + "/detokenize", {"model": MODEL, "tokens": tok["tokens"]}
    )
    assert status == 200 and back == {"prompt": answer}
    assert (await post(emulator_url + "/detokenize", {"tokens": [-1]}))[0] == 400


@pytest.mark.parametrize("emulator_url", [{"time_scale": 0.1}], indirect=True)
async def test_resumed_answers_continue_the_original(c: openai.AsyncOpenAI) -> None:
    """A resume after k tokens (the gateway's continuation) produces exactly the rest of the
    uninterrupted answer, with the prompt grown by k tokens."""
    messages: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]
    whole = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=30)
    text = whole.choices[0].message.content or ""
    assert whole.usage is not None and whole.usage.completion_tokens == 30
    head = " ".join(text.split(" ")[:11])  # the first 10 tokens (" w" each)
    rest = await c.chat.completions.create(
        model=MODEL,
        messages=[*messages, {"role": "assistant", "content": head}],
        max_tokens=20,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert head + (rest.choices[0].message.content or "") == text
    assert rest.usage is not None and rest.usage.prompt_tokens == whole.usage.prompt_tokens + 10
    with pytest.raises(openai.BadRequestError, match="not compatible"):
        await c.chat.completions.create(
            model=MODEL,
            messages=[*messages, {"role": "assistant", "content": head}],
            max_tokens=2,
            extra_body={"continue_final_message": True},
        )

    prompt = "Once upon a time"
    natural = tokens.natural_output_tokens(prompt)
    full = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=natural + 5)
    assert full.choices[0].finish_reason == "stop"  # ends at its natural length
    done = full.choices[0].text
    k = min(7, natural - 1)
    head = "".join(" " + w for w in done.split()[:k])
    resumed = await c.completions.create(model=MODEL, prompt=prompt + head, max_tokens=natural + 5)
    assert head + resumed.choices[0].text == done
    assert resumed.choices[0].finish_reason == "stop"
    assert (
        full.usage and resumed.usage and resumed.usage.prompt_tokens == full.usage.prompt_tokens + k
    )


def test_split_appended_rules() -> None:
    prompt = "Write about the moon"
    seed = tokens.digest(prompt)
    assert tokens.split_appended(prompt + tokens.answer_text(seed, 0, 9)) == (prompt, 9)
    assert tokens.split_appended(prompt + tokens.answer_text(seed, 0, 1)) == (
        prompt + tokens.answer_text(seed, 0, 1),
        0,
    )  # one token is not enough evidence
    assert tokens.split_appended(prompt + tokens.answer_text(seed + 1, 0, 9))[1] == 0
    assert tokens.split_appended("the of and to in a is that")[1] == 0
    assert len(tokens.text_ids(prompt)) == protocol.count_text_tokens(prompt)
