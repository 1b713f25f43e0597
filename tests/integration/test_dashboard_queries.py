"""Every PromQL expression of the Grafana dashboard and the Prometheus rules, evaluated by a real
Prometheus that scrapes a real gateway and the emulated vLLM backend while traffic flows.

All expressions must parse; every dashboard panel must return data once the gateway has served
traffic (the panels that only show rare events are listed in `MAY_BE_EMPTY`, with why), and the
core panels (TTFT, TTLT, queue depth, request rate) must return finite values.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import StartGateway
from fixtures.prometheus_fixtures import Prometheus, StartPrometheus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROM_DIR = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "sagesched.json"

CORE_PANELS = {
    "Time to first token by policy",
    "Time to last token by policy",
    "Queue depth",
    "Request rate",
    "Request rate by terminal state and status",
}
MAY_BE_EMPTY = {
    # counters that get a series only when a request is preempted or retried, which this
    # traffic (no preemption, one healthy backend) never does
    "Preemptions and retries",
    # the class this traffic uses (standard, the default) has no objective to burn
    "SLO burn ($class)",
}
GRAFANA_MACROS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def panel_targets() -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel."""
    return [
        (p["title"], t["expr"])
        for p in dashboard()["panels"]
        if p["type"] != "row"
        for t in p["targets"]
    ]


def rule_files() -> list[Path]:
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    return [PROM_DIR / f for f in config["rule_files"]]


def rule_exprs() -> list[tuple[str, str]]:
    out = []
    for path in rule_files():
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                out.append((rule.get("record") or rule["alert"], rule["expr"]))
    return out


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace Grafana variables ($x, ${x}) with concrete values; unknown ones fail."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"unknown dashboard variable ${name} in {expr!r}"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def variable_as_promql(query: str) -> tuple[str, str]:
    """`label_values(metric, label)` → (`group by (label) (metric)`, label)."""
    m = re.fullmatch(r"label_values\(\s*([^,]+?)\s*,\s*(\w+)\s*\)", query)
    assert m, f"unsupported variable query {query!r}"
    return f"group by ({m.group(2)}) ({m.group(1)})", m.group(2)


async def traffic(gateway: str, stop: asyncio.Event) -> int:
    """Bursts of streamed requests (more than the in-flight cap, so some queue) and one for an
    unknown model (404, outcome rejected) per burst, until `stop` is set. Returns the count."""
    sent = 0

    def body(model: str, i: int) -> dict[str, Any]:
        return {
            "model": model,
            "messages": [{"role": "user", "content": f"question number {i % 4}"}],
            "max_tokens": 4 + (i % 3) * 4,
            "ignore_eos": True,
            "stream": True,
        }

    async with aiohttp.ClientSession() as s:

        async def one(model: str, i: int, status: int) -> None:
            async with s.post(gateway + "/v1/chat/completions", json=body(model, i)) as r:
                assert r.status == status, await r.text()
                await r.read()

        while not stop.is_set():
            burst = [one("tiny-llama", sent + k, 200) for k in range(6)]
            await asyncio.gather(*burst, one("no-such-model", sent, 404))
            sent += 7
    return sent


async def wait_ready(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(url + "/ready") as r:
                if r.status == 200:
                    return
            assert time.monotonic() < deadline, "the gateway never became ready"
            await asyncio.sleep(0.2)


async def results(
    prom: Prometheus, exprs: list[tuple[str, str]]
) -> list[tuple[str, str, list[Any]]]:
    out = []
    for name, expr in exprs:
        data = await prom.query(expr)  # raises if Prometheus rejects the expression
        out.append((name, expr, data["result"]))
    return out


def finite(result: list[dict[str, Any]]) -> bool:
    return bool(result) and all(math.isfinite(float(r["value"][1])) for r in result)


async def test_dashboard_and_rules_evaluate_against_live_gateway(
    start_emulator: StartEmulator, start_gateway: StartGateway, start_prometheus: StartPrometheus
) -> None:
    backend = await start_emulator(time_scale=0.1)
    gw = await start_gateway([{"url": backend, "max_inflight": 2}], policy="sagesched")
    await wait_ready(gw.url)
    addr = {"gateway": gw.url.removeprefix("http://"), "vllm": backend.removeprefix("http://")}
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"]: [addr["gateway" if "gateway" in job["job_name"] else "vllm"]]
            for job in config["scrape_configs"]}  # fmt: skip
    assert set(jobs) == {"sagesched-gateway", "vllm"}
    prom = start_prometheus(jobs=jobs, rule_files=tuple(str(f) for f in rule_files()))
    await prom.wait_for_data(f"count(up == 1) == {len(jobs)}")  # both scraped before traffic

    stop = asyncio.Event()
    driver = asyncio.create_task(traffic(gw.url, stop))
    try:
        values = await resolve_variables(prom, addr)
        panels = [(title, substitute(e, values)) for title, e in panel_targets()]
        deadline = time.monotonic() + 90
        while True:  # poll until every panel that must have data has it (or the deadline)
            assert not driver.done(), driver.exception()
            got = await results(prom, panels)
            missing = [(t, e) for t, e, r in got if not r and t not in MAY_BE_EMPTY]
            not_finite = [(t, e) for t, e, r in got if t in CORE_PANELS and not finite(r)]
            if not missing and not not_finite:
                break
            assert time.monotonic() < deadline, f"no data: {missing}; not finite: {not_finite}"
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        sent = await driver
    assert sent > 0
    rules = [(name, substitute(e, {})) for name, e in rule_exprs()]
    await results(prom, rules)  # every rule expression parses and evaluates
    firing = (await prom.query("ALERTS"))["result"]  # a healthy gateway trips no alert
    assert not firing, [a["metric"] for a in firing]
    assert {t for t, _ in panel_targets()} >= CORE_PANELS | MAY_BE_EMPTY


async def resolve_variables(prom: Prometheus, addr: dict[str, str]) -> dict[str, str]:
    """Evaluate each query variable like Grafana would and pick the value this test expects
    among those returned (so the variable queries are tested too)."""
    expected = {"model": "tiny-llama", "backend": addr["vllm"], "instance": addr["vllm"],
                "class": "standard"}  # fmt: skip
    values: dict[str, str] = dict(GRAFANA_MACROS)
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "datasource":
            values[var["name"]] = "prometheus"
            continue
        promql, label = variable_as_promql(var["query"]["query"])
        want = expected.get(var["name"])
        deadline = time.monotonic() + 30
        while True:  # the model's first requests may still be running
            result = (await prom.query(promql))["result"]
            found = {r["metric"][label] for r in result}
            if want is None and found:  # policy: whatever the gateway labels it with
                assert len(found) == 1, found
                want = next(iter(found))
            if want in found:
                break
            assert time.monotonic() < deadline, f"${var['name']}: {want!r} not in {found}"
            await asyncio.sleep(0.5)
        values[var["name"]] = want  # a regex matching itself (dots match dots)
    return values
