"""Who goes where a slot frees, measured on a simulated fleet with prefix
caching: "best job first, then best backend" against `Scheduler.dispatch_for`.

Needs the engine model's prefix cache (`Seq.hashes`). Run:
`python bench/slot_choice.py` (defaults: 4 `h200-llama3-8b` backends with 870,000 KV tokens,
chunked prefill, cap 32 per backend, a synthetic multi-turn workload). Both arms keep the same
SageSched queue (`cost=time`) and the same router; they differ only in who takes a free slot:

- `job-first`: `Scheduler.dispatch` hands out the best waiting job, the router places it;
- `slot-first`: when one backend has room (a slot freed, the usual case under load)
  `dispatch_for` hands out the waiting job best *there*, its prefix read from the router's
  index; when several have room the router places the best job, as in `job-first`.

Workload: sessions of 2-8 turns sharing one of 20 system prompts (1,000-3,000 tokens); a turn
re-sends the conversation so far plus 50-400 new tokens; turns arrive in order, a session's
next turn 1-20 s after its previous one arrives (open loop); outputs log-normal, predicted by a
noisy oracle. Reports mean TTFT and TTLT, the fleet's prefix hit ratio and throughput.

The loop is `loadgen.sim.fleet.simulate_fleet` (moved there for the routing study). It settles
each engine's step when the global clock reaches its end; the first version here settled a
step as soon as it was taken, a little ahead of the other engines' clocks, so its figures in
docs/policies.md may differ from a rerun in the last digit or two.
"""

from __future__ import annotations

import argparse
import random
import statistics

import numpy as np

from loadgen.engine.configs import engine_config
from loadgen.schema import TraceRequest
from loadgen.sim.fleet import Fleet, simulate_fleet
from policies import LengthDist

BLOCK = 16


def workload(
    n_sessions: int, rate: float, seed: int
) -> tuple[list[TraceRequest], list[LengthDist]]:
    """Multi-turn sessions; block hashes of 16-token blocks; open-loop arrivals; beliefs."""
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    systems = [tuple(rng.getrandbits(62) for _ in range(rng.randint(60, 190))) for _ in range(20)]
    rows: list[tuple[TraceRequest, LengthDist]] = []
    t = 0.0
    for s in range(n_sessions):
        t += rng.expovariate(rate)
        chain = systems[rng.randrange(len(systems))]
        at = t
        for _ in range(rng.randint(2, 8)):
            chain = chain + tuple(rng.getrandbits(62) for _ in range(rng.randint(3, 25)))
            true = max(1, int(nprng.lognormal(5.0, 0.9)))
            req = TraceRequest(at, len(chain) * BLOCK, true, "slot-choice", session=f"s{s}",
                               block_hashes=chain, block_tokens=BLOCK)  # fmt: skip
            rows.append((req, LengthDist.noisy_oracle(true, 0.5, nprng).truncate(4096)))
            chain = chain + tuple(rng.getrandbits(62) for _ in range(true // BLOCK))
            at += rng.uniform(1.0, 20.0)
    rows.sort(key=lambda row: row[0].arrival_s)
    return [r for r, _ in rows], [d for _, d in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", type=int, default=4)
    parser.add_argument("--cap", type=int, default=32)
    parser.add_argument("--kv-tokens", type=int, default=870_000)
    parser.add_argument("--profile", default="h200-llama3-8b")
    parser.add_argument("--policy", default="sagesched:cost=time")
    parser.add_argument("--routers", nargs="*", default=["sagesched", "prefix", "least-loaded"])
    parser.add_argument("--sessions", type=int, default=1500)
    parser.add_argument("--rates", type=float, nargs="*", default=[6.0, 9.0, 12.0])
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.backends} x {args.profile}, cap {args.cap}, KV {args.kv_tokens:,} tokens, "
          f"{args.policy} in the queue; means over {args.seeds} seeds")  # fmt: skip
    print(f"{'sessions/s':>10} {'router':>13} {'arm':>10} {'TTFT s':>8} {'TTLT s':>8} "
          f"{'hit':>6} {'req/s':>7}")  # fmt: skip
    engine = engine_config("vllm-chunked-prefill").with_(
        kv_tokens=args.kv_tokens, max_seqs=max(args.cap, 64)
    )
    for rate in args.rates:
        for spec in args.routers:
            for slot_first in (False, True):
                fleet = Fleet(args.backends, engine, args.profile, args.cap, slot_first)
                rows = []
                for seed in range(args.seeds):
                    requests, beliefs = workload(args.sessions, rate, seed)
                    res = simulate_fleet(requests, args.policy, spec, fleet, beliefs=beliefs)
                    rows.append(res.summary())
                arm = "slot-first" if slot_first else "job-first"
                print(
                    f"{rate:>10.1f} {spec:>13} {arm:>10} "
                    f"{statistics.fmean(r['ttft_mean'] for r in rows):>8.3f} "
                    f"{statistics.fmean(r['ttlt_mean'] for r in rows):>8.3f} "
                    f"{statistics.fmean(r['hit'] for r in rows):>6.3f} "
                    f"{statistics.fmean(r['throughput'] for r in rows):>7.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
