"""Several gateway replicas: `replicas: {count, index}` gives each replica its own backends
(backend i to replica i mod count), and the pool admits only into them while one is healthy."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gateway.config import AdaptiveCapConfig, ConfigError, build, load
from gateway.scheduling.backends import BackendPool

FOUR = [{"url": f"http://b{i}:8000"} for i in range(4)]


def test_each_replica_owns_every_count_th_backend() -> None:
    owned = [
        [b.owned for b in build({"backends": FOUR, "replicas": {"count": 2, "index": i}}).backends]
        for i in range(2)
    ]
    assert owned == [[True, False, True, False], [False, True, False, True]]
    assert all(b.owned for b in build({"backends": FOUR}).backends)  # one gateway owns all


def test_replica_index_from_the_environment() -> None:
    env = {"SAGESCHED_BACKENDS": "http://a:1,http://b:2,http://c:3", "SAGESCHED_REPLICAS": "3"}
    cfg = load(None, {}, {**env, "SAGESCHED_REPLICA_INDEX": "2"})
    assert (cfg.replicas.count, cfg.replicas.index) == (3, 2)
    assert [b.owned for b in cfg.backends] == [False, False, True]


def test_a_backend_marked_not_owned_stays_overflow_only() -> None:
    backends = [{**FOUR[0], "owned": False}, *FOUR[1:]]
    cfg = build({"backends": backends, "replicas": {"count": 2, "index": 0}})
    assert [b.owned for b in cfg.backends] == [False, False, True, False]


@pytest.mark.parametrize(
    "replicas",
    [{"count": 2, "index": 2}, {"count": 5, "index": 0}, {"count": 0}, {"index": -1}],
)
def test_impossible_replica_settings_are_refused(replicas: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match="replicas"):
        build({"backends": FOUR, "replicas": replicas})


async def _backend() -> web.AppRunner:
    """A real server answering the pool's health check and model discovery."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


@pytest.fixture
async def two_backends() -> AsyncIterator[list[web.AppRunner]]:
    runners = [await _backend(), await _backend()]
    yield runners
    for r in runners:
        await r.cleanup()


async def test_the_pool_admits_only_into_its_own_backends_while_one_is_healthy(
    two_backends: list[web.AppRunner],
) -> None:
    urls = [
        {"url": f"http://127.0.0.1:{r.addresses[0][1]}", "max_inflight": 2} for r in two_backends
    ]
    cfg = build({"backends": urls, "replicas": {"count": 2, "index": 1}})
    async with aiohttp.ClientSession() as session:
        pool = BackendPool(
            cfg.backends,
            session,
            health_interval_s=60.0,
            adaptive=AdaptiveCapConfig(enabled=False),
        )
        await pool.start()
        try:
            other, mine = pool.backends
            assert other.healthy and mine.healthy
            mine.inflight = 1  # least-loaded alone would pick the idle backend
            assert pool.pick("m") is mine
            pool.acquire(mine)
            assert pool.pick("m") is None  # full: wait here rather than over-admit the other's
            assert pool.pick("m", exclude={mine.name}) is other  # a retry may go elsewhere
            await two_backends[1].cleanup()  # this replica's backend goes away
            await pool.check(mine)
            assert not pool.backends[1].healthy
            assert pool.pick("m") is other  # then the others serve
        finally:
            await pool.stop()
