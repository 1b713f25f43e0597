"""The portability grid: every (source, window, load point, policy) cell, run in parallel.

A *cell* is one simulation of one frozen LSSP window at one load point under one policy; it
yields one value per study metric. Cells are grouped into *chunks* of one window (all load
points x all policies), which is what an executor ships to a worker: a chunk loads its window
once and returns tidy rows. Executors: `serial` (in process), `process` (a
`ProcessPoolExecutor`, the default) and `ray` (the same chunk function as a Ray task). The
result is independent of the executor and of the worker count: rows are sorted before they are
returned, and every simulation is a pure function of its inputs.

Two load axes:
- `knee` (the paper's): a region multiplies the window's frozen knee λ_ref; λ divides arrival
  gaps *and* SLO slack, so the axis mixes load with SLO tightness;
- `util` (ours): a level is the offered decode work over the engine's token capacity
  (`loadgen.regions.factor_for_utilisation`, lssp-constant profile), while SLO slack is held at
  the window's knee tightness (divided by λ_ref at every level), so only the load moves.
"""

from __future__ import annotations

import csv
import functools
import gzip
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from loadgen.engine.configs import engine_config
from loadgen.metrics import late_rate, summarize
from loadgen.regions import REGIONS, compress, factor_for_utilisation, region_factor
from loadgen.schema import Window
from loadgen.sim.simulator import Contender, resolve, simulate
from policies.capacity import CapLaw
from policies.registry import parse_policy

SOURCES: tuple[str, ...] = ("lssp-azure2024", "lssp-bailian", "lssp-burstgpt")
SOURCE_LABELS: dict[str, str] = {
    "lssp-azure2024": "Azure",
    "lssp-bailian": "Bailian",
    "lssp-burstgpt": "BurstGPT",
}

POLICIES: dict[str, tuple[str, int | None]] = {
    # paper name: (this project's contender, gateway in-flight cap: -1 default, None none)
    "fifo": ("fcfs", None),  # uncapped, exactly the knee's reference
    "edf": ("edf", -1),
    "least_laxity_first": ("llf", -1),
    "estimated_service_time_first": ("est-first", -1),
    "weighted_fair_share": ("wfs", -1),
    "kv_constrained_online": ("kv-constrained", -1),
    "admission_control": ("admission-control", -1),
    "vllm_faithful": ("vllm-fcfs", -1),
    "vllm_chunked_prefill_faithful": ("vllm-chunked-prefill", -1),
    "sarathi_faithful": ("sarathi", -1),
    "slai_faithful": ("slai", -1),
    "vllm_style_token_budget": ("token-budget", -1),
    "scorpio_style_slo_guard": ("slo-guard", -1),
}
"""The paper's 13 policies, in its order, mapped to this project's contenders."""
ROBUSTNESS_ONLY = frozenset({"vllm_style_token_budget", "scorpio_style_slo_guard"})
ALIASES = {
    "admission_control": "fifo",  # its default laxity threshold (−inf) filters nothing
    "vllm_style_token_budget": "ssjf",  # the queue-level ssjf on the paper engine, cap 64
}
"""Contenders that are another policy under a different name here (value: which): simulated
and shown, but left out of the statistics (ranks, τ, reversals), where a duplicate would count
one policy twice. Neither has a published mechanism to copy (docs/simulator.md)."""
HEADLINE_POLICIES: tuple[str, ...] = tuple(
    p for p in POLICIES if p not in ROBUSTNESS_ONLY and p not in ALIASES
)
GATEWAY_POLICIES: dict[str, str] = {
    "gateway_fcfs": "fcfs",
    "gateway_sagesched": "sagesched",
    "gateway_trail": "trail",
}
"""This project's gateway as shipped, which the paper's grid lacks (run only by the what-if on
a capture, `loadgen.study.whatif`): the policy in front of vLLM with chunked prefill
(`vllm-chunked-prefill`, i.e. `vllm_chunked_prefill_faithful` = vLLM alone) behind the
self-tuning in-flight cap with its shipped defaults (`CapLaw()`, starting at 8), predictions
the log-normal belief (σ = 0.2) around each request's imputed prediction."""
GATEWAY_START_CAP = 8
"""The gateway's default `max_inflight`, where its self-tuning cap starts."""
MEASURED = "MEASURED"
"""The load point of a capture's own clock (arrival factor 1; SLO slack at the knee's
tightness, as on the utilisation axis): the operator's measured load, which the what-if runs
next to the knee regions."""

METRICS: dict[str, bool] = {
    # study metric: higher is better
    "anwg": True,
    "completion_fraction": True,
    "slo_violation_rate": False,
    "goodput_rps": True,
    "latency_s_mean": False,
    "latency_s_p95": False,
    "latency_s_p99": False,
    "request_throughput_rps": True,
    "token_throughput_tps": True,
    "ttft_s_mean": False,
    "ttft_s_p95": False,
}
"""REFERENCE.md §2's metric list. `slo_violation_rate` is the paper's late / completed."""
PRIMARY_METRIC = "anwg"
_SUMMARY_KEYS = {
    "latency_s_mean": "ttlt_s_mean",
    "latency_s_p95": "ttlt_s_p95",
    "latency_s_p99": "ttlt_s_p99",
}

UTIL_LEVELS: dict[str, float] = {
    "U0.25": 0.25,
    "U0.5": 0.5,
    "U1": 1.0,
    "U2": 2.0,
    "U4": 4.0,
    "U8": 8.0,
}
"""Utilisation axis: level name → offered decode work over token capacity."""
AXES: dict[str, tuple[str, ...]] = {"knee": tuple(REGIONS), "util": tuple(UTIL_LEVELS)}


class Row(NamedTuple):
    """One tidy result: a metric value of one cell."""

    source: str
    window: str
    axis: str
    region: str
    policy: str
    metric: str
    value: float


@dataclass(frozen=True, slots=True)
class Chunk:
    """The unit of work shipped to a worker: one window, some load points, some policies.

    A frozen source's window is named by its index (the worker loads it); a window that exists
    only in the caller (a capture's) travels whole in `window`. `profile` is the engine's
    latency profile (the paper's `lssp-constant` unless the what-if asks for another)."""

    source: str
    window_index: int
    axis: str
    regions: tuple[str, ...]
    policies: tuple[str, ...]
    window: Window | None = None
    profile: str = "lssp-constant"

    @property
    def cells(self) -> int:
        return len(self.regions) * len(self.policies)


@functools.lru_cache(maxsize=8)
def windows_of(source: str) -> tuple[Window, ...]:
    """The frozen windows of `source` (cached per process)."""
    from loadgen.traces import load_windows

    return tuple(load_windows(source))


def contender(policy: str) -> Contender:
    """The contender that plays the paper's `policy` (or one of `GATEWAY_POLICIES`)."""
    if policy in GATEWAY_POLICIES:
        engine = engine_config("vllm-chunked-prefill")
        spec = GATEWAY_POLICIES[policy]
        return Contender(policy, parse_policy(spec), engine, GATEWAY_START_CAP, cap_law=CapLaw())
    spec, cap = POLICIES[policy]
    return resolve(spec, inflight_cap=cap)


def load_point(window: Window, axis: str, region: str) -> tuple[float, float]:
    """(arrival factor, SLO-slack factor) of a load point for a window."""
    knee = region_factor(window, "KNEE")
    if region == MEASURED:
        return 1.0, knee
    if axis == "knee":
        factor = region_factor(window, region)
        return factor, factor
    if axis == "util":
        return factor_for_utilisation(window.requests, UTIL_LEVELS[region]), knee
    raise ValueError(f"unknown axis {axis!r}; known: {list(AXES)}")


def cell_metrics(
    window: Window, axis: str, region: str, policy: str, profile: str = "lssp-constant"
) -> dict[str, float]:
    """Every study metric of one cell (NaN where undefined)."""
    factor, slo = load_point(window, axis, region)
    requests = compress(window.requests, factor, slo_factor=slo)
    res = simulate(requests, contender(policy), profile)
    summary = summarize(res.records)
    out = {m: summary[_SUMMARY_KEYS.get(m, m)] for m in METRICS}
    out["slo_violation_rate"] = late_rate(res.records)
    return out


def run_chunk(chunk: Chunk) -> list[Row]:
    """Every cell of a chunk, as tidy rows (a top-level function, so it pickles)."""
    window = chunk.window or windows_of(chunk.source)[chunk.window_index]
    rows = []
    for region in chunk.regions:
        for policy in chunk.policies:
            cell = cell_metrics(window, chunk.axis, region, policy, chunk.profile)
            for metric, value in cell.items():
                rows.append(
                    Row(chunk.source, window.window_id, chunk.axis, region, policy, metric, value)
                )
    return rows


def plan(
    *,
    sources: Sequence[str] = SOURCES,
    windows: int | None = None,
    axes: Sequence[str] = ("knee",),
    regions: dict[str, Sequence[str]] | None = None,
    policies: Sequence[str] = tuple(POLICIES),
) -> list[Chunk]:
    """The chunks of a grid: `windows` first windows per source (None: all)."""
    chunks = []
    for axis in axes:
        points = tuple((regions or {}).get(axis, AXES[axis]))
        for source in sources:
            n = (
                len(windows_of(source))
                if windows is None
                else min(windows, len(windows_of(source)))
            )
            chunks += [Chunk(source, i, axis, points, tuple(policies)) for i in range(n)]
    return chunks


Progress = Callable[[int], None]


def _serial(chunks: Sequence[Chunk], workers: int, tick: Progress) -> Iterator[list[Row]]:
    for chunk in chunks:
        rows = run_chunk(chunk)
        tick(chunk.cells)
        yield rows


def _process(chunks: Sequence[Chunk], workers: int, tick: Progress) -> Iterator[list[Row]]:
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_chunk, c): c for c in chunks}
        for fut in as_completed(futures):
            rows = fut.result()
            tick(futures[fut].cells)
            yield rows


def _ray(chunks: Sequence[Chunk], workers: int, tick: Progress) -> Iterator[list[Row]]:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(run_chunk)
        pending = {task.remote(c): c for c in chunks}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            ref = done[0]
            rows: list[Row] = ray.get(ref)
            tick(pending.pop(ref).cells)
            yield rows
    finally:
        if started:
            ray.shutdown()


EXECUTORS: dict[str, Callable[[Sequence[Chunk], int, Progress], Iterator[list[Row]]]] = {
    "serial": _serial,
    "process": _process,
    "ray": _ray,
}


def run_grid(
    chunks: Sequence[Chunk],
    *,
    executor: str = "process",
    workers: int | None = None,
    progress: bool = True,
) -> list[Row]:
    """Run every chunk; rows sorted (deterministic whatever the executor and worker count)."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; known: {list(EXECUTORS)}")
    n_workers = workers or min(2, os.cpu_count() or 1)
    rows: list[Row] = []
    with tqdm(
        total=sum(c.cells for c in chunks), unit="cell", disable=not progress, smoothing=0.05
    ) as bar:
        for part in EXECUTORS[executor](chunks, n_workers, bar.update):
            rows += part
    rows.sort(key=lambda r: r[:6])
    return rows


FIELDS = list(Row._fields)


def write_rows(rows: Iterable[Row], path: Path) -> Path:
    """Write tidy rows as CSV (gzip when the name ends in .gz); floats by `repr`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for r in rows:
            w.writerow([*r[:6], repr(r.value)])
    return path


def read_rows(path: Path) -> list[Row]:
    """Read what `write_rows` wrote."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        if header != FIELDS:
            raise ValueError(f"{path}: expected columns {FIELDS}, got {header}")
        return [Row(r[0], r[1], r[2], r[3], r[4], r[5], float(r[6])) for r in reader]
