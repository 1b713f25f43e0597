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
forms. Runs: straight at vLLM, through the gateway with SageSched, through the gateway with
FCFS at the same cap (reported: what the policy adds beyond the cap), straight at vLLM again.
The cap is the simulator's recommendation for these requests (`recommend_cap`). The measured
ratios and the simulator's predictions (`cpu-tiny-vllm` as committed, and at the engine
host's speed probed before and after the runs, `fit_cpu.speed_factor`) are written to
`.cache/validation.json` and recorded in docs/validation.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadgen.demo.run import ONE_THREAD, gateway_config, write_warm_set
from loadgen.engine.fit_cpu import profile_probe, speed_factor
from loadgen.engine.profiles import Scaled, make_profile
from loadgen.procs import Children, free_port, sagesched
from loadgen.replay.cli import run
from loadgen.replay.client import ReplayRequest, ReplayResult
from loadgen.replay.prompts import build_requests, synthetic_window, tokenize_counter
from loadgen.replay.validation import measured_gain, recommend_cap, simulated_gain, window_trace
from loadgen.vllm_real import CACHE, RealVllm, split_cpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WINDOW = {"source": "lssp-azure2024", "window": 0, "n": 80, "max_prompt": 1800,
          "max_output": 128, "factor": 1.0}  # fmt: skip
PROFILE = "cpu-tiny-vllm"


def tagged(reqs: list[ReplayRequest], tag: str) -> list[ReplayRequest]:
    """The requests with `tag` in front of each prompt (one more token or two)."""
    return [dataclasses.replace(r, prompt=f"{tag} {r.prompt}") for r in reqs]


@pytest.fixture(scope="module")
def split_vllm() -> Iterator[tuple[RealVllm, set[int]]]:
    """A vLLM server pinned to the engine CPUs, and the front-end CPUs."""
    engine, front = split_cpus()
    with RealVllm(cpus=engine, log_path=CACHE / "vllm-validation.log") as server:
        yield server, front


def through_gateway(
    server: RealVllm, reqs: list[ReplayRequest], policy: str, cap: int, tmp: Path
) -> list[ReplayResult]:
    """`reqs` replayed through a fresh gateway (its own process) running `policy`."""
    with Children(tmp) as children:
        port = free_port()
        warm_set = tmp / "warm.jsonl"
        write_warm_set([], warm_set, holdout=False)
        cfg = gateway_config(tmp / f"gw-{policy}.yaml", port, server.url, policy, cap, warm_set)
        children.start("gateway", sagesched("serve", "--config", str(cfg)),
                       f"http://127.0.0.1:{port}/ready", 240, env=ONE_THREAD)  # fmt: skip
        return run(f"http://127.0.0.1:{port}", server.name, reqs, progress=False)


def test_gateway_sagesched_beats_vllm_alone(
    split_vllm: tuple[RealVllm, set[int]], tmp_path: Path
) -> None:
    server, front = split_vllm
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, front)  # the client, and the gateway it starts, on the front end
    try:
        result = validate(server, tmp_path)
    finally:
        os.sched_setaffinity(0, before)
    measured = result["measured"]
    assert measured["direct_failed"] == 0 and measured["gateway_failed"] == 0
    assert measured["ratio"] < 1.0, f"gateway mean TTLT not below vLLM's: {result}"


def validate(server: RealVllm, tmp: Path) -> dict[str, Any]:
    t_start = time.monotonic()
    count = tokenize_counter(server.url, server.name)
    assert count is not None, "vLLM's /tokenize is missing"
    trace = window_trace(**WINDOW)  # type: ignore[arg-type]
    reqs = build_requests(trace, prompts="sample", count_tokens=count, pad=True)
    assert sum(r.prompt_tokens == t.prompt_tokens for r, t in zip(reqs, trace, strict=True)) >= 70
    cap, sweep = recommend_cap(reqs, PROFILE)
    # a fresh vLLM CPU server is slow on its first batch shapes: warm it up first
    warm = build_requests(synthetic_window(n=30, rate_per_s=6.0, seed=98), prompts="ids")
    run(server.url, server.name, warm, progress=False)
    load = os.getloadavg()[0]
    # the engine host's speed against the profile, before and after the runs; the simulator
    # is also run at it, to tell the machine's speed from the model's shape
    reference = asyncio.run(profile_probe(PROFILE))
    speeds = [asyncio.run(speed_factor(server.url, server.name, reference, seed=50))]
    # Each run's prompts start with their own tag, so vLLM's prefix cache never serves one
    # run's prefill from an earlier run's. The machine's speed drifts: the gateway runs sit
    # between two direct runs and are compared with both together.
    direct = run(server.url, server.name, tagged(reqs, "alpha"), progress=False)
    via = through_gateway(server, tagged(reqs, "beta"), "sagesched", cap, tmp)
    via_fcfs = through_gateway(server, tagged(reqs, "delta"), "fcfs", cap, tmp)
    direct += run(server.url, server.name, tagged(reqs, "gamma"), progress=False)
    speeds.append(asyncio.run(speed_factor(server.url, server.name, reference, seed=51)))
    measured = measured_gain(direct, via)
    fcfs = measured_gain(direct, via_fcfs)
    simulated = simulated_gain(reqs, PROFILE, cap, policies=("sagesched", "fcfs"))
    at_speed = Scaled(make_profile(PROFILE), statistics.fmean(speeds))
    simulated_at_speed = simulated_gain(reqs, at_speed, cap, policies=("sagesched", "fcfs"))
    result: dict[str, Any] = {
        "window": WINDOW,
        "cpus": {"engine": server.cpus, "front_end": sorted(os.sched_getaffinity(0))},
        "gateway": {"policy": "sagesched", "max_inflight": cap, "warm": "sample (400 prompts)"},
        "simulated_cap_sweep": sweep,
        "load_average_1m": load,
        "measured": measured,
        "measured_gateway_fcfs": {k: v for k, v in fcfs.items() if k.startswith("gateway")}
        | {"ratio": fcfs["ratio"]},
        "measured_sagesched_over_gateway_fcfs": measured["gateway_ttlt_mean_s"]
        / fcfs["gateway_ttlt_mean_s"],
        "simulated_cpu_tiny_vllm": simulated,
        "simulated_sagesched_over_gateway_fcfs": simulated["gateway_ttlt_mean_s"]
        / simulated["gateway_fcfs_ttlt_mean_s"],
        "probed_speeds": speeds,
        "simulated_at_probed_speed": simulated_at_speed,
        "gain_measured": 1 - measured["ratio"],
        "gain_simulated": 1 - simulated["ratio"],
        "gain_simulated_at_probed_speed": 1 - simulated_at_speed["ratio"],
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    (CACHE / "validation.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return result
