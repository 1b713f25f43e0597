"""The Grafana dashboard: in step with its generator, provisioning-ready (datasource as a
variable, model/backend/policy variables), and every metric it or the rules name exists (in the
gateway's registry, the emulator's vLLM-named registry, or as a recording rule)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from gateway.observability.metrics import GatewayMetrics
from loadgen.emulator.metrics import EmulatorMetrics

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "sagesched.json"
RULE_FILES = [DEPLOY / "prometheus" / n for n in ("sagesched.rules.yml", "sagesched.alerts.yml")]
MUST_SHOW = ("sagesched_time_to_first_token_seconds", "sagesched_time_to_last_token_seconds",
             "sagesched_queue_depth", "sagesched_queue_wait_seconds", "sagesched_backend_inflight",
             "sagesched_backend_inflight_cap", "sagesched_requests_total",
             "sagesched_preemptions_total", "sagesched_retries_total",
             "sagesched_predictor_latency_seconds", "sagesched_prediction_error_ratio",
             "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:time_to_first_token_seconds", "sagesched_class_time_to_first_token_seconds",
             "sagesched_class_time_to_last_token_seconds", "sagesched_class_requests_total",
             "sagesched_class_queue_depth", "sagesched_class_slo_total",
             "sagesched_class_slo_objective", "sagesched_tenant_output_tokens_total")  # fmt: skip


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "build_dashboard", DASHBOARD.parents[1] / "build_dashboard.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def rules() -> list[dict[str, Any]]:
    return [
        r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]
    ]


def sample_names(registry: Any) -> set[str]:
    out = set()
    for family in registry.collect():
        out.add(family.name)
        for suffix in ("_total", "_bucket", "_count", "_sum"):
            out.add(family.name + suffix)
    return out


def test_dashboard_json_is_what_the_generator_writes() -> None:
    assert DASHBOARD.read_text() == generator().render(), (
        "run `python deploy/grafana/build_dashboard.py`"
    )


def test_datasource_and_variables() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model", "backend", "policy", "class"):
        assert variables[name]["type"] == "query" and variables[name]["includeAll"]
        assert name in variables[name]["query"]["query"]
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_panels_have_unique_ids_and_titles() -> None:
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    titles = [p["title"] for p in panels if p["type"] != "row"]
    assert len(set(titles)) == len(titles)


def test_every_series_named_exists() -> None:
    gateway = sample_names(GatewayMetrics().registry)
    vllm = sample_names(EmulatorMetrics("m").registry)
    recorded = {r["record"] for r in rules() if "record" in r}
    named = set()
    for expr in exprs() + [r["expr"] for r in rules()]:
        bare = re.sub(r'"[^"]*"', '""', expr)  # label values are not series names
        named |= set(re.findall(r"\b(?:[a-z_]+:)*(?:sagesched|vllm)[a-z0-9_:]*", bare))
    unknown = {n for n in named if n not in gateway | vllm | recorded}
    assert not unknown, unknown


def test_the_dashboard_shows_the_issue_series() -> None:
    text = " ".join(exprs())
    recorded = {r["record"]: r["expr"] for r in rules() if "record" in r}
    expanded = text + " ".join(e for name, e in recorded.items() if name in text)
    missing = [m for m in MUST_SHOW if m not in expanded]
    assert not missing, missing


def test_gateway_quantiles_come_from_recording_rules() -> None:
    recorded = {r["record"] for r in rules() if "record" in r}
    for q in ("p50", "p95", "p99"):
        for metric in ("time_to_first_token_seconds", "time_to_last_token_seconds"):
            name = f"model_policy:sagesched_{metric}:{q}"
            assert name in recorded and any(name in e for e in exprs()), name


def test_one_row_per_class() -> None:
    rows = [p for p in dashboard()["panels"] if p["type"] == "row" and p.get("repeat")]
    assert [r["repeat"] for r in rows] == ["class"]
    below = [p for p in dashboard()["panels"] if p["gridPos"]["y"] > rows[0]["gridPos"]["y"]]
    assert below and all('class=~"$class"' in t["expr"] for p in below for t in p["targets"])
