"""Prompt size from the backend's tokenizer: a queued job is counted by the emulator's
`/tokenize` (then from the cache), a job that starts at once is not counted, a backend without
`/tokenize` or a count past its timeout leaves the characters/4 estimate, and the answers'
`usage.prompt_tokens` reach the metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import RunningGateway, StartGateway
from fixtures.scrape import scrape, total

from gateway.serving.openai_api import parse_call

MODEL = "tiny-llama"
ADMIN = {"Authorization": "Bearer adm"}
# punctuation-heavy: the emulator counts 1.3 tokens per unit, characters/4 is far below
TEXT = "a, b; c. d! e? f: g - h, i; j."


def chat(text: str, n: int = 4, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": n,
        "ignore_eos": True,
        "stream": stream,
    }


async def until(check: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    t0 = time.monotonic()
    while not (value := await check()):
        assert time.monotonic() - t0 < timeout_s, "condition not reached"
        await asyncio.sleep(0.02)
    return value


async def waiting_jobs(s: aiohttp.ClientSession, gw: RunningGateway) -> list[dict[str, Any]]:
    async with s.get(gw.url + "/admin/queue", headers=ADMIN) as r:
        return list((await r.json())["jobs"])


async def hold_slot(s: aiohttp.ClientSession, gw: RunningGateway) -> asyncio.Task[Any]:
    """A long streaming request that occupies the backend's only slot (cancel it to leave)."""
    task = asyncio.create_task(
        s.post(gw.url + "/v1/chat/completions", json=chat("hold", 400, stream=True))
    )

    async def started() -> bool:
        return gw.state.pool.backends[0].inflight == 1

    await until(started)
    return task


def release(hold: asyncio.Task[Any]) -> None:
    """The held request's client leaves (its slot frees at once)."""
    if hold.done():
        hold.result().close()
    else:
        hold.cancel()


async def test_queued_prompts_are_counted_by_the_backend(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    backend = await start_emulator()
    gw = await start_gateway([{"url": backend, "max_inflight": 1}], policy="fcfs", admin_key="adm")
    estimate = parse_call("chat", chat(TEXT)).prompt_tokens_estimate
    async with aiohttp.ClientSession() as s:
        async with s.post(backend + "/tokenize", json=chat(TEXT)) as r:
            exact = (await r.json())["count"]
        assert exact > 2 * estimate  # the estimate is badly off for this prompt
        hold = await hold_slot(s, gw)
        first = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=chat(TEXT)))

        async def counted() -> list[dict[str, Any]]:
            jobs = await waiting_jobs(s, gw)
            return [j for j in jobs if j["prompt_tokens"] == exact]

        await until(counted)  # rekeyed while waiting
        async with s.get(gw.url + "/admin/queue", headers=ADMIN) as r:
            running = (await r.json())["running"]
        assert [j["rank"] for j in running] == [0] and running[0]["key"]  # the held request
        second = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=chat(TEXT)))
        await until(lambda: _n_counted(counted, 2))
        release(hold)
        answers = await asyncio.gather(first, second)
        usage = [(await a.json())["usage"]["prompt_tokens"] for a in answers]
    assert usage == [exact, exact]
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_prompt_counts_total", source="tokenizer") == 1
    assert total(samples, "sagesched_prompt_counts_total", source="cache") == 1
    assert total(samples, "sagesched_prompt_counts_total") == 2  # the held one started at once
    assert total(samples, "sagesched_prompt_tokens_total") == 2 * exact  # usage, completed only


async def _n_counted(check: Callable[[], Any], n: int) -> bool:
    return len(await check()) == n


async def test_estimate_when_tokenize_is_missing_or_slow(
    start_emulator: StartEmulator, start_faulty_backend: Any, start_gateway: StartGateway
) -> None:
    estimate = parse_call("chat", chat(TEXT)).prompt_tokens_estimate
    flaky = await start_faulty_backend("hang")  # no /tokenize route at all
    flaky.set_mode("hang", "ok")
    slow = await start_emulator()
    for backend, tokenizer in (
        (flaky.url, {}),
        (slow, {"timeout_s": 1e-6}),  # never answers in time
    ):
        gw = await start_gateway(
            [{"url": backend, "max_inflight": 1}],
            policy="fcfs",
            admin_key="adm",
            tokenizer=tokenizer,
        )
        async with aiohttp.ClientSession() as s:
            hold = await hold_slot(s, gw)
            queued = asyncio.create_task(s.post(gw.url + "/v1/chat/completions", json=chat(TEXT)))
            await until(lambda gw=gw: _has_source(gw, "estimate"))  # type: ignore[misc]
            jobs = await waiting_jobs(s, gw)
            assert [j["prompt_tokens"] for j in jobs] == [estimate]
            release(hold)
            assert (await queued).status == 200
        assert gw.state.counter is not None and gw.state.counter._skip_until  # asked no more


async def _has_source(gw: RunningGateway, source: str) -> bool:
    # the count's source is recorded on the trace as soon as the count ends
    jobs = [
        j
        for sched in gw.state.dispatcher._schedulers.values()
        for j in sched.queue
        if j.ctx.trace.prompt_count_source == source
    ]
    return bool(jobs)
