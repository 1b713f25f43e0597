"""Metrics over hand-made records."""

from __future__ import annotations

import math

import pytest

from loadgen.metrics import RequestRecord, jain_index, summarize, tpot, ttft, ttlt, violations


def _records() -> list[RequestRecord]:
    return [
        RequestRecord(0, 0.0, 10, 5, deadline_s=1.0, first_token_s=0.1, finish_s=0.5, tokens=5),
        RequestRecord(1, 0.0, 10, 3, deadline_s=0.5, first_token_s=0.2, finish_s=1.0, tokens=3),
        RequestRecord(2, 0.5, 10, 4, deadline_s=2.0, first_token_s=None, tokens=0, dropped=True),
        RequestRecord(3, 1.0, 10, 1, deadline_s=1.5, first_token_s=1.5, finish_s=1.5, tokens=1),
    ]


def test_latencies() -> None:
    recs = _records()
    assert ttft(recs) == pytest.approx([0.1, 0.2, 0.5])
    assert ttlt(recs) == pytest.approx([0.5, 1.0, 0.5])
    assert tpot(recs) == pytest.approx([0.1, 0.4])  # one-token requests have no TPOT


def test_summary_counts_every_arrival() -> None:
    s = summarize(_records(), token_s=0.1)
    assert s["requests"] == 4 and s["completed"] == 3
    assert s["completion_fraction"] == pytest.approx(0.75)
    # request 1 is late, request 2 was dropped; request 3 finishes exactly at its deadline
    assert violations(_records()) == 2
    assert s["slo_violation_rate"] == pytest.approx(0.5)
    assert s["anwg"] == pytest.approx(0.5)
    assert s["request_throughput_rps"] == pytest.approx(3 / 1.5)
    assert s["goodput_rps"] == pytest.approx(2 / 1.5)
    assert s["token_throughput_tps"] == pytest.approx(9 / 1.5)
    assert s["ttft_s_p50"] == pytest.approx(0.2)
    assert s["mean_slowdown"] == pytest.approx((1.0 + 1.0 / 0.3 + 5.0) / 3)


def test_jain_index_bounds() -> None:
    assert jain_index([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert math.isnan(jain_index([]))


def test_empty_run_is_nan_not_zero() -> None:
    s = summarize([RequestRecord(0, 0.0, 10, 5, dropped=True)])
    assert s["anwg"] == 0.0
    assert math.isnan(s["ttlt_s_mean"]) and math.isnan(s["request_throughput_rps"])
