"""Load regions: compression, knee bisection, explicit rates, utilisation, the knee manifests,
and the reproduction of the portability paper's published λ_ref."""

from __future__ import annotations

import csv
import math
import statistics

import pytest

from loadgen.regions import (
    REGIONS,
    compress,
    factor_for_rate,
    factor_for_utilisation,
    find_knee,
    knee_path,
    mean_rate_rps,
    read_knees,
    region_factor,
)
from loadgen.schema import TraceRequest, Window
from loadgen.sim.simulator import simulate

SOURCES = ["lssp-azure2024", "lssp-bailian", "lssp-burstgpt"]


def _req(t: float, prompt: int, out: int, slack: float) -> TraceRequest:
    return TraceRequest(t, prompt, out, "t", predicted_output_tokens=out, deadline_s=t + slack)


def test_compress_divides_gaps_and_slack() -> None:
    reqs = [_req(0.0, 10, 5, 2.0), _req(4.0, 10, 5, 1.0)]
    out = compress(reqs, 4.0)
    assert [r.arrival_s for r in out] == [0.0, 1.0]
    assert [r.deadline_s for r in out] == [0.5, 1.25]
    with pytest.raises(ValueError):
        compress(reqs, 0.0)


def test_knee_of_a_single_request_is_slack_over_service_time() -> None:
    # 10 tokens take 10 ms; a 1 s slack is met while 1/λ ≥ 0.010, so the knee is λ = 100
    assert find_knee([_req(0.0, 10, 10, 1.0)]) == pytest.approx(100.0, rel=1e-6)


def test_knee_of_a_queueing_window() -> None:
    # 65 requests at once, 64 sequences: the 65th waits 20 steps then needs 20 more (40 ms)
    reqs = [_req(0.0, 10, 20, 4.0) for _ in range(65)]
    knee = find_knee(reqs)
    assert knee == pytest.approx(100.0, rel=1e-6)
    assert simulate(compress(reqs, knee * 0.99), "fcfs").records[-1].met_slo()


def test_regions_are_the_published_multiples() -> None:
    assert REGIONS == {"LOW": 0.5, "PRE_KNEE": 0.8, "KNEE": 1.0, "POST_KNEE": 1.1,
                       "OVERLOAD": 1.2, "HIGH_PRESSURE": 1.5}  # fmt: skip


def test_region_factor_uses_the_window_knee_or_the_manifest() -> None:
    w = Window("custom", "w0", (_req(0.0, 10, 10, 1.0),), {"knee": 50.0})
    assert region_factor(w, "OVERLOAD") == pytest.approx(60.0)
    fresh = Window("custom", "w1", (_req(0.0, 10, 10, 1.0),))
    assert region_factor(fresh, "LOW") == pytest.approx(50.0, rel=1e-6)
    with pytest.raises(ValueError, match="unknown region"):
        region_factor(w, "MEDIUM")


def test_explicit_rate_and_utilisation_targets() -> None:
    reqs = [_req(i * 0.5, 100, 10, 5.0) for i in range(11)]  # 2 req/s
    f = factor_for_rate(reqs, 8.0)
    assert f == pytest.approx(4.0)
    assert mean_rate_rps(compress(reqs, f)) == pytest.approx(8.0)
    # 110 tokens over 5 s is 22 tok/s; capacity 64 seqs / 1 ms = 64,000 tok/s
    assert factor_for_utilisation(reqs, 0.5) == pytest.approx(0.5 * 64_000 / 22)


@pytest.mark.parametrize("source", SOURCES)
def test_knee_manifest_matches_the_published_lambda_ref(source: str) -> None:
    with knee_path(source).open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["window_id", "knee", "lambda_ref"]
    ratios = [float(r["knee"]) / float(r["lambda_ref"]) for r in rows]
    assert len(ratios) == (39 if source == "lssp-azure2024" else 40)
    assert 0.9 <= statistics.median(ratios) <= 1.1
    assert sum(abs(x - 1) <= 0.2 for x in ratios) >= 0.8 * len(ratios)
    assert set(read_knees(source)) == {r["window_id"] for r in rows}


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_bisection_reproduces_lambda_ref_on_every_frozen_window(source: str) -> None:
    from loadgen.traces import load_windows

    ratios = [find_knee(w.requests) / w.meta["lambda_ref"] for w in load_windows(source)]
    assert 0.9 <= statistics.median(ratios) <= 1.1
    assert sum(abs(x - 1) <= 0.2 for x in ratios) >= 0.8 * len(ratios)
    assert all(math.isfinite(x) for x in ratios)


def test_kv_batch_bounds_the_full_batch_when_memory_binds() -> None:
    from loadgen.engine.configs import engine_config
    from loadgen.engine.profiles import make_profile
    from loadgen.regions import factor_for_utilisation, kv_batch

    # O·(I + O/2) per request: 1000·(1000 + 500) = 1.5e6 held over 1000 output tokens
    reqs = [_req(float(i), 1000, 1000, 1e9) for i in range(10)]
    qwen = engine_config("h200-qwen3-32b")
    assert kv_batch(reqs, qwen) == pytest.approx(qwen.kv_tokens / 1500)
    # KV holds 163 of these, fewer than the 1,024 sequences: that batch sets the capacity
    prof = make_profile("h200-qwen3-32b")

    def capacity(n: int) -> float:
        return n / prof.iteration_s(n, n * 1500, 0)

    roomy = qwen.with_(kv_tokens=10**9)
    ratio = factor_for_utilisation(reqs, 1.0, engine=roomy, profile=prof) / (
        factor_for_utilisation(reqs, 1.0, engine=qwen, profile=prof)
    )
    assert ratio == pytest.approx(capacity(1024) / capacity(163))
