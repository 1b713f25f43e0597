"""What counting prompts with the backend's tokenizer adds to TTFT (gateway.scheduling.prompts).

An emulated backend (`cpu-tiny-vllm`) behind an in-process gateway with the tokenizer on and
off, in interleaved rounds. Two loads:

- idle: one request at a time (every job starts at once, so nothing is counted: the added
  TTFT should be nil);
- queued: bursts of `--burst` chat requests (distinct prompts, 16 output tokens) on an
  in-flight cap of 2, so most jobs wait and are counted (beside the embedding under sagesched;
  after submission, with a rekey, under fcfs).

Reports median TTFT per arm and the difference, and the `/tokenize` round trip itself (the
gateway's `PromptCounter.count`, timed). Run: `python -m bench.tokenize_overhead [--rounds 3]
[--policy sagesched]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import aiohttp
from aiohttp import web

from gateway.config import build
from gateway.scheduling.prompts import PromptCounter
from gateway.serving.app import create_app
from loadgen.emulator import EmulatorConfig, make_runner
from loadgen.emulator import create_app as emulator_app

COUNT_S: list[float] = []
_count = PromptCounter.count


async def _timed_count(self: PromptCounter, call: Any) -> tuple[int, str]:
    t0 = time.perf_counter()
    try:
        return await _count(self, call)
    finally:
        COUNT_S.append(time.perf_counter() - t0)


PromptCounter.count = _timed_count  # type: ignore[method-assign]


async def ttft(s: aiohttp.ClientSession, url: str, i: int, words: int) -> float:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": f"Question {i}: " + "why, " * words + "?"}],
        "max_tokens": 16,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {") and b'"content":""' not in line:
                first = time.perf_counter() - t0
                async for _ in r.content:
                    pass
                return first
    raise RuntimeError("no token")


async def arm(
    backend: str, policy: str, enabled: bool, load: str, burst: int, seed: int
) -> list[float]:
    cfg = build(
        {
            "backends": [{"url": backend, "max_inflight": 2}],
            "policy": policy,
            "tokenizer": {"enabled": enabled},
            "port": 1,
        }
    )
    runner = web.AppRunner(create_app(cfg), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as s:
            await ttft(s, url, -1, 4)  # warm
            base = seed * 10_000
            if load == "idle":
                return [await ttft(s, url, base + i, 20 + i) for i in range(burst)]
            return list(
                await asyncio.gather(*(ttft(s, url, base + i, 20 + 7 * i) for i in range(burst)))
            )
    finally:
        await runner.cleanup()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--policy", default="sagesched")
    args = ap.parse_args()
    runner, port = await make_runner(emulator_app(EmulatorConfig()), "127.0.0.1", 0)
    backend = f"http://127.0.0.1:{port}"
    try:
        for load in ("idle", "queued"):
            got: dict[bool, list[float]] = {True: [], False: []}
            COUNT_S.clear()
            for r in range(args.rounds):
                for enabled in (r % 2 == 0, r % 2 != 0):  # alternate which arm goes first
                    got[enabled] += await arm(
                        backend, args.policy, enabled, load, args.burst, r * 2 + enabled
                    )
            on, off = statistics.median(got[True]), statistics.median(got[False])
            counts = sorted(COUNT_S)
            count = (
                f"count p50 {statistics.median(counts) * 1e3:.2f} ms, "
                f"p90 {counts[int(0.9 * len(counts))] * 1e3:.2f} ms, n={len(counts)}"
                if counts
                else "no counts"
            )
            print(
                f"{args.policy:10s} {load:7s} median TTFT on {on * 1e3:7.1f} ms, "
                f"off {off * 1e3:7.1f} ms, added {(on - off) * 1e3:+6.1f} ms ({count})"
            )
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
