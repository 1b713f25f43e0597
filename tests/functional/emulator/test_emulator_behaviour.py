"""Emulator behaviour: priority scheduling, abort on disconnect, time scale, the speed and
balance probes, the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import openai
import pytest

from loadgen.engine.fit_cpu import emulated, machine_balance, profile_probe, speed_factor
from loadgen.engine.profiles import CPU_TINY_VLLM, CpuTinyVllm, Scaled, make_profile
from loadgen.procs import free_port

MODEL = "tiny-llama"
ROOT = Path(__file__).resolve().parents[3]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


async def gauge(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


async def wait_for(cond: object, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if await cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met before the deadline")


async def test_priority_orders_the_waiting_queue(start_emulator: object) -> None:
    url = await start_emulator(priority_scheduling=True, max_num_seqs=1)  # type: ignore[operator]
    done: list[str] = []

    async def run(name: str, priority: int, tokens: int) -> None:
        async with client(url) as c:
            await c.completions.create(
                model=MODEL,
                prompt=name,
                max_tokens=tokens,
                extra_body={"ignore_eos": True, "priority": priority},
            )
        done.append(name)

    first = asyncio.create_task(run("busy", 0, 40))  # holds the only sequence slot
    await wait_for(lambda: _running_is(url, 1.0), 5)
    late_low = asyncio.create_task(run("low", 10, 2))
    await wait_for(lambda: _waiting_is(url, 1.0), 5)
    high = asyncio.create_task(run("high", -5, 2))
    await asyncio.gather(first, late_low, high)
    # the high-priority request arrived later but is served before the low one; the running
    # request is not preempted for it (vLLM: max_num_seqs does not preempt)
    assert done == ["busy", "high", "low"]


async def _running_is(url: str, v: float) -> bool:
    return await gauge(url, "vllm:num_requests_running") == v


async def _waiting_is(url: str, v: float) -> bool:
    return await gauge(url, "vllm:num_requests_waiting") == v


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts(emulator_url: str, stream: bool) -> None:
    body = {"model": MODEL, "prompt": "long", "max_tokens": 1500, "ignore_eos": True}
    body["stream"] = stream
    async with aiohttp.ClientSession() as s:

        async def call() -> None:
            async with s.post(emulator_url + "/v1/completions", json=body) as resp:
                await resp.content.readline()  # streaming: the first chunk
                await asyncio.sleep(60)  # hold the connection until cancelled

        task = asyncio.create_task(call())
        await wait_for(lambda: _running_is(emulator_url, 1.0), 5)
        task.cancel()  # drop the connection mid-request
        with contextlib.suppress(asyncio.CancelledError):
            await task
    t0 = time.monotonic()
    await wait_for(lambda: _running_is(emulator_url, 0.0), 2)
    assert time.monotonic() - t0 < 2  # 1,500 tokens would take ~15 s if not aborted
    assert await gauge(emulator_url, "vllm:num_requests_waiting") == 0
    assert await gauge(emulator_url, "vllm:e2e_request_latency_seconds_count") == 0


async def _ttlt(url: str, tokens: int) -> float:
    async with client(url) as c:
        t0 = time.perf_counter()
        await c.completions.create(
            model=MODEL, prompt=[1, 2, 3, 4], max_tokens=tokens, extra_body={"ignore_eos": True}
        )
        return time.perf_counter() - t0


async def test_time_scale(start_emulator: object) -> None:
    prof = make_profile("cpu-tiny-vllm")
    tokens = 60
    # request overhead, the first token from the prefill iteration, then one decode
    # iteration per token
    expected = (
        prof.request_overhead_s(0) + prof.iteration_s(0, 0, 4) + prof.decode_run_s(1, 5, tokens - 1)
    )
    real = await _ttlt(await start_emulator(time_scale=1.0), tokens)  # type: ignore[operator]
    fast = await _ttlt(await start_emulator(time_scale=0.2), tokens)  # type: ignore[operator]
    assert expected * 0.95 <= real <= expected * 1.5 + 0.05
    assert expected * 0.2 * 0.95 <= fast <= expected * 0.2 * 1.5 + 0.05
    assert fast < real / 2


async def test_speed_factor_recovers_the_time_scale(start_emulator: object) -> None:
    """The speed probe behind the fidelity test's time scale measures an emulator running at
    half the profile's time as about 0.5, and one at the profile's pace as about 1."""
    reference = await profile_probe()
    fast = await start_emulator(time_scale=0.5)  # type: ignore[operator]
    same = await start_emulator()  # type: ignore[operator]
    assert 0.5 * 0.9 <= await speed_factor(fast, MODEL, reference, seed=1) <= 0.5 * 1.25
    assert 0.9 <= await speed_factor(same, MODEL, reference, seed=2) <= 1.15


async def test_machine_balance_reads_the_three_speeds_apart() -> None:
    """The balance probe behind the real-engine tests: an emulator at 1.5x the profile's time
    whose prefill costs 8x and whose decoding sequences 3x the profile's per token reads
    about 1.5 / 4.5 / 12 (prefill ratio 8: shifted); one at the profile's pace about 1 / 1 / 1."""
    k = replace(CPU_TINY_VLLM, per_prefill_tok_ms=CPU_TINY_VLLM.per_prefill_tok_ms * 8,
                per_seq_ms=CPU_TINY_VLLM.per_seq_ms * 3)  # fmt: skip
    async with emulated(Scaled(CpuTinyVllm(k), 1.5)) as url:
        slow = await machine_balance(url, MODEL)
    async with emulated(CpuTinyVllm()) as url:
        same = await machine_balance(url, MODEL)
    got = (slow.fixed_scale, slow.sequence_scale, slow.prefill_scale)
    assert got == pytest.approx((1.5, 4.5, 12.0), rel=0.2), got
    assert slow.shifted and 8 * 0.8 <= slow.prefill_ratio <= 8 * 1.2
    got = (same.fixed_scale, same.sequence_scale, same.prefill_scale)
    assert got == pytest.approx((1.0, 1.0, 1.0), rel=0.2), got
    assert not same.shifted


def test_cli_serves_the_openai_client() -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "sagesched_cli", "emulate", "--profile", "cpu-tiny-vllm"]
    proc = subprocess.Popen([*cmd, "--port", str(port)], cwd=ROOT, env=env)
    stack = contextlib.ExitStack()
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        stack.enter_context(c)
        end = time.monotonic() + 30
        while True:
            try:
                models = c.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > end or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        assert models.data[0].id == MODEL
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
        assert r.usage is not None and r.usage.completion_tokens == 3
    finally:
        stack.close()
        proc.terminate()
        assert proc.wait(timeout=10) == 0
