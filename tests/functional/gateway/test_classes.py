"""Request classes on a real gateway in front of the emulated backend: the class from the
header or the API key (unknown: 400 naming the choices), bands served in priority order,
per-class bounds and timeouts, shedding under saturation (429 + Retry-After, sheddable first,
then the lowest band's oldest), and per-class metrics where every request ends in one counted
terminal state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import aiohttp
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import RunningGateway, StartGateway
from fixtures.scrape import scrape, total

pytestmark = pytest.mark.timeout(60)

CLASSES = {
    "default": "standard",
    "list": [
        {"name": "interactive", "priority": 0, "max_waiting": 2, "ttft_slo_s": 30,
         "api_keys": ["key-int"]},
        {"name": "standard", "priority": 1, "queue_timeout_s": 30},
        {"name": "batch", "priority": 2, "sheddable": True, "ttlt_slo_s": 0.001,
         "api_keys": ["key-batch"]},
        {"name": "quick", "priority": 1, "queue_timeout_s": 0.3},
        {"name": "hold", "priority": 0},
    ],
}  # fmt: skip


async def one_slot_gateway(start_emulator: StartEmulator, start_gateway: StartGateway,
                           **config: Any) -> RunningGateway:  # fmt: skip
    backend = await start_emulator(time_scale=0.05)
    return await start_gateway(
        [{"url": backend, "max_inflight": 1}], policy="fcfs", classes=CLASSES, **config
    )


def body(n: int = 2) -> dict[str, Any]:
    return {"model": "tiny-llama", "prompt": "hi", "max_tokens": n, "ignore_eos": True}


async def post(
    s: aiohttp.ClientSession, gw: RunningGateway, klass: str | None = None,
    key: str | None = None, tenant: str | None = None, n: int = 2,
) -> tuple[int, dict[str, Any], float, dict[str, str]]:  # fmt: skip
    """(status, JSON body, completion time, headers)."""
    headers = {}
    if klass is not None:
        headers["X-SageSched-Class"] = klass
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if tenant is not None:
        headers["X-SageSched-Tenant"] = tenant
    async with s.post(gw.url + "/v1/completions", json=body(n), headers=headers) as r:
        data = await r.json()
        return r.status, data, time.monotonic(), dict(r.headers)


async def until(cond: Any) -> None:
    for _ in range(400):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def queued(gw: RunningGateway, call: Awaitable[Any], waiting: int) -> asyncio.Task[Any]:
    """Start a request and return once the gateway holds `waiting` queued requests."""
    task = asyncio.ensure_future(call)
    await until(lambda: gw.state.dispatcher.waiting() == waiting)
    return task


async def blocker(
    s: aiohttp.ClientSession, gw: RunningGateway, key: str | None = None
) -> asyncio.Task[Any]:
    """A long request holding the only slot until cancelled."""
    task = asyncio.ensure_future(post(s, gw, klass="hold", key=key, n=1500))
    await until(lambda: gw.state.pool.backends[0].inflight == 1)
    return task


async def test_unknown_class_is_a_400_naming_the_choices(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    gw = await one_slot_gateway(start_emulator, start_gateway)
    async with aiohttp.ClientSession() as s:
        status, data, _, _ = await post(s, gw, klass="gold")
    assert status == 400
    err = data["error"]
    assert err["code"] == "unknown_class" and err["type"] == "invalid_request_error"
    for name in ("interactive", "standard", "batch", "quick"):
        assert name in err["message"]
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="rejected") == 1
    assert total(samples, "sagesched_class_requests_total") == 0


async def test_bands_are_served_in_priority_order_and_keys_pick_classes(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    gw = await one_slot_gateway(start_emulator, start_gateway, api_keys=["key-int", "key-batch"])
    async with aiohttp.ClientSession() as s:
        block = await blocker(s, gw, key="key-int")
        # arrival order: batch (by key), standard (default), batch (key caps the header's
        # interactive), interactive (by key), interactive (header; a key may ask for less)
        tasks = [
            await queued(gw, post(s, gw, key="key-batch"), 1),
            await queued(gw, post(s, gw, key="key-int", klass="standard"), 2),
            await queued(gw, post(s, gw, key="key-batch", klass="interactive"), 3),
            await queued(gw, post(s, gw, key="key-int"), 4),
            await queued(gw, post(s, gw, key="key-batch", klass="batch"), 5),
        ]
        block.cancel()
        done = await asyncio.gather(*tasks)
    assert [d[0] for d in done] == [200] * 5
    finish = [d[2] for d in done]
    order = sorted(range(5), key=finish.__getitem__)
    assert order == [3, 1, 0, 2, 4]  # interactive, standard, then the batch band in arrival order
    samples = await scrape(gw.url + "/metrics")
    for klass, n in (("interactive", 1), ("standard", 1), ("batch", 3)):
        assert total(samples, "sagesched_class_requests_total", **{"class": klass},
                     outcome="completed") == n  # fmt: skip


async def test_shedding_under_saturation(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    gw = await one_slot_gateway(start_emulator, start_gateway, max_waiting=3)
    async with aiohttp.ClientSession() as s:
        block = await blocker(s, gw)
        b1 = await queued(gw, post(s, gw, klass="batch"), 1)
        b2 = await queued(gw, post(s, gw, klass="batch"), 2)
        s1 = await queued(gw, post(s, gw), 3)
        # full: a standard arrival evicts the oldest sheddable request (b1)
        s2 = asyncio.ensure_future(post(s, gw))
        status, data, _, headers = await b1
        assert status == 429 and data["error"]["code"] == "shed"
        assert headers["Retry-After"] == "1"
        await until(lambda: gw.state.dispatcher.waiting() == 3)
        # a sheddable arrival into the full queue is refused at once
        status, data, _, headers = await post(s, gw, klass="batch")
        assert status == 429 and data["error"]["code"] == "shed" and "Retry-After" in headers
        # interactive evicts the remaining sheddable one (b2), then the lowest band's oldest
        i1 = asyncio.ensure_future(post(s, gw, klass="interactive"))
        assert (await b2)[0] == 429
        await until(lambda: gw.state.dispatcher.waiting() == 3)
        i2 = asyncio.ensure_future(post(s, gw, klass="interactive"))
        status, data, _, _ = await s1
        assert status == 429 and data["error"]["code"] == "shed"
        await until(lambda: gw.state.dispatcher.waiting() == 3)
        # interactive is at its own bound (2 waiting): 429 queue_full, nothing evicted
        status, data, _, _ = await post(s, gw, klass="interactive")
        assert status == 429 and data["error"]["code"] == "queue_full"
        # a standard arrival finds nothing less urgent to evict: 429 queue_full
        status, data, _, _ = await post(s, gw)
        assert status == 429 and data["error"]["code"] == "queue_full"
        block.cancel()
        assert [(await t)[0] for t in (s2, i1, i2)] == [200, 200, 200]
    samples = await scrape(gw.url + "/metrics")
    c = "sagesched_class_requests_total"
    assert total(samples, c, **{"class": "batch"}, outcome="shed") == 3
    assert total(samples, c, **{"class": "standard"}, outcome="shed") == 1
    assert total(samples, c, **{"class": "standard"}, outcome="queue_full") == 1
    assert total(samples, c, **{"class": "interactive"}, outcome="queue_full") == 1
    # every request ended in exactly one counted state (the blocker was cancelled)
    assert total(samples, "sagesched_requests_total") == 10
    assert total(samples, c) == 10
    assert total(samples, "sagesched_requests_total", outcome="shed", code="429") == 4
    assert total(samples, "sagesched_class_queue_depth") == 0


async def test_per_class_timeout_and_slo_metrics(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    gw = await one_slot_gateway(start_emulator, start_gateway)
    async with aiohttp.ClientSession() as s:
        block = await blocker(s, gw)
        quick = await queued(gw, post(s, gw, klass="quick"), 1)
        standard = await queued(gw, post(s, gw, tenant="acme"), 2)
        status, data, _, _ = await quick  # its own 0.3 s timeout, while standard waits on
        assert status == 503 and data["error"]["code"] == "queue_timeout"
        assert not standard.done()
        batch = asyncio.ensure_future(post(s, gw, klass="batch", tenant="acme"))
        interactive = asyncio.ensure_future(post(s, gw, klass="interactive", tenant="zed"))
        await until(lambda: gw.state.dispatcher.waiting() == 3)
        block.cancel()
        assert [(await t)[0] for t in (standard, batch, interactive)] == [200, 200, 200]
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_class_requests_total", **{"class": "quick"},
                 outcome="queue_timeout") == 1  # fmt: skip
    for klass in ("standard", "batch", "interactive"):
        labels = {"class": klass}
        assert total(samples, "sagesched_class_time_to_first_token_seconds_count", **labels) == 1
        assert total(samples, "sagesched_class_time_to_last_token_seconds_count", **labels) == 1
        assert total(samples, "sagesched_class_queue_wait_seconds_count", **labels) == 1
    slo = "sagesched_class_slo_total"
    assert total(samples, slo, **{"class": "interactive"}, slo="ttft", result="met") == 1
    assert total(samples, slo, **{"class": "batch"}, slo="ttlt", result="missed") == 1
    assert total(samples, slo, **{"class": "standard"}) == 0  # no objective, not judged
    objective = "sagesched_class_slo_objective"
    assert total(samples, objective, **{"class": "interactive"}, slo="ttft") == 0.99
    # tenants appear hashed, never by name
    tenants = {
        dict(k[1]).get("tenant") for k in samples if k[0] == "sagesched_tenant_requests_total"
    }
    assert "acme" not in tenants and "zed" not in tenants
    assert all(t == "other" or (t.startswith("t-") and len(t) == 10) for t in tenants)
    assert total(samples, "sagesched_tenant_requests_total") == 5
