"""The emulator against the real vLLM CPU build (tiny model): response shapes and timing.

Slow (one real server per session; the first run installs it). The fidelity check replays
the same seeded window through both and compares median TTFT and TTLT; the measured ratios
are written to `.cache/emulator-fidelity.json` and recorded in docs/benchmarks.md.
vLLM's speed on a shared CPU drifts with the other load (the 1-minute load average is
recorded with the ratios); the emulator follows its committed profile.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from loadgen.replay import medians, synthetic_window
from loadgen.replay import replay_window as replay
from loadgen.vllm_real import CACHE, RealVllm

pytestmark = pytest.mark.slow
StartEmulator = Callable[..., Awaitable[str]]

# the /metrics series the gateway reads (REFERENCE.md §4)
GATEWAY_SERIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
)
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"messages": [{"role": "user", "content": "Hello, how are you?"}]}),
    ("completions", {"prompt": "Once upon a time"}),
    ("completions", {"prompt": [2023, 2003, 1037, 3231]}),
]
TOLERANCE = 0.30


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
    for name in GATEWAY_SERIES:
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
    window = synthetic_window(n=40, rate_per_s=3.0, seed=4)
    # a fresh vLLM CPU server is slow the first time it meets a batch shape (a first replay's
    # median TTFT is 3-4x the next one's): warm it up on two other windows first
    for seed in (98, 99):
        await replay(real_vllm.url, "tiny-llama", synthetic_window(n=40, rate_per_s=4.0, seed=seed))
    load = os.getloadavg()[0]
    real = medians(await replay(real_vllm.url, "tiny-llama", window))
    emu = medians(await replay(await start_emulator(), "tiny-llama", window))
    ratios = {k: emu[k] / real[k] for k in real}
    result = {
        "window": "synthetic_window(n=40, rate_per_s=3.0, seed=4)",
        "load_average_1m": load,
        "real": real,
        "emulator": emu,
        "ratio": ratios,
    }
    (CACHE / "emulator-fidelity.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    for k, ratio in ratios.items():
        assert abs(ratio - 1) <= TOLERANCE, f"{k}: emulator/vLLM = {ratio:.2f} ({result})"


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
