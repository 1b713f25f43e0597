"""A real Prometheus server scrapes the gateway; PromQL over its histograms returns data."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import StartGateway
from fixtures.prometheus_fixtures import StartPrometheus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def test_prometheus_scrapes_gateway_ttft(
    start_emulator: StartEmulator, start_gateway: StartGateway, start_prometheus: StartPrometheus
) -> None:
    backend = await start_emulator(time_scale=0.1)
    gw = await start_gateway([backend], policy="fcfs")
    prom = start_prometheus([gw.url.removeprefix("http://")])
    await prom.wait_for_data('up{job="sagesched"} == 1')  # scraping before the traffic starts
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
    }

    async with aiohttp.ClientSession() as s:

        async def one() -> None:
            async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.read()

        for _ in range(6):  # traffic spread over several scrapes, so rate() has two points
            await asyncio.gather(*(one() for _ in range(5)))
            await asyncio.sleep(0.6)
    rate = "rate(sagesched_time_to_first_token_seconds_bucket[1m])"
    p50 = await prom.wait_for_data(f"histogram_quantile(0.5, sum by (le) ({rate}))")
    assert float(p50[0]["value"][1]) > 0
    # Prometheus sees the last requests only at its next scrape (1 s): poll until it has them.
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        count = await prom.wait_for_data('sum(sagesched_requests_total{outcome="completed"})')
        if float(count[0]["value"][1]) == 30 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.5)
    assert float(count[0]["value"][1]) == 30
