"""The self-tuning cap's scrape: vLLM's /metrics text → `EngineSample` → the controller."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from gateway.config import AdaptiveCapConfig, BackendConfig
from gateway.scheduling.backends import BackendPool, read_sample

TWO_ENGINES = """\
# HELP vllm:num_requests_waiting Requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.6
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
# HELP vllm:generation_tokens Number of generation tokens processed.
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 100.0
vllm:generation_tokens_total{engine="1",model_name="m"} 50.0
"""


def test_several_engines_sum_queues_and_counters_and_take_the_fullest_kv() -> None:
    s = read_sample(TWO_ENGINES)
    assert s.waiting == 7.0
    assert s.kv_usage == 0.7  # not 1.3
    assert s.generation_tokens == 150.0


def test_missing_series_are_unknown_not_zero() -> None:
    only_kv = "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.2\n"
    s = read_sample(only_kv)
    assert s.kv_usage == 0.2 and s.waiting is None and s.generation_tokens is None
    assert read_sample("# TYPE other gauge\nother 1\n") == read_sample("")
    assert read_sample("").waiting is None


def test_v0_names_are_read_too() -> None:
    text = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.5\n"
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
    )
    s = read_sample(text)
    assert s.kv_usage == 0.5 and s.waiting == 0.0


@pytest.mark.parametrize(
    ("text", "status", "expect"),
    [
        (TWO_ENGINES, 200, 16 - 7 + 2),  # 7 waiting in vLLM: cap to what it runs + allowance
        ("", 404, 16),  # no /metrics: nothing known, the configured cap holds
    ],
)
async def test_one_scrape_steps_the_controller(text: str, status: int, expect: int) -> None:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text, status=status)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    woken: list[int] = []
    try:
        async with aiohttp.ClientSession() as session:
            pool = BackendPool(
                [BackendConfig(url=f"http://127.0.0.1:{port}", name="b", max_inflight=16)],
                session,
                health_interval_s=60.0,
                adaptive=AdaptiveCapConfig(),
            )
            pool.listen(lambda: woken.append(1))
            b = pool.backends[0]
            b.healthy, b.inflight = True, 16
            await pool._scrape(b)  # a queue seen once may be a prompt waiting for one step
            assert b.cap == 16
            await pool._scrape(b)
            assert b.cap == expect
    finally:
        await runner.cleanup()
    assert not woken  # the cap did not grow


QUEUED = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",num_gpu_blocks="32"} 1.0
"""


@pytest.mark.parametrize(("routing", "scraped"), [("prefix", True), ("least-loaded", False)])
async def test_a_router_that_reads_the_engine_gets_it_with_fixed_caps(
    routing: str, scraped: bool
) -> None:
    """With the cap fixed there is no controller to scrape for, yet a prefix router scores
    the engines' queues and sizes its index from their KV: the pool scrapes for it (and does
    not for a router that reads neither)."""
    from policies.routing import make_router

    hits: list[str] = []

    async def metrics(_: web.Request) -> web.Response:
        hits.append("metrics")
        return web.Response(text=QUEUED)

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/models", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    rows = [BackendConfig(url=url, name=n, max_inflight=4) for n in ("a", "b")]
    try:
        async with aiohttp.ClientSession() as session:
            pool = BackendPool(
                rows, session, health_interval_s=60.0, router=make_router(routing),
                adaptive=AdaptiveCapConfig(enabled=False, interval_s=0.02),
            )  # fmt: skip
            await pool.start()
            # scraped: until both backends were read twice (at most 5 s); not: 15 intervals
            for _ in range(250 if scraped else 15):
                if len(hits) >= 4:
                    break
                await asyncio.sleep(0.02)
            states = [b.state() for b in pool.backends]
            await pool.stop()
    finally:
        await runner.cleanup()
    assert (len(hits) >= 4) is scraped, hits
    if scraped:
        assert all(s.waiting == 3 and s.kv_usage == 0.25 for s in states), states
        assert all(s.kv_tokens == 32 * 128 for s in states), states
    else:
        assert all(s.waiting is None and s.kv_blocks is None for s in states), states
    assert all(b.cap == 4 for b in pool.backends)  # fixed means fixed
