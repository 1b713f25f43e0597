"""`promtool` (Debian package `prometheus`) checks the scrape config and the rule files and runs
the rules' unit tests in `deploy/prometheus/tests/`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROM_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULE_FILES = sorted(PROM_DIR.glob("*.rules.yml")) + sorted(PROM_DIR.glob("*.alerts.yml"))
RULE_TESTS = sorted((PROM_DIR / "tests").glob("*.yml"))


@pytest.fixture(scope="module")
def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is missing: run `make system-deps` (apt-get install prometheus)")
    return binary


def run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout}\n{proc.stderr}"


def test_check_config(promtool: str) -> None:
    run(promtool, "check", "config", str(PROM_DIR / "prometheus.yml"))


def test_check_rules(promtool: str) -> None:
    assert len(RULE_FILES) == 2
    run(promtool, "check", "rules", *map(str, RULE_FILES))


def test_rule_unit_tests(promtool: str) -> None:
    assert RULE_TESTS
    run(promtool, "test", "rules", *map(str, RULE_TESTS))


def test_every_alert_has_a_firing_unit_test() -> None:
    alerts = {
        rule["alert"]
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    fired = {
        case["alertname"]
        for path in RULE_TESTS
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts and alerts <= fired, f"alerts without a firing test: {alerts - fired}"
