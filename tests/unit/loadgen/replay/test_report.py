"""Report math: latencies from the scheduled send, ITL, goodput, schedule lag, warnings."""

from __future__ import annotations

import math

import pytest

from loadgen.metrics import summarize
from loadgen.replay.client import ReplayResult, classify
from loadgen.replay.report import (
    comparison,
    failures,
    lags,
    medians,
    meets,
    parse_slos,
    summarize_replay,
    table,
    warnings_for,
)


def result(i: int, sched: float, lag: float, ttft: float, gaps: list[float]) -> ReplayResult:
    r = ReplayResult(i, sched, 10, len(gaps) + 1)
    r.sent_s = sched + lag
    r.first_token_s = sched + ttft
    r.gaps_s = gaps
    r.finish_s = r.first_token_s + sum(gaps)
    r.tokens = len(gaps) + 1
    r.status = "ok"
    return r


def test_latencies_are_measured_from_the_scheduled_send() -> None:
    rs = [result(0, 0.0, 0.002, 0.1, [0.01, 0.03]), result(1, 1.0, 0.020, 0.3, [0.02])]
    s = summarize_replay(rs)
    assert s["ttft_s_mean"] == pytest.approx(0.2)
    assert s["e2el_s_mean"] == pytest.approx((0.14 + 0.32) / 2)
    assert s["itl_s_mean"] == pytest.approx(0.02)
    assert s["tpot_s_mean"] == pytest.approx((0.02 + 0.02) / 2)
    assert s["duration_s"] == pytest.approx(1.32)
    assert s["request_throughput_rps"] == pytest.approx(2 / 1.32)
    assert s["output_throughput_tps"] == pytest.approx(5 / 1.32)
    assert lags(rs) == pytest.approx([0.002, 0.020])
    assert s["lag_s_max"] == pytest.approx(0.020)
    # the shared metrics module sees the same requests
    study = summarize([r.record() for r in rs])
    assert study["ttlt_s_mean"] == pytest.approx(s["e2el_s_mean"])


def test_lag_warning_and_failures() -> None:
    ok = result(0, 0.0, 0.050, 0.1, [0.01])
    bad = ReplayResult(1, 0.5, 10, 4, status="connection", error="refused")
    s = summarize_replay([ok, bad])
    assert s["failed"] == 1 and failures([ok, bad]) == {"connection": 1}
    assert any("schedule lag" in w for w in warnings_for(s))
    text = table(s, failures([ok, bad]))
    assert "connection:" in text and "Successful requests:" in text
    assert not warnings_for(summarize_replay([result(0, 0.0, 0.001, 0.1, [0.01])]))
    assert math.isnan(bad.lag_s) and not bad.record().completed


def test_goodput_against_slos() -> None:
    slos = parse_slos(["ttft:200", "e2el:250"])
    assert slos == {"ttft": 0.2, "e2el": 0.25}
    fast, slow = result(0, 0.0, 0, 0.1, [0.01]), result(1, 0.0, 0, 0.3, [0.01])
    assert meets(fast, slos) and not meets(slow, slos)
    s = summarize_replay([fast, slow], slos)
    assert s["slo_attainment"] == 0.5
    with pytest.raises(ValueError):
        parse_slos(["latency:3"])


def test_comparison_ratios_and_medians() -> None:
    a = summarize_replay([result(0, 0.0, 0, 0.2, [0.1])])
    b = summarize_replay([result(0, 0.0, 0, 0.1, [0.05])])
    text = comparison({"fcfs": a, "sagesched": b})
    line = next(x for x in text.splitlines() if x.startswith("TTLT mean"))
    assert line.split()[-1] == "0.500"
    assert medians([result(0, 0.0, 0, 0.2, [0.1])]) == pytest.approx({"ttft_s": 0.2, "ttlt_s": 0.3})


def test_classify() -> None:
    assert classify(ConnectionRefusedError()) == "connection"
    assert classify(TimeoutError()) == "timeout"
    assert classify(RuntimeError()) == "error"
