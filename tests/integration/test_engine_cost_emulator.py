"""The engine's cost learned the way the cap is: the self-tuning cap's fitted curve against an
emulated engine with known coefficients, and SageSched's `time` cost pricing with it.

The emulator runs a linear profile (an iteration takes A + B_SEQ·B + B_TOK·P seconds: no
context term) while clients with short and long prompts keep it busy, so batch and prefill vary
independently: the cap's climb moves the batch, and the prompt mix swings every `PHASE_S`
between mostly short and mostly long. (With a steady mix every one-second interval holds
about the same share of long prompts, so prefill per iteration barely varies between intervals
and the per-token prefill cost is weakly determined.)

The fit must recover A, B_SEQ and B_TOK within 20%; a gateway started from the
remembered curve builds its scheduler with that cost, and `sagesched:cost=time` then orders a
4,000-token prompt after a 10-token one with the same predicted output distribution (with
the `tokens` cost the two keys tie).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path

import aiohttp
import pytest
from fixtures.gateway_fixtures import StartGateway

from loadgen.emulator import EmulatorConfig, create_app, make_runner
from loadgen.engine.profiles import LatencyProfile
from policies import Job, LengthDist

# a real-time control loop sharing this process with its clients: run with nothing else busy
pytestmark = [pytest.mark.slow, pytest.mark.timing]

A_S, B_SEQ_S, B_TOK_S = 0.010, 0.0006, 0.00004
CLIENTS = 48
PHASE_S = 5.0
LONG_SHARE = (0.1, 0.9)
"""Share of long prompts in even and odd phases."""


class Linear(LatencyProfile):
    """Iteration time linear in batch and prefill, with known coefficients."""

    name = "test-linear-cost"
    description = "an iteration linear in batch and prefill"

    def iteration_s(self, n_decode: int, decode_context: int, prefill_tokens: int) -> float:
        return A_S + B_SEQ_S * n_decode + B_TOK_S * prefill_tokens


async def _client(session: aiohttp.ClientSession, url: str, seed: int, start: float) -> None:
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    while True:
        phase = int((loop.time() - start) // PHASE_S) % 2
        long = rng.random() < LONG_SHARE[phase]
        # a word of its own in front: no two prompts share a cached prefix
        prompt = f"w{rng.randrange(10**9)} " + "lorem ipsum " * (400 if long else 20)
        body = {"model": "tiny-llama", "prompt": prompt,
                "max_tokens": rng.randint(30, 120), "ignore_eos": True}  # fmt: skip
        async with session.post(url + "/v1/completions", json=body) as r:
            await r.read()


async def test_the_fitted_engine_cost_orders_long_prompts_later(
    start_gateway: StartGateway, tmp_path: Path
) -> None:
    app = create_app(EmulatorConfig(max_num_seqs=512, max_model_len=4096), Linear())
    runner, port = await make_runner(app, "127.0.0.1", 0)
    emu = f"http://127.0.0.1:{port}"
    adaptive = {"enabled": True, "memory_path": str(tmp_path / "curves.json")}
    try:
        gw = await start_gateway(
            [{"url": emu, "max_inflight": 8}], policy="fcfs", adaptive_cap=adaptive
        )
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CLIENTS + 4)
        ) as session:
            start = asyncio.get_running_loop().time()
            clients = [
                asyncio.create_task(_client(session, gw.url, i, start)) for i in range(CLIENTS)
            ]
            await asyncio.sleep(40.0)
            for task in clients:
                task.cancel()
            for task in clients:
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await task
        ctl = gw.state.pool.backends[0].controller
        assert ctl is not None
        fit = ctl.fit.coefficients()
        gw.state.pool.remember()
        timed = await start_gateway(
            [{"url": emu, "max_inflight": 8}], policy="sagesched:cost=time", adaptive_cap=adaptive
        )
        tokens = await start_gateway(
            [{"url": emu, "max_inflight": 8}], policy="sagesched:cost=tokens",
            adaptive_cap=adaptive,
        )  # fmt: skip
        keys = {}  # the policy's own key component (the gateway composes it into bands)
        for name, g in (("time", timed), ("tokens", tokens)):
            sched = g.state.dispatcher.scheduler("tiny-llama")
            dist = LengthDist.from_samples([20, 60, 120, 300])
            short = Job(1, 0.0, prompt_tokens=10, dist=dist)
            long = Job(2, 0.0, prompt_tokens=4000, dist=dist)
            keys[name] = (sched.policy.key(short, 0.0)[-1], sched.policy.key(long, 0.0)[-1])
        cost = timed.state.pool.engine_profile("tiny-llama")
    finally:
        await runner.cleanup()
    assert fit is not None, "no curve fitted"
    assert fit["alpha"] == pytest.approx(A_S, rel=0.2), fit
    assert fit["beta"] == pytest.approx(B_SEQ_S, rel=0.2), fit
    assert fit["pi"] == pytest.approx(B_TOK_S, rel=0.2), fit
    assert cost is not None and cost.prefill_s_per_token == pytest.approx(B_TOK_S, rel=0.2)
    short_key, long_key = keys["time"]
    assert short_key < long_key, keys  # lower is served first: the short prompt goes first
    assert keys["tokens"][0] == keys["tokens"][1], keys  # the tokens cost cannot tell them apart
