"""The emulator against the real vLLM CPU build (tiny model): response shapes and timing.

Slow (one real server per session; the first run installs it). The fidelity check (marker
`timing`: `make test` runs it in its own pytest process, on a pinned server with nothing else
alive) asserts that the emulator's median TTFT and median TTLT are within 30% of vLLM's on a
window it was not fitted on. The committed `cpu-tiny-vllm` coefficients carry the engine's
shape; the two numbers that differ between machines of one kind, and on a shared CPU from
one minute to the next (the iteration speed and the API server's per-request overhead), are
fitted inside the test on a calibration window replayed against the same server just before
(`loadgen.engine.fit_cpu.fit_window`). Calibration and checked window alternate (C W C W C W,
fresh prompt ids each time: vLLM caches prefixes), the fit is made on the calibration
window's medians over the pairs, one emulated twin per pair replays the checked window with
it, and the assertion is on the median over the pairs of twin / vLLM. Everything goes to
`.cache/emulator-fidelity.json`; docs/benchmarks.md records the runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from fixtures.emulator_fixtures import VLLM_SERIES

from loadgen.engine.fit_cpu import (
    CAL_WINDOW,
    emulate_window,
    fit_window,
    machine_shape,
    window_stats,
)
from loadgen.engine.profiles import CpuTinyVllm
from loadgen.replay import replay_window as replay
from loadgen.replay import synthetic_window
from loadgen.vllm_real import CACHE, RealVllm

pytestmark = pytest.mark.slow
StartEmulator = Callable[..., Awaitable[str]]

REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("chat", {"messages": [{"role": "user", "content": "Hello, how are you?"}]}),
    ("completions", {"prompt": "Once upon a time"}),
    ("completions", {"prompt": [2023, 2003, 1037, 3231]}),
    ("completions", {"prompt": ["Hello there", "Bye now"], "n": 2}),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}], "n": 2}),
]
TOLERANCE = 0.30
WINDOW: dict[str, Any] = {"n": 30, "rate_per_s": 2.0, "seed": 4}
"""The checked window: 30 ShareGPT-like requests at 2 per second, a few streams at a time
(median TTLT 0.3-0.7 s depending on the machine). The calibration window is
`fit_cpu.CAL_WINDOW` (other requests, other rate)."""
PAIRS = 3


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


async def _vllm_rules(url: str) -> dict[str, Any]:
    """What the rules of one server give: `/tokenize` shapes and whether its counts are the
    usage's, the resumed chat's prompt growth, and the statuses of requests vLLM refuses."""
    user = [{"role": "user", "content": "Tell me about the sea."}]
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as s:

        async def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
            async with s.post(url + path, json={"model": "tiny-llama", **body}) as r:
                return r.status, await r.json()

        _, tok = await post("/tokenize", {"prompt": "Once upon a time"})
        _, done = await post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1})
        _, chat_tok = await post("/tokenize", {"messages": user})
        _, chat = await post("/v1/chat/completions", {"messages": user, "max_tokens": 4})
        out["tokenize"] = shape(tok)
        out["counts are usage"] = (
            tok["count"] == done["usage"]["prompt_tokens"]
            and chat_tok["count"] == chat["usage"]["prompt_tokens"]
        )
        head = chat["choices"][0]["message"]["content"]
        resumed = [*user, {"role": "assistant", "content": head}]
        flags = {"continue_final_message": True, "add_generation_prompt": False}
        status, more = await post(
            "/v1/chat/completions", {"messages": resumed, "max_tokens": 2, **flags}
        )
        out["resume"] = status, more["usage"]["prompt_tokens"] > chat["usage"]["prompt_tokens"]
        refused = [
            {"messages": resumed, "max_tokens": 2, "continue_final_message": True},
            {"messages": user, "max_tokens": 2, "min_tokens": 3},
            {"messages": user, "max_tokens": 2, "n": 0},
        ]
        out["refused"] = [(await post("/v1/chat/completions", b))[0] for b in refused]
        ask = {"instructions": "Be brief.", "input": "Hello there", "max_output_tokens": 3}
        _, whole = await post("/v1/responses", ask)
        out["responses"] = shape(whole)
        async with s.post(
            url + "/v1/responses", json={"model": "tiny-llama", "stream": True, **ask}
        ) as r:
            lines = (await r.read()).decode().splitlines()
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        # how many text deltas a few tokens make depends on detokenising the model's output
        # (real vLLM merges some of the tiny model's tokens): consecutive deltas count once
        out["responses events"] = _runs([(e["type"], shape(e)) for e in events])
        out["event names"] = _runs([line[7:] for line in lines if line.startswith("event: ")])
    return out


def _runs(items: list[Any]) -> list[Any]:
    """`items` with each run of equal consecutive entries kept once."""
    return [x for i, x in enumerate(items) if i == 0 or x != items[i - 1]]


async def test_tokenize_resume_and_refusals_like_vllm(
    real_vllm: RealVllm, start_emulator: StartEmulator
) -> None:
    emu = await start_emulator()
    real, emulated = await _vllm_rules(real_vllm.url), await _vllm_rules(emu)
    assert real["counts are usage"] and real["resume"] == (200, True)
    assert real["refused"] == [400, 400, 400]
    assert emulated == real


async def test_priority_without_priority_scheduling(real_vllm: RealVllm) -> None:
    """vLLM 0.32.0 accepts and ignores a non-zero priority under FCFS (the emulator's default
    follows it); should a release reject it again, this test says so."""
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "priority": 5}
    async with aiohttp.ClientSession() as s:
        got = await _call(s, real_vllm.url, "completions", body)
    assert got["usage"]["completion_tokens"] == 2


@pytest.mark.timing
async def test_fidelity_median_ttft_and_ttlt(quiet_vllm: RealVllm) -> None:
    """Fit on the calibration window, check on the other one, in `PAIRS` interleaved pairs
    against the same pinned server; medians over the pairs within 30%. On a machine of
    another kind than the reference (prefill far slower against its fixed work,
    `fit_cpu.machine_shape`), the profile's coefficients are fitted on it first and both
    windows are replayed as the same workload at its speed (arrivals further apart, shorter
    prompts)."""
    t0 = time.perf_counter()
    url, model = quiet_vllm.url, quiet_vllm.name
    # a fresh vLLM CPU server is slow the first time it meets a batch shape (a first replay's
    # median TTLT was 5x the next one's): warm it up on another window and on the
    # calibration window's shapes
    await replay(url, model, synthetic_window(n=40, rate_per_s=4.0, seed=98), seed=98)
    balance, shape = await machine_shape(url, model)
    k = shape.k
    cal, checked = (shape.window(synthetic_window(**w)) for w in (CAL_WINDOW, WINDOW))
    await replay(url, model, cal, seed=99)
    profile = CpuTinyVllm(k)
    emulated_cal = await emulate_window(profile, cal)  # the profile at time scale 1
    pairs = []
    for i in range(PAIRS):
        real_cal = window_stats(await replay(url, model, cal, seed=10 + i))
        real = window_stats(await replay(url, model, checked, seed=20 + i))
        pairs.append({"cal": real_cal, "real": real})
    # one fit on the calibration window's medians over the pairs (a single replay's speed
    # moved 25% between identical replays on a machine of the other kind)
    cal_median = {n: statistics.median(p["cal"][n] for p in pairs) for n in pairs[0]["cal"]}
    fit = fit_window(cal_median, emulated_cal, k)
    # the emulated twins (and the unfitted profile, reported) after vLLM's runs, side by
    # side: each emulator sleeps most of the time and barely loads the CPU
    *twins, unfitted = await asyncio.gather(
        *(emulate_window(fit.profile(k), checked) for _ in pairs),
        emulate_window(profile, checked),
    )
    names = ("ttft_ms", "ttlt_ms")
    for p, twin in zip(pairs, twins, strict=True):
        p["emulator"] = twin
        p["ratio"] = {n: twin[n] / p["real"][n] for n in names}
    ratios = {n: statistics.median(p["ratio"][n] for p in pairs) for n in names}
    real_median = {n: statistics.median(p["real"][n] for p in pairs) for n in names}
    result = {
        "window": f"synthetic_window(**{WINDOW})",
        "calibration": f"synthetic_window(**{CAL_WINDOW})",
        "fit": dataclasses.asdict(fit),
        "balance": dataclasses.asdict(balance) | {"prefill_ratio": balance.prefill_ratio},
        "shape": dataclasses.asdict(shape),
        "emulated_calibration_at_scale_1": emulated_cal,
        "pairs": pairs,
        "ratio": ratios,
        "unfitted": {
            "emulator": unfitted,
            "ratio": {n: unfitted[n] / real_median[n] for n in names},
        },
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
