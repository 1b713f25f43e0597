"""Where the gateway's CPU goes per request: a py-spy profile at an open-loop rate.

    python bench/gateway_profile.py [--policy sagesched] [--rate 40] [--seconds 20]
    python bench/gateway_profile.py --streams 64     # closed loop: saturated, as gateway_overhead

The setup of `gateway_cpu.py` (a zero-compute backend answering 16 streamed tokens, distinct
short prompts, the gateway pinned to core 0, the backend and this client to core 1): after a
warm-up, py-spy (`pip install py-spy`; it samples the process from outside) records the
gateway's stacks while `--rate` requests per second arrive for `--seconds`, and the gateway's
CPU time over those requests is read from the scheduler, in all and for the event-loop
thread alone (exact). Each sample is put in the first matching part below (by the frames it
holds, innermost first), and a part's share of the samples is charged that share of the CPU
per request: an estimate, since py-spy also samples a thread that waits for the core (the
loop and the embedder's thread share core 0), which inflates the loop's parts. `--raw FILE`
keeps py-spy's stacks. `--streams N` replaces the open loop by N closed-loop streams of
distinct prompts (`gateway_overhead.py --distinct-prompts`, 16-token answers): the gateway's
core saturated.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gateway_overhead
from gateway_cpu import BACKEND, PY, gateway, open_loop, thread_cpu_s, tree_cpu_s
from gateway_overhead import process

from loadgen.procs import free_port

PARTS = (
    ("embedding: tokenizer", ("OnnxEncoder.tokenize",)),
    ("embedding: MiniLM forward pass", ("OnnxEncoder", "TorchEncoder", "Embedder.encode")),
    ("predictor: learning", ("learn_vectors", "ModelState.learn", "_learn_gathered")),
    ("predictor: neighbour query, distribution, rank score", ("predict_vector", "rank_score",
                                                               "global_dist", "_global")),
    ("predictor: worker threads (hand-over, waiting)", ("concurrent/futures", "threading.py")),
    ("queue policy (SageSched key, reviews)", ("policies/",)),
    ("dispatcher, prediction glue", ("gateway/scheduling", "gateway/prediction")),
    ("relay and HTTP (aiohttp)", ("gateway/serving", "aiohttp", "yarl", "multidict")),
    ("metrics, tracing, capture", ("gateway/observability", "prometheus_client")),
    ("event loop (asyncio)", ("asyncio",)),
)  # fmt: skip
"""(part, substrings of a frame): a sample is charged to the first part one of its frames
matches, the innermost frames tried first."""


def part_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, keys in PARTS:
            if any(k in frame for k in keys):
                return name
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="sagesched")
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--raw", default=None, help="keep py-spy's raw stacks here")
    ap.add_argument("--native", action="store_true", help="py-spy --native (C frames too)")
    ap.add_argument("--gil", action="store_true", help="py-spy --gil: only the thread holding "
                    "the GIL (no samples of a thread waiting for the core or the GIL)")  # fmt: skip
    ap.add_argument("--streams", type=int, default=0, help="closed loop of N streams instead")
    args = ap.parse_args()
    gateway_overhead.DISTINCT = True

    def traffic(seconds: float) -> int:
        if args.streams:
            return asyncio.run(gateway_overhead.load(url, args.streams, 16, seconds))[1]
        return asyncio.run(open_loop(url, args.rate, seconds))

    spy = shutil.which("py-spy") or str(Path(PY).with_name("py-spy"))
    if not Path(spy).exists():
        ap.error("needs py-spy (pip install py-spy)")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {1})
    port = free_port()
    with (
        tempfile.TemporaryDirectory() as tmp,
        process([PY, "-c", BACKEND, str(port)], 1, f"http://127.0.0.1:{port}/health"),
    ):
        gw_port, proxy = gateway(port, args.policy)()
        with proxy as pid:
            url = f"http://127.0.0.1:{gw_port}"
            traffic(3.0)  # warm-up
            time.sleep(2.0)
            raw = args.raw or str(Path(tmp) / "stacks.txt")
            recorder = subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
                 "--output", raw, "--duration", str(int(args.seconds) + 3), "--nonblocking",
                 *(["--native"] if args.native else []), *(["--gil"] if args.gil else [])],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            before, threads = tree_cpu_s(pid), thread_cpu_s(pid)
            n = traffic(args.seconds)
            time.sleep(2.0)  # learning after the last responses
            cpu_ms = (tree_cpu_s(pid) - before) * 1000 / n
            after = thread_cpu_s(pid)
            loop_ms = (after.get(pid, 0.0) - threads.get(pid, 0.0)) * 1000 / n
            _, spy_err = recorder.communicate()
        if recorder.returncode or not Path(raw).exists():
            sys.exit(f"py-spy failed (exit {recorder.returncode}): {spy_err.strip()}")
        samples: Counter[str] = Counter()
        for line in Path(raw).read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack:
                samples[part_of(stack.split(";"))] += int(count)
    total = sum(samples.values())
    load = f"{args.streams} streams" if args.streams else f"{args.rate:g} req/s"
    print(f"{args.policy}, {load}, {n} requests in {args.seconds:g} s: {cpu_ms:.2f} CPU "
          f"ms/request (with py-spy sampling), {total} samples")  # fmt: skip
    print(f"exact split: event-loop thread {loop_ms:.2f} ms/request, other threads (embedder, "
          f"worker pool) {cpu_ms - loop_ms:.2f} ms/request")  # fmt: skip
    print("| part | share of samples | ms/request |\n|---|---:|---:|")
    for name, k in samples.most_common():
        print(f"| {name} | {k / total:.1%} | {cpu_ms * k / total:.2f} |")


if __name__ == "__main__":
    main()
