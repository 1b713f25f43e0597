"""Worker apps and one scheduling authority (`serve --workers N`, in process: real Unix socket,
real worker apps, emulated backend): one logical queue, per-request messages, summed metrics,
a worker's slots returned when it goes, errors and preemption across the socket."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import StartGateway
from fixtures.scrape import scrape, total
from fixtures.worker_fixtures import BURST, RunningWorkers, StartWorkers

from gateway.serving.app import STATE
from gateway.workers import host_predictor
from gateway.workers.authority import REQUEST_OPS
from gateway.workers.host_predictor import HostPredictor
from predictor import Embedder, LengthPredictor
from predictor.config import PredictorConfig

pytestmark = [pytest.mark.timeout(120)]

MODEL = "tiny-llama"


def chat(text: str, n: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": n,
            "ignore_eos": True, "stream": True, **extra}  # fmt: skip


async def until(check: Callable[[], bool], timeout_s: float = 20) -> None:
    """Poll `check` (a condition on the gateway's state) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> tuple[float, bytes]:  # fmt: skip
    """(when the first byte of the answer came, the whole answer)."""
    async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        first = await r.content.readany()
        at = time.monotonic()
        return at, first + await r.read()


async def burst_order(urls: list[str], dispatcher: Any, pool: Any) -> list[int]:
    """Occupy the only slot, queue BURST one request at a time (alternating `urls`, each
    admitted before the next is sent), free the slot, and return the indices in the order
    they started."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        blocker = asyncio.create_task(stream(s, urls[0], chat("Write a long essay.", 2000)))
        await until(lambda: pool.backends[0].inflight == 1)  # the blocker holds the slot
        waiting = dispatcher.waiting
        tasks = []
        for i, (klass, n, text) in enumerate(BURST):
            headers = {"X-SageSched-Class": klass}
            answer = stream(s, urls[i % len(urls)], chat(text, n), headers)
            tasks.append(asyncio.create_task(answer))
            await until(lambda i=i: waiting() == i + 1)  # type: ignore[misc]
        blocker.cancel()  # its client leaves: the slot goes to the best waiting request
        starts = await asyncio.gather(*tasks)
    return sorted(range(len(BURST)), key=lambda i: starts[i][0])


async def test_a_burst_through_two_workers_starts_in_the_single_process_order(
    start_emulator: StartEmulator, start_gateway: StartGateway, start_workers: StartWorkers,
    embedder: Embedder,
) -> None:  # fmt: skip
    backend = await start_emulator(time_scale=1.0)
    # no preemption: the blocker keeps the slot while the burst queues
    one = await start_gateway([{"url": backend, "max_inflight": 1}], policy="sagesched",
                              preemption=False,
                              predictor=LengthPredictor(embedder=embedder))  # fmt: skip
    single = await burst_order([one.url], one.state.dispatcher, one.state.pool)
    await one.stop()
    two = await start_workers([{"url": backend, "max_inflight": 1}], policy="sagesched",
                              preemption=False,
                              predictor=LengthPredictor(embedder=embedder))  # fmt: skip
    split = await burst_order(two.urls, two.authority.dispatcher, two.authority.pool)
    assert split == single
    assert single != list(range(len(BURST)))  # the policy reordered the burst
    assert all(c.admitted == len(BURST) // 2 + (c.index == 0) for c in two.authority.workers)


def per_request(workers: RunningWorkers) -> float:
    conns = workers.authority.workers
    sent = sum(c.received[op] for c in conns for op in REQUEST_OPS)
    return sent / sum(c.admitted for c in conns)


@pytest.mark.parametrize("policy", ["fcfs", "sagesched"])
async def test_messages_are_per_request_not_per_token(
    policy: str, start_emulator: StartEmulator, start_workers: StartWorkers
) -> None:
    backend = await start_emulator(time_scale=0.05)
    counts = {}
    for n in (10, 300):
        workers = await start_workers([{"url": backend, "max_inflight": 4}], policy=policy)
        async with aiohttp.ClientSession() as s:
            answers = await asyncio.gather(
                *(stream(s, workers.urls[i % 2], chat(f"Question {i}?", n)) for i in range(8))
            )
        assert all(a.endswith(b"data: [DONE]\n\n") for _, a in answers)
        counts[n] = per_request(workers)
        reviews = sum(c.received["tokens"] for c in workers.authority.workers)
        await workers.stop()
        if policy == "fcfs":  # no review points: admit, then the attempt's end
            assert counts[n] == 2 and reviews == 0
    # SageSched reviews a running job at its predicted distribution's support points (at most
    # the predictor's bucket_count, 24): a few messages per request, not one per token
    assert counts[300] <= 2 + PredictorConfig().bucket_count < 300 / 10


async def test_the_host_predictor_predicts_and_learns_for_every_worker(
    start_emulator: StartEmulator, start_workers: StartWorkers, embedder: Embedder
) -> None:
    """One predictor per host: requests through both workers are learnt into the authority's
    predictor (the workers keep no history), and a worker's waiting request is queued with
    the distribution the host's predictor gives its prompt."""
    backend = await start_emulator(time_scale=0.05)
    host = LengthPredictor(embedder=embedder)
    host.observe_many([LONG, SHORT], [1500, 3])
    workers = await start_workers([{"url": backend, "max_inflight": 1}], policy="sagesched",
                                  preemption=False, predictor=host)  # fmt: skip
    authority = workers.authority
    assert authority.prediction is not None and authority.prediction.local is host
    async with aiohttp.ClientSession() as s:
        answers = await asyncio.gather(*(stream(s, workers.urls[i % 2], chat(f"Q{i}?", 4 + i))
                                         for i in range(6)))  # fmt: skip
        assert all(a.endswith(b"data: [DONE]\n\n") for _, a in answers)
        await until(lambda: host.own_state(MODEL).index.added == 6)
        learned = sorted(int(v) for v in host.own_state(MODEL).index.recent(10)[0])
        assert learned == [4, 5, 6, 7, 8, 9]
        running = asyncio.create_task(stream(s, workers.urls[0], chat("Hold.", 2000)))
        await until(lambda: authority.pool.backends[0].inflight == 1)
        waiting = [asyncio.create_task(stream(s, workers.urls[i], chat(text, 2000)))
                   for i, text in enumerate((LONG, SHORT))]  # fmt: skip
        await until(lambda: authority.dispatcher.waiting() == 2)
        # the host's history (LONG 1,500 tokens, SHORT 3) tells them apart; a worker's own
        # empty predictor would give both the same prior
        medians = sorted(j["predicted_median"] for j in authority.dispatcher.snapshot())
        assert medians[0] < 50 < medians[1], medians
        running.cancel()
        for task in waiting:
            task.cancel()


async def test_the_authority_never_loads_the_embedding_model_its_workers_run(
    start_emulator: StartEmulator, start_workers: StartWorkers
) -> None:
    """The authority's predictor learns and predicts the vectors its workers embed, so the
    predictor it loads as the config says holds no embedding model (~130 MiB per host)."""
    backend = await start_emulator(time_scale=0.05)
    workers = await start_workers([{"url": backend, "max_inflight": 1}], policy="sagesched",
                                  preemption=False, load_predictor=True)  # fmt: skip
    prediction = workers.authority.prediction
    assert prediction is not None and prediction.local is not None
    host = prediction.local
    async with aiohttp.ClientSession() as s:
        answers = await asyncio.gather(*(stream(s, workers.urls[i % 2], chat(f"Q{i}?", 4 + i))
                                         for i in range(6)))  # fmt: skip
        assert all(a.endswith(b"data: [DONE]\n\n") for _, a in answers)
    await until(lambda: host.own_state(MODEL).index.added == 6)
    assert sorted(int(v) for v in host.own_state(MODEL).index.recent(10)[0]) == list(range(4, 10))
    assert not host.embedder.loaded and host.embedder.dim == 384


async def test_the_configured_embedding_backend_reaches_the_snapshot_and_the_workers(
    start_emulator: StartEmulator, start_workers: StartWorkers, embedder: Embedder,
    tmp_path: Path,
) -> None:  # fmt: skip
    """`predictor.embed_backend` overrides the backend a snapshot was learnt with (the history
    is kept), and the workers embed with the authority's choice."""
    snapshot = tmp_path / "history.snapshot"
    learnt = LengthPredictor(embedder=embedder)
    learnt.observe_many(["One?", "Two?", "Three?"], [5, 6, 7])
    learnt.save(snapshot)
    assert LengthPredictor.snapshot_config(snapshot).embed_backend == "onnx-int8"
    backend = await start_emulator(time_scale=0.01)
    settings = {"snapshot_path": str(snapshot), "embed_backend": "onnx"}
    workers = await start_workers([backend], policy="sagesched", load_predictor=True,
                                  predictor_settings=settings)  # fmt: skip
    prediction = workers.authority.prediction
    assert prediction is not None and (host := prediction.local) is not None
    assert host.config.embed_backend == "onnx" and host.embedder.backend == "onnx"
    assert host.state(None).index.added == 3
    for runner in workers.runners:
        worker = runner.app[STATE].prediction.predictor
        assert isinstance(worker, HostPredictor) and worker.config.embed_backend == "onnx"


async def test_an_idle_worker_starts_jobs_on_the_global_distribution_it_keeps(
    start_emulator: StartEmulator, start_workers: StartWorkers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs that start at once start on the host's recent global distribution; a worker asks
    the authority for it once per model and prompt band while it is fresh, not once per
    request (each request is still predicted and learnt by the host)."""
    monkeypatch.setattr(host_predictor, "GLOBAL_FRESH_S", 600.0)  # however slow the machine
    backend = await start_emulator(time_scale=0.01)
    workers = await start_workers([{"url": backend, "max_inflight": 8}], policy="sagesched",
                                  preemption=False)  # fmt: skip
    conn = workers.authority.workers[0]
    async with aiohttp.ClientSession() as s:
        for i in range(6):  # one at a time through worker 0: each starts at once
            _, answer = await stream(s, workers.urls[0], chat(f"Question {i}?", 3))
            assert answer.endswith(b"data: [DONE]\n\n")
    await until(lambda: conn.received["learn"] == 6)
    assert conn.received["admit"] == 6 and conn.received["call predict"] == 6
    assert conn.received["call global"] == 1, dict(conn.received)


async def test_metrics_are_the_sum_over_workers(
    start_emulator: StartEmulator, start_workers: StartWorkers
) -> None:
    backend = await start_emulator(time_scale=0.05)
    workers = await start_workers([{"url": backend, "max_inflight": 4}], policy="fcfs")
    async with aiohttp.ClientSession() as s:
        for i in range(6):  # 4 through worker 0, 2 through worker 1
            await stream(s, workers.urls[0 if i < 4 else 1], chat(f"Q{i}", 5))
    for url in workers.urls:
        samples = await scrape(url + "/metrics")
        assert total(samples, "sagesched_requests_total", outcome="completed") == 6
        assert total(samples, "sagesched_time_to_first_token_seconds_count") == 6
        assert total(samples, "sagesched_output_tokens_total") == 30
        assert total(samples, "sagesched_backend_inflight_cap") == 4  # one backend, not two
        assert total(samples, "sagesched_backend_healthy") == 1
    assert [c.admitted for c in workers.authority.workers] == [4, 2]


async def test_a_worker_that_goes_returns_its_slots(
    start_emulator: StartEmulator, start_workers: StartWorkers
) -> None:
    """Worker 0 holds the only backend slot and a queued request; its connection closes: the
    authority finishes both, so worker 1's queued request gets the slot."""
    backend = await start_emulator(time_scale=1.0)
    workers = await start_workers([{"url": backend, "max_inflight": 1}], policy="fcfs")
    authority = workers.authority
    async with aiohttp.ClientSession() as s:
        running = asyncio.create_task(stream(s, workers.urls[0], chat("Long.", 2000)))
        await until(lambda: authority.pool.backends[0].inflight == 1)
        queued0 = asyncio.create_task(stream(s, workers.urls[0], chat("Queued on 0.", 5)))
        await until(lambda: authority.dispatcher.waiting() == 1)
        queued1 = asyncio.create_task(stream(s, workers.urls[1], chat("Queued on 1.", 5)))
        await until(lambda: authority.dispatcher.waiting() == 2)
        await workers.links[0].close()  # as if worker 0 died
        _, answer = await asyncio.wait_for(queued1, 30)
        assert answer.endswith(b"data: [DONE]\n\n")
        with pytest.raises(AssertionError):  # worker 0's queued request: 503, no authority
            await queued0
        running.cancel()
    await until(lambda: authority.pool.backends[0].inflight == 0)
    assert authority.dispatcher.waiting() == 0
    assert [c.index for c in authority.workers] == [1]


async def test_refusals_cross_as_the_same_errors(
    start_emulator: StartEmulator, start_workers: StartWorkers
) -> None:
    backend = await start_emulator(time_scale=1.0)
    workers = await start_workers([{"url": backend, "max_inflight": 1}], policy="fcfs",
                                  max_waiting=1, queue_timeout_s=0.5, retry_after_s=7)  # fmt: skip
    authority = workers.authority
    async with aiohttp.ClientSession() as s:
        running = asyncio.create_task(stream(s, workers.urls[0], chat("Long.", 2000)))
        await until(lambda: authority.pool.backends[0].inflight == 1)
        waiting = asyncio.create_task(s.post(workers.urls[1] + "/v1/chat/completions",
                                             json=chat("Waits.", 5)))  # fmt: skip
        await until(lambda: authority.dispatcher.waiting() == 1)
        async with s.post(workers.urls[1] + "/v1/chat/completions", json=chat("Full.", 5)) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "7"
            assert (await r.json())["error"]["code"] == "queue_full"
        async with await waiting as r:  # the queue timeout, measured in the authority
            assert r.status == 503 and (await r.json())["error"]["code"] == "queue_timeout"
        running.cancel()
    samples = await scrape(workers.url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="queue_full", code="429") == 1
    assert total(samples, "sagesched_requests_total", outcome="queue_timeout", code="503") == 1


LONG = "Write a very long essay about the sea."
SHORT = "Say yes."


async def test_a_preemption_reaches_the_relay_in_another_worker(
    start_emulator: StartEmulator, start_workers: StartWorkers, embedder: Embedder
) -> None:
    """LONG runs through worker 0; SHORT arrives through worker 1 and preempts it: the
    authority's decision reaches worker 0's relay as a message, LONG resumes as a
    continuation, and its client sees every token once."""
    predictor = LengthPredictor(embedder=embedder)
    predictor.observe_many([LONG, SHORT], [1500, 3])
    backend = await start_emulator(time_scale=0.5)
    workers = await start_workers([{"url": backend, "max_inflight": 1}], policy="sagesched",
                                  preemption=True, predictor=predictor)  # fmt: skip
    async with aiohttp.ClientSession() as s:
        long_task = asyncio.create_task(stream(s, workers.urls[0], chat(LONG, 120)))
        authority = workers.authority
        await until(lambda: authority.pool.backends[0].inflight == 1)
        await asyncio.sleep(0.3)  # streaming
        _, short = await stream(s, workers.urls[1], chat(SHORT, 3))
        _, long_answer = await asyncio.wait_for(long_task, 60)
    assert short.endswith(b"data: [DONE]\n\n")
    assert long_answer.count(b'"content":"') - long_answer.count(b'"content":""') == 120
    samples = await scrape(workers.urls[1] + "/metrics")
    assert total(samples, "sagesched_preemptions_total") == 1
    assert total(samples, "sagesched_requests_total", outcome="completed") == 2
    assert authority.workers[0].sent["preempt"] == 1


async def test_a_stale_start_at_once_state_still_waits_for_the_prediction(
    start_emulator: StartEmulator, start_workers: StartWorkers
) -> None:
    """Worker 1 believes the model is idle (as if the authority's push had not reached it
    yet) while a request waits: its new request skips the prediction, the authority answers
    `later`, and the request is admitted again with its prediction, then served."""
    backend = await start_emulator(time_scale=1.0)
    workers = await start_workers([{"url": backend, "max_inflight": 1}], policy="sagesched",
                                  preemption=False)  # fmt: skip
    authority = workers.authority
    async with aiohttp.ClientSession() as s:
        running = asyncio.create_task(stream(s, workers.urls[0], chat("Long.", 2000)))
        await until(lambda: authority.pool.backends[0].inflight == 1)
        workers.links[1].startable[MODEL] = True  # stale
        late = asyncio.create_task(stream(s, workers.urls[1], chat("A short one?", 5)))
        await until(lambda: authority.dispatcher.waiting() == 1)
        conn = next(c for c in authority.workers if c.index == 1)
        assert (conn.sent["later"], conn.received["admit"], conn.admitted) == (1, 2, 1)
        job = authority.dispatcher.snapshot()[0]
        assert job["predicted_median"] is not None
        running.cancel()
        _, answer = await asyncio.wait_for(late, 30)
    assert answer.endswith(b"data: [DONE]\n\n")


async def test_retries_cross_the_socket(start_faulty_backend: Any,
                                        start_workers: StartWorkers) -> None:  # fmt: skip
    """A backend that resets before the first byte: the worker's request is granted again on
    the other backend; when every backend fails, the worker answers 502 as one process does
    (its own check and the authority's agree)."""
    bad = await start_faulty_backend("reset_before_headers")
    good = await start_faulty_backend("ok")
    workers = await start_workers([bad.url, good.url], policy="fcfs", max_retries=2)
    async with aiohttp.ClientSession() as s:
        _, answer = await stream(s, workers.urls[1], chat("Retry me.", 3))
        assert b"t2" in answer and answer.endswith(b"data: [DONE]\n\n")
        assert (bad.hits, good.hits) == (["reset_before_headers"], ["ok"])
        good.set_mode("status_500")
        bad.set_mode("status_500")
        await until(lambda: all(b.healthy for b in workers.authority.pool.backends))
        async with s.post(workers.urls[0] + "/v1/chat/completions", json=chat("Fail.", 3)) as r:
            assert r.status == 502 and (await r.json())["error"]["code"] == "upstream_failed"
    samples = await scrape(workers.url + "/metrics")
    assert total(samples, "sagesched_retries_total") == 3
    assert total(samples, "sagesched_requests_total", outcome="upstream_error", code="502") == 1
    assert not any(c.held for c in workers.authority.workers)
    assert all(b.inflight == 0 for b in workers.authority.pool.backends)
