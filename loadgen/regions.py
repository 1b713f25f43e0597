"""Operating regions: the knee (REFERENCE.md §2), explicit rates and utilisation targets.

A load *factor* λ compresses a window's clock: arrival' = arrival / λ and deadline' =
arrival' + (deadline − arrival) / λ, so λ divides inter-arrival gaps and SLO slack alike. The
knee λ_ref of a window is the factor at which FCFS's SLO-violation rate reaches 0.5%, found by
bisecting log λ over [1e-2, 1e4] in 30 steps; a region is a fixed multiple of it. The knees of
the LSSP windows are frozen in `loadgen/data/knees/<source>.csv` (written by
`python -m loadgen.regions SOURCE...`).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from loadgen.engine.configs import CONTINUOUS, EngineConfig
from loadgen.engine.profiles import LatencyProfile, make_profile
from loadgen.schema import TraceRequest, Window
from loadgen.sim.simulator import Contender, resolve, simulate

REGIONS: dict[str, float] = {
    "LOW": 0.5,
    "PRE_KNEE": 0.8,
    "KNEE": 1.0,
    "POST_KNEE": 1.1,
    "OVERLOAD": 1.2,
    "HIGH_PRESSURE": 1.5,
}
"""Region name → multiple of the knee."""

KNEE_DIR = Path(__file__).resolve().parent / "data" / "knees"
KNEE_THRESHOLD = 0.005
"""FCFS SLO-violation rate that defines the knee."""
SLO_MULTIPLIER = 20.0
PREFILL_TOKEN_S = 0.0004
DECODE_TOKEN_S = 0.02
"""The paper's SLO: deadline = arrival + 20 × (0.0004 s × prompt + 0.02 s × predicted output),
on the window's own clock (REFERENCE.md §2)."""


def slo_deadline(arrival_s: float, prompt: int, predicted: float) -> float:
    """The paper's SLO deadline (window clock, seconds)."""
    return arrival_s + SLO_MULTIPLIER * (PREFILL_TOKEN_S * prompt + DECODE_TOKEN_S * predicted)


def compress(
    requests: Sequence[TraceRequest], factor: float, *, slo_factor: float | None = None
) -> list[TraceRequest]:
    """The requests on a clock sped up `factor` times (gaps and SLO slack divided by it).

    With `slo_factor`, SLO slack is divided by `slo_factor` instead, so load and SLO tightness
    can be moved separately (the study's utilisation axis holds slack fixed).
    """
    slo = factor if slo_factor is None else slo_factor
    if factor <= 0 or slo <= 0:
        raise ValueError("load factor must be positive")
    out = []
    for r in requests:
        arrival = r.arrival_s / factor
        deadline = None if r.deadline_s is None else arrival + (r.deadline_s - r.arrival_s) / slo
        out.append(dataclasses.replace(r, arrival_s=arrival, deadline_s=deadline))
    return out


def fcfs_contender() -> Contender:
    """The knee's reference: FCFS, no gateway cap, the `continuous` (LSSP) engine."""
    return resolve("fcfs", inflight_cap=None)


def violates(
    requests: Sequence[TraceRequest],
    factor: float,
    *,
    profile: LatencyProfile,
    contender: Contender,
    threshold: float = KNEE_THRESHOLD,
) -> bool:
    """Whether the violation rate at `factor` reaches `threshold` (stops at the first proof)."""
    limit = max(1, math.ceil(threshold * len(requests) - 1e-9))
    res = simulate(compress(requests, factor), contender, profile, stop_after_violations=limit)
    return res.stopped_early


def find_knee(
    requests: Sequence[TraceRequest],
    *,
    profile: LatencyProfile | str = "lssp-constant",
    contender: Contender | None = None,
    threshold: float = KNEE_THRESHOLD,
    lo: float = 1e-2,
    hi: float = 1e4,
    steps: int = 30,
) -> float:
    """Bisect log λ for the factor where FCFS's SLO-violation rate reaches `threshold`.

    Returns the geometric midpoint of the final bracket; `lo` if even `lo` violates.
    """
    prof = make_profile(profile) if isinstance(profile, str) else profile
    c = contender or fcfs_contender()
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        if violates(requests, mid, profile=prof, contender=c, threshold=threshold):
            hi = mid
        else:
            lo = mid
    return math.sqrt(lo * hi)


def mean_rate_rps(requests: Sequence[TraceRequest]) -> float:
    """Arrivals per second on the requests' own clock ((n − 1) / span)."""
    span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    return (len(requests) - 1) / span if span > 0 else math.inf


def factor_for_rate(requests: Sequence[TraceRequest], rate_rps: float) -> float:
    """The load factor that makes the window's mean arrival rate `rate_rps`."""
    return rate_rps / mean_rate_rps(requests)


def kv_batch(requests: Sequence[TraceRequest], engine: EngineConfig) -> float:
    """How many of these requests the engine's KV cache holds at once: its capacity over the
    decode-time-weighted context Σ O·(I + O/2) / Σ O (a request holding more context for longer
    counts for more)."""
    held = sum(r.output_tokens * (r.prompt_tokens + r.output_tokens / 2) for r in requests)
    return engine.kv_tokens * sum(r.output_tokens for r in requests) / max(held, 1.0)


def factor_for_utilisation(
    requests: Sequence[TraceRequest],
    target: float,
    *,
    engine: EngineConfig = CONTINUOUS,
    profile: LatencyProfile | str = "lssp-constant",
) -> float:
    """The load factor at which offered decode work is `target` × the engine's token capacity.

    Capacity is one token per sequence of a full batch per decode iteration at the window's
    mean context, where a full batch is `max_seqs` or as many sequences as the KV cache holds
    at the window's decode-time-weighted context (Σ O·(I + O/2) / Σ O), whichever is smaller;
    offered work is the window's output tokens over its (compressed) span.
    """
    prof = make_profile(profile) if isinstance(profile, str) else profile
    n = max(1, min(engine.max_seqs, int(kv_batch(requests, engine))))
    mean_ctx = sum(r.prompt_tokens + r.output_tokens / 2 for r in requests) / len(requests)
    capacity_tps = n / prof.iteration_s(n, int(n * mean_ctx), 0)
    span = requests[-1].arrival_s - requests[0].arrival_s
    demand_tps = sum(r.output_tokens for r in requests) / span
    return target * capacity_tps / demand_tps


def knee_path(source: str) -> Path:
    return KNEE_DIR / f"{source}.csv"


def read_knees(source: str) -> dict[str, float]:
    """window_id → knee from the frozen manifest of `source`."""
    with knee_path(source).open() as f:
        return {row["window_id"]: float(row["knee"]) for row in csv.DictReader(f)}


def region_factor(window: Window, region: str) -> float:
    """The load factor of `region` for `window` (frozen knee, else measured now)."""
    try:
        mult = REGIONS[region]
    except KeyError:
        raise ValueError(f"unknown region {region!r}; known: {list(REGIONS)}") from None
    knee = window.meta.get("knee")
    if knee is None:
        try:
            knee = read_knees(window.source)[window.window_id]
        except (FileNotFoundError, KeyError):
            knee = find_knee(window.requests)
    return float(knee) * mult


def write_knees(source: str, windows: Sequence[Window]) -> Path:
    """Measure every window's knee and write the manifest (window_id, knee, lambda_ref)."""
    path = knee_path(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["window_id", "knee", "lambda_ref"])
        for win in windows:
            ref = win.meta.get("lambda_ref", "")
            w.writerow([win.window_id, repr(find_knee(win.requests)), ref])
    return path


def main(argv: list[str]) -> int:
    from loadgen.traces import load_windows

    for source in argv or ["lssp-azure2024", "lssp-bailian", "lssp-burstgpt"]:
        print(write_knees(source, load_windows(source)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
