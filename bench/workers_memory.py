"""Memory of `sagesched serve --workers N` with a full predictor history: the RSS of each
process (the parent, which is the scheduling authority when N > 1, and every worker).

The predictor snapshot is built first: `--items` completions of the served model (random unit
vectors, random lengths: a history's memory does not depend on the text), saved as a
gateway would. Each arm then starts `sagesched serve --policy sagesched` on that snapshot in
front of `sagesched emulate`, sends `--requests` distinct prompts (so every process has
embedded and predicted), and reads each process's RSS from /proc. With one predictor per
host the history is held once, by the authority, however many workers there are.

Run: `python bench/workers_memory.py [--workers 1,2] [--items 50000]` (about 2 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.procs import Children, free_port, sagesched
from loadgen.procstat import rss_kb

MODEL = "tiny-llama"
ADMIN = {"Authorization": "Bearer adm"}


def build_snapshot(path: Path, items: int) -> None:
    from predictor import LengthPredictor

    predictor = LengthPredictor()
    rng = np.random.default_rng(0)
    for start in range(0, items, 10_000):
        n = min(10_000, items - start)
        vectors = rng.standard_normal((n, predictor.embedder.dim)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        lengths = rng.integers(1, 2_000, n).astype(float)
        prompts = rng.integers(10, 4_000, n).astype(float)
        predictor.learn_vectors(vectors, lengths, prompts, MODEL)
    predictor.save(path)


async def traffic(url: str, requests: int) -> list[int]:
    """Send distinct prompts one connection each; the worker pids from the admin view."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        for i in range(requests):
            text = f"Question {i}: why is {i} odd?"
            body = {"model": MODEL, "max_tokens": 4, "stream": False,
                    "messages": [{"role": "user", "content": text}]}  # fmt: skip
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
        async with s.get(url + "/admin/queue", headers=ADMIN) as r:
            data = await r.json()
    return [int(w["pid"]) for w in data.get("workers", [])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--items", type=int, default=50_000)
    ap.add_argument("--requests", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        snapshot = tmp / "predictor.snapshot"
        build_snapshot(snapshot, args.items)
        print(f"snapshot: {args.items} items of {MODEL}, {snapshot.stat().st_size / 2**20:.0f} MiB")
        print("| workers | process | RSS MiB |")
        print("|---|---|---:|")
        with Children(tmp) as children:
            emu_port = free_port()
            emu = f"http://127.0.0.1:{emu_port}"
            children.start("emulator", sagesched("emulate", "--port", str(emu_port),
                                                 "--served-model-name", MODEL),
                           emu + "/health", 120)  # fmt: skip
            for n in (int(w) for w in args.workers.split(",")):
                port = free_port()
                config, copy = tmp / f"gw-{n}.yaml", tmp / f"copy-{n}"
                copy.write_bytes(snapshot.read_bytes())  # the gateway saves over its own
                config.write_text(f"policy: sagesched\nadmin_key: adm\n"
                                  f"backends: [{{url: '{emu}'}}]\n"
                                  f"predictor: {{snapshot_path: '{copy}'}}\n")  # fmt: skip
                url = f"http://127.0.0.1:{port}"
                proc = children.start(f"gateway-{n}", sagesched("serve", "--config", str(config),
                                      "--port", str(port), "--workers", str(n)),
                                      url + "/ready", 300)  # fmt: skip
                workers = asyncio.run(traffic(url, args.requests))
                parent = "authority" if n > 1 else "the one process"
                rows = [(parent, rss_kb(proc.pid))]
                rows += [(f"worker {i}", rss_kb(pid)) for i, pid in enumerate(workers)]
                for name, kb in rows:
                    print(f"| {n} | {name} | {kb / 1024:.0f} |")
                print(f"| {n} | **all** | **{sum(kb for _, kb in rows) / 1024:.0f}** |")
                children.stop(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
