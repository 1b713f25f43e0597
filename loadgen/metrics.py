"""Per-request records and the metrics computed from them, shared by simulation and replay.

`RequestRecord` is what the simulator (and, later, the live replay) writes for every arrival;
every function here is a pure function of a sequence of records, so simulated and live numbers
mean the same thing. Times are seconds on the run's clock. Undefined values (no completed
request, no deadline) are NaN, never imputed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEADLINE_EPS_S = 1e-9
"""A finish at the deadline (within float noise) meets it."""


@dataclass(slots=True)
class RequestRecord:
    """One request's life (times in seconds of the run's clock, sizes in tokens)."""

    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    """Target output length (the trace's true length)."""
    deadline_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    tokens: int = 0
    """Output tokens produced (equals `output_tokens` once finished)."""
    preemptions: int = 0
    """Times the request lost its place (gateway or engine preemption)."""
    dropped: bool = False
    """Never finished: rejected at admission or cut off at the end of the run."""
    tenant: str = "default"

    @property
    def completed(self) -> bool:
        return self.finish_s is not None and not self.dropped

    def met_slo(self) -> bool:
        """Finished no later than its deadline (a request without one meets it by finishing)."""
        if not self.completed:
            return False
        assert self.finish_s is not None
        return self.deadline_s is None or self.finish_s <= self.deadline_s + DEADLINE_EPS_S


def distribution(values: Sequence[float], prefix: str) -> dict[str, float]:
    """`<prefix>_mean`, `_p50`, `_p95`, `_p99` of `values` (NaN when empty)."""
    if not values:
        return {f"{prefix}_{s}": math.nan for s in ("mean", "p50", "p95", "p99")}
    a = np.asarray(values, dtype=np.float64)
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {
        f"{prefix}_mean": float(a.mean()),
        f"{prefix}_p50": float(p50),
        f"{prefix}_p95": float(p95),
        f"{prefix}_p99": float(p99),
    }


def ttft(records: Sequence[RequestRecord]) -> list[float]:
    """Time to first token (s) of every request that got one."""
    return [r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None]


def ttlt(records: Sequence[RequestRecord]) -> list[float]:
    """Time to last token (end-to-end latency, s) of every completed request."""
    return [r.finish_s - r.arrival_s for r in records if r.completed and r.finish_s is not None]


def tpot(records: Sequence[RequestRecord]) -> list[float]:
    """Time per output token after the first (s), completed requests with ≥ 2 tokens."""
    return [
        (r.finish_s - r.first_token_s) / (r.tokens - 1)
        for r in records
        if r.completed and r.finish_s is not None and r.first_token_s is not None and r.tokens > 1
    ]


def makespan_s(records: Sequence[RequestRecord]) -> float:
    """From the first arrival to the last finish (NaN without a completion)."""
    finishes = [r.finish_s for r in records if r.completed and r.finish_s is not None]
    if not finishes:
        return math.nan
    return max(finishes) - min(r.arrival_s for r in records)


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (Σx)² / (n·Σx²): 1 when all equal, 1/n at worst."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0 or not np.any(a):
        return math.nan
    return float(a.sum() ** 2 / (a.size * np.square(a).sum()))


def slowdowns(records: Sequence[RequestRecord], token_s: float) -> list[float]:
    """End-to-end latency over the request's ideal service time (output × `token_s`)."""
    return [
        (r.finish_s - r.arrival_s) / (max(r.output_tokens, 1) * token_s)
        for r in records
        if r.completed and r.finish_s is not None
    ]


def summarize(records: Sequence[RequestRecord], *, token_s: float = 0.001) -> dict[str, float]:
    """Every headline metric of one run.

    Rates are over the makespan. `slo_violation_rate` counts every arrival that did not finish
    by its deadline (late, dropped or unfinished) over all arrivals; `anwg` (the portability
    paper's primary metric) is the share of all arrivals finished within SLO, and `goodput_rps`
    those per second. Slowdown is latency over output × `token_s` (ideal decode time); Jain's
    index is over per-request slowdowns.
    """
    n = len(records)
    done = [r for r in records if r.completed]
    met = sum(r.met_slo() for r in records)
    span = makespan_s(records)
    out: dict[str, float] = {"requests": float(n), "completed": float(len(done))}
    out |= distribution(ttft(records), "ttft_s")
    out |= distribution(ttlt(records), "ttlt_s")
    out |= distribution(tpot(records), "tpot_s")
    tokens = sum(r.tokens for r in done)
    out["request_throughput_rps"] = len(done) / span if span > 0 else math.nan
    out["token_throughput_tps"] = tokens / span if span > 0 else math.nan
    out["completion_fraction"] = len(done) / n if n else math.nan
    out["slo_violation_rate"] = (n - met) / n if n else math.nan
    out["anwg"] = met / n if n else math.nan
    out["goodput_rps"] = met / span if span > 0 else math.nan
    slow = slowdowns(records, token_s)
    out["mean_slowdown"] = float(np.mean(slow)) if slow else math.nan
    out["jain_index"] = jain_index(slow)
    out["preemptions"] = float(sum(r.preemptions for r in records))
    return out


def violations(records: Sequence[RequestRecord]) -> int:
    """Arrivals that did not finish by their deadline."""
    return sum(not r.met_slo() for r in records)


def late_rate(records: Sequence[RequestRecord]) -> float:
    """Completed requests that finished after their deadline, over completed requests.

    The portability paper's SLO-violation rate (dropped requests are not counted; NaN when
    nothing completed). `summarize`'s `slo_violation_rate` counts over all arrivals instead.
    """
    done = [r for r in records if r.completed]
    if not done:
        return math.nan
    return sum(not r.met_slo() for r in done) / len(done)
