"""The whole self-tuning cap loop against the emulator: gateway scrape loop → vLLM-named
/metrics → `policies.capacity.CapController` → the pool's cap, in real time.

The emulated engine runs a profile whose throughput saturates at a known batch: an iteration
takes `STEP_S` until the tokens it touches (decode contexts plus prefill) exceed `CONTEXT`,
then grows in proportion, so the token rate is flat beyond B* = CONTEXT / (context per
request). Shortening the prompts (a load change) moves B* up. The cap must settle within
±25% of B* within 60 s, and follow the change.

Answer lengths vary (uniform 50–150 tokens): with one fixed length every batch the cap admits
at once finishes at once, and the summed context, so the rate above B*, swings by ±35% over
a request's lifetime (a 1 s sample's CV 0.14–0.19, against 0.02–0.05 with varied lengths);
real traffic is not in lockstep.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics

import aiohttp
import pytest
from fixtures.gateway_fixtures import StartGateway

from loadgen.emulator import EmulatorConfig, create_app, make_runner
from loadgen.engine.profiles import LatencyProfile

# A real-time control loop (emulator, gateway and 80 clients share this process): it runs
# with the timing tests, with nothing else busy.
pytestmark = [pytest.mark.slow, pytest.mark.timing]

STEP_S = 0.04
CONTEXT = 4000
OUTPUT = (50, 150)
"""Answer lengths, uniform (inclusive)."""
CLIENTS = 80


class Saturating(LatencyProfile):
    """Constant iteration time up to `CONTEXT` tokens touched, proportional beyond."""

    name = "test-saturating"
    description = "throughput flat beyond a known batch"

    def iteration_s(self, n_decode: int, decode_context: int, prefill_tokens: int) -> float:
        return STEP_S * max(1.0, (decode_context + prefill_tokens) / CONTEXT)


def knee(prompt_tokens: int) -> float:
    """B*: requests whose summed context per iteration reaches CONTEXT. A running slot holds
    an answer of length L for L iterations, so a slot's mean decode context is prompt +
    E[L²] / (2 E[L]); each prompt's prefill is spread over its answer (prompt / E[L])."""
    lengths = range(OUTPUT[0], OUTPUT[1] + 1)
    mean = statistics.mean(lengths)
    mean_sq = statistics.mean(n * n for n in lengths)
    return CONTEXT / (prompt_tokens + mean_sq / (2 * mean) + prompt_tokens / mean)


async def _client(session: aiohttp.ClientSession, url: str, prompt: str, seed: int) -> None:
    rng = random.Random(seed)
    while True:
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": rng.randint(*OUTPUT),
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
            caps1 = await _load(session, gw.url, long_prompt, backend)
            # the load changes: the long-prompt clients leave (their queued requests go with
            # them, so the change reaches the engine at once, not after a 30 s FIFO backlog)
            # and short-prompt clients arrive
            caps2 = await _load(session, gw.url, short_prompt, backend)
    finally:
        await runner.cleanup()
    for caps, b in ((caps1, b1), (caps2, b2)):
        settled = statistics.mean(caps[-20:])
        assert 0.75 * b <= settled <= 1.25 * b, (b, caps1, caps2)


async def _load(
    session: aiohttp.ClientSession, url: str, prompt: str, backend: object
) -> list[int]:
    """`CLIENTS` closed-loop clients for 60 s; the cap once a second."""
    clients = [asyncio.create_task(_client(session, url, prompt, i)) for i in range(CLIENTS)]
    caps = []
    try:
        for _ in range(60):
            await asyncio.sleep(1.0)
            caps.append(backend.cap)  # type: ignore[attr-defined]
    finally:
        for task in clients:
            task.cancel()
        for task in clients:
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await task
    return caps
