"""Replay reports: `vllm bench serve`-style latency tables plus the trace-study metrics.

Everything derives from `ReplayResult`s; the trace-study metrics (SLO attainment, slowdown,
Jain's index) come from `loadgen.metrics.summarize` over the same `RequestRecord`s the
simulator writes, so live and simulated numbers mean the same thing. Latencies are measured
from each request's *scheduled* send time, so a late client shows up as latency (and as
schedule lag), never as a lighter load.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence

from loadgen.metrics import distribution, summarize
from loadgen.replay.client import ReplayResult

LAG_WARN_S = 0.010
"""Schedule-lag p99 above which the client, not the server, limits the replay."""
SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_slos(spec: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "e2el:2000"]` (milliseconds, as `vllm bench serve --goodput`) → seconds."""
    out = {}
    for item in spec:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"bad SLO {item!r}: use {'/'.join(SLO_KEYS)}:MILLISECONDS")
        out[key] = float(value) / 1000.0
    return out


def _tpot(r: ReplayResult) -> float | None:
    if r.first_token_s is None or r.finish_s is None or r.tokens < 2:
        return None
    return (r.finish_s - r.first_token_s) / (r.tokens - 1)


def meets(r: ReplayResult, slos: Mapping[str, float]) -> bool:
    """Whether a successful request meets every given SLO (seconds)."""
    if not r.ok or r.first_token_s is None or r.finish_s is None:
        return False
    tpot = _tpot(r) or 0.0
    got = {"ttft": r.first_token_s - r.scheduled_s, "tpot": tpot,
           "e2el": r.finish_s - r.scheduled_s}  # fmt: skip
    return all(got[k] <= v for k, v in slos.items())


def lags(results: Sequence[ReplayResult]) -> list[float]:
    """Schedule lag (actual − scheduled send, s) of every request that was sent."""
    return [r.lag_s for r in results if r.sent_s is not None]


def summarize_replay(
    results: Sequence[ReplayResult], slos: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Every number of the report (seconds, requests/s, tokens/s)."""
    ok = [r for r in results if r.ok]
    ends = [r.finish_s for r in results if r.finish_s is not None]
    duration = max(ends) - min(r.scheduled_s for r in results) if ends else math.nan
    out: dict[str, float] = {
        "requests": float(len(results)),
        "successful": float(len(ok)),
        "failed": float(len(results) - len(ok)),
        "duration_s": duration,
    }
    out_tokens = sum(r.tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    out["request_throughput_rps"] = per_s(len(ok))
    out["output_throughput_tps"] = per_s(out_tokens)
    out["total_token_throughput_tps"] = per_s(out_tokens + in_tokens)
    ttft = [r.first_token_s - r.scheduled_s for r in ok if r.first_token_s is not None]
    out |= distribution(ttft, "ttft_s")
    out |= distribution([t for r in ok if (t := _tpot(r)) is not None], "tpot_s")
    out |= distribution([g for r in ok for g in r.gaps_s], "itl_s")
    e2el = [r.finish_s - r.scheduled_s for r in ok if r.finish_s is not None]
    out |= distribution(e2el, "e2el_s")
    lag = lags(results)
    out |= distribution(lag, "lag_s")
    out["lag_s_max"] = max(lag) if lag else math.nan
    if slos:
        good = sum(meets(r, slos) for r in results)
        out["goodput_rps"] = per_s(good)
        out["slo_attainment"] = good / len(results) if results else math.nan
    study = summarize([r.record() for r in results])
    for key in ("anwg", "slo_violation_rate", "mean_slowdown", "jain_index", "makespan_s"):
        if key in study:
            out[f"study_{key}"] = study[key]
    return out


def failures(results: Sequence[ReplayResult]) -> dict[str, int]:
    """Failed requests per status."""
    return dict(Counter(r.status for r in results if not r.ok))


def warnings_for(summary: Mapping[str, float]) -> list[str]:
    out = []
    if summary.get("lag_s_p99", 0.0) > LAG_WARN_S:
        out.append(
            f"WARNING: schedule lag p99 {summary['lag_s_p99'] * 1000:.1f} ms > "
            f"{LAG_WARN_S * 1000:.0f} ms: the client is the bottleneck, latencies are suspect"
        )
    if summary.get("failed", 0.0) > 0:
        out.append(f"WARNING: {int(summary['failed'])} of {int(summary['requests'])} failed")
    return out


def _ms(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v * 1000:.2f}"


def table(summary: Mapping[str, float], errors: Mapping[str, int] | None = None,
          title: str = "Serving Benchmark Result") -> str:  # fmt: skip
    """The `vllm bench serve` layout (ms), then schedule lag, study metrics and failures."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<40}{value:>10}")

    row("Successful requests:", f"{int(summary['successful'])}")
    row("Failed requests:", f"{int(summary['failed'])}")
    row("Benchmark duration (s):", f"{summary['duration_s']:.2f}")
    row("Request throughput (req/s):", f"{summary['request_throughput_rps']:.2f}")
    row("Output token throughput (tok/s):", f"{summary['output_throughput_tps']:.2f}")
    row("Total token throughput (tok/s):", f"{summary['total_token_throughput_tps']:.2f}")
    if "goodput_rps" in summary:
        row("Request goodput (req/s):", f"{summary['goodput_rps']:.2f}")
        row("SLO attainment:", f"{summary['slo_attainment']:.3f}")
    sections = (
        ("ttft_s", "Time to First Token"),
        ("tpot_s", "Time per Output Token (excl. 1st token)"),
        ("itl_s", "Inter-token Latency"),
        ("e2el_s", "End-to-end Latency"),
        ("lag_s", "Schedule lag (client)"),
    )
    for key, name in sections:
        lines.append(f"{name[:w]:-^{w}}")
        for stat, label in (("mean", "Mean"), ("p50", "Median"), ("p95", "P95"), ("p99", "P99")):
            row(f"{label} {key.split('_')[0].upper()} (ms):", _ms(summary[f"{key}_{stat}"]))
    lines.append(f"{'Trace-study metrics':-^{w}}")
    for key in sorted(k for k in summary if k.startswith("study_")):
        row(key.removeprefix("study_") + ":", f"{summary[key]:.4g}")
    if errors:
        lines.append(f"{'Failures':-^{w}}")
        for status, n in sorted(errors.items()):
            row(f"{status}:", str(n))
    lines.append("=" * w)
    lines += warnings_for(summary)
    return "\n".join(lines)


COMPARE_KEYS = (
    ("e2el_s_mean", "TTLT mean (s)"),
    ("e2el_s_p50", "TTLT p50 (s)"),
    ("e2el_s_p99", "TTLT p99 (s)"),
    ("ttft_s_mean", "TTFT mean (s)"),
    ("ttft_s_p50", "TTFT p50 (s)"),
    ("ttft_s_p99", "TTFT p99 (s)"),
    ("request_throughput_rps", "throughput (req/s)"),
    ("output_throughput_tps", "output (tok/s)"),
    ("failed", "failed"),
    ("lag_s_p99", "lag p99 (s)"),
)


def comparison(summaries: Mapping[str, Mapping[str, float]]) -> str:
    """Side by side, with each column's ratio to the first (baseline) column."""
    names = list(summaries)
    base = summaries[names[0]]
    width = max(12, *(len(n) for n in names))
    head = f"{'metric':<20}" + "".join(f"{n:>{width + 2}}" for n in names)
    head += "".join(f"{n + '/' + names[0]:>{width + 10}}" for n in names[1:])
    lines = [head]
    for key, label in COMPARE_KEYS:
        cells = "".join(f"{summaries[n].get(key, math.nan):>{width + 2}.4g}" for n in names)
        for n in names[1:]:
            b = base.get(key, math.nan)
            ratio = summaries[n].get(key, math.nan) / b if b else math.nan
            cells += f"{ratio:>{width + 10}.3f}"
        lines.append(f"{label:<20}{cells}")
    return "\n".join(lines)


def medians(results: Sequence[ReplayResult]) -> dict[str, float]:
    """Median TTFT and TTLT (s) of the successful requests."""
    ok = [r for r in results if r.ok and r.first_token_s is not None and r.finish_s is not None]
    return {
        "ttft_s": statistics.median(r.first_token_s - r.scheduled_s for r in ok),  # type: ignore[operator]
        "ttlt_s": statistics.median(r.finish_s - r.scheduled_s for r in ok),  # type: ignore[operator]
    }
