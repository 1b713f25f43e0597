"""LSSP frozen windows: counts, conventions, and the shipped copy equal to the shared files."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.traces import load_requests, load_windows, shared_data_dir
from loadgen.traces.lssp import LSSP_STEMS

EXPECTED_WINDOWS = {"lssp-azure2024": 39, "lssp-bailian": 40, "lssp-burstgpt": 40}


def _shared_lssp() -> Path:
    folder = shared_data_dir() / "traces" / "lssp"
    if not folder.exists():
        pytest.fail(f"shared data not at {folder} (set SAGESCHED_SHARED_DATA)")
    return folder


@pytest.mark.parametrize("source", sorted(LSSP_STEMS))
def test_shipped_windows_follow_the_conventions(source: str) -> None:
    windows = load_windows(source)
    assert len(windows) == EXPECTED_WINDOWS[source]
    assert [len(w) for w in windows] == [200] * len(windows)
    ids = [w.window_id for w in windows]
    assert ids == sorted(ids)  # file order: pilot_v2_w10..w39 then stage0_w00..w09
    assert "pilot_v2_w10" in ids[0] and "stage0" in ids[-1]
    for w in windows:
        assert w.source == source
        assert w.requests[0].arrival_s == 0.0
        arrivals = [r.arrival_s for r in w.requests]
        assert arrivals == sorted(arrivals)
        lam, factor = w.meta["lambda_ref"], w.meta["absolute_load_factor"]
        assert isinstance(lam, float) and factor == pytest.approx(1.5 * lam, rel=1e-9)
        for r in w.requests:
            assert r.source == source
            assert r.predicted_output_tokens is not None and r.predicted_output_tokens >= 1
            assert r.deadline_s is not None and r.deadline_s > r.arrival_s
            assert r.prompt_tokens >= 1 and r.output_tokens >= 1


def test_azure2024_misses_w09_only() -> None:
    ids = {w.window_id for w in load_windows("lssp-azure2024")}
    assert "azure_llm_2024_stage0_w09" not in ids
    assert "azure_llm_2024_stage0_w08" in ids


def test_burstgpt_arrivals_are_raw_whole_seconds() -> None:
    first = load_windows("lssp-burstgpt", count=1)
    assert len(first) == 1
    assert all(r.arrival_s == int(r.arrival_s) for r in first[0].requests)
    assert first[0].requests[1].arrival_s == 1.0  # raw time, not compressed by the factor


@pytest.mark.parametrize("source", sorted(LSSP_STEMS))
def test_shipped_copy_equals_the_shared_files(source: str) -> None:
    shared = load_windows(source, path=_shared_lssp())
    assert shared == load_windows(source)


def test_load_requests_concatenates_windows() -> None:
    requests = load_requests("lssp-bailian")
    assert len(requests) == 8000
    assert sum(r.arrival_s == 0.0 for r in requests) >= 40


def test_wrong_window_size_is_refused() -> None:
    with pytest.raises(ValueError, match="200"):
        load_windows("lssp-burstgpt", n_requests=100)


def test_shared_originals_match_the_data_manifest() -> None:
    """The shipped copy was cut from these exact files (sha256 of uncompressed content)."""
    import gzip
    import hashlib

    folder = _shared_lssp()
    manifest = folder.parent.parent / "MANIFEST.tsv"
    expected = {}
    for line in manifest.read_text().splitlines()[1:]:
        cols = line.split("\t")
        if cols[0].startswith("traces/lssp/"):
            expected[cols[0].removeprefix("traces/lssp/")] = cols[-1]
    assert len(expected) == 6
    for name, sha in expected.items():
        data = (folder / name).read_bytes()
        if name.endswith(".gz"):
            data = gzip.decompress(data)
        assert hashlib.sha256(data).hexdigest() == sha, name
