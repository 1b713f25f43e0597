"""The real-engine check shared by the slow test and `bench/hardware_validation.py`.

One window is replayed (a) straight at a vLLM server and (b) through the gateway running
SageSched with a small in-flight cap, so the gateway holds the backlog; the simulator then
runs the same requests (direct vLLM vs gateway + SageSched) on a latency profile, and the
measured and predicted gains are put side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from loadgen.engine.profiles import LatencyProfile
from loadgen.replay.client import ReplayRequest, ReplayResult
from loadgen.replay.report import summarize_replay
from loadgen.schema import TraceRequest

LIVE_WINDOW = {"source": "lssp-azure2024", "window": 0, "n": 80, "max_prompt": 1800,
               "max_output": 128, "factor": 1.0}  # fmt: skip
"""The real-engine validation's window: 80 requests in 3.75 s, so a backlog forms on the
vLLM CPU build (the slow test and `bench/live_modes.py`)."""


def window_trace(source: str, window: int, n: int, max_prompt: int, max_output: int,
                 factor: float) -> list[TraceRequest]:  # fmt: skip
    """The first `n` requests of a shipped window, lengths capped, clock sped up `factor`×."""
    from loadgen.regions import compress
    from loadgen.traces import load_windows

    w = load_windows(source)[window]
    trace = [
        dataclasses.replace(r, prompt_tokens=min(r.prompt_tokens, max_prompt),
                            output_tokens=min(r.output_tokens, max_output))
        for r in w.requests[:n]
    ]  # fmt: skip
    return compress(trace, factor)


def simulated_ttlt(
    requests: Sequence[ReplayRequest],
    profile: str | LatencyProfile,
    arms: Mapping[str, tuple[str, int | None]],
    engine: Any = None,
) -> dict[str, float]:
    """Mean TTLT (s) in the simulator of each arm, `name: (policy, gateway cap or None for
    the engine alone)`, on the requests actually sent (their prompt and output lengths and
    arrival times; true lengths as beliefs). Engine: the emulator's vLLM CPU configuration
    unless `engine` is given."""
    from loadgen.emulator import EmulatorConfig
    from loadgen.metrics import summarize
    from loadgen.sim.simulator import Contender, simulate
    from policies.registry import parse_policy

    eng = engine or EmulatorConfig().engine_config()
    trace = [TraceRequest(r.arrival_s, r.prompt_tokens, r.output_tokens, "replay")
             for r in requests]  # fmt: skip
    out = {}
    for name, (policy, cap) in arms.items():
        res = simulate(trace, Contender(name, parse_policy(policy), eng, cap), profile)
        out[name] = summarize(res.records)["ttlt_s_mean"]
    return out


def simulated_gain(
    requests: Sequence[ReplayRequest],
    profile: str | LatencyProfile,
    cap: int,
    engine: Any = None,
    policies: Sequence[str] = ("sagesched",),
) -> dict[str, float]:
    """`simulated_ttlt` of direct vLLM and of the gateway with each of `policies` at cap
    `cap`. Keys: `direct_ttlt_mean_s`, `gateway_ttlt_mean_s` (the first policy),
    `gateway_<policy>_ttlt_mean_s` for the others, and `ratio` (first policy over direct)."""
    arms: dict[str, tuple[str, int | None]] = {"direct": ("fcfs", None)}
    arms |= {("gateway" if i == 0 else f"gateway_{p}"): (p, cap) for i, p in enumerate(policies)}
    ttlt = simulated_ttlt(requests, profile, arms, engine)
    out = {f"{name}_ttlt_mean_s": v for name, v in ttlt.items()}
    out["ratio"] = out["gateway_ttlt_mean_s"] / out["direct_ttlt_mean_s"]
    return out


CAP_CANDIDATES = (2, 4, 8, 16, 32)


def recommend_cap(
    requests: Sequence[ReplayRequest],
    profile: str | LatencyProfile,
    caps: Sequence[int] = CAP_CANDIDATES,
    engine: Any = None,
) -> tuple[int, dict[int, float]]:
    """The gateway's in-flight cap for these requests: the one of `caps` whose simulated
    gateway + SageSched mean TTLT is lowest (ties: the smaller cap), and the simulated ratio
    to direct vLLM for every cap. Too small a cap throttles the engine's batching; too large
    a one leaves the backlog in the engine's FCFS queue, out of the policy's reach."""
    arms: dict[str, tuple[str, int | None]] = {"direct": ("fcfs", None)}
    arms |= {str(c): ("sagesched", c) for c in caps}
    ttlt = simulated_ttlt(requests, profile, arms, engine)
    sweep = {c: ttlt[str(c)] / ttlt["direct"] for c in caps}
    return min(sweep, key=lambda c: (sweep[c], c)), sweep


def _from_send(results: Sequence[ReplayResult]) -> float:
    """Mean TTLT measured from the actual send (schedule lag excluded)."""
    v = [r.finish_s - r.sent_s for r in results if r.ok and r.finish_s and r.sent_s is not None]
    return sum(v) / len(v) if v else float("nan")


def measured_gain(direct: Sequence[ReplayResult], via: Sequence[ReplayResult]) -> dict[str, float]:
    """Mean TTLT straight at vLLM and through the gateway, and their ratio, from the scheduled
    send (the replay's definition) and from the actual send (without the client's lag, which
    on a machine shared by client, gateway and engine is CPU starvation, not the server)."""
    d, g = summarize_replay(direct), summarize_replay(via)
    d_send, g_send = _from_send(direct), _from_send(via)
    return {
        "direct_ttlt_from_send_mean_s": d_send,
        "gateway_ttlt_from_send_mean_s": g_send,
        "ratio_from_send": g_send / d_send,
        "direct_lag_mean_s": d["lag_s_mean"],
        "gateway_lag_mean_s": g["lag_s_mean"],
        "direct_ttlt_mean_s": d["e2el_s_mean"],
        "gateway_ttlt_mean_s": g["e2el_s_mean"],
        "direct_ttft_mean_s": d["ttft_s_mean"],
        "gateway_ttft_mean_s": g["ttft_s_mean"],
        "direct_failed": d["failed"],
        "gateway_failed": g["failed"],
        "direct_lag_p99_s": d["lag_s_p99"],
        "gateway_lag_p99_s": g["lag_s_p99"],
        "ratio": g["e2el_s_mean"] / d["e2el_s_mean"],
    }


@dataclasses.dataclass(frozen=True)
class GatewayArm:
    """How one replay goes through the gateway: its policy and the backend's cap settings
    (`cap` None: the shipped default `max_inflight`, tuned from there unless `adaptive` is
    off); `priority`: the backend runs vLLM priority scheduling and gets each request's key."""

    policy: str
    cap: int | None = None
    adaptive: bool = True
    priority: bool = False
    cap_memory: Path | None = None
    """The self-tuning cap's curve memory file (read at start, written at stop)."""


CAP_SERIES = "sagesched_backend_inflight_cap"


def tagged(requests: Sequence[ReplayRequest], tag: str) -> list[ReplayRequest]:
    """The requests with `tag` in front of each prompt, so that one run's prompts share no
    prefix with another's (vLLM caches prefixes)."""
    return [dataclasses.replace(r, prompt=f"{tag} {r.prompt}") for r in requests]


def warm_up(url: str, model: str) -> None:
    """Send a fresh server 30 short requests (6/s) before anything on it is measured: a vLLM
    CPU server is slow on its first batch shapes."""
    from loadgen.replay.cli import run
    from loadgen.replay.prompts import build_requests, synthetic_window

    warm = build_requests(synthetic_window(n=30, rate_per_s=6.0, seed=98), prompts="ids")
    run(url, model, warm, progress=False)


class GatewayRun(NamedTuple):
    """One replay through a gateway: the results, the backend's in-flight cap at the end, and
    the cap every `CAP_EVERY_S` during the replay as (seconds since its start, cap)."""

    results: list[ReplayResult]
    cap: int
    caps: list[tuple[float, int]]


CAP_EVERY_S = 0.5
"""Seconds between readings of the gateway's cap during a replay."""


def gateway_cap(url: str) -> int:
    """The in-flight cap of a one-backend gateway at `url` (`sagesched_backend_inflight_cap`;
    loadgen does not import the gateway's own scrape helper)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    caps = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == CAP_SERIES
    ]
    return int(caps[0])


def through_gateway(
    backend: str, model: str, requests: Sequence[ReplayRequest], arm: GatewayArm, tmp: Path
) -> GatewayRun:
    """`requests` replayed through a fresh gateway (its own process, one torch thread,
    predictor warm-started from the shipped sample) in front of `backend`, its cap read
    every `CAP_EVERY_S` by a thread beside the replay."""
    from loadgen.demo.run import ONE_THREAD, gateway_config, write_warm_set
    from loadgen.procs import Children, free_port, sagesched
    from loadgen.replay.cli import run

    with Children(tmp) as children:
        port = free_port()
        warm = tmp / "warm.jsonl"
        write_warm_set([], warm, holdout=False)
        cfg = gateway_config(tmp / f"gw-{arm.policy}.yaml", port, backend, arm.policy, arm.cap,
                             warm, adaptive=arm.adaptive, priority=arm.priority,
                             cap_memory=arm.cap_memory)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        children.start("gateway", sagesched("serve", "--config", str(cfg)), url + "/ready",
                       240, env=ONE_THREAD)  # fmt: skip
        caps: list[tuple[float, int]] = []
        done = threading.Event()
        t0 = time.monotonic()

        def read_caps() -> None:
            while not done.wait(CAP_EVERY_S):
                with contextlib.suppress(OSError, IndexError, ValueError):
                    caps.append((round(time.monotonic() - t0, 2), gateway_cap(url)))

        reader = threading.Thread(target=read_caps, daemon=True)
        reader.start()
        try:
            results = run(url, model, list(requests), progress=False)
        finally:
            done.set()
            reader.join()
        return GatewayRun(results, gateway_cap(url), caps)
