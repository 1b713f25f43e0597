"""Short bursts and the self-tuning cap, in simulation: cold against a remembered curve.

    python bench/cap_bursts.py [--seeds 3]

Workload: the demo's traffic (`loadgen.demo.run.workload`: the frozen LSSP Azure-2024 window
0, 200 requests, outputs capped at 256, at 1.6x the `cpu-tiny-vllm` engine's peak token rate),
one 8-second burst, on the `cpu-tiny-vllm` profile with the `vllm-chunked-prefill` engine;
beliefs log-normal around the true length (sigma 0.5). Arms: vLLM alone (no gateway cap), the
gateway with FCFS and with SageSched behind fixed caps, behind the self-tuning cap from a cold
start at 8, and behind the self-tuning cap started from the curve a previous run of the same
traffic left (a restarted gateway). Each seed shuffles the arrival gaps.

Prints one table: mean TTLT, its ratio to vLLM alone, the mean cap, and for SageSched the
ordering gain kept = (gateway FCFS at the same cap law - row) / (gateway FCFS - best fixed
cap's SageSched), plus throughput against vLLM alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.engine.configs import engine_config  # noqa: E402
from loadgen.schema import TraceRequest  # noqa: E402
from loadgen.sim.simulator import Contender, SimResult, simulate  # noqa: E402
from policies.capacity import CapLaw  # noqa: E402
from policies.registry import parse_policy  # noqa: E402

PROFILE = "cpu-tiny-vllm"
FIXED = (4, 8, 16, 32, 64)
START_CAP = 8


def burst(seed: int) -> list[TraceRequest]:
    """The demo's 200 requests at the demo's load, arrival gaps shuffled by `seed`."""
    from loadgen.demo.run import SOURCE
    from loadgen.engine.configs import engine_config as cfg
    from loadgen.regions import compress, factor_for_utilisation
    from loadgen.traces import shipped_windows

    window = shipped_windows(SOURCE)[0]
    trace = [dataclasses.replace(r, output_tokens=min(r.output_tokens, 256))
             for r in window.requests[:200]]  # fmt: skip
    factor = factor_for_utilisation(trace, 1.6, engine=cfg("vllm-chunked-prefill"),
                                    profile=PROFILE)  # fmt: skip
    trace = compress(trace, factor)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(trace)]
    random.Random(seed).shuffle(gaps)
    t, out = 0.0, [dataclasses.replace(trace[0], arrival_s=0.0)]
    for r, g in zip(trace[1:], gaps, strict=True):
        t += g
        out.append(dataclasses.replace(r, arrival_s=t))
    return out


def run(reqs: list[TraceRequest], policy: str, cap: int | None, *, tuned: bool = False,
        memory: dict | None = None) -> SimResult:  # type: ignore[type-arg]  # fmt: skip
    engine = engine_config("vllm-chunked-prefill")
    c = Contender(policy, parse_policy(policy), engine, cap,
                  cap_law=CapLaw() if tuned else None, cap_memory=memory)  # fmt: skip
    return simulate(reqs, c, PROFILE, belief_sigma=0.5)


def ttlt(res: SimResult) -> float:
    return statistics.fmean(r.finish_s - r.arrival_s for r in res.records if r.finish_s is not None)


def tput(res: SimResult) -> float:
    done = [r for r in res.records if r.finish_s is not None]
    return sum(r.output_tokens for r in done) / max(r.finish_s for r in done)  # type: ignore[type-var]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    rows: dict[str, list[tuple[float, float, float]]] = {}

    def add(name: str, res: SimResult, base: SimResult) -> None:
        rows.setdefault(name, []).append(
            (ttlt(res), tput(res) / tput(base), res.extra.get("cap_mean", float("nan")))
        )

    for seed in range(args.seeds):
        reqs = burst(seed)
        alone = run(reqs, "fcfs", None)
        add("vLLM alone (no cap)", alone, alone)
        for cap in FIXED:
            add(f"sagesched, cap {cap}", run(reqs, "sagesched", cap), alone)
        for policy in ("fcfs", "sagesched"):
            cold = run(reqs, policy, START_CAP, tuned=True)
            add(f"{policy}, self-tuning cap, cold", cold, alone)
            # the same traffic once more, the controller starting where the last run left it
            learnt = run(burst(seed + 1000), policy, START_CAP, tuned=True).cap_memory
            warm = run(reqs, policy, START_CAP, tuned=True, memory=learnt)
            add(f"{policy}, self-tuning cap, remembered", warm, alone)
    mean = {k: tuple(statistics.fmean(x[i] for x in v) for i in range(3)) for k, v in rows.items()}
    base = mean["vLLM alone (no cap)"][0]
    best = min(mean[f"sagesched, cap {c}"][0] for c in FIXED)
    print(f"{args.seeds} seeds, {PROFILE}, the demo's burst (200 requests)")
    print("| arm | TTLT mean s | / vLLM alone | gain kept | tokens/s vs vLLM | mean cap |")
    print("|---|---|---|---|---|---|")
    for name, (t, tp, cap) in mean.items():
        kept = ""
        if name.startswith("sagesched, self-tuning"):
            fcfs = mean[name.replace("sagesched", "fcfs")][0]
            kept = f"{(fcfs - t) / (fcfs - best):.2f}" if fcfs > best else "nan"
        print(f"| {name} | {t:.2f} | {t / base:.3f} | {kept} | {tp:.3f} | {cap:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
