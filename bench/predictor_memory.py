"""The predictor's memory per served model as its history fills: the RSS a `ModelState` (history
index, its lengths, the online learners' rings) adds at its configured bounds, item by item.

The rings are allocated at their full size up front but the system backs their pages only
when written, so a gateway's RSS grows with each completion learned until every ring is
full, then stays (docs/reliability.md, docs/operations.md "Sizing memory"). Items are random
unit vectors (the cost does not depend on the text) with random lengths.

Run: `python bench/predictor_memory.py [--items 100000] [--step 10000]`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.procstat import rss_kb
from predictor.config import PredictorConfig
from predictor.state import ModelState


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=100_000, help="completions to learn")
    ap.add_argument("--step", type=int, default=10_000, help="a table row every this many")
    ap.add_argument("--dim", type=int, default=384, help="embedding size (all-MiniLM-L6-v2)")
    args = ap.parse_args()
    config = PredictorConfig()
    me = os.getpid()
    before = rss_kb(me)
    state = ModelState.new(args.dim, config)
    empty = rss_kb(me) - before
    print(f"history bound {config.capacity_items:,} items; an empty state: {empty / 1024:.1f} MiB")
    print("| items learned | state RSS MiB | KB per item since the last row | learn s |")
    print("|---|---|---|---|")
    rng = np.random.default_rng(0)
    done, last = 0, rss_kb(me)
    while done < args.items:
        k = min(args.step, args.items - done)
        v = rng.normal(size=(k, args.dim)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        t0 = time.perf_counter()
        for i in range(0, k, 1000):  # in the gateway's batch sizes, not one call
            state.learn(v[i : i + 1000], rng.integers(1, 1000, len(v[i : i + 1000])),
                        rng.integers(5, 2000, len(v[i : i + 1000])))  # fmt: skip
        took = time.perf_counter() - t0
        done += k
        now = rss_kb(me)
        print(f"| {done:,} | {(now - before) / 1024:.1f} | {(now - last) / k:.2f} | {took:.1f} |")
        last = now
    return 0


if __name__ == "__main__":
    sys.exit(main())
