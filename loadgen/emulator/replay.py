"""A small open-loop replay for the emulator's fidelity check (the full replay CLI is separate).

`synthetic_window` draws a seeded ShareGPT-like window (Poisson arrivals, log-normal prompt
and output lengths clipped to fit the tiny model); `replay` sends it to one OpenAI-compatible
server with the official async client: `/v1/completions`, prompts as seeded random token ids
(exact lengths on vLLM and the emulator alike, no prefix-cache hits), streaming,
`max_tokens` = the recorded output with `ignore_eos`, and records TTFT and TTLT per request.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass

import openai


@dataclass(frozen=True, slots=True)
class WindowRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class ReplayRecord:
    ttft_s: float
    ttlt_s: float
    output_tokens: int


def synthetic_window(
    n: int = 40,
    rate_per_s: float = 3.0,
    seed: int = 0,
    *,
    max_prompt: int = 1024,
    max_output: int = 256,
) -> list[WindowRequest]:
    """`n` requests; prompt median 200 tokens (σ 1.0), output median 80 tokens (σ 0.8)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        p = min(max_prompt, max(8, round(200 * math.exp(rng.gauss(0.0, 1.0)))))
        o = min(max_output, max(4, round(80 * math.exp(rng.gauss(0.0, 0.8)))))
        out.append(WindowRequest(t, p, o))
    return out


async def _one(
    client: openai.AsyncOpenAI, model: str, req: WindowRequest, prompt: list[int]
) -> ReplayRecord:
    t0 = time.perf_counter()
    first: float | None = None
    n = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=req.output_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for ch in stream:
        if ch.choices and ch.choices[0].text:
            first = first or time.perf_counter()
        if ch.usage is not None:
            n = ch.usage.completion_tokens
    end = time.perf_counter()
    return ReplayRecord((first or end) - t0, end - t0, n)


async def replay(
    url: str, model: str, window: list[WindowRequest], seed: int = 0
) -> list[ReplayRecord]:
    """Send `window` open-loop (arrival times relative to now); records in window order."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 30000) for _ in range(r.prompt_tokens)] for r in window]
    # retries only re-open a connection the server closed while idle (keep-alive race)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=2) as c:
        start = time.perf_counter()
        tasks = []
        for req, prompt in zip(window, prompts, strict=True):
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(c, model, req, prompt)))
        return list(await asyncio.gather(*tasks))


def medians(records: list[ReplayRecord]) -> dict[str, float]:
    """Median TTFT and TTLT in seconds."""
    return {
        "ttft_s": statistics.median(r.ttft_s for r in records),
        "ttlt_s": statistics.median(r.ttlt_s for r in records),
    }
