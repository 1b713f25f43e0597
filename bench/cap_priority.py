"""The self-tuning cap and vLLM priority mode in simulation (docs/benchmarks.md).

    python bench/cap_priority.py                 # both tables (a few minutes on 2 cores)
    python bench/cap_priority.py --table cap     # only the cap table

Workload: the shipped ShareGPT sample (`loadgen/data/prompts/sharegpt-400.jsonl.gz`), Poisson
arrivals in a random order per seed, compressed so offered decode work is `--util` × the
engine's token capacity at its full batch (`loadgen.regions.factor_for_utilisation`) on the
`h200-llama3-8b` profile; predictions are the true length × exp(N(0, 0.5²)) with a log-normal
belief of σ = 0.5 (the study's `oracle-50%` arm). The engine is vLLM with chunked prefill at its
GPU defaults (`max_num_seqs` 256, 8,192-token budget), drained until every request finishes.

Cap table: vLLM alone (no gateway cap, engine FCFS), then `sagesched:preemptive=false` behind
fixed caps and behind the self-tuning cap (`policies.capacity`, the gateway's default law).
"Gain kept" = (vLLM alone − row) / (vLLM alone − best fixed cap) on mean TTLT.

Priority table: vLLM alone; hold-only (self-tuning cap, FCFS engine); priority-only (no cap,
every request forwarded at once with its quantised Gittins index as vLLM `priority`, engine
with priority scheduling); hold + priority (both).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.engine.configs import EngineConfig, engine_config  # noqa: E402
from loadgen.metrics import summarize  # noqa: E402
from loadgen.regions import compress, factor_for_utilisation  # noqa: E402
from loadgen.schema import TraceRequest  # noqa: E402
from loadgen.sim.simulator import Contender, simulate  # noqa: E402
from policies.capacity import CapLaw  # noqa: E402
from policies.registry import parse_policy  # noqa: E402

PROFILE = "h200-llama3-8b"
POLICY = "sagesched:preemptive=false"
ERROR = 0.5
FIXED_CAPS = (32, 64, 128, 192, 256)
START_CAP = 8
"""The gateway's default starting cap (`BackendConfig.max_inflight`)."""
ENGINE: EngineConfig = engine_config("vllm-chunked-prefill").with_(
    name="vllm-gpu-defaults",
    max_seqs=256,
    max_batch_tokens=8192,
    chunk_tokens=8192,
    drain_s=36_000.0,
)
PRIORITY_ENGINE = ENGINE.with_(priority_scheduling=True, waiting_order="priority")


def workload(seed: int, util: float, n: int) -> list[TraceRequest]:
    with gzip.open(ROOT / "loadgen/data/prompts/sharegpt-400.jsonl.gz", "rt") as fh:
        records = [json.loads(line) for line in fh]
    rng = np.random.default_rng([seed, 15])
    idx = rng.choice(len(records), size=n, replace=n > len(records))
    t = np.cumsum(rng.exponential(1.0, size=n))
    noise = np.exp(rng.normal(0.0, ERROR, size=n))
    reqs = [
        TraceRequest(
            arrival_s=float(at - t[0]),
            prompt_tokens=max(1, min(int(records[i]["prompt_tokens"]), 4096)),
            output_tokens=(out := max(1, min(int(records[i]["output_tokens"]), 4096))),
            source="sharegpt-400",
            predicted_output_tokens=max(1, round(out * z)),
        )
        for i, at, z in zip(idx, t, noise, strict=True)
    ]
    return compress(reqs, factor_for_utilisation(reqs, util, engine=ENGINE, profile=PROFILE))


def arm(
    name: str,
    policy: str,
    cap: int | None,
    *,
    law: CapLaw | None = None,
    priority: bool = False,
) -> Contender:
    engine = PRIORITY_ENGINE if priority else ENGINE
    return Contender(
        name,
        parse_policy(policy),
        engine,
        cap,
        gateway_preemption=False,
        cap_law=law,
        forward_priority=priority,
    )


def run(
    contenders: list[Contender], seeds: int, util: float, n: int
) -> dict[str, dict[str, float]]:
    """Mean over seeds of TTLT mean/p99, TTFT mean, token throughput, mean tuned cap."""
    rows: dict[str, dict[str, list[float]]] = {c.name: {} for c in contenders}
    for seed in range(seeds):
        reqs = workload(seed, util, n)
        for c in contenders:
            res = simulate(reqs, c, PROFILE, belief_sigma=ERROR)
            s = summarize(res.records)
            vals = {
                "ttlt": s["ttlt_s_mean"],
                "ttlt_p99": s["ttlt_s_p99"],
                "ttft": s["ttft_s_mean"],
                "tput": s["token_throughput_tps"],
                "cap": res.extra.get("cap_mean", float("nan")),
                "preempt": res.extra["engine_preemptions"],
            }
            for k, v in vals.items():
                rows[c.name].setdefault(k, []).append(v)
    return {name: {k: float(np.mean(v)) for k, v in r.items()} for name, r in rows.items()}


def cap_table(seeds: int, util: float, n: int) -> str:
    law = CapLaw()
    arms = [arm("vLLM alone (FCFS, no cap)", "fcfs", None)]
    arms += [arm(f"{POLICY}, cap {c}", POLICY, c) for c in FIXED_CAPS]
    arms.append(arm(f"{POLICY}, self-tuning cap", POLICY, START_CAP, law=law))
    rows = run(arms, seeds, util, n)
    base = rows[arms[0].name]
    fixed = [rows[a.name] for a in arms[1 : 1 + len(FIXED_CAPS)]]
    best = min(fixed, key=lambda r: r["ttlt"])
    gain = base["ttlt"] - best["ttlt"]
    out = [
        "| arm | TTLT mean s | TTLT p99 s | TTFT mean s | tokens/s | vs vLLM tput | gain kept"
        " | mean cap | engine preemptions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a in arms:
        r = rows[a.name]
        kept = (base["ttlt"] - r["ttlt"]) / gain if gain > 0 else float("nan")
        out.append(
            f"| {a.name} | {r['ttlt']:.2f} | {r['ttlt_p99']:.2f} | {r['ttft']:.2f} | "
            f"{r['tput']:.0f} | {r['tput'] / base['tput']:.3f} | {kept:.2f} | "
            f"{r['cap']:.0f} | {r['preempt']:.0f} |"
        )
    return "\n".join(out)


def priority_table(seeds: int, util: float, n: int) -> str:
    law = CapLaw()
    arms = [
        arm("vLLM alone (FCFS, no cap)", "fcfs", None),
        arm("hold only (self-tuning cap)", POLICY, START_CAP, law=law),
        arm("priority only (no cap)", POLICY, None, priority=True),
        arm("hold + priority", POLICY, START_CAP, law=law, priority=True),
    ]
    rows = run(arms, seeds, util, n)
    base = rows[arms[0].name]
    out = [
        "| arm | TTLT mean s | TTLT p99 s | TTFT mean s | tokens/s | vs vLLM TTLT | vs vLLM tput"
        " | engine preemptions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in arms:
        r = rows[a.name]
        out.append(
            f"| {a.name} | {r['ttlt']:.2f} | {r['ttlt_p99']:.2f} | {r['ttft']:.2f} | "
            f"{r['tput']:.0f} | {r['ttlt'] / base['ttlt']:.3f} | "
            f"{r['tput'] / base['tput']:.3f} | {r['preempt']:.0f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", choices=("cap", "priority", "both"), default="both")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--util", type=float, default=1.2)
    ap.add_argument("--requests", type=int, default=10_000)
    args = ap.parse_args(argv)
    wall = time.perf_counter()
    print(
        f"{args.requests} ShareGPT requests x {args.seeds} seeds, utilisation {args.util}, "
        f"{PROFILE}, engine {ENGINE.name} (max_num_seqs {ENGINE.max_seqs}, "
        f"{ENGINE.kv_tokens} KV tokens), {POLICY}, prediction error {ERROR}"
    )
    if args.table in ("cap", "both"):
        print("\n" + cap_table(args.seeds, args.util, args.requests))
    if args.table in ("priority", "both"):
        print("\n" + priority_table(args.seeds, args.util, args.requests))
    print(f"\n({time.perf_counter() - wall:.0f} s)")


if __name__ == "__main__":
    main()
