"""Exact prefix routing from KV-cache events: two emulators publish vLLM's KV events on ZMQ
(`--kv-events-config`, vLLM's wire format), the gateway subscribes (`kv_events:` per
backend) and matches tokenized prompts against what each engine really caches. When an
engine evicts a conversation's blocks, the events say so and the router stops expecting
them there, where its own index of what it sent would still expect them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import RunningGateway, StartGateway

from loadgen.procs import free_port
from policies.routing.chain import chain_tokens

MODEL = "tiny-llama"
KV_TOKENS = 4096
"""Each emulator's KV: a dozen fillers of about 700 tokens evict a conversation's blocks."""


def _events(port: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://127.0.0.1:{port}"})  # fmt: skip


def _chat(text: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with s.post(f"{url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def _chain(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, ...]:
    async with s.post(f"{url}/tokenize", json={"model": MODEL, "messages": body["messages"]}) as r:
        return chain_tokens((await r.json())["tokens"], 16)


async def _setup(start_emulator: StartEmulator, start_gateway: StartGateway,
                 events: bool) -> tuple[list[str], RunningGateway]:  # fmt: skip
    ports = [free_port() for _ in range(2)]
    urls = [await start_emulator(time_scale=0.05, kv_tokens=KV_TOKENS, kv_events=_events(p))
            for p in ports]  # fmt: skip
    rows = [
        {"url": u, "max_inflight": 1, **({"kv_events": f"tcp://127.0.0.1:{p}"} if events else {})}
        for u, p in zip(urls, ports, strict=True)
    ]
    return urls, await start_gateway(rows, policy="fcfs", routing="prefix")


async def test_the_router_matches_what_the_engines_report(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    urls, gw = await _setup(start_emulator, start_gateway, events=True)
    pool = gw.state.pool
    talk = _chat("Tell me about the harbour and its boats. " * 30)
    async with aiohttp.ClientSession() as s:
        await _post(s, gw.url, talk)
        for _ in range(100):  # the events of that request arrive
            if any(b.events is not None and b.events.exact for b in pool.backends):
                break
            await asyncio.sleep(0.05)
        holder = next(b for b in pool.backends if b.events is not None and b.events.exact)
        other = next(b for b in pool.backends if b is not holder)
        assert other.events is not None
        chain = await _chain(s, urls[0], talk)
        assert holder.events.cache.match_tokens(chain) == len(chain) > 10  # every full block
        assert other.events.cache.match_tokens(chain) == 0
        # fillers of distinct text evict the conversation's blocks from both engines
        fillers = [_chat(f"Filler {i}: " + f"word{i} " * 300) for i in range(24)]
        await asyncio.gather(*(_post(s, gw.url, f) for f in fillers))
        await asyncio.sleep(0.3)
        assert holder.events.cache.match_tokens(chain) == 0
        async with s.get(f"{gw.url}/metrics") as r:
            text = await r.text()
    assert 'sagesched_backend_kv_events_exact{backend="' + holder.name + '"} 1.0' in text
    assert holder.events.events > 0 and holder.events.gaps == 0


async def test_evicted_prefix_is_not_expected_with_events_and_is_without(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    """The same traffic with and without events: the next turn, queued (so tokenized), is
    routed for a prefix that both engines evicted; with events no backend is expected to hold
    it (reason fallback, exact decisions counted), without them the router's index still
    expects it where it sent turn 1 (reason affinity, or balance when that backend was the
    busy one)."""
    reasons = {}
    for events in (True, False):
        _, gw = await _setup(start_emulator, start_gateway, events=events)
        pool = gw.state.pool
        history = "Tell me about the harbour and its boats. " * 30
        turn2 = _chat(history)
        turn2["messages"] += [{"role": "assistant", "content": "It is old."},
                              {"role": "user", "content": "And the boats?"}]  # fmt: skip
        async with aiohttp.ClientSession() as s:
            await _post(s, gw.url, _chat(history))
            fillers = [_chat(f"Filler {i}: " + f"word{i} " * 300) for i in range(24)]
            await asyncio.gather(*(_post(s, gw.url, f) for f in fillers))
            await asyncio.sleep(0.3)
            before = dict(pool.decisions)
            busy = [_post(s, gw.url, {**_chat(f"Busy {i}: " + "x " * 200), "max_tokens": 1500,
                           "ignore_eos": True})
                    for i in range(2)]  # fmt: skip
            tasks = [asyncio.create_task(b) for b in busy]
            await asyncio.sleep(0.05)  # both backends taken: turn 2 waits and is tokenized
            await _post(s, gw.url, turn2)
            await asyncio.gather(*tasks)
        new = {k: n - before.get(k, 0) for k, n in pool.decisions.items()}
        reasons[events] = {k[2] for k, n in new.items() if n}
        if events:
            assert pool.exact_decisions.get(MODEL, 0) >= 1
        await gw.stop()
    assert reasons[True] == {"fallback"}, reasons  # busy fillers and turn 2: nothing cached
    assert reasons[False] & {"affinity", "balance"}, reasons  # turn 2 expected where turn 1 was
