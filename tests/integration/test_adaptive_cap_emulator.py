"""The whole self-tuning cap loop against the emulator: gateway scrape loop → vLLM-named
/metrics → `policies.capacity.CapController` → the pool's cap, in real time.

The emulated engine runs a profile whose throughput saturates at a known batch: an iteration
takes `STEP_S` until the tokens it touches (decode contexts plus prefill) exceed `CONTEXT`,
then grows in proportion, so the token rate is flat beyond B* = CONTEXT / (context per
request). Shortening the prompts (a load change) moves B* up. The cap must settle within
±25% of B* within 60 s, and follow the change.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics

import aiohttp
import pytest
from fixtures.gateway_fixtures import StartGateway

from loadgen.emulator import EmulatorConfig, create_app, make_runner
from loadgen.engine.profiles import LatencyProfile

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xfail(
        strict=True,
        reason="issue 15 open: on this flat-throughput profile slow start overshoots (8 -> 64 "
        "within a second, before a 0.25 s sample sees the rate flatten) and an over-full "
        "engine drains for tens of seconds, so the cap has not settled within 60 s",
    ),
]

STEP_S = 0.04
CONTEXT = 4000
OUTPUT = 100
CLIENTS = 80


class Saturating(LatencyProfile):
    """Constant iteration time up to `CONTEXT` tokens touched, proportional beyond."""

    name = "test-saturating"
    description = "throughput flat beyond a known batch"

    def iteration_s(self, n_decode: int, decode_context: int, prefill_tokens: int) -> float:
        return STEP_S * max(1.0, (decode_context + prefill_tokens) / CONTEXT)


def knee(prompt_tokens: int) -> float:
    """B*: requests whose summed context per iteration reaches CONTEXT (decode context
    averages prompt + output/2; each prompt's prefill is spread over its output)."""
    return CONTEXT / (prompt_tokens + OUTPUT / 2 + prompt_tokens / OUTPUT)


async def _client(session: aiohttp.ClientSession, url: str, prompt: list[str]) -> None:
    while True:
        body = {"model": "tiny-llama", "prompt": prompt[0], "max_tokens": OUTPUT,
                "ignore_eos": True}  # fmt: skip
        async with session.post(url + "/v1/completions", json=body) as r:
            await r.read()


async def _prompt_tokens(session: aiohttp.ClientSession, url: str, prompt: str) -> int:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1}
    async with session.post(url + "/v1/completions", json=body) as r:
        return int((await r.json())["usage"]["prompt_tokens"])


async def test_cap_settles_at_the_saturating_batch_and_follows_a_change(
    start_gateway: StartGateway,
) -> None:
    app = create_app(EmulatorConfig(max_num_seqs=512, max_model_len=4096), Saturating())
    runner, port = await make_runner(app, "127.0.0.1", 0)
    emu = f"http://127.0.0.1:{port}"
    try:
        gw = await start_gateway(
            [{"url": emu, "max_inflight": 8}], policy="fcfs", adaptive_cap={"enabled": True}
        )
        backend = gw.state.pool.backends[0]
        long_prompt, short_prompt = "lorem ipsum " * 150, "lorem ipsum " * 45
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CLIENTS + 4)
        ) as session:
            b1 = knee(await _prompt_tokens(session, emu, long_prompt))
            b2 = knee(await _prompt_tokens(session, emu, short_prompt))
            assert b2 > 1.8 * b1  # the change really moves the efficient batch
            prompt = [long_prompt]
            clients = [
                asyncio.create_task(_client(session, gw.url, prompt)) for _ in range(CLIENTS)
            ]
            try:
                caps1 = await _watch(backend, 60.0)
                prompt[0] = short_prompt
                caps2 = await _watch(backend, 60.0)
            finally:
                for task in clients:
                    task.cancel()
                for task in clients:
                    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                        await task
    finally:
        await runner.cleanup()
    for caps, b in ((caps1, b1), (caps2, b2)):
        settled = statistics.mean(caps[-20:])
        assert 0.75 * b <= settled <= 1.25 * b, (b, caps1, caps2)


async def _watch(backend: object, seconds: float) -> list[int]:
    caps = []
    for _ in range(int(seconds)):
        await asyncio.sleep(1.0)
        caps.append(backend.cap)  # type: ignore[attr-defined]
    return caps
