"""Event counters exist at zero once a model has a scheduler, before their first event, so
`increase()` over them counts the first preemption or retry too."""

from __future__ import annotations

import aiohttp
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import StartGateway
from fixtures.scrape import scrape


async def test_event_counters_start_at_zero(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    gw = await start_gateway([await start_emulator()], policy="fcfs")
    backend = gw.state.pool.backends[0].name
    names = ("sagesched_preemptions_total", "sagesched_retries_total")
    before = await scrape(gw.url + "/metrics")
    assert not [k for k in before if k[0] in names]
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    async with aiohttp.ClientSession() as s, s.post(gw.url + "/v1/completions", json=body) as r:
        assert r.status == 200
    after = await scrape(gw.url + "/metrics")
    labels = {"model": "tiny-llama", "backend": backend}
    preempt = frozenset((labels | {"policy": "fcfs"}).items())
    assert after[("sagesched_preemptions_total", preempt)] == 0
    assert after[("sagesched_retries_total", frozenset(labels.items()))] == 0
