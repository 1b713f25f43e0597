"""`sagesched simulate` end to end on a few frozen windows."""

from __future__ import annotations

import json

import pytest

import sagesched_cli


def test_simulate_json_on_two_windows(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--source", "lssp-burstgpt", "--windows", "2", "--region", "KNEE",
            "--policies", "fcfs,sagesched,vllm-fcfs", "--json"]  # fmt: skip
    assert sagesched_cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["windows"] == 2 and out["load"] == "region=KNEE"
    assert set(out["contenders"]) == {"fcfs", "sagesched", "vllm-fcfs"}
    for metrics in out["contenders"].values():
        assert 0.0 <= metrics["anwg"] <= 1.0
        assert metrics["anwg"] + metrics["slo_violation_rate"] == pytest.approx(1.0)


def test_simulate_table_with_an_explicit_factor(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--source", "lssp-bailian", "--windows", "1", "--factor", "10",
            "--profile", "h200-llama3-8b", "--policies", "ssjf"]  # fmt: skip
    assert sagesched_cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "factor=10.0" in text and "ssjf" in text


def test_unknown_contender_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--source", "lssp-bailian", "--windows", "1", "--policies", "nope"]
    assert sagesched_cli.main(argv) == 2
    assert "unknown policy" in capsys.readouterr().out
