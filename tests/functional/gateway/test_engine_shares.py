"""Engine shares and TPOT objectives of request classes on a real gateway in front of the
emulated backend (`policies.shares` through the dispatcher): a batch class at its share waits
beside free slots while an interactive request is active, is lent them once interactive is
idle, a share bounds the band's KV where the backend reports its size, a TPOT objective bounds
the batch from the backend's fitted curve, and the metrics show
the share in force, the jobs held and lent, and each class's time per output token."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import RunningGateway, StartGateway
from fixtures.scrape import scrape, total

from policies.capacity import CapController, CapLaw, EngineSample

pytestmark = pytest.mark.timeout(90)

WINDOW_S = 1.0


def classes(**interactive: Any) -> dict[str, Any]:
    return {
        "default": "batch",
        "active_window_s": WINDOW_S,
        "list": [
            {"name": "interactive", "priority": 0, **interactive},
            {"name": "batch", "priority": 2, "engine_share": 0.25},
        ],
    }


async def gateway(start_emulator: StartEmulator, start_gateway: StartGateway,
                  **interactive: Any) -> RunningGateway:  # fmt: skip
    backend = await start_emulator(time_scale=1.0)
    return await start_gateway([{"url": backend, "max_inflight": 4}], policy="fcfs",
                               classes=classes(**interactive))  # fmt: skip


async def stream(s: aiohttp.ClientSession, gw: RunningGateway, klass: str, n: int,
                 prompt: str = "hi") -> int:  # fmt: skip
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": n, "ignore_eos": True,
            "stream": True}  # fmt: skip
    headers = {"X-SageSched-Class": klass}
    async with s.post(gw.url + "/v1/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status


async def until(cond: Any, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def running(gw: RunningGateway) -> int:
    return gw.state.pool.backends[0].inflight


async def test_a_batch_share_waits_beside_free_slots_then_is_lent_them(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    gw = await gateway(start_emulator, start_gateway, tpot_slo_s=10.0)
    dispatcher = gw.state.dispatcher
    async with aiohttp.ClientSession() as s:
        interactive = asyncio.ensure_future(stream(s, gw, "interactive", 1500))
        await until(lambda: running(gw) == 1)
        batch = [asyncio.ensure_future(stream(s, gw, "batch", 1000)) for _ in range(3)]
        # the batch band's share of a cap of 4 is 1 slot while interactive is active
        await until(lambda: dispatcher.waiting() == 2 and running(gw) == 2)
        samples = await scrape(gw.url + "/metrics")
        assert total(samples, "sagesched_engine_share_slots", **{"class": "batch"}) == 1
        # the band's head was held (the one behind it is not looked at while the head waits)
        assert total(samples, "sagesched_engine_share_held_total", **{"class": "batch"}) == 1
        assert total(samples, "sagesched_engine_share_lent_total", **{"class": "batch"}) == 0
        # a running request does not keep its band active: at the window's end, lent
        await until(lambda: dispatcher.waiting() == 0, timeout_s=3 * WINDOW_S)
        assert running(gw) == 4
        interactive.cancel()
        assert await asyncio.gather(*batch) == [200] * 3
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_engine_share_lent_total", **{"class": "batch"}) == 2
    assert total(samples, "sagesched_engine_share_slots", **{"class": "batch"}) == 4  # idle
    tpot = "sagesched_class_time_per_output_token_seconds_count"
    assert total(samples, tpot, **{"class": "batch"}) == 3
    # interactive was cancelled: no completed answer, so no time per token and no verdict
    assert total(samples, tpot, **{"class": "interactive"}) == 0
    assert total(samples, "sagesched_class_slo_total", slo="tpot") == 0


async def test_a_batch_share_bounds_its_kv_where_the_backend_reports_it(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    """Batch's share 0.5 of a cap of 4 is 2 slots, but of the backend's 1,000 tokens of KV
    only 500: while interactive is active a first long-prompt batch request starts, a second
    waits beside a free slot, and it is lent the slot once interactive is idle."""
    backend = await start_emulator(time_scale=1.0)
    spec = classes()
    spec["list"][1]["engine_share"] = 0.5
    gw = await start_gateway([{"url": backend, "max_inflight": 4}], policy="fcfs",
                             classes=spec)  # fmt: skip
    gw.state.pool.backends[0].sample = EngineSample(kv_capacity_tokens=1_000.0)  # as scraped
    dispatcher = gw.state.dispatcher
    long_prompt = "Tell me everything about the sea. " * 70  # ~600 tokens
    async with aiohttp.ClientSession() as s:
        interactive = asyncio.ensure_future(stream(s, gw, "interactive", 1500))
        await until(lambda: running(gw) == 1)
        batch = [asyncio.ensure_future(stream(s, gw, "batch", 200, long_prompt))
                 for _ in range(2)]  # fmt: skip
        await until(lambda: dispatcher.waiting() == 1 and running(gw) == 2)
        samples = await scrape(gw.url + "/metrics")
        assert total(samples, "sagesched_engine_share_held_total", **{"class": "batch"}) == 1
        await until(lambda: dispatcher.waiting() == 0, timeout_s=3 * WINDOW_S)
        assert running(gw) == 3  # lent once interactive is idle
        interactive.cancel()
        assert await asyncio.gather(*batch) == [200, 200]


def trained(alpha: float, beta: float, cap: int) -> CapController:
    """A cap controller that has fitted an engine whose iteration takes alpha + beta * B."""
    ctl = CapController(CapLaw(), cap)
    t = tokens = iterations = 0.0
    for i in range(400):
        batch = (2, 4, 6)[i % 3]
        step = alpha + beta * batch
        n = 0.25 / step
        t, tokens, iterations = t + 0.25, tokens + n * batch, iterations + n
        sample = EngineSample(waiting=0.0, kv_usage=0.3, generation_tokens=tokens,
                              running=float(batch), iterations=iterations)  # fmt: skip
        ctl.observe(t, sample, batch)
    assert ctl.confident()
    return ctl


async def test_a_tpot_objective_bounds_the_batch_from_the_fitted_curve(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    """Interactive promises 13.5 ms per token and the backend's fitted iteration is 10 ms +
    1 ms per running request, so while interactive is active at most 3 may run (B* = 3): one
    interactive and two batch; batch's own share (the whole cap here) does not bind."""
    backend = await start_emulator(time_scale=1.0)
    spec = classes(tpot_slo_s=0.0135)
    spec["list"][1]["engine_share"] = 1.0
    gw = await start_gateway([{"url": backend, "max_inflight": 4}], policy="fcfs",
                             classes=spec)  # fmt: skip
    b = gw.state.pool.backends[0]
    b.controller = trained(0.010, 0.001, b.cap)
    curve = b.controller.iteration_curve()
    assert curve is not None and abs(curve(3) - 0.013) < 0.0005
    async with aiohttp.ClientSession() as s:
        interactive = asyncio.ensure_future(stream(s, gw, "interactive", 1500))
        await until(lambda: running(gw) == 1)
        batch = [asyncio.ensure_future(stream(s, gw, "batch", 1500)) for _ in range(3)]
        await until(lambda: gw.state.dispatcher.waiting() == 1 and running(gw) == 3)
        samples = await scrape(gw.url + "/metrics")
        assert total(samples, "sagesched_engine_share_slots", **{"class": "batch"}) == 2
        assert total(samples, "sagesched_engine_share_held_total", **{"class": "batch"}) == 1
        for task in (interactive, *batch):
            task.cancel()
        await asyncio.gather(interactive, *batch, return_exceptions=True)
