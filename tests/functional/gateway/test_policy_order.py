"""A burst of 200 mixed requests on an emulated backend with in-flight cap 8: requests start
in the policy's order, and SageSched's mean TTLT beats FCFS's."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import aiohttp
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import StartGateway

from gateway.scheduling.dispatcher import Dispatcher
from policies import Job
from predictor import Embedder, LengthPredictor

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOPICS = [
    "rivers",
    "bridges",
    "tea",
    "jazz",
    "glaciers",
    "printing",
    "chess",
    "volcanoes",
    "railways",
    "bees",
    "clocks",
    "salt",
    "maps",
    "coffee",
    "silk",
    "comets",
]


def prompt(kind: str, topic: str, variant: int) -> tuple[str, int]:
    """A prompt and its true output length: yes/no questions are short, essays are long."""
    if kind == "short":
        return f"Answer yes or no only: are {topic} older than {variant} years?", 4 + variant % 9
    return f"Write a long, detailed essay on the history of {topic}, part {variant}.", 160 + 7 * (
        variant % 12
    )


def workload(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [
        prompt(rng.choice(["short", "long"]), rng.choice(TOPICS), rng.randint(0, 99))
        for _ in range(n)
    ]


def trained_predictor(embedder: Embedder) -> LengthPredictor:
    predictor = LengthPredictor(embedder=embedder)
    history = workload(160, seed=99)  # same families, other instances
    predictor.observe_many([p for p, _ in history], [n for _, n in history])
    return predictor


async def burst(url: str, requests: list[tuple[str, int]]) -> list[float]:
    """Send every request at once (streaming); return each one's TTLT in seconds."""

    async def one(s: aiohttp.ClientSession, text: str, n: int) -> float:
        body = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": n,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.monotonic()
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            data = await r.read()
        assert data.endswith(b"data: [DONE]\n\n")
        return time.monotonic() - t0

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        return list(await asyncio.gather(*(one(s, t, n) for t, n in requests)))


def record_grants(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, Job, list[Job]]]:
    """Wrap the dispatcher's grant step: (time, granted job, jobs still waiting)."""
    grants: list[tuple[float, Job, list[Job]]] = []
    original = Dispatcher._grant

    def spy(self: Dispatcher, sched: Any, job: Job, backend: Any) -> None:
        grants.append((time.monotonic(), job, list(sched.queue)))
        original(self, sched, job, backend)

    monkeypatch.setattr(Dispatcher, "_grant", spy)
    return grants


async def run(
    policy: str,
    start_emulator: StartEmulator,
    start_gateway: StartGateway,
    predictor: LengthPredictor | None,
    requests: list[tuple[str, int]],
) -> list[float]:
    backend = await start_emulator(time_scale=0.5)
    gw = await start_gateway(
        [{"url": backend, "max_inflight": 8}], policy=policy, predictor=predictor
    )
    return await burst(gw.url, requests)


async def test_start_order_and_ttlt(
    start_emulator: StartEmulator,
    start_gateway: StartGateway,
    embedder: Embedder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    requests = workload(200, seed=1)
    length = {text: n for text, n in requests}
    grants = record_grants(monkeypatch)

    fcfs_ttlt = await run("fcfs", start_emulator, start_gateway, None, requests)
    fcfs_grants, grants[:] = list(grants), []
    arrivals = [job.arrival_s for _, job, _ in fcfs_grants]
    assert arrivals == sorted(arrivals), "FCFS must start requests in arrival order"

    sage_ttlt = await run(
        "sagesched", start_emulator, start_gateway, trained_predictor(embedder), requests
    )
    short = lambda job: length[job.ctx.call.prompt_text] < 50  # noqa: E731
    inversions = sum(1 for _, job, waiting in grants if not short(job) for w in waiting if short(w))
    long_grants = sum(1 for _, job, waiting in grants if not short(job) and waiting)
    admitted = sorted(job.arrival_s for _, job, _ in grants)
    span = grants[-1][0] - grants[0][0]
    print(f"\narrivals span {admitted[-1] - admitted[0]:.2f} s; grants span {span:.2f} s")
    print(f"SageSched: {inversions} short jobs passed over by {long_grants} long grants")
    assert inversions <= 5, "SageSched must start predicted-short requests before long ones"

    fcfs_mean, sage_mean = statistics.mean(fcfs_ttlt), statistics.mean(sage_ttlt)
    print(
        f"mean TTLT: fcfs {fcfs_mean:.2f} s, sagesched {sage_mean:.2f} s,"
        f" ratio {sage_mean / fcfs_mean:.2f}"
    )
    assert sage_mean < fcfs_mean
