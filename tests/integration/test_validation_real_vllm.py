"""Real-engine validation: the same window straight at the vLLM CPU build and through the
gateway with SageSched (slow; its own vLLM server, pinned).

The machine is split in two (`loadgen.vllm_real.split_cpus`): vLLM runs pinned to the first
half of the CPUs (the "engine host"), this test's client and the gateway to the rest (the
"front end"), as in a deployment where the gateway does not share the engine's cores.
Unpinned on two cores, the gateway's embeddings took CPU from vLLM's own API server and the
gateway run measured the CPU contention, not the scheduling (gateway 2.1-2.6x slower at
every cap).

The window (LSSP Azure-2024 window 0, first 80 requests, prompts capped at 1,800 tokens and
outputs at 128) is replayed with real ShareGPT prompts padded to the trace's prompt lengths
(exact, through vLLM's /tokenize), at load factor 1.0 (80 requests in 3.75 s), so a backlog
forms. Three arms: straight at vLLM, through the gateway with SageSched, through the gateway
with FCFS under the same cap logic (what the policy adds beyond the cap). They run in
`PAIRS` rounds,
the arms' order rotated each round (D S F, S F D, F D S), every run with its own prompt tag
(vLLM caches prefixes) and every gateway fresh (a gateway that had learnt the previous
round's identical prompts would be an oracle). A drift of the machine's speed hits every arm of
a round alike. Asserted over the rounds' ratios: the median SageSched / FCFS below 0.95, and
the one-sided 95% upper bound of the mean SageSched / vLLM alone below 1 (the direction, with
its confidence; the 0.8 target is recorded). On a machine of another kind than the reference
(`fit_cpu.machine_shape`) the window is replayed as the same workload at its speed. Both
gateways run the shipped defaults: nothing about the cap is configured (the self-tuning cap
starts at the default `max_inflight` and tunes itself from vLLM's `/metrics`), so the
SageSched/FCFS ratio is what the policy adds under the same cap logic. Marker `timing`: `make
test` runs it in its own pytest process on a pinned server with nothing else alive. Results go
to `.cache/validation.json` and docs/validation.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import scipy.stats as sps

from loadgen.engine.fit_cpu import machine_shape
from loadgen.engine.profiles import CpuTinyVllm
from loadgen.replay.cli import run
from loadgen.replay.client import ReplayResult
from loadgen.replay.prompts import build_requests, tokenize_counter
from loadgen.replay.report import summarize_replay
from loadgen.replay.validation import (
    LIVE_WINDOW,
    GatewayArm,
    recommend_cap,
    simulated_gain,
    tagged,
    through_gateway,
    warm_up,
    window_trace,
)
from loadgen.vllm_real import CACHE, RealVllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TARGET = 0.8
"""The median SageSched / vLLM alone the project aims for (recorded, not asserted)."""
PAIRS = 3
ARMS = ("direct", "sagesched", "fcfs")
TAGS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota")
"""One prompt tag word per run (one BERT token each)."""
LEARN_TAGS = ("kappa", "lambda")
"""The curve-learning runs' tags."""


@pytest.mark.timing
def test_gateway_sagesched_beats_vllm_alone(quiet_vllm: RealVllm, tmp_path: Path) -> None:
    result = validate(quiet_vllm, tmp_path)
    assert result["failed"] == 0, result
    median = result["median"]
    # the policy's own bound: what SageSched adds over FCFS under the same cap logic
    assert median["sagesched_over_fcfs"] < 0.95, f"not < 0.95 x gateway FCFS: {median}"
    # the claim, as a direction with its confidence: the one-sided 95% upper bound of the mean
    # round ratio SageSched / vLLM alone is below 1. The target (median <= 0.8) is recorded
    # beside it (`target_met`): it held on some machines and not on others (docs/validation.md)
    bound = result["sagesched_over_direct_upper95"]
    assert bound < 1.0, f"SageSched / vLLM alone: upper 95% bound {bound:.3f} >= 1 ({median})"


def upper_bound(values: list[float], confidence: float = 0.95) -> float:
    """One-sided upper confidence bound of the mean of `values` (Student's t)."""
    n = len(values)
    half = float(sps.t.ppf(confidence, n - 1)) * statistics.stdev(values) / math.sqrt(n)
    return statistics.fmean(values) + half


def validate(server: RealVllm, tmp: Path) -> dict[str, Any]:
    t_start = time.monotonic()
    count = tokenize_counter(server.url, server.name)
    assert count is not None, "vLLM's /tokenize is missing"
    warm_up(server.url, server.name)  # a fresh vLLM CPU server is slow on its first batches
    # on a machine of another kind than the reference (prefill far slower against its fixed
    # work), the window is replayed as the same workload at that machine's speed
    balance, shape = asyncio.run(machine_shape(server.url, server.name))
    trace = shape.window(window_trace(**LIVE_WINDOW))  # type: ignore[arg-type]
    reqs = build_requests(trace, prompts="sample", count_tokens=count, pad=True)
    assert sum(r.prompt_tokens == t.prompt_tokens for r, t in zip(reqs, trace, strict=True)) >= 70
    profile = CpuTinyVllm(shape.k)  # the engine model of this machine, for the simulation
    cap, sweep = recommend_cap(reqs, profile)  # for the simulated comparison only
    # the self-tuning cap learns this engine's curve first (two gateways, one after the
    # other, replaying the window with the same curve memory); every measured gateway starts
    # from a copy of that memory, as a restarted gateway does
    memory = tmp / "cap-memory.json"
    for tag in LEARN_TAGS:
        learnt_cap = through_gateway(
            server.url, server.name, tagged(reqs, tag), GatewayArm("fcfs", cap_memory=memory), tmp
        ).cap
    remembered = json.loads(memory.read_text()) if memory.exists() else {}
    load = os.getloadavg()[0]
    rounds = []
    for i in range(PAIRS):
        runs: dict[str, list[ReplayResult]] = {}
        end_caps: dict[str, int] = {}
        cap_traces: dict[str, list[tuple[float, int]]] = {}
        for j, arm in enumerate(ARMS[i:] + ARMS[:i]):
            sent = tagged(reqs, TAGS[i * len(ARMS) + j])
            if arm == "direct":
                runs[arm] = run(server.url, server.name, sent, progress=False)
            else:
                copy = tmp / f"cap-memory-{i}-{arm}.json"
                if remembered:
                    copy.write_text(json.dumps(remembered))
                gw = through_gateway(
                    server.url, server.name, sent, GatewayArm(arm, cap_memory=copy), tmp
                )
                runs[arm], end_caps[arm], cap_traces[arm] = gw
        summary = {arm: summarize_replay(runs[arm]) for arm in ARMS}
        ttlt = {arm: summary[arm]["e2el_s_mean"] for arm in ARMS}
        rounds.append({
            "order": list(runs),
            "ttlt_mean_s": ttlt,
            "sagesched_over_direct": ttlt["sagesched"] / ttlt["direct"],
            "fcfs_over_direct": ttlt["fcfs"] / ttlt["direct"],
            "sagesched_over_fcfs": ttlt["sagesched"] / ttlt["fcfs"],
            "ttft_mean_s": {arm: summary[arm]["ttft_s_mean"] for arm in ARMS},
            "lag_p99_s": {arm: summary[arm]["lag_s_p99"] for arm in ARMS},
            "failed": sum(summary[arm]["failed"] for arm in ARMS),
            "cap_at_end": end_caps,
            "caps": cap_traces,
        })  # fmt: skip
    ratios = ("sagesched_over_direct", "fcfs_over_direct", "sagesched_over_fcfs")
    simulated = simulated_gain(reqs, profile, cap, policies=("sagesched", "fcfs"))
    median = {k: statistics.median(r[k] for r in rounds) for k in ratios}
    result: dict[str, Any] = {
        "window": LIVE_WINDOW,
        "balance": dataclasses.asdict(balance) | {"prefill_ratio": balance.prefill_ratio},
        "shape": dataclasses.asdict(shape),
        "cpus": {"engine": server.cpus, "front_end": sorted(os.sched_getaffinity(0))},
        "gateway": {
            "config": "shipped defaults (self-tuning cap, started from the learnt curve)",
            "learnt_cap": learnt_cap,
            "remembered": sorted(remembered),
            "warm": "sample (400 prompts)",
            "fresh_per_run": True,
        },
        "simulated_cap": cap,
        "simulated_cap_sweep": sweep,
        "load_average_1m": load,
        "rounds": rounds,
        "median": median,
        "sagesched_over_direct_upper95": upper_bound([r["sagesched_over_direct"] for r in rounds]),
        "target_met": median["sagesched_over_direct"] <= TARGET,
        "failed": sum(r["failed"] for r in rounds),
        "simulated": simulated,
        "simulated_sagesched_over_gateway_fcfs": simulated["gateway_ttlt_mean_s"]
        / simulated["gateway_fcfs_ttlt_mean_s"],
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    (CACHE / "validation.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return result
