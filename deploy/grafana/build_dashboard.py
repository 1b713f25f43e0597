"""Generate `dashboards/sagesched.json`, the gateway's Grafana dashboard.

Run `python deploy/grafana/build_dashboard.py` after editing; a unit test fails while the JSON
in the repository differs from what this script writes. Panels read the recording rules of
`deploy/prometheus/sagesched.rules.yml` for quantiles (cheap to draw over long ranges) and raw
counters with `$__rate_interval` for rates. Variables: `datasource`, `model`, `backend`,
`policy` (the gateway's labels), `instance` (the vLLM scrape targets) and `class` (request
classes: one row per class, repeated).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "dashboards" / "sagesched.json"
DS = {"type": "prometheus", "uid": "${datasource}"}

MP = 'model=~"$model", policy=~"$policy"'
MBP = 'model=~"$model", backend=~"$backend", policy=~"$policy"'
MB = 'model=~"$model", backend=~"$backend"'
VLLM = 'instance=~"$instance", model_name=~"$model"'
MC = 'model=~"$model", class=~"$class"'


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def panel(
    title: str,
    description: str,
    targets: list[tuple[str, str]],
    unit: str,
    grid: tuple[int, int, int, int],
    kind: str = "timeseries",
    overrides: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A panel; `targets` are (expr, legend) pairs; `grid` is (x, y, w, h)."""
    x, y, w, h = grid
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {
            "defaults": {"unit": unit, "custom": {}} if kind == "timeseries" else {"unit": unit},
            "overrides": overrides or [],
        },
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["last"]}}
        if kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        "targets": [target(e, leg, chr(ord("A") + i)) for i, (e, leg) in enumerate(targets)],
    }


def traced(p: dict[str, Any]) -> dict[str, Any]:
    """The panel with exemplars on its queries (the trace ids of single requests)."""
    for t in p["targets"]:
        t["exemplar"] = True
    return p


def row(title: str, y: int, repeat: str | None = None) -> dict[str, Any]:
    """A row; with `repeat`, Grafana draws it and its panels once per value of that variable."""
    out = {"type": "row", "title": title, "collapsed": False, "panels": [],
           "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}}  # fmt: skip
    if repeat:
        out["repeat"] = repeat
    return out


def quantiles(
    record: str, selector: str, legend: str, qs: tuple[str, ...] = ("p50", "p95", "p99")
) -> list[tuple[str, str]]:
    """The `qs` (default p50/p95/p99) of a recorded quantile family."""
    return [(f"{record}:{q}{{{selector}}}", f"{q} {legend}") for q in qs]


def dashed(regex: str) -> dict[str, Any]:
    """An override drawing matching series as dashed lines (caps, the vLLM side)."""
    return {
        "matcher": {"id": "byRegexp", "options": regex},
        "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}],
    }


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"var-{name}"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def panels() -> list[dict[str, Any]]:
    ttft, ttlt = "sagesched_time_to_first_token_seconds", "sagesched_time_to_last_token_seconds"
    client = "cancelled_waiting|cancelled_running|client_too_slow"  # the client's doing
    errors = f'outcome!~"completed|rejected|queue_full|shed|shutdown|{client}"'
    out = [
        row("Overview", 0),
        panel("Request rate", "Requests per second that reached a terminal state.",
              [(f"sum(rate(sagesched_requests_total{{{MP}}}[$__rate_interval]))", "req/s")],
              "reqps", (0, 1, 6, 4), kind="stat"),
        panel("Error ratio (5 m)", "Share of requests that ended in a server-side error.",
              [(f"(sum(rate(sagesched_requests_total{{{MP}, {errors}}}[5m])) or vector(0)) / "
                f"sum(rate(sagesched_requests_total{{{MP}}}[5m]))", "errors")],
              "percentunit", (6, 1, 6, 4), kind="stat"),
        panel("Waiting in the gateway", "Requests queued in the gateway now.",
              [(f"sum(sagesched_queue_depth{{{MP}}})", "waiting")], "short", (12, 1, 6, 4),
              kind="stat"),
        panel("Healthy backends", "Backends that passed their last health check.",
              [('sum(sagesched_backend_healthy{backend=~"$backend"})', "healthy")], "short",
              (18, 1, 6, 4), kind="stat"),
        row("Latency by policy", 5),
        panel("Time to first token by policy",
              "Arrival at the gateway to the first token relayed: queue wait + prediction + "
              "the backend's own TTFT.",
              quantiles(f"model_policy:{ttft}", MP, "{{policy}} {{model}}"), "s", (0, 6, 12, 8)),
        panel("Time to last token by policy", "Arrival at the gateway to the last token relayed.",
              quantiles(f"model_policy:{ttlt}", MP, "{{policy}} {{model}}"), "s", (12, 6, 12, 8)),
        panel("Inter-token latency p95 by policy",
              "Gap between streamed chunks at the gateway; preemption and overload raise it.",
              [(f"model_policy:sagesched_inter_token_latency_seconds:p95{{{MP}}}",
                "p95 {{policy}} {{model}}")], "s", (0, 14, 12, 8)),
        panel("Time to first token p95 by backend", "Per backend, from the raw histogram.",
              [(f"histogram_quantile(0.95, sum by (backend, le) (rate({ttft}_bucket{{{MBP}}}"
                "[$__rate_interval])))", "p95 {{backend}}")], "s", (12, 14, 12, 8)),
        row("Queue", 22),
        panel("Queue depth", "Requests waiting in the gateway, per model and policy.",
              [(f"sum by (model, policy) (sagesched_queue_depth{{{MP}}})",
                "{{policy}} {{model}}")], "short", (0, 23, 12, 8)),
        panel("Queue wait", "Admission to dispatch to a backend.",
              quantiles("model_policy:sagesched_queue_wait_seconds", MP, "{{policy}} {{model}}"),
              "s", (12, 23, 12, 8)),
        row("Backends", 31),
        panel("In flight against the cap", "Requests running on each backend; dashed: its cap.",
              [('sum by (backend) (sagesched_backend_inflight{backend=~"$backend"})',
                "in flight {{backend}}"),
               ('max by (backend) (sagesched_backend_inflight_cap{backend=~"$backend"})',
                "cap {{backend}}")], "short", (0, 32, 12, 8), overrides=[dashed("cap .*")]),
        panel("Backend health", "1 = passed its last health check.",
              [('max by (backend) (sagesched_backend_healthy{backend=~"$backend"})',
                "{{backend}}")], "short", (12, 32, 6, 8)),
        panel("Output tokens per second", "Tokens relayed per backend.",
              [(f"sum by (backend) (rate(sagesched_output_tokens_total{{{MB}}}"
                "[$__rate_interval]))", "{{backend}}")], "short", (18, 32, 6, 8)),
        row("Traffic and errors", 40),
        panel("Request rate by terminal state and status", "One series per outcome and code.",
              [(f"sum by (outcome, code) (rate(sagesched_requests_total{{{MP}}}"
                "[$__rate_interval]))", "{{outcome}} {{code}}")], "reqps", (0, 41, 12, 8)),
        panel("Error ratio", "Server-side errors over all requests (recorded, 5 m).",
              [(f"model_policy:sagesched_requests_errors:ratio_rate5m{{{MP}}}",
                "{{policy}} {{model}}")], "percentunit", (12, 41, 12, 8)),
        panel("Preemptions and retries",
              "Running requests preempted and requeued; requests retried on another backend.",
              [(f"sum by (backend, policy) (rate(sagesched_preemptions_total{{{MBP}}}"
                "[$__rate_interval]))", "preempted {{backend}} {{policy}}"),
               (f"sum by (backend) (rate(sagesched_retries_total{{{MB}}}[$__rate_interval]))",
                "retried {{backend}}")], "reqps", (0, 49, 12, 8)),
        row("Predictor", 57),
        panel("Predictor latency", "Time to predict a request's output-length distribution.",
              [(f'model:sagesched_predictor_latency_seconds:{q}{{model=~"$model"}}',
                f"{q} {{{{model}}}}") for q in ("p50", "p99")], "s", (0, 58, 12, 8)),
        panel("Prediction error",
              "|predicted median - true output tokens| / true output tokens, completed requests.",
              [(f"model_policy:sagesched_prediction_error_ratio:{q}{{{MP}}}",
                f"{q} {{{{policy}}}} {{{{model}}}}") for q in ("p50", "p90")], "percentunit",
              (12, 58, 12, 8)),
        row("Where the time goes: gateway next to vLLM", 66),
        panel("Gateway queue, vLLM waiting, vLLM running",
              "A healthy gateway holds the backlog (gateway waiting) and keeps vLLM's own "
              "queue near empty; dashed: the vLLM side.",
              [(f"sum(sagesched_queue_depth{{{MP}}})", "gateway waiting"),
               ('sum by (backend) (sagesched_backend_inflight{backend=~"$backend"})',
                "gateway in flight {{backend}}"),
               (f"sum by (instance) (vllm:num_requests_waiting{{{VLLM}}})",
                "vLLM waiting {{instance}}"),
               (f"sum by (instance) (vllm:num_requests_running{{{VLLM}}})",
                "vLLM running {{instance}}")], "short", (0, 67, 12, 8),
              overrides=[dashed("vLLM .*")]),
        panel("vLLM KV-cache usage", "1 = every KV block in use; near 1 vLLM preempts.",
              [(f"max by (instance) (vllm:kv_cache_usage_perc{{{VLLM}}})", "{{instance}}")],
              "percentunit", (12, 67, 12, 8)),
        panel("Time to first token p95: gateway against vLLM",
              "The gap between the two lines is time spent in the gateway (queue + prediction).",
              [(f"model_policy:{ttft}:p95{{{MP}}}", "gateway {{policy}} {{model}}"),
               (f"instance_model_name:vllm:time_to_first_token_seconds:p95{{{VLLM}}}",
                "vLLM {{instance}}"),
               (f"model_policy:sagesched_queue_wait_seconds:p95{{{MP}}}",
                "gateway queue wait {{policy}} {{model}}")], "s", (0, 75, 12, 8),
              overrides=[dashed("vLLM .*")]),
        panel("vLLM preemptions", "The engine's own recompute preemptions (KV pressure).",
              [(f"sum by (instance) (rate(vllm:num_preemptions_total{{{VLLM}}}"
                "[$__rate_interval]))", "{{instance}}")], "short", (12, 75, 12, 8)),
        row("Routing", 83),
        panel("Routing decisions by reason",
              "Requests routed to each backend. affinity: to the backend expected to hold the "
              "most of the prompt's prefix; balance: elsewhere, for load; fallback: no backend "
              "was expected to hold any of it.",
              [(f"sum by (backend, reason) (rate(sagesched_routing_decisions_total{{{MB}}}"
                "[$__rate_interval]))", "{{reason}} {{backend}}")], "reqps", (0, 84, 12, 8)),
        panel("Prefix-cache hit ratio: the router's expectation against vLLM's",
              "Prompt tokens the router expected cached where it sent them, over the prompt "
              "tokens it routed; dashed: each vLLM server's own hits over queries. Expectation "
              "well above vLLM's: the engines evict sooner than the router's index assumes.",
              [(f"model_backend:sagesched_routing_cached_tokens:ratio_rate1m{{{MB}}}",
                "expected {{backend}}"),
               (f"instance_model_name:vllm:prefix_cache_hits:ratio_rate1m{{{VLLM}}}",
                "vLLM {{instance}}")], "percentunit", (12, 84, 12, 8),
              overrides=[dashed("vLLM .*")]),
        row("Traces", 92),
        traced(panel("Slow first tokens, with their traces",
              "p99 time to first token from the raw histogram; the dots are exemplars: one "
              "request's trace id (tracing on, Prometheus with exemplar storage), a link to "
              "its trace in Jaeger.",
              [(f"histogram_quantile(0.99, sum by (le) (rate({ttft}_bucket{{{MP}}}"
                "[$__rate_interval])))", "p99")], "s", (0, 93, 24, 8))),
    ]  # fmt: skip
    out += class_row(101)
    for i, p in enumerate(out, start=1):
        p["id"] = i
    return out


def class_row(y: int) -> list[dict[str, Any]]:
    """One row per request class (`gateway.scheduling.classes`): latency, queue, outcomes, SLO
    burn, the tenants' share of the output, token speed and the engine share."""
    tpot = "model_class:sagesched_class_time_per_output_token_seconds"
    ttft = "model_class:sagesched_class_time_to_first_token_seconds"
    ttlt = "model_class:sagesched_class_time_to_last_token_seconds"
    burn = "class_slo:sagesched_class_slo_missed"
    return [
        row("Class $class", y, repeat="class"),
        panel("Time to first token ($class)",
              "Arrival at the gateway to the first token relayed, this class's requests.",
              quantiles(ttft, MC, "{{model}}", ("p50", "p99")), "s", (0, y + 1, 8, 8)),
        panel("Time to last token ($class)",
              "Arrival to the last token relayed, completed requests of this class.",
              quantiles(ttlt, MC, "{{model}}", ("p50", "p99")), "s", (8, y + 1, 8, 8)),
        panel("Outcomes ($class)",
              "Terminal states of this class's requests; shed = refused or evicted from a "
              "full queue (429), queue_full = the class's or the gateway's bound.",
              [(f"sum by (outcome) (rate(sagesched_class_requests_total{{{MC}}}"
                "[$__rate_interval]))", "{{outcome}}")], "reqps", (16, y + 1, 8, 8)),
        panel("Queue ($class)",
              "Requests of this class waiting for their first dispatch, and their wait (p95).",
              [('sum(sagesched_class_queue_depth{class=~"$class"})', "waiting"),
               (f"model_class:sagesched_class_queue_wait_seconds:p95{{{MC}}}",
                "wait p95 {{model}} (s)")], "short", (0, y + 9, 8, 8)),
        panel("SLO burn ($class)",
              "Share of this class's requests missing its objective over 5 m and 1 h; dashed: "
              "the fast-burn threshold (14.4 x the error budget) of SageSchedClassSLOFastBurn.",
              [(f'{burn}:ratio_rate5m{{class=~"$class"}}', "missed 5 m {{slo}}"),
               (f'{burn}:ratio_rate1h{{class=~"$class"}}', "missed 1 h {{slo}}"),
               ('14.4 * class_slo:sagesched_class_slo_budget:ratio{class=~"$class"}',
                "fast-burn threshold {{slo}}")], "percentunit", (8, y + 9, 8, 8),
              overrides=[dashed("fast-burn .*")]),
        panel("Output tokens by tenant ($class)",
              "Tokens relayed per tenant (hashed ids of the busiest tenants; the rest: other): "
              "tenants share a band by virtual token counters.",
              [('sum by (tenant) (rate(sagesched_tenant_output_tokens_total{class=~"$class"}'
                "[$__rate_interval]))", "{{tenant}}")], "short", (16, y + 9, 8, 8)),
        panel("Time per output token ($class)",
              "First to last token over the tokens after the first, completed requests of "
              "this class: its streaming speed, which a TPOT objective (tpot_slo_s) promises.",
              quantiles(tpot, MC, "{{model}}", ("p50", "p99")), "s", (0, y + 17, 8, 8)),
        panel("Engine share ($class)",
              "Slots of each backend this class's band may hold now (its engine_share, or "
              "what a more urgent class's TPOT objective leaves; the cap while nothing more "
              "urgent is active).",
              [('sum by (backend) (sagesched_engine_share_slots{class=~"$class"})',
                "{{backend}}")], "short", (8, y + 17, 8, 8)),
        panel("Share lent and held ($class)",
              "Jobs of this class started beyond its engine share (lent: nothing more urgent "
              "was active) and jobs held back at it while a backend had room.",
              [('sum(rate(sagesched_engine_share_lent_total{class=~"$class"}'
                "[$__rate_interval]))", "lent"),
               ('sum(rate(sagesched_engine_share_held_total{class=~"$class"}'
                "[$__rate_interval]))", "held")], "reqps", (16, y + 17, 8, 8)),
    ]  # fmt: skip


def variables() -> list[dict[str, Any]]:
    source = {"name": "datasource", "label": "Data source", "type": "datasource",
              "query": "prometheus", "current": {}, "hide": 0}  # fmt: skip
    return [
        source,
        variable("model", "Model", "label_values(sagesched_requests_total, model)"),
        variable("backend", "Backend", "label_values(sagesched_backend_inflight, backend)"),
        variable("policy", "Policy", "label_values(sagesched_requests_total, policy)"),
        variable("instance", "vLLM instance", "label_values(vllm:num_requests_running, instance)"),
        variable("class", "Class", "label_values(sagesched_class_requests_total, class)"),
    ]


def dashboard() -> dict[str, Any]:
    return {
        "uid": "sagesched-gateway",
        "title": "SageSched gateway",
        "description": "Is the queue helping or hurting, and for whom: gateway latency by "
        "policy, the queue, backends against their caps, and vLLM's own series beside them.",
        "tags": ["sagesched", "vllm", "llm"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "graphTooltip": 1,
        "annotations": {"list": []},
        "templating": {"list": variables()},
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    OUT.write_text(render(), encoding="utf-8")
    sys.stdout.write(f"wrote {OUT}\n")
