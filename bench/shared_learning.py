"""Shared learning through Redis: how fast a completion reaches another replica, and what it
costs the replica that publishes it.

Two replicas in two processes share one local `redis-server` (started here, no persistence):
replica A learns `--items` ShareGPT completions with `observe_async` (the gateway's call, the
prompts embedded beforehand so the embedder does not set the pace) at `--rate` per second;
replica B follows the stream. Reported:

- propagation delay: A's `offer` (right after A learned it) → B has learned it (after
  `learn_vectors` returned), median / p99 / max, on one host clock;
- the request path's cost: one `SharedLearning.offer` call (the listener `observe_async`
  runs), median and p99 over 20,000 calls;
- background CPU per record: A encoding and publishing a burst of `--burst` records
  (pipelined XADD), B decoding and learning them (hnswlib add + online models), as process
  CPU time divided by the records;
- Redis memory per record for the int8 and float32 encodings (`MEMORY USAGE` / `XLEN`).

Run: `python bench/shared_learning.py [--items 200] [--rate 20] [--burst 5000]` (about a
minute; needs `redis-server` and the shared ShareGPT file, $SAGESCHED_SHARED_DATA).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# bench/predictor.py is named like the package: drop bench/ from the path (sys.path[0] when
# run as a script) so `import predictor` finds the package
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from predictor import Embedder, LengthPredictor  # noqa: E402
from predictor.datasets import build_records  # noqa: E402
from predictor.shared import SharedLearning  # noqa: E402

MODEL = "bench-model"
OFFERS = 20_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(folder: str) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is missing (make system-deps)"
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", folder, "--save", "",
            "--appendonly", "no"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def follower(url: str, total: int, extra: int, ready: Any, out: Any) -> None:
    """Replica B (its own process): learn everything A publishes; report the delays of the
    first `total` records and the CPU the `extra` ones after them cost."""

    async def main() -> None:
        predictor = LengthPredictor(embedder=Embedder())
        shared = SharedLearning(predictor, url, replica_id="b", warm_items=0)
        await shared.start()
        assert await shared.wait_connected(10)
        ready.set()
        while shared.received < total:
            await asyncio.sleep(0.01)
        delays = list(shared.delays_s)
        cpu0 = time.process_time()
        ready.set()
        while shared.received < total + extra:
            await asyncio.sleep(0.01)
        out.put((delays, time.process_time() - cpu0, shared.received - total))
        await shared.stop()

    asyncio.run(main())


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


async def publisher(args: argparse.Namespace, url: str, ready: Any) -> dict[str, Any]:
    embedder = Embedder()
    predictor = LengthPredictor(embedder=embedder)
    records = build_records("sharegpt", args.items, seed=1, tokenizer=embedder.tokenizer)
    vectors = embedder.encode([predictor.text(r["prompt"]) for r in records])
    shared = SharedLearning(predictor, url, replica_id="a", warm_items=0, buffer_items=65_536)
    await shared.start()
    assert await shared.wait_connected(10)
    await asyncio.to_thread(ready.wait, 60)
    ready.clear()
    gap = 1.0 / args.rate
    start = time.monotonic()
    for i, (rec, vec) in enumerate(zip(records, vectors, strict=True)):
        await asyncio.sleep(max(start + i * gap - time.monotonic(), 0.0))
        await predictor.observe_async(
            rec["prompt"], rec["output_tokens"], rec["prompt_tokens"], vector=vec, model=MODEL
        )
    await asyncio.to_thread(ready.wait, 60)  # B has learned every record

    # the request path's cost: one offer (the buffer drained by the publisher meanwhile)
    timings = []
    vec = vectors[0]
    for _ in range(OFFERS):
        t0 = time.perf_counter_ns()
        shared.offer(MODEL, vec, 100, 200)
        timings.append((time.perf_counter_ns() - t0) / 1000.0)
        if shared._buffer.qsize() > 60_000:
            await asyncio.sleep(0.01)
    while not shared._buffer.empty():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.6)

    # background CPU of publishing a burst
    published0 = shared.published
    cpu0 = time.process_time()
    for i in range(args.burst):
        shared.offer(MODEL, vectors[i % len(vectors)], 100, 200)
    while shared.published < published0 + args.burst:
        await asyncio.sleep(0.005)
    publish_cpu = time.process_time() - cpu0
    await shared.stop()
    await predictor.aclose()
    return {"offer_us": timings, "publish_cpu_s": publish_cpu, "burst": args.burst,
            "vectors": vectors, "dropped": shared.dropped}  # fmt: skip


async def memory_per_record(url: str, vectors: np.ndarray) -> dict[str, float]:
    import redis.asyncio as aioredis

    from predictor.shared import SharedRecord, encode

    client = aioredis.Redis.from_url(url)
    out = {}
    for encoding in ("int8", "float32"):
        key = f"bench:{encoding}"
        pipe = client.pipeline(transaction=False)
        for i in range(1000):
            rec = SharedRecord(MODEL, vectors[i % len(vectors)], 120.0, 250.0, "a", 1.7e12)
            pipe.xadd(key, encode(rec, encoding))  # type: ignore[arg-type]
        await pipe.execute()
        used = await client.memory_usage(key, samples=0)
        out[encoding] = float(used or 0) / 1000.0
    await client.aclose()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--rate", type=float, default=20.0, help="completions per second on A")
    p.add_argument("--burst", type=int, default=5000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as folder:
        redis_proc, url = start_redis(folder)
        try:
            ctx = mp.get_context("spawn")
            ready, out = ctx.Event(), ctx.Queue()
            total = args.items
            extra = OFFERS + args.burst
            child = ctx.Process(target=follower, args=(url, total, extra, ready, out))
            child.start()
            result = asyncio.run(publisher(args, url, ready))
            delays, follow_cpu, followed = out.get(timeout=120)
            child.join(30)
            memory = asyncio.run(memory_per_record(url, result["vectors"]))
        finally:
            redis_proc.kill()
            redis_proc.wait()
    ms = [d * 1000 for d in delays]
    worst = sorted(range(len(ms)), key=ms.__getitem__)[-3:]
    print("slowest (index: ms):", ", ".join(f"{i}: {ms[i]:.1f}" for i in worst))
    offer = result["offer_us"]
    print(
        f"propagation A→B over {len(ms)} completions at {args.rate:g}/s: median "
        f"{statistics.median(ms):.1f} ms, p99 {pct(ms, 99):.1f} ms, max {max(ms):.1f} ms"
    )
    print(
        f"offer (request path): median {statistics.median(offer):.1f} µs, "
        f"p99 {pct(offer, 99):.1f} µs over {len(offer)} calls"
    )
    print(
        f"publish CPU (A, background): {result['publish_cpu_s'] / result['burst'] * 1e6:.0f} "
        f"µs/record over {result['burst']}"
    )
    print(
        f"follow CPU (B: decode + learn): {follow_cpu / max(followed, 1) * 1e6:.0f} µs/record "
        f"over {followed}"
    )
    print(
        f"Redis memory per record: int8 {memory['int8']:.0f} B, float32 "
        f"{memory['float32']:.0f} B; dropped {result['dropped']}"
    )


if __name__ == "__main__":
    main()
