"""Gateways that share learning through a real redis-server: a completion served by one is
learned by the other; with Redis unreachable or killed mid-run every request still succeeds,
each replica learns locally, the metrics and one log line say so, and a Redis that comes back
is used again (the buffered records published)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import RunningGateway, StartGateway
from fixtures.redis_fixtures import RedisServer, StartRedis, free_port
from fixtures.scrape import scrape, total

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MODEL = "tiny-llama"


async def ask(gw: RunningGateway, n: int, tag: str) -> list[int]:
    """`n` concurrent chat requests with distinct prompts; their HTTP statuses."""

    async def one(s: aiohttp.ClientSession, i: int) -> int:
        text = f"{tag}: question {i} about tea"
        body = {"model": MODEL, "max_tokens": 12, "ignore_eos": True,
                "messages": [{"role": "user", "content": text}]}  # fmt: skip
        async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession() as s:
        statuses = await asyncio.gather(*(one(s, i) for i in range(n)))
    while gw.state.background:  # learning runs after each response
        await asyncio.gather(*list(gw.state.background))
    return list(statuses)


def learned(gw: RunningGateway) -> int:
    assert gw.state.predictor is not None
    return gw.state.predictor.own_state(MODEL).index.added


async def shared(gw: RunningGateway) -> dict[str, float]:
    samples = await scrape(gw.url + "/metrics")
    out = {r: total(samples, "sagesched_shared_learning_records_total", result=r)
           for r in ("published", "received", "dropped")}  # fmt: skip
    out["connected"] = total(samples, "sagesched_shared_learning_connected")
    out["disconnects"] = total(samples, "sagesched_shared_learning_disconnects_total")
    return out


async def until(condition: Callable[[], bool], within_s: float) -> None:
    """Fails unless `condition()` holds within `within_s` (the bound is the assertion)."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {within_s} s"
        await asyncio.sleep(0.01)


async def until_metrics(
    gw: RunningGateway, condition: Callable[[dict[str, float]], bool], within_s: float
) -> dict[str, float]:
    deadline = time.monotonic() + within_s
    while not condition(now := await shared(gw)):
        assert time.monotonic() < deadline, f"not within {within_s} s: {now}"
        await asyncio.sleep(0.05)
    return now


async def start_pair(
    start_emulator: StartEmulator, start_gateway: StartGateway, url: str
) -> tuple[RunningGateway, RunningGateway]:
    backend = await start_emulator()
    return (
        await start_gateway([backend], policy="sagesched",
                            shared_learning={"redis_url": url, "replica_id": "gw-a"}),
        await start_gateway([backend], policy="sagesched",
                            shared_learning={"redis_url": url, "replica_id": "gw-b"}),
    )  # fmt: skip


async def test_a_dead_redis_costs_no_request_and_learning_stays_local(
    start_emulator: StartEmulator,
    start_gateway: StartGateway,
    caplog: pytest.LogCaptureFixture,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    caplog.set_level(logging.INFO, logger="sagesched.predictor.shared")
    port = free_port()  # nothing listens there
    gw, _ = await start_pair(start_emulator, start_gateway, f"redis://127.0.0.1:{port}/0")
    assert await ask(gw, 8, "dead") == [200] * 8
    assert learned(gw) == 8
    now = await until_metrics(gw, lambda m: m["disconnects"] == 1, within_s=2.0)
    assert now["connected"] == 0 and now["published"] == 0
    lost = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lost) == 2 and all("learning locally only" in m for m in lost)  # one a replica

    server = RedisServer(port, tmp_path_factory.mktemp("redis"))
    try:
        server.start()  # Redis appears: found by the reconnection loop, the buffer published
        now = await until_metrics(gw, lambda m: m["published"] == 8, within_s=10.0)
        assert now["connected"] == 1 and now["disconnects"] == 1
    finally:
        server.kill()


async def test_redis_killed_mid_run_then_restarted(
    start_emulator: StartEmulator,
    start_gateway: StartGateway,
    start_redis: StartRedis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sagesched.predictor.shared")
    redis = start_redis()
    a, b = await start_pair(start_emulator, start_gateway, redis.url)
    for gw in (a, b):
        await until_metrics(gw, lambda m: m["connected"] == 1, within_s=5.0)

    assert await ask(a, 4, "shared") == [200] * 4
    await until(lambda: learned(b) == 4, within_s=1.0)  # what A served, B has learned

    redis.kill()
    await until_metrics(a, lambda m: m["connected"] == 0, within_s=3.0)
    assert await ask(a, 4, "alone") == [200] * 4  # no error to any client
    assert learned(a) == 8 and learned(b) == 4  # A learned locally; nothing reached B
    assert (await shared(a))["disconnects"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("lost" in m for m in warnings) == 2

    redis.start()  # an empty Redis on the same port
    for gw in (a, b):
        await until_metrics(gw, lambda m: m["connected"] == 1, within_s=8.0)
    await until(lambda: learned(b) == 8, within_s=2.0)  # A's buffered records reached B
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("restored" in m for m in infos) == 2
    assert (await shared(a))["disconnects"] == 1 and (await shared(b))["received"] == 8
