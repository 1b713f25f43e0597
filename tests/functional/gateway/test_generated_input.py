"""Generated hostile input against a live gateway (issue 18 part 1): schemathesis draws requests
from the gateway's own `/openapi.json` — valid ones (positive) and ones that break the schema
(negative) — and sends them to `sagesched serve` in front of `sagesched emulate`, both real
processes. Every answer must be: no 5xx except an upstream fault (502/503 with an upstream
code), every error an OpenAI JSON error object, and schemathesis' own checks (status codes
and content types the document declares). At the end the gateway's terminal-state counter
must equal the requests sent to its counted routes: none lost, none counted twice.

The same run goes against one process (`workers=1`) and against `serve --workers 2` (two
relay processes sharing the port, one scheduling authority; `/metrics` merged over all of
them), so the counter check covers the cross-process path too.

`CASES` per operation and mode keeps the run near a minute on two cores (docs/reliability.md).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from loadgen.procs import Children, free_port, sagesched

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CASES = 120
"""Examples per generating operation and mode (3 operations x 2 modes; the GET routes take
as many as they have distinct cases)."""
API_KEY, ADMIN_KEY = "k-generated-1", "adm-generated-1"
COUNTED = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
UPSTREAM_CODES = {"upstream_failed", "upstream_broken", "no_healthy_backend", "queue_timeout"}


@dataclass
class Live:
    url: str
    logs: Path
    sent: dict[str, int] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def live(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Live]:
    workers: int = request.param
    logs = tmp_path_factory.mktemp(f"generated-w{workers}")
    backend, port = free_port(), free_port()
    with Children(logs) as kids:
        kids.start("emulate", sagesched("emulate", "--profile", "cpu-tiny-vllm", "--port",
                                        str(backend), "--time-scale", "0.01"),
                   f"http://127.0.0.1:{backend}/health")  # fmt: skip
        kids.start("serve", sagesched("serve", "--backend", f"http://127.0.0.1:{backend}",
                                      "--port", str(port), "--api-key", API_KEY,
                                      "--admin-key", ADMIN_KEY, "--max-inflight", "32",
                                      "--queue-timeout", "30", "--workers", str(workers)),
                   f"http://127.0.0.1:{port}/ready")  # fmt: skip
        yield Live(f"http://127.0.0.1:{port}", logs)


def counted_total(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "sagesched_requests_total"
    )


def check_answer(status: int, ctype: str, body: bytes, where: str) -> None:
    """The invariants of every answer (issue 18 part 1)."""
    if status < 400:
        return
    assert ctype.startswith("application/json"), f"{where}: {status} {ctype} {body[:200]!r}"
    err = json.loads(body)["error"]
    assert set(err) >= {"message", "type", "param", "code"}, f"{where}: {body[:200]!r}"
    if status >= 500:
        assert err["code"] in UPSTREAM_CODES, f"{where}: a gateway 5xx: {body[:300]!r}"


def run_operation(live: Live, op: Any, mode: GenerationMode) -> None:
    label = op.label
    key = ADMIN_KEY if "/admin/" in label else API_KEY
    path = label.split(" ", 1)[1]

    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=op.as_strategy(generation_mode=mode))
    def test(case: Any) -> None:
        headers = {"Authorization": f"Bearer {key}"}
        response = case.call(base_url=live.url, headers=headers, timeout=60)
        live.sent[path] = live.sent.get(path, 0) + 1
        live.statuses[response.status_code] = live.statuses.get(response.status_code, 0) + 1
        ctype = response.headers.get("content-type", [""])
        ctype = ctype[0] if isinstance(ctype, list) else ctype
        check_answer(response.status_code, ctype, response.content, f"{label} {mode.value}")
        case.validate_response(response, checks=[not_a_server_error],
                               excluded_checks=[])  # fmt: skip

    try:
        test()
    except Unsatisfiable:  # a GET without parameters has no schema-breaking variant
        assert mode is GenerationMode.NEGATIVE and label.startswith("GET")


def test_generated_requests(live: Live) -> None:
    with urllib.request.urlopen(live.url + "/openapi.json", timeout=10) as r:
        doc = json.load(r)
    for path in COUNTED:  # the served model, so that valid requests reach the backend
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        body["schema"]["properties"]["model"] = {"enum": ["tiny-llama"]}
    schema = schemathesis.openapi.from_dict(doc)
    before = counted_total(live.url)
    ops = [op.ok() for op in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(ops) >= 9, [op.label for op in ops]  # schemathesis leaves out /openapi.json
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run_operation(live, op, mode)
    sent = sum(live.sent.values())
    counted = sum(n for p, n in live.sent.items() if p in COUNTED)
    print(f"generated requests: {sent} ({counted} to counted routes), statuses {live.statuses}")
    assert counted >= 6 * CASES * 0.9  # hypothesis stops early only on exhausted spaces
    assert counted_total(live.url) - before == counted  # one terminal state each
    log = (live.logs / "serve.log").read_text(errors="replace")
    assert "Traceback" not in log and "internal error" not in log
