"""Shared learning through a real redis-server: what one replica learns reaches another within
a second, a late starter warms from the stream, models stay apart, and losing Redis (refused,
killed, hung) only degrades to local learning."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures.redis_fixtures import RedisServer, StartRedis, free_port

from predictor import Embedder, LengthPredictor, PredictorConfig
from predictor.shared import SharedLearning, decode, encode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# small thresholds so a handful of completions already answer for a model
CONFIG = PredictorConfig(min_neighbours=2, model_min_items=2, capacity_items=1_000)
SEEDS = ["What is 2+2?", "Say hi", "Name a colour", "Translate 'cat' into French"]
ESSAY = "Write a detailed essay about the history of the Roman Empire"
NEAR = "Write a long essay on the history of the Roman Empire"
MODEL = "tiny-llama"

Replica = Callable[..., Awaitable[tuple[LengthPredictor, SharedLearning]]]


@pytest.fixture
async def replica(embedder: Embedder) -> AsyncIterator[Replica]:
    """Factory: a fresh predictor (the shared embedder) with shared learning started."""
    made: list[tuple[LengthPredictor, SharedLearning]] = []

    async def make(
        url: str, name: str, *, seeds: bool = True, **kwargs: object
    ) -> tuple[LengthPredictor, SharedLearning]:
        predictor = LengthPredictor(CONFIG, embedder=embedder)
        if seeds:  # local history before sharing starts: short answers
            predictor.observe_many(SEEDS, [5, 3, 4, 6], model=MODEL)
        shared = SharedLearning(predictor, url, replica_id=name, **kwargs)  # type: ignore[arg-type]
        await shared.start()
        made.append((predictor, shared))
        return predictor, shared

    yield make
    for predictor, shared in made:
        await shared.stop()
        await predictor.aclose()


async def until(condition: Callable[[], bool], within_s: float) -> float:
    """Seconds until `condition()` held; fails if it did not within `within_s` (the bound
    is what the test asserts, e.g. propagation within one second)."""
    start = time.monotonic()
    while not condition():
        elapsed = time.monotonic() - start
        assert elapsed < within_s, f"not within {within_s} s"
        await asyncio.sleep(0.002)
    return time.monotonic() - start


def mean(predictor: LengthPredictor, prompt: str, model: str = MODEL) -> float:
    return predictor.predict(prompt, prompt_tokens=12, model=model).mean()


def test_records_round_trip_int8_and_float32(embedder: Embedder) -> None:
    from predictor.shared import SharedRecord

    vec = embedder.encode([ESSAY])[0]
    rec = SharedRecord(MODEL, vec, 12.0, 900.0, "a", 1.5e12)
    exact = decode({k.encode(): v for k, v in encode(rec, "float32").items()}, vec.size)
    assert np.array_equal(exact.vector, vec) and exact.output_tokens == 900.0
    small = encode(rec, "int8")
    assert len(small["v"]) == vec.size  # one byte a dimension
    back = decode({k.encode(): v for k, v in small.items()}, vec.size)
    cosine = float(back.vector @ vec / np.linalg.norm(back.vector) / np.linalg.norm(vec))
    assert cosine > 0.9999
    assert (back.model, back.replica, back.prompt_tokens) == (MODEL, "a", 12.0)
    with pytest.raises(ValueError, match="384-d"):
        decode({k.encode(): v for k, v in small.items()}, 768)


async def connected_pair(
    replica: Replica, url: str, **options: Any
) -> tuple[LengthPredictor, SharedLearning, LengthPredictor, SharedLearning]:
    """Replicas "a" and "b" on one Redis, both connected."""
    a, share_a = await replica(url, "a", **options)
    b, share_b = await replica(url, "b", **options)
    assert await share_a.wait_connected(5) and await share_b.wait_connected(5)
    return a, share_a, b, share_b


async def test_a_completion_learned_by_one_replica_reaches_another_within_a_second(
    start_redis: StartRedis, replica: Replica
) -> None:
    redis = start_redis()
    a, share_a, b, share_b = await connected_pair(replica, redis.url)
    before_a, before_b = mean(a, NEAR), mean(b, NEAR)
    assert before_a == before_b < 10  # both know only the short seeds

    await a.observe_async(ESSAY, 900, 12, model=MODEL)
    delay = await until(lambda: share_b.received == 1, within_s=1.0)
    after_b = mean(b, NEAR)
    # moved toward the true length, exactly as far as on the replica that learned it
    assert math.log(900 / after_b) < math.log(900 / before_b) - 2.0, (before_b, after_b)
    assert after_b == pytest.approx(mean(a, NEAR), rel=0.02)
    await until(lambda: share_a.published == 1, within_s=1.0)  # counted once XADD answered
    assert share_a.received == 0  # its own record is not learned twice
    assert a.own_state(MODEL).index.added == b.own_state(MODEL).index.added == len(SEEDS) + 1
    assert 0 < share_b.delays_s[0] < 1.0 and delay < 1.0


async def test_a_replica_started_late_warms_from_the_stream(
    start_redis: StartRedis, replica: Replica, embedder: Embedder
) -> None:
    redis = start_redis()
    a, share_a = await replica(redis.url, "a")
    assert await share_a.wait_connected(5)
    for i in range(20):
        await a.observe_async(f"{ESSAY}, part {i}", 880 + i, 12, model=MODEL)
    await until(lambda: share_a.published == 20, within_s=2.0)

    late, share_late = await replica(redis.url, "late", seeds=False)
    assert await share_late.wait_connected(5)
    assert share_late.warmed == 20 and share_late.received == 0
    assert late.own_state(MODEL).index.added == 20
    assert 800 < late.predict(NEAR, prompt_tokens=12, model=MODEL).quantile(0.5) < 950
    # and it follows what comes next
    await a.observe_async(ESSAY, 901, 12, model=MODEL)
    await until(lambda: share_late.received == 1, within_s=1.0)


async def test_a_replica_restored_from_its_snapshot_warms_only_what_it_missed(
    start_redis: StartRedis, replica: Replica, embedder: Embedder, tmp_path: Path
) -> None:
    redis = start_redis()
    a, share_a, b, share_b = await connected_pair(replica, redis.url)
    for i in range(5):
        await a.observe_async(f"{ESSAY}, part {i}", 900 + i, 12, model=MODEL)
    for i in range(3):
        await b.observe_async(f"Say hi to person {i}", 5, 6, model=MODEL)
    await until(lambda: share_b.received == 5 and share_a.received == 3, within_s=2.0)
    await share_b.stop()  # B goes down gracefully: everything it learned is in its snapshot
    snapshot = tmp_path / "b.snapshot"
    b.save(snapshot)
    held = b.own_state(MODEL).index.added
    assert held == len(SEEDS) + 5 + 3
    for i in range(2):  # published while B is away
        await a.observe_async(f"{ESSAY}, later part {i}", 700, 12, model=MODEL)
    await until(lambda: share_a.published == 7, within_s=2.0)

    restored = LengthPredictor.load(snapshot, embedder=embedder)
    shared = SharedLearning(
        restored, redis.url, replica_id="b-restarted", warm_after_s=snapshot.stat().st_mtime
    )
    try:
        await shared.start()
        assert await shared.wait_connected(5)
        # only the two it missed: none of the 10 older records (its own 3 included) twice
        assert shared.warmed == 2
        assert restored.own_state(MODEL).index.added == held + 2
    finally:
        await shared.stop()
        await restored.aclose()


async def test_records_of_another_model_stay_apart(
    start_redis: StartRedis, replica: Replica
) -> None:
    redis = start_redis()
    a, _, b, share_b = await connected_pair(replica, redis.url)
    default_before = b.index.added
    await a.observe_async(ESSAY, 900, 12, model="other-model")
    await a.observe_async(ESSAY, 7, 12, model=None)
    await until(lambda: share_b.received == 2, within_s=1.0)
    assert b.own_state("other-model").index.added == 1
    assert b.own_state(MODEL).index.added == len(SEEDS)  # untouched
    assert b.index.added == default_before + 1  # the record without a model
    _, out, _ = b.own_state("other-model").index.items_in_order()
    assert out.tolist() == [900.0]


async def test_an_unreachable_redis_degrades_to_local_learning_then_recovers(
    replica: Replica, caplog: pytest.LogCaptureFixture, tmp_path_factory: pytest.TempPathFactory
) -> None:
    caplog.set_level(logging.INFO, logger="sagesched.predictor.shared")
    port = free_port()  # nothing listens here yet
    a, share_a = await replica(f"redis://127.0.0.1:{port}/0", "a", backoff_s=(0.05, 0.2))
    assert not await share_a.wait_connected(0.5)
    for i in range(3):  # local learning goes on; offering never raises
        await a.observe_async(f"{ESSAY} {i}", 900, 12, model=MODEL)
    assert a.own_state(MODEL).index.added == len(SEEDS) + 3
    assert share_a.state == "down" and share_a.disconnects == 1 and share_a.published == 0
    lost = [r for r in caplog.records if "lost" in r.getMessage()]
    assert len(lost) == 1 and "learning locally only" in lost[0].getMessage()

    server = RedisServer(port, tmp_path_factory.mktemp("redis"))
    try:
        server.start()
        assert await share_a.wait_connected(2.0)
        await until(lambda: share_a.published == 3, within_s=1.0)  # the buffer, published
        assert share_a.disconnects == 1
        assert any("connected" in r.getMessage() for r in caplog.records)
    finally:
        server.kill()


@pytest.mark.parametrize("fault", ["kill", "pause"])
async def test_losing_redis_mid_run_is_logged_once_and_restored(
    start_redis: StartRedis, replica: Replica, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    """kill: connections reset, then refused; pause (SIGSTOP): nothing answers, the read
    times out. Either way local learning goes on, one line says lost, one says restored."""
    caplog.set_level(logging.INFO, logger="sagesched.predictor.shared")
    redis = start_redis()
    fast = {"backoff_s": (0.05, 0.2), "block_ms": 200, "timeout_s": 0.3}
    a, share_a, _, share_b = await connected_pair(replica, redis.url, **fast)
    if fault == "kill":
        redis.kill()
    else:
        redis.pause()
    await until(lambda: share_a.state == share_b.state == "down", within_s=3.0)
    await a.observe_async(ESSAY, 900, 12, model=MODEL)  # never raises; learned locally
    assert a.own_state(MODEL).index.added == len(SEEDS) + 1
    await asyncio.sleep(0.5)  # several reconnection attempts: still one line each
    if fault == "kill":
        redis.start()
    else:
        redis.resume()
    assert await share_a.wait_connected(3.0) and await share_b.wait_connected(3.0)
    await a.observe_async(NEAR, 800, 12, model=MODEL)
    await until(lambda: share_b.received >= 1, within_s=1.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("lost" in m for m in warnings) == 2  # one line per replica, not per attempt
    assert sum("restored" in m for m in infos) == 2
    assert share_a.disconnects == share_b.disconnects == 1
