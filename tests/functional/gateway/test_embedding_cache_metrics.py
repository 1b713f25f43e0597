"""A repeated prompt is served from the predictor's embedding cache, and /metrics says so."""

from __future__ import annotations

import aiohttp
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import StartGateway
from fixtures.scrape import scrape

SERIES = "sagesched_embedding_cache_lookups_total"


async def test_repeated_prompt_is_a_cache_hit(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    gw = await start_gateway([await start_emulator()], policy="sagesched")
    hit, miss = frozenset({("result", "hit")}), frozenset({("result", "miss")})
    before = await scrape(gw.url + "/metrics")
    assert (SERIES, hit) in before and (SERIES, miss) in before  # exposed from the start
    prompt = "A templated prompt about cache counters, seen exactly twice here 7c1f."
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(gw.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.read()
    after = await scrape(gw.url + "/metrics")
    assert after[(SERIES, miss)] - before[(SERIES, miss)] == 1  # embedded once
    assert after[(SERIES, hit)] - before[(SERIES, hit)] >= 1  # then served from the cache
