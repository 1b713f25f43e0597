"""The window sampler: determinism, outcome-blindness, rebasing, and the frozen set."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadgen.schema import TraceRequest, Window
from loadgen.traces import TraceDataMissing, frozen, load_requests, load_windows
from loadgen.traces.windows import (
    SAMPLER,
    default_count,
    rebase,
    sample_windows,
    stride_starts,
    window_digest,
)


@given(
    n_total=st.integers(0, 5000),
    n_requests=st.integers(1, 300),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
def test_stride_starts_fit_and_do_not_overlap(
    n_total: int, n_requests: int, seed: int, data: st.DataObject
) -> None:
    fit = n_total // n_requests
    count = data.draw(st.integers(0, fit))
    starts = stride_starts(n_total, n_requests, count, seed)
    assert len(starts) == count
    assert starts == stride_starts(n_total, n_requests, count, seed)
    for a, b in itertools.pairwise(starts):
        assert b >= a + n_requests
    assert all(0 <= s <= n_total - n_requests for s in starts)


def test_stride_starts_refuses_what_cannot_fit() -> None:
    with pytest.raises(ValueError, match="at most 2"):
        stride_starts(450, 200, 3, 0)
    with pytest.raises(ValueError):
        stride_starts(450, 0, 1, 0)
    assert default_count(199, 200) == 0
    assert default_count(383, 200) == 1
    assert default_count(19366, 200) == 48


def _fake_trace(n: int, salt: int = 0) -> list[TraceRequest]:
    return [
        TraceRequest(10.0 + 0.5 * i, 100 + (i * 7 + salt) % 50, 1 + (i * 13 + salt) % 90, "x")
        for i in range(n)
    ]


def test_sampler_is_outcome_blind() -> None:
    """Windows start at the same indices whatever the lengths are."""
    a = sample_windows("x", _fake_trace(5000, 0), n_requests=200, count=5, seed=3)
    b = sample_windows("x", _fake_trace(5000, 17), n_requests=200, count=5, seed=3)
    assert [w.meta["start_index"] for w in a] == [w.meta["start_index"] for w in b]
    assert [w.requests[0].prompt_tokens for w in a] != [w.requests[0].prompt_tokens for w in b]


def test_windows_are_rebased_and_consecutive() -> None:
    trace = _fake_trace(3000)
    for w in sample_windows("x", trace, n_requests=100, count=4, seed=1):
        start = w.meta["start_index"]
        assert w.meta["sampler"] == SAMPLER
        assert w.requests[0].arrival_s == 0.0
        assert [r.prompt_tokens for r in w.requests] == [
            r.prompt_tokens for r in trace[start : start + 100]
        ]
        assert w.requests[-1].arrival_s == pytest.approx(0.5 * 99)


def test_rebase_moves_deadlines_with_arrivals() -> None:
    reqs = [TraceRequest(5.0, 1, 1, "x", deadline_s=7.5), TraceRequest(6.0, 1, 1, "x")]
    out = rebase(reqs)
    assert (out[0].arrival_s, out[0].deadline_s) == (0.0, 2.5)
    assert (out[1].arrival_s, out[1].deadline_s) == (1.0, None)
    assert rebase([]) == ()


@pytest.mark.parametrize("source", ["azure-code-2023", "azure-conv-2023", "servegen-reason"])
def test_same_seed_same_windows_other_seed_other_windows(shared: Path, source: str) -> None:
    first = load_windows(source, count=3, seed=7)
    again = load_windows(source, count=3, seed=7)
    other = load_windows(source, count=3, seed=8)
    assert first == again
    assert [window_digest(w) for w in first] == [window_digest(w) for w in again]
    assert len(first) == 3 and all(len(w) == 200 for w in first)
    assert [window_digest(w) for w in first] != [window_digest(w) for w in other]


def test_burstgpt_slice_gives_one_window_whose_start_depends_on_seed(shared: Path) -> None:
    starts = {load_windows("burstgpt-v1", seed=s)[0].meta["start_index"] for s in range(6)}
    assert len(starts) > 1
    assert all(0 <= s <= 383 - 200 for s in starts)


def test_window_digest_sees_every_field() -> None:
    base = Window("x", "w", (TraceRequest(0.0, 1, 2, "x"),))
    other = Window("x", "w", (TraceRequest(0.0, 1, 2, "x", deadline_s=1.0),))
    assert window_digest(base) != window_digest(other)


@pytest.mark.parametrize("source", sorted(frozen.FROZEN_SPEC))
def test_frozen_windows_ship_and_match_their_manifest(source: str) -> None:
    manifest = frozen.read_manifest(source)
    n_requests, count, seed = frozen.FROZEN_SPEC[source]
    assert (manifest["n_requests"], manifest["count"], manifest["seed"]) == (
        n_requests,
        count,
        seed,
    )
    windows = frozen.read_frozen(source)
    assert len(windows) == count
    assert all(len(w) == n_requests and w.source == source for w in windows)
    assert [window_digest(w) for w in windows] == [w["sha256"] for w in manifest["windows"]]


@pytest.mark.parametrize("source", sorted(frozen.FROZEN_SPEC))
def test_frozen_windows_equal_a_fresh_sampling(shared: Path, source: str) -> None:
    n_requests, count, seed = frozen.FROZEN_SPEC[source]
    fresh = load_windows(source, n_requests=n_requests, count=count, seed=seed)
    assert fresh == frozen.read_frozen(source)


def test_frozen_windows_serve_when_shared_data_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SAGESCHED_SHARED_DATA", str(tmp_path))
    windows = load_windows("azure-conv-2023", count=4, seed=0)
    assert windows == frozen.read_frozen("azure-conv-2023")
    assert len(load_windows("servegen-language", count=4)) == 4
    assert len(load_windows("lssp-bailian")) == 40  # shipped, never needs shared data


def test_load_requests_is_arrival_ordered_for_every_shared_source(shared: Path) -> None:
    for source in ["azure-code-2023", "burstgpt-v3", "servegen-multimodal", "lssp-burstgpt"]:
        reqs = load_requests(source)
        assert reqs, source
        if source.startswith("lssp"):
            continue  # windows concatenated: each restarts at 0
        assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs)), source


def test_shipped_windows_need_nothing_outside_the_repo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from loadgen.traces import shipped_windows

    monkeypatch.setenv("SAGESCHED_SHARED_DATA", str(tmp_path))
    counts = {s: len(shipped_windows(s)) for s in ("lssp-azure2024", "burstgpt-v3", "azure-2024")}
    assert counts == {"lssp-azure2024": 39, "burstgpt-v3": 1, "azure-2024": 0}
    # count=None means ServeGen's default (4), the frozen language set's count
    assert load_windows("servegen-language") == frozen.read_frozen("servegen-language")
    with pytest.raises(TraceDataMissing):
        load_windows("servegen-reason")  # default 4 windows, but 2 ship
