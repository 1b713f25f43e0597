"""ServeGen synthesis: moment-matched arrivals, seeded reproducibility, length tables."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from loadgen.traces import get_source, load_requests, load_windows
from loadgen.traces.arrivals import renewal_arrivals, sample_gaps, weibull_shape
from loadgen.traces.servegen import (
    SLOT_S,
    ServeGenSource,
    active_slots,
    parse_pmf,
    pmf_items,
    synthesize,
)


@pytest.mark.parametrize("cv", [0.3, 1.0, 2.5, 8.6, 40.0])
def test_weibull_shape_reproduces_cv(cv: float) -> None:
    k = weibull_shape(cv)
    ratio = math.exp(math.lgamma(1 + 2 / k) - 2 * math.lgamma(1 + 1 / k))
    assert math.sqrt(ratio - 1) == pytest.approx(cv, rel=1e-6)


@pytest.mark.parametrize("dist", ["Gamma", "Weibull", ""])
def test_gaps_have_the_asked_mean_and_cv(dist: str) -> None:
    rng = np.random.default_rng(1)
    cv = 1.0 if dist == "" else 1.6
    gaps = sample_gaps(rng, dist, 4.0, cv, 400_000)
    assert gaps.mean() == pytest.approx(0.25, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def _client_rows(shared: Path) -> list[tuple[str, float, float]]:
    """(dist, rate, cv) of real m-large client slots with a moderate CV, one per family."""
    source = get_source("servegen-language")
    assert isinstance(source, ServeGenSource)
    picked: dict[str, tuple[str, float, float]] = {}
    for c in source.clients(None):
        for dist, rate, cv in zip(c.iat_dist, c.rate_rps, c.cv, strict=True):
            if dist and dist not in picked and rate > 0.5 and 0.8 < cv < 2.0:
                picked[dist] = (dist, float(rate), float(cv))
    assert set(picked) == {"Gamma", "Weibull"}
    return list(picked.values())


def test_long_synthesis_matches_the_client_description(shared: Path) -> None:
    for dist, rate, cv in _client_rows(shared):
        duration = 100_000 / rate  # about 100k arrivals
        times = renewal_arrivals(np.random.default_rng(5), dist, rate, cv, duration)
        gaps = np.diff(times)
        assert times.size / duration == pytest.approx(rate, rel=0.03), dist
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08), dist


def test_renewal_arrivals_stay_in_range_and_are_sorted() -> None:
    times = renewal_arrivals(np.random.default_rng(0), "Gamma", 3.0, 5.0, SLOT_S)
    assert times.size > 0
    assert np.all(np.diff(times) >= 0) and times[0] >= 0 and times[-1] < SLOT_S
    assert renewal_arrivals(np.random.default_rng(0), "Gamma", 0.0, 1.0, SLOT_S).size == 0


def test_extreme_cv_is_bounded() -> None:
    times = renewal_arrivals(np.random.default_rng(0), "Gamma", 2.0, 148.0, SLOT_S)
    assert times.size <= 20 * 2.0 * SLOT_S + 1000


def test_pmf_parsing_matches_literal_eval(shared: Path) -> None:
    source = get_source("servegen-reason")
    assert isinstance(source, ServeGenSource)
    tables = source.clients(None)[0].tables_at(0.0)
    assert tables is not None
    for field in ("input_tokens", "output_tokens", "reason_ratio"):
        expected = ast.literal_eval(tables[field])
        values, probs = pmf_items(tables[field])
        assert dict(zip(values.tolist(), probs.tolist(), strict=True)) == expected
    assert pmf_items("{}")[0].size == 0
    values, cdf = parse_pmf("{3: 1, 5: 3}")
    assert values.tolist() == [3.0, 5.0] and cdf.tolist() == [0.25, 1.0]


def test_synthesis_is_seeded_and_reproducible(shared: Path) -> None:
    source = get_source("servegen-multimodal")
    assert isinstance(source, ServeGenSource)
    clients = source.clients(None)
    slot = active_slots(clients)[10]
    a = synthesize("s", clients, first_slot=slot, seed=3, n_requests=300)
    b = synthesize("s", clients, first_slot=slot, seed=3, n_requests=300)
    c = synthesize("s", clients, first_slot=slot, seed=4, n_requests=300)
    assert a == b and len(a) == 300
    assert a != c
    longer = synthesize("s", clients, first_slot=slot, seed=3, n_requests=600)
    assert longer[:300] == a  # a slot's synthesis does not depend on how much is asked for
    assert all(r.arrival_s >= clients[0].slot_start_s[slot] for r in a)
    assert all(r.tenant is not None and r.tenant.startswith("chunk-") for r in a)
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in a)


def test_synthesised_rate_follows_the_summed_description(shared: Path) -> None:
    """Over the first 600 s slot the synthesised count is near the summed rate x 600 s."""
    source = get_source("servegen-reason")
    assert isinstance(source, ServeGenSource)
    clients = source.clients(None)
    expected = sum(float(c.rate_rps[0]) for c in clients) * SLOT_S
    got = len(load_requests("servegen-reason"))
    assert got == pytest.approx(expected, rel=0.1)


def test_category_length_means_are_plausible(shared: Path) -> None:
    """Means of the shipped-size windows sit near SOURCES.md's rate-weighted means."""
    reason = [r for w in load_windows("servegen-reason", count=4) for r in w.requests]
    assert np.mean([r.output_tokens for r in reason]) == pytest.approx(2134, rel=0.35)
    assert np.mean([r.prompt_tokens for r in reason]) == pytest.approx(1576, rel=0.35)


def test_folder_path_must_exist(tmp_path: Path) -> None:
    from loadgen.traces import TraceDataMissing

    with pytest.raises(TraceDataMissing):
        load_requests("servegen-language", tmp_path / "missing")
    with pytest.raises(TraceDataMissing, match="chunk"):
        load_requests("servegen-language", tmp_path)
