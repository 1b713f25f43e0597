"""The whole self-tuning cap loop against the emulator: gateway scrape loop → vLLM-named
/metrics → `policies.capacity.CapController` → the pool's cap, in real time.

The emulated engine runs a linear profile with a known curve: an iteration takes
A + B_SEQ·B + B_CTX·ΣL + B_TOK·P seconds (B running requests, ΣL their context, P prompt
tokens), so at the traffic's mix its throughput is B / (A + beta'·B) and the batch at share f
of the plateau is f / (1 - f) · A / beta' (`knee`). Shortening the prompts (a load change)
lowers beta' and moves the knee up. Targets: within ±20% of the knee within 30 s from a cold
start, follows the change (within `CHANGE_S`), and a gateway restarted with the curve memory is
within ±20% within 5 s.

Answer lengths vary (uniform 50–150 tokens): with one fixed length every batch the cap admits
at once finishes at once, and real traffic is not in lockstep.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
from pathlib import Path

import aiohttp
import pytest
from fixtures.gateway_fixtures import StartGateway

from loadgen.emulator import EmulatorConfig, create_app, make_runner
from loadgen.engine.profiles import LatencyProfile
from policies.capacity import CapLaw

# A real-time control loop (emulator, gateway and the clients share this process): it runs
# with the timing tests, with nothing else busy.
pytestmark = [pytest.mark.slow, pytest.mark.timing]

A_S, B_SEQ_S, B_CTX_S, B_TOK_S = 0.010, 0.0003, 0.000003, 0.00005
OUTPUT = (50, 150)
"""Answer lengths, uniform (inclusive)."""
CLIENTS = 96
CHANGE_S = 150
"""Seconds of the new load: the traffic mix the knee depends on fades with a 30 s half-life,
so the last 20 s of these see 95% of the new mix."""
WORDS = [f"w{i}" for i in range(100_000)]


class Linear(LatencyProfile):
    """Iteration time linear in its shape, with known coefficients."""

    name = "test-linear"
    description = "an iteration linear in batch, context and prefill"

    def iteration_s(self, n_decode: int, decode_context: int, prefill_tokens: int) -> float:
        return A_S + B_SEQ_S * n_decode + B_CTX_S * decode_context + B_TOK_S * prefill_tokens


def knee(prompt_tokens: int, fraction: float = CapLaw().plateau_fraction) -> float:
    """The batch at `fraction` of the plateau. A running slot holds an answer of length L for
    L iterations, so a slot's mean context is prompt + E[L^2] / (2 E[L]), and each prompt's
    prefill is spread over its answer (prompt / E[L] tokens per iteration)."""
    lengths = range(OUTPUT[0], OUTPUT[1] + 1)
    mean = statistics.mean(lengths)
    mean_sq = statistics.mean(n * n for n in lengths)
    context = prompt_tokens + mean_sq / (2 * mean)
    slope = B_SEQ_S + B_CTX_S * context + B_TOK_S * prompt_tokens / mean
    return fraction / (1 - fraction) * A_S / slope


async def _client(session: aiohttp.ClientSession, url: str, prompt: str, seed: int) -> None:
    rng = random.Random(seed)
    while True:
        # a word of its own in front: no two prompts share a cached prefix (the knee assumes
        # every prompt is prefilled in full)
        unique = f"{rng.choice(WORDS)} {prompt}"
        body = {"model": "tiny-llama", "prompt": unique, "max_tokens": rng.randint(*OUTPUT),
                "ignore_eos": True}  # fmt: skip
        async with session.post(url + "/v1/completions", json=body) as r:
            await r.read()


async def _prompt_tokens(session: aiohttp.ClientSession, url: str, prompt: str) -> int:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1}
    async with session.post(url + "/v1/completions", json=body) as r:
        return int((await r.json())["usage"]["prompt_tokens"])


async def _load(
    session: aiohttp.ClientSession, url: str, prompt: str, backend: object, seconds: int
) -> list[int]:
    """`CLIENTS` closed-loop clients for `seconds`; the cap once a second."""
    clients = [asyncio.create_task(_client(session, url, prompt, i)) for i in range(CLIENTS)]
    caps = []
    try:
        for _ in range(seconds):
            await asyncio.sleep(1.0)
            caps.append(backend.cap)  # type: ignore[attr-defined]
    finally:
        for task in clients:
            task.cancel()
        for task in clients:
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await task
    return caps


def near(caps: list[int], b: float) -> bool:
    """The caps average within ±20% of `b`; none is further off than the refinement dither
    (±`CapLaw.refine_step` around the estimate while its error is still above half the
    bound) adds to that."""
    spread = 0.2 + CapLaw().refine_step
    return abs(statistics.mean(caps) - b) <= 0.2 * b and all(abs(c - b) <= spread * b for c in caps)


async def test_cap_finds_the_knee_cold_follows_a_change_and_restarts_warm(
    start_gateway: StartGateway, tmp_path: Path
) -> None:
    app = create_app(EmulatorConfig(max_num_seqs=512, max_model_len=4096), Linear())
    runner, port = await make_runner(app, "127.0.0.1", 0)
    emu = f"http://127.0.0.1:{port}"
    memory = tmp_path / "curves.json"
    adaptive = {"enabled": True, "memory_path": str(memory)}
    try:
        gw = await start_gateway(
            [{"url": emu, "max_inflight": 8}], policy="fcfs", adaptive_cap=adaptive
        )
        backend = gw.state.pool.backends[0]
        long_prompt, short_prompt = "lorem ipsum " * 150, "lorem ipsum " * 45
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=2 * CLIENTS + 4)
        ) as session:
            b1 = knee(await _prompt_tokens(session, emu, long_prompt))
            b2 = knee(await _prompt_tokens(session, emu, short_prompt))
            assert 1.5 * b1 < b2 < 0.8 * CLIENTS  # the change really moves the efficient batch
            cold = await _load(session, gw.url, long_prompt, backend, 40)
            # the load changes: the long-prompt clients leave and short-prompt ones arrive
            change = await _load(session, gw.url, short_prompt, backend, CHANGE_S)
            gw.state.pool.remember()
            # a restart: a new gateway reads the memory and starts where the curve says
            gw2 = await start_gateway(
                [{"url": emu, "max_inflight": 8}], policy="fcfs", adaptive_cap=adaptive
            )
            warm = await _load(session, gw2.url, short_prompt, gw2.state.pool.backends[0], 15)
    finally:
        await runner.cleanup()
    report = (b1, b2, cold, change, warm)
    assert near(cold[30:], b1), report  # within ±20% from 30 s on, cold
    assert near(change[-20:], b2), report
    assert near(warm[5:], b2), report  # within 5 s of a restart
