"""The emulator against the real vLLM CPU build (tiny model): response shapes and timing.

Slow (one real server per session; the first run installs it). The fidelity check replays one
seeded window through vLLM three times (fresh prompts each time: vLLM caches prefixes) and
through the emulator with the committed `cpu-tiny-vllm` profile, and asserts that median TTFT
and median TTLT agree within 30%. The profile's coefficients are its shape; the machine's
speed is measured beside the replays (`loadgen.engine.fit_cpu.speed_factor`, before and after
each one) and given to the emulator as its time scale: a shared CPU's speed drifts by tens of
percent within minutes and differs between machines, so a profile in absolute milliseconds
holds only where and when it was fitted (the unscaled ratios are reported). Everything goes
to `.cache/emulator-fidelity.json`; docs/benchmarks.md records it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from fixtures.emulator_fixtures import VLLM_SERIES

from loadgen.engine.fit_cpu import profile_probe, speed_factor
from loadgen.replay import medians, synthetic_window
from loadgen.replay import replay_window as replay
from loadgen.vllm_real import CACHE, RealVllm

pytestmark = pytest.mark.slow
StartEmulator = Callable[..., Awaitable[str]]

REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"messages": [{"role": "user", "content": "Hello, how are you?"}]}),
    ("completions", {"prompt": "Once upon a time"}),
    ("completions", {"prompt": [2023, 2003, 1037, 3231]}),
]
TOLERANCE = 0.30
WINDOW: dict[str, Any] = {"n": 30, "rate_per_s": 2.0, "seed": 4}
"""The compared window: 30 ShareGPT-like requests at 2 per second, a few streams at a time
(median TTLT about 0.6 s on this machine)."""


def shape(obj: Any) -> Any:
    """Keys and value types, recursively (lists by their first element)."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [shape(obj[0])] if obj else []
    return type(obj).__name__


async def _call(s: aiohttp.ClientSession, url: str, route: str, body: dict[str, Any]) -> Any:
    """A non-streaming response, or the list of streamed chunks."""
    async with s.post(f"{url}/v1/{route}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not body.get("stream"):
            return await resp.json()
        chunks = []
        async for line in resp.content:
            text = line.decode().strip()
            if text.startswith("data: ") and text != "data: [DONE]":
                chunks.append(json.loads(text[6:]))
            elif text == "data: [DONE]":
                chunks.append("[DONE]")
        return chunks


async def _shapes(url: str) -> list[Any]:
    out = []
    async with aiohttp.ClientSession() as s:
        for route, extra in REQUESTS:
            for stream in (False, True):
                body = {"model": "tiny-llama", "max_tokens": 3, "ignore_eos": True, **extra}
                if stream:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                got = await _call(s, url, route.replace("chat", "chat/completions"), body)
                out.append(shape(got))
    return out


async def _series(url: str) -> set[str]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        text = await resp.text()
    return {line.split("{", 1)[0] for line in text.splitlines() if line.startswith("vllm:")}


async def test_same_response_shapes_and_metric_names(
    real_vllm: RealVllm, start_emulator: StartEmulator
) -> None:
    emu = await start_emulator()
    real_shapes, emu_shapes = await _shapes(real_vllm.url), await _shapes(emu)
    for i, (r, e) in enumerate(zip(real_shapes, emu_shapes, strict=True)):
        assert e == r, f"request {i}: emulator {e} != vLLM {r}"
    real_names, emu_names = await _series(real_vllm.url), await _series(emu)
    for name in VLLM_SERIES:
        assert name in real_names, f"vLLM lacks {name}"
        assert name in emu_names, f"emulator lacks {name}"


async def test_priority_without_priority_scheduling(real_vllm: RealVllm) -> None:
    """vLLM 0.32.0 accepts and ignores a non-zero priority under FCFS (the emulator's default
    follows it); should a release reject it again, this test says so."""
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "priority": 5}
    async with aiohttp.ClientSession() as s:
        got = await _call(s, real_vllm.url, "completions", body)
    assert got["usage"]["completion_tokens"] == 2


async def test_fidelity_median_ttft_and_ttlt(
    real_vllm: RealVllm, start_emulator: StartEmulator
) -> None:
    """Replay the window (seed 4) through vLLM three times, each between two speed probes, and
    through the emulator running the committed `cpu-tiny-vllm` profile once per vLLM replay,
    at the speed probed around it; compare the medians of the three emulated and the three
    vLLM replays' median TTFT and TTLT. The profile at time scale 1 is reported beside it."""
    t0 = time.perf_counter()
    # a fresh vLLM CPU server is slow the first time it meets a batch shape (a first replay's
    # median TTFT is 3-4x the next one's): warm it up on another window first
    warm_up = synthetic_window(n=24, rate_per_s=4.0, seed=98)
    await replay(real_vllm.url, "tiny-llama", warm_up, seed=98)
    reference = await profile_probe()
    window = synthetic_window(**WINDOW)
    load = [os.getloadavg()[0]]
    # each vLLM replay sends fresh prompts (prompt seed): vLLM caches prefixes and a repeated
    # prompt skips its prefill (a repeat's median TTFT was 4x lower), the emulator does not
    speeds = [await speed_factor(real_vllm.url, "tiny-llama", reference, seed=40)]
    real_runs = []
    for seed in (41, 42, 43):
        real_runs.append(medians(await replay(real_vllm.url, "tiny-llama", window, seed=seed)))
        speeds.append(await speed_factor(real_vllm.url, "tiny-llama", reference, seed=seed))
    load.append(os.getloadavg()[0])
    # each replay's emulated twin runs at the mean speed of the probes around it, the
    # unscaled profile beside them (the emulators barely load the CPU)
    scales = [(before + after) / 2 for before, after in itertools.pairwise(speeds)]
    urls = [await start_emulator(time_scale=x) for x in [*scales, 1.0]]
    *emu_runs, unscaled = [
        medians(r) for r in await asyncio.gather(*(replay(u, "tiny-llama", window) for u in urls))
    ]
    # median of three replays against one-off stalls of a shared machine
    real = {n: statistics.median(r[n] for r in real_runs) for n in real_runs[0]}
    emu = {n: statistics.median(r[n] for r in emu_runs) for n in emu_runs[0]}
    ratios = {n: emu[n] / real[n] for n in real}
    result = {
        "window": f"synthetic_window(**{WINDOW})",
        "load_average_1m": load,
        "speeds": speeds,
        "time_scales": scales,
        "real_runs": real_runs,
        "real": real,
        "emulator_runs": emu_runs,
        "emulator": emu,
        "ratio": ratios,
        "unscaled": {"emulator": unscaled, "ratio": {n: unscaled[n] / real[n] for n in real}},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (CACHE / "emulator-fidelity.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    for n, ratio in ratios.items():
        assert abs(ratio - 1) <= TOLERANCE, f"{n}: emulator/vLLM = {ratio:.2f} ({result})"


async def test_priority_scheduling_server(
    real_vllm_priority: RealVllm, start_emulator: StartEmulator
) -> None:
    """Both servers with priority scheduling take a `priority` and answer alike (last in this
    file: it starts a second vLLM server, after the fidelity replay)."""
    emu = await start_emulator(priority_scheduling=True)
    shapes = []
    async with aiohttp.ClientSession() as s:
        for url in (real_vllm_priority.url, emu):
            body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 3, "ignore_eos": True}
            got = await _call(s, url, "completions", body | {"priority": -3})
            assert got["usage"]["completion_tokens"] == 3
            shapes.append(shape(got))
    assert shapes[0] == shapes[1]
