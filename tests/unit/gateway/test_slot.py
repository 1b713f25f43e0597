"""The slot contract (`gateway.scheduling.slot`): the preemption window on its own, then a real
`Dispatcher` and `BackendPool` driven through `LocalSlot`s as the relay drives them (no
network: the backends are marked healthy by hand and never contacted)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.config import GatewayConfig, build
from gateway.errors import QueueTimeout, UpstreamFailed
from gateway.observability.metrics import RequestTrace
from gateway.scheduling.backends import BackendPool
from gateway.scheduling.dispatcher import Dispatcher, LocalSlot
from gateway.scheduling.slot import Attempt, PreemptWindow, Slot
from gateway.serving.openai_api import parse_call
from policies import Job, parse_policy

MODEL = "m"

# -- the window ---------------------------------------------------------------------------


async def test_preemption_stops_a_block_that_waits_forever() -> None:
    """A stream stalled in the backend: the block awaits something that never comes."""
    window = PreemptWindow()
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def attempt() -> str:
        with window:
            await never
        await asyncio.sleep(0)  # the cancellation was consumed: the task runs on
        return "after"

    task = asyncio.create_task(attempt())
    await asyncio.sleep(0)
    assert window.open
    assert window.preempt()
    assert not window.preempt()  # once
    assert await task == "after"
    assert window.preempted and not task.cancelled()
    assert not window.preempt()  # closed


async def test_a_client_cancellation_is_not_swallowed() -> None:
    window = PreemptWindow()
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def attempt() -> None:
        with window:
            await never

    task = asyncio.create_task(attempt())
    await asyncio.sleep(0)
    window.preempt()
    task.cancel()  # the client left at the same time
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not window.preempted


async def test_preemption_from_inside_the_block_sets_a_flag_only() -> None:
    """The block's own token report made it the victim: no cancellation is left pending to
    hit the task later, after the block."""
    window = PreemptWindow()

    async def attempt(stop_at: int, chunks: int) -> int:
        seen = 0
        with window:
            for seen in range(chunks):
                await asyncio.sleep(0)
                if seen == stop_at:
                    assert window.preempt()
                if window.requested:
                    break
        await asyncio.sleep(0.01)  # would raise CancelledError if one were pending
        return seen

    assert await asyncio.create_task(attempt(3, 10)) == 3
    assert window.preempted


def test_a_window_is_open_only_inside_its_block() -> None:
    window = PreemptWindow()
    assert not window.open and not window.preempt()


# -- LocalSlot on a real dispatcher -------------------------------------------------------


def config(**extra: Any) -> GatewayConfig:
    backends = [
        {"url": f"http://b{i}:1", "name": f"b{i}", "max_inflight": 1, "models": [MODEL]}
        for i in range(extra.pop("backends", 1))
    ]
    return build({"backends": backends, "adaptive_cap": {"enabled": False}, **extra})


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def gateway(cfg: GatewayConfig, session: aiohttp.ClientSession) -> tuple[BackendPool, Dispatcher]:
    pool = BackendPool(cfg.backends, session, health_interval_s=60.0, adaptive=cfg.adaptive_cap)
    for b in pool.backends:
        b.healthy = True
    return pool, Dispatcher(parse_policy(cfg.policy), pool, cfg)


def job(dispatcher: Dispatcher, true_tokens: int | None = None, stream: bool = True) -> Job:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 100, "stream": stream}
    trace = RequestTrace(model=MODEL, arrived=asyncio.get_running_loop().time(), policy="x")
    j = dispatcher.new_job(parse_call("completions", body, None), trace, None)
    j.true_output_tokens = true_tokens
    return j


async def test_a_slot_is_granted_in_turn_and_finished_once(
    session: aiohttp.ClientSession,
) -> None:
    pool, dispatcher = gateway(config(policy="fcfs"), session)
    first, second = job(dispatcher), job(dispatcher)
    slot: Slot = dispatcher.slot(first)  # the local slot meets the contract (mypy checks)
    async with slot as a:
        grant = await a.granted()
        assert grant.backend is pool.backends[0] and grant.priority is None
        with pytest.raises(RuntimeError):
            async with dispatcher.slot(second) as b:
                waiting = asyncio.create_task(b.granted())
                await asyncio.sleep(0.01)
                assert not waiting.done() and dispatcher.waiting() == 1
                a.ended(Attempt.COMPLETED)  # frees the backend: the second is granted
                assert (await waiting).backend is pool.backends[0]
                raise RuntimeError("the relay failed")  # the exit still finishes it
    assert isinstance(a, LocalSlot) and isinstance(b, LocalSlot) and a.finished and b.finished
    assert pool.backends[0].inflight == 0 and dispatcher.waiting() == 0
    assert dispatcher.class_depths() == {"interactive": 0, "standard": 0, "batch": 0}


async def test_a_client_leaving_the_queue_withdraws_the_job(
    session: aiohttp.ClientSession,
) -> None:
    pool, dispatcher = gateway(config(policy="fcfs"), session)
    async with dispatcher.slot(job(dispatcher)) as a:
        await a.granted()

        async def client() -> None:
            async with dispatcher.slot(job(dispatcher)) as b:
                await b.granted()

        task = asyncio.create_task(client())
        await asyncio.sleep(0.01)
        assert dispatcher.waiting() == 1 and dispatcher.class_depths()["standard"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert dispatcher.waiting() == 0 and dispatcher.class_depths()["standard"] == 0
    assert pool.backends[0].inflight == 0


async def test_queue_timeout(session: aiohttp.ClientSession) -> None:
    classes = {"list": [{"name": "a", "queue_timeout_s": 0.05}], "default": "a"}
    pool, dispatcher = gateway(config(policy="fcfs", classes=classes), session)
    async with dispatcher.slot(job(dispatcher)) as a:
        await a.granted()
        with pytest.raises(QueueTimeout):
            async with dispatcher.slot(job(dispatcher)) as b:
                await b.granted()
        assert dispatcher.waiting() == 0
    assert pool.backends[0].inflight == 0


async def test_retry_elsewhere_then_give_up(session: aiohttp.ClientSession) -> None:
    pool, dispatcher = gateway(config(policy="fcfs", backends=2, max_retries=2), session)
    b0, b1 = pool.backends
    with pytest.raises(UpstreamFailed):
        async with dispatcher.slot(job(dispatcher)) as slot:
            first = (await slot.granted()).backend
            slot.ended(Attempt.RETRY, backend_down=True)
            assert not first.healthy and first.inflight == 0
            second = (await slot.granted()).backend
            assert second is not first
            slot.ended(Attempt.RETRY, backend_down=False)  # no backend left to try
    assert dispatcher.retries == {(MODEL, b0.name): 1, (MODEL, b1.name): 1}
    assert b0.inflight == b1.inflight == 0


async def test_preemption_reaches_a_stalled_stream_and_the_job_resumes(
    session: aiohttp.ClientSession,
) -> None:
    """srpt-oracle: a short arrival preempts the long job whose stream sends nothing; the
    long one waits again and is granted once the short one is done."""
    pool, dispatcher = gateway(config(policy="srpt-oracle", preemption=True), session)
    long_job = job(dispatcher, true_tokens=1000)
    stalled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    grants: list[str] = []

    async def long_request() -> None:
        async with dispatcher.slot(long_job) as slot:
            await slot.granted()
            assert slot.review_at == 1  # srpt reviews at every token
            slot.tokens(1)
            assert slot.review_at == 2 and long_job.generated == 1
            with slot.preemptible() as window:
                await stalled
            assert window.preempted
            slot.ended(Attempt.PREEMPTED)
            await slot.granted()
            grants.append("long")
            slot.ended(Attempt.COMPLETED)

    task = asyncio.create_task(long_request())
    await asyncio.sleep(0.01)
    async with dispatcher.slot(job(dispatcher, true_tokens=5)) as short:
        await short.granted()  # granted once the long job gave the backend back
        grants.append("short")
        assert long_job.preemptions == 1
        short.ended(Attempt.COMPLETED)
    await asyncio.wait_for(task, 1)
    assert grants == ["short", "long"]
    assert dispatcher.preemptions[(MODEL, "b0")] == 1
    assert pool.backends[0].inflight == 0


async def test_a_job_not_in_its_window_is_not_preempted(
    session: aiohttp.ClientSession,
) -> None:
    """Connecting, or a whole (non-streamed) answer: no window, so no preemption; the running
    job's own token report at a review point then preempts it from inside its window."""
    pool, dispatcher = gateway(config(policy="srpt-oracle", preemption=True), session)
    async with dispatcher.slot(job(dispatcher, true_tokens=1000)) as slot:
        await slot.granted()
        short = await dispatcher.slot(job(dispatcher, true_tokens=5)).__aenter__()
        assert dispatcher.preemptions[(MODEL, "b0")] == 0
        with slot.preemptible() as window:
            slot.tokens(1)  # a review point: the waiting short job beats this one
            assert window.requested
        assert window.preempted
        slot.ended(Attempt.PREEMPTED)
        assert (await short.granted()).backend is pool.backends[0]
        await short.__aexit__(None, None, None)
    assert dispatcher.preemptions[(MODEL, "b0")] == 1
    assert pool.backends[0].inflight == 0 and dispatcher.waiting() == 0
