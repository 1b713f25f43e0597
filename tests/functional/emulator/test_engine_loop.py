"""The real-time engine loop and the engine model's priority waiting order."""

from __future__ import annotations

import asyncio

from loadgen.emulator.engine_loop import EngineLoop
from loadgen.engine.configs import engine_config
from loadgen.engine.model import Engine, Seq
from loadgen.engine.profiles import make_profile
from policies.job import Job


def test_priority_waiting_order_in_the_engine_model() -> None:
    cfg = engine_config("vllm-chunked-prefill").with_(max_seqs=1, waiting_order="priority")
    eng = Engine(cfg, make_profile("lssp-constant"))
    seqs = [Seq(Job(i, float(i), 10, priority=p), 1, 1.0) for i, p in enumerate([5, 0, -1, 0])]
    for s in seqs:
        eng.add(s)
    order = []
    now = 0.0
    while len(eng):
        r = eng.step(now, 0.0)
        now += r.dt_s
        order += [s.job.id for s in r.finished]
    assert order == [2, 1, 3, 0]


async def test_loop_emits_every_token_and_aborts() -> None:
    cfg = engine_config("vllm-chunked-prefill")
    loop = EngineLoop(cfg, make_profile("cpu-tiny-vllm"), time_scale=0.05)
    await loop.start()
    try:
        a = loop.submit(10, 30)
        b = loop.submit(10, 10_000)
        seen = []
        while not a.done:
            await a.event.wait()
            a.event.clear()
            seen.append(a.emitted)
        assert seen[-1] == 30 and seen == sorted(seen)
        assert b.emitted > 0 and not b.done
        loop.abort(b)
        assert b.done and b.aborted and len(loop.engine) == 0
        await asyncio.sleep(0.01)
        assert loop.stats.running == 0
    finally:
        await loop.stop()
