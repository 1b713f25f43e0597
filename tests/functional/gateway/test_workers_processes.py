"""`sagesched serve --workers 2` as real processes next to `sagesched emulate`: one queue for
both workers (a burst starts in the `--workers 1` order), connections spread over the
workers, metrics summed, one predictor for the host (the same traffic leaves the snapshot
`--workers 1` leaves), SIGTERM drains in-flight streams and exits 0, a killed worker is
restarted and its request's backend slot comes back."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fixtures.scrape import scrape, total
from fixtures.worker_fixtures import BURST

from loadgen.procs import Children, free_port, sagesched

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ADMIN = {"Authorization": "Bearer adm"}


def start_gateway(children: Children, tmp_path: Path, backend: str, workers: int,
                  policy: str = "fcfs", extra: str = "",
                  ) -> tuple[str, subprocess.Popen[bytes]]:  # fmt: skip
    port = free_port()
    config = tmp_path / f"gw-{port}.yaml"
    config.write_text(f"policy: {policy}\npreemption: false\nadmin_key: adm\n"
                      f"backends: [{{url: '{backend}', max_inflight: 1}}]\n"
                      "adaptive_cap: {enabled: false}\nhealth_interval_s: 0.5\n"
                      + extra)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    cmd = sagesched("serve", "--config", str(config), "--port", str(port),
                    "--workers", str(workers))  # fmt: skip
    proc = children.start(f"gateway-{port}", cmd, url + "/ready", timeout_s=180)
    return url, proc


def chat(text: str, n: int) -> dict[str, Any]:
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": text}],
            "max_tokens": n, "ignore_eos": True, "stream": True}  # fmt: skip


def fresh() -> aiohttp.ClientSession:
    """A client whose every request opens its own connection (so the kernel picks a worker
    for each)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def admin(url: str, view: str) -> Any:
    async with fresh() as s, s.get(f"{url}/admin/{view}", headers=ADMIN) as r:
        assert r.status == 200
        return await r.json()


async def until(url: str, view: str, check: Any, timeout_s: float = 60) -> Any:
    """Poll an admin view of the authority until `check(view)` holds."""
    deadline = time.monotonic() + timeout_s
    while not check(data := await admin(url, view)):
        assert time.monotonic() < deadline, f"/admin/{view} never satisfied the check: {data}"
        await asyncio.sleep(0.05)
    return data


def inflight(data: Any) -> int:
    return int(sum(b["inflight"] for b in data["backends"]))


async def stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> tuple[float, bytes]:  # fmt: skip
    async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        first = await r.content.readany()
        return time.monotonic(), first + await r.read()


async def burst_order(url: str) -> list[int]:
    """Hold the one slot, queue BURST one request at a time (each admitted before the next,
    each on its own connection), free the slot, return the order in which they started."""
    async with fresh() as s:
        blocker = asyncio.create_task(stream(s, url, chat("Write a long essay.", 2000)))
        await until(url, "backends", lambda d: inflight(d) == 1)
        tasks = []
        for i, (klass, n, text) in enumerate(BURST):
            headers = {"X-SageSched-Class": klass}
            tasks.append(asyncio.create_task(stream(s, url, chat(text, n), headers)))
            await until(url, "queue", lambda d, i=i: d["waiting"] == i + 1)
        blocker.cancel()
        starts = await asyncio.gather(*tasks)
    return sorted(range(len(BURST)), key=lambda i: starts[i][0])


async def test_two_workers_share_one_queue_spread_connections_and_sum_metrics(
    children: Children, tmp_path: Path, backend: str
) -> None:
    one, proc = start_gateway(children, tmp_path, backend, 1, "sagesched")
    single = await burst_order(one)
    await asyncio.to_thread(children.stop, proc)
    two, _ = start_gateway(children, tmp_path, backend, 2, "sagesched")
    assert await burst_order(two) == single
    assert single != list(range(len(BURST)))
    sent = len(BURST) + 1
    async with fresh() as s:  # more requests until both workers served some (each ~1/2)
        while min(w["admitted"] for w in (await admin(two, "queue"))["workers"]) == 0:
            assert sent < 60, "every connection went to one worker"
            await stream(s, two, chat("More.", 3))
            sent += 1
    workers = (await admin(two, "queue"))["workers"]
    assert sorted(w["index"] for w in workers) == [0, 1]
    assert sum(w["admitted"] for w in workers) == sent
    for _ in range(4):  # whichever worker answers /metrics, it shows the sum over both
        samples = await scrape(two + "/metrics")
        assert total(samples, "sagesched_requests_total", outcome="completed") == sent - 1
        assert total(samples, "sagesched_requests_total", outcome="cancelled_running") == 1
        assert total(samples, "sagesched_backend_inflight_cap") == 1


FAMILIES = (("Answer yes or no: is {} a colour?", 3), ("Name three facts about {}.", 18),
            ("Write a long story about {} and a lighthouse keeper.", 60))  # fmt: skip
"""Prompt families and their output lengths (the emulator, with `ignore_eos`, gives each
exactly its `max_tokens`)."""
SUBJECTS = ("copper", "a river", "the moon", "green", "a violin", "winter", "an owl", "glass")


async def test_the_workers_learn_into_one_predictor_as_one_process_does(
    children: Children, tmp_path: Path, backend: str
) -> None:
    """One predictor per host: the same traffic through `--workers 2` and `--workers 1`
    leaves snapshots with histories of the same size (each worker learning only what it
    relayed would leave two halves), whose predictions of new prompts agree (the predicted
    means' cosine >= 0.99, their Kendall tau against the true lengths within 0.01)."""
    from scipy.stats import kendalltau

    from predictor import LengthPredictor
    from predictor.config import PredictorConfig

    traffic = [(f.format(x), n) for x in SUBJECTS for f, n in FAMILIES]
    snapshots = {}
    for workers in (1, 2):
        snapshots[workers] = snapshot = tmp_path / f"predictor-{workers}.snapshot"
        url, proc = start_gateway(children, tmp_path, backend, workers, "sagesched",
                                  f"predictor: {{snapshot_path: '{snapshot}'}}\n")  # fmt: skip
        async with fresh() as s:
            for text, n in traffic:  # one at a time: both learn in the same order
                await stream(s, url, chat(text, n))
        if workers == 2:
            admitted = [w["admitted"] for w in (await admin(url, "queue"))["workers"]]
            assert min(admitted) > 0, admitted  # both workers relayed some of it
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 90) == 0
    # predictions from the served model's own history (the default state stays empty here)
    one, two = (LengthPredictor.load(snapshots[w], PredictorConfig(model_min_items=1))
                for w in (1, 2))  # fmt: skip
    sizes = [len(p.own_state("tiny-llama").index) for p in (one, two)]
    assert sizes == [len(traffic)] * 2, sizes
    probes = [(f.format(x), n) for x in ("a lantern", "salt", "a hawk") for f, n in FAMILIES]
    means = [[p.predict(text, model="tiny-llama").mean() for text, _ in probes]
             for p in (one, two)]  # fmt: skip
    cosine = sum(a * b for a, b in zip(*means, strict=True)) / math.prod(
        math.sqrt(sum(v * v for v in row)) for row in means)  # fmt: skip
    assert cosine >= 0.99, means
    truth = [n for _, n in probes]
    taus = [kendalltau(m, truth).statistic for m in means]
    assert abs(taus[0] - taus[1]) <= 0.01 and taus[0] > 0.5, taus


async def test_sigterm_drains_in_flight_streams_and_exits_0(
    children: Children, tmp_path: Path, backend: str
) -> None:
    url, proc = start_gateway(children, tmp_path, backend, 2)
    async with fresh() as s:
        running = asyncio.create_task(stream(s, url, chat("A long answer.", 300)))
        queued = asyncio.create_task(stream(s, url, chat("Waits for the slot.", 20)))
        await until(url, "queue", lambda d: d["waiting"] == 1)
        proc.send_signal(signal.SIGTERM)  # the parent only: it stops the workers
        (_, first), (_, second) = await asyncio.wait_for(asyncio.gather(running, queued), 90)
    assert first.endswith(b"data: [DONE]\n\n") and second.endswith(b"data: [DONE]\n\n")
    assert first.count(b'"content":"') - first.count(b'"content":""') == 300
    assert await asyncio.to_thread(proc.wait, 90) == 0


async def test_a_killed_worker_is_restarted_and_its_slot_comes_back(
    children: Children, tmp_path: Path, backend: str
) -> None:
    url, _ = start_gateway(children, tmp_path, backend, 2)
    async with fresh() as s:
        for _ in range(6):
            await stream(s, url, chat("Before.", 3))
        samples = await scrape(url + "/metrics")  # every worker's series, as of now
        assert total(samples, "sagesched_requests_total", outcome="completed") == 6
        doomed = asyncio.create_task(stream(s, url, chat("A very long answer.", 2000)))
        data = await until(url, "queue", lambda d: any(w["holding"] for w in d["workers"]))
        holder = next(w for w in data["workers"] if w["holding"])
        assert inflight(await admin(url, "backends")) == 1
        os.kill(holder["pid"], signal.SIGKILL)
        with pytest.raises((aiohttp.ClientError, AssertionError)):
            await asyncio.wait_for(doomed, 30)
        await until(url, "backends", lambda d: inflight(d) == 0)  # the slot came back
        data = await until(url, "queue", lambda d: len(d["workers"]) == 2
                           and all(w["ready"] for w in d["workers"]))  # fmt: skip
        reborn = next(w for w in data["workers"] if w["index"] == holder["index"])
        assert reborn["pid"] != holder["pid"]
        for _ in range(6):  # both workers serve again
            _, answer = await stream(s, url, chat("After the restart.", 5))
            assert answer.endswith(b"data: [DONE]\n\n")
    # the restarted worker counts from zero; the dead one's series are kept as last scraped
    samples = await scrape(url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="completed") == 12
