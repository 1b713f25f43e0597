"""Both studies end to end on a small grid (seconds): `sagesched study --mode lssp|sagesched`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.study import cli
from loadgen.study.grid import POLICIES


def test_lssp_small_grid_report(tmp_path: Path) -> None:
    argv = ["--mode", "lssp", "--out", str(tmp_path), "--windows", "2", "--boot", "40"]
    argv += ["--regions", "LOW,KNEE,HIGH_PRESSURE,U1,U4", "--no-progress", "--workers", "2"]
    assert cli.main(argv) == 0
    report = (tmp_path / "report.md").read_text()
    # the knee table: 3 regions x 3 source pairs, each beside the published value
    assert report.count("| KNEE |") >= 2 and "Azure–Bailian (ours, 95% CI) | paper" in report
    assert "0.958" in report and "supported_practical" in report
    assert "## Load axis: utilisation, SLOs held fixed" in report
    for png in ("tau_heatmap_knee.png", "rank_bump_knee.png", "tau_heatmap_util.png"):
        assert (tmp_path / png).stat().st_size > 1000
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["knee"]["tau_b"]) == 9
    assert summary["meta"]["cells_knee"] == 3 * 2 * 3 * len(POLICIES)


def test_sagesched_small_grid_report(tmp_path: Path) -> None:
    from loadgen.traces.registry import TraceDataMissing

    try:
        code = cli.main(
            [
                *("--mode", "sagesched", "--out", str(tmp_path), "--small", "--boot", "50"),
                *("--no-progress", "--no-plots"),
            ]
        )
    except (TraceDataMissing, FileNotFoundError) as exc:  # pragma: no cover
        pytest.fail(f"shared prompt/trace data missing: {exc}")
    assert code == 0
    report = (tmp_path / "report.md").read_text()
    assert "## Headline: pooled mean-TTLT gain of SageSched" in report
    summary = json.loads((tmp_path / "summary.json").read_text())
    for arm in ("semantic", "oracle-0%", "oracle-50%"):
        assert {"fcfs", "ssjf", "trail", "fastserve", "ltr", "srpt-oracle"} <= set(
            summary["pooled"][arm]
        )
    gain, lo, hi = summary["pooled"]["oracle-0%"]["fcfs"]
    assert lo <= gain <= hi and -1.0 < gain < 1.0
