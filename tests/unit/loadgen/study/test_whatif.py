"""The what-if on a capture: the paper's imputed fields, windows with their own knees, the
agreement statistics against a public source, and a small end-to-end run with its report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from loadgen.regions import find_knee
from loadgen.schema import TraceRequest
from loadgen.study import analysis, whatif
from loadgen.study.grid import MEASURED, METRICS, Row, read_rows
from loadgen.traces import load_windows


def write_capture(folder: Path, requests: list[TraceRequest], t0: float = 1.7e9) -> Path:
    """`requests` as a gateway capture file (completed records on the wall clock)."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "capture-000001.jsonl").open("w") as f:
        for r in requests:
            rec = {"v": 1, "arrival_s": t0 + r.arrival_s, "model": "m",
                   "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                   "outcome": "completed"}  # fmt: skip
            f.write(json.dumps(rec) + "\n")
        f.write(json.dumps({"v": 1, "arrival_s": t0, "model": "m", "prompt_tokens": None,
                            "output_tokens": None, "outcome": "rejected"}) + "\n")  # fmt: skip
    return folder


def bailian_stream(n_windows: int, speedup: float) -> list[TraceRequest]:
    """Consecutive Bailian windows on one clock, `speedup` times faster than recorded."""
    out: list[TraceRequest] = []
    offset = 0.0
    for w in load_windows("lssp-bailian")[:n_windows]:
        out += [
            TraceRequest(offset + r.arrival_s / speedup, r.prompt_tokens, r.output_tokens, "x")
            for r in w.requests
        ]
        offset = out[-1].arrival_s + 1.0
    return out


def test_paper_fields_follow_the_reference_rule() -> None:
    reqs = [TraceRequest(0.5 * i, 100 + i, 50 + (i % 400), "x") for i in range(2000)]
    out = whatif.paper_fields(reqs, seed=3)
    assert out == whatif.paper_fields(reqs, seed=3)
    assert out != whatif.paper_fields(reqs, seed=4)
    for r in out:
        assert r.predicted_output_tokens is not None and r.deadline_s is not None
        expected = r.arrival_s + 20 * (0.0004 * r.prompt_tokens + 0.02 * r.predicted_output_tokens)
        assert r.deadline_s == pytest.approx(expected)
    noise = np.log([r.predicted_output_tokens / r.output_tokens for r in out])  # type: ignore[operator]
    assert abs(float(np.mean(noise))) < 0.02
    assert 0.18 < float(np.std(noise)) < 0.22  # σ = 0.2, as the paper imputed


def test_capture_windows_are_consecutive_with_their_own_knee(tmp_path: Path) -> None:
    reqs = bailian_stream(2, speedup=50.0)
    cap = write_capture(tmp_path / "cap", reqs)
    windows = whatif.capture_windows(cap, n_requests=150)
    assert len(windows) == 2  # 400 completed requests: two whole windows of 150
    first = windows[0].requests
    assert [r.output_tokens for r in first] == [r.output_tokens for r in reqs[:150]]
    assert first[0].arrival_s == 0.0 and all(r.deadline_s is not None for r in first)
    assert windows[0].meta["knee"] == find_knee(first)
    with pytest.raises(ValueError, match="fewer than one window of 500"):
        whatif.capture_windows(cap, n_requests=500)


def _rows(source: str, values: dict[str, list[float]]) -> list[Row]:
    return [
        Row(source, f"{source}_w{i}", "knee", "KNEE", policy, "anwg", v)
        for policy, vs in values.items()
        for i, v in enumerate(vs)
    ]


def test_agreement_is_perfect_for_the_same_ranking_and_finds_flips() -> None:
    rng = np.random.default_rng(0)
    base = {p: list(0.9 - 0.2 * k + rng.normal(0, 0.01, 8)) for k, p in enumerate("abcd")}
    flipped = {p: [1.0 - v for v in vs] for p, vs in base.items()}
    for capture, tau, flips in ((base, 1.0, 0), (flipped, -1.0, 6)):
        rows = _rows(whatif.CAPTURE, capture) + _rows("lssp-bailian", base)
        grid = analysis.build(rows, tuple("abcd"), sources=(whatif.CAPTURE, "lssp-bailian"))
        (agree,) = whatif.agreements(grid, ["KNEE"], n_boot=300)
        assert agree.source == "lssp-bailian"
        assert agree.tau.value == pytest.approx(tau)
        assert len(agree.supported) == flips


def test_whatif_end_to_end_on_a_small_capture(tmp_path: Path) -> None:
    cap = write_capture(tmp_path / "cap", bailian_stream(2, speedup=200.0))
    policies = ("fifo", "edf", "vllm_faithful", "gateway_sagesched")
    out = tmp_path / "out"
    out.mkdir()
    summary = whatif.run_whatif(
        cap, out, window_requests=200, public_per_source=1, regions=("KNEE",),
        policies=policies, executor="serial", n_boot=200, progress=False,
    )  # fmt: skip
    knees = summary["knees"]
    assert len(knees) == 2 and all(k > 0 for k in knees)
    assert summary["measured_load_x_knee"] == pytest.approx(math.exp(-np.mean(np.log(knees))))
    assert summary["measured_utilisation"] > 0
    ranking = summary["ranking"]
    assert sorted(ranking[MEASURED]) == sorted(policies) == sorted(ranking["KNEE"])
    assert summary["recommended"] == ranking[MEASURED][0]
    assert set(summary["tied_with_recommended"]) <= set(policies) - {summary["recommended"]}
    fastest = summary["best_mean_latency"]
    assert set(summary["tied_with_best_latency"]) <= set(policies) - {fastest}
    assert set(summary["tau"]) == {f"KNEE|{s}" for s in whatif.SOURCES}
    assert all(-1.0 <= v[0] <= 1.0 for v in summary["tau"].values() if not math.isnan(v[0]))
    rows = read_rows(out / "whatif.csv.gz")
    cells = 2 * 2 + 3 * 1  # capture windows x (KNEE + MEASURED) + public windows x KNEE
    assert len(rows) == cells * len(policies) * len(METRICS)
    report = (out / "report.md").read_text()
    assert f"**{summary['recommended']}**" in report
    for label in ("Azure", "Bailian", "BurstGPT", "## KNEE", "At your measured load"):
        assert label in report


def test_ties_are_policies_whose_paired_interval_includes_zero() -> None:
    rng = np.random.default_rng(1)
    boot = np.column_stack(
        [1.0 + rng.normal(0, 0.01, 500), 1.0 + rng.normal(0, 0.01, 500), 0.5 + np.zeros(500)]
    )
    assert whatif._ties(boot, 0).tolist() == [True, True, False]
