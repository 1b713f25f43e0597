"""Prefix routing in the live gateway, counted by the engines: multi-turn sessions through a
gateway in front of four emulated vLLM servers with prefix caching. A prefix router keeps each
conversation where its earlier turns are cached, so the engines' own hit counters
(`vllm:prefix_cache_hits` over `vllm:prefix_cache_queries`) read at least twice what
least-loaded placement gets. Counters, not times: the check does not depend on the machine."""

from __future__ import annotations

import asyncio
import random
import re

import aiohttp
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import StartGateway

from gateway.scheduling.routing import SESSION_HEADER

MODEL = "tiny-llama"
SESSIONS = 16
TURNS = 4
BACKENDS = 8


def _messages(session: int, turn: int) -> list[dict[str, str]]:
    """Turn `turn` of session `session`: its own system prompt, the earlier turns with their
    recorded answers, then the new question."""
    out = [{"role": "system", "content": f"You are assistant {session}. " * 12}]
    for t in range(turn + 1):
        out.append({"role": "user", "content": f"Question {t} of {session}: " + "why? " * 40})
        if t < turn:
            out.append({"role": "assistant", "content": f"Answer {t}: " + "because. " * 30})
    return out


async def _session(s: aiohttp.ClientSession, url: str, session: int) -> None:
    think = random.Random(session)  # the same think times for every router
    for turn in range(TURNS):
        await asyncio.sleep(think.uniform(0.0, 0.3))  # the user reads, then asks again
        body = {"model": MODEL, "messages": _messages(session, turn), "max_tokens": 16}
        headers = {SESSION_HEADER: f"conv-{session}"}
        async with s.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            await r.read()


async def _counters(s: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with s.get(f"{url}/metrics") as r:
        text = await r.text()

    def value(name: str) -> float:
        return sum(
            float(v) for v in re.findall(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        )

    return value("prefix_cache_queries"), value("prefix_cache_hits")


async def _hit_ratio(start_emulator: StartEmulator, start_gateway: StartGateway,
                     routing: str) -> float:  # fmt: skip
    urls = [await start_emulator(time_scale=1.0) for _ in range(BACKENDS)]
    gw = await start_gateway([{"url": u, "max_inflight": 4} for u in urls], policy="fcfs",
                             routing=routing)  # fmt: skip
    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(_session(s, gw.url, i) for i in range(SESSIONS)))
        counts = [await _counters(s, u) for u in urls]
    queries, hits = sum(c[0] for c in counts), sum(c[1] for c in counts)
    assert queries > 0
    return hits / queries


async def test_prefix_routers_keep_conversations_where_their_prefix_is_cached(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    ratios = {
        routing: await _hit_ratio(start_emulator, start_gateway, routing)
        for routing in ("least-loaded", "prefix", "sagesched", "session")
    }
    print(ratios)
    for routing in ("prefix", "sagesched", "session"):
        assert ratios[routing] >= 2 * ratios["least-loaded"], ratios
