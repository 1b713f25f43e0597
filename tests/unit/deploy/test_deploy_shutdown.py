"""The deployments give the gateway's SIGTERM drain the time it needs (issue 18 part 5): the
Kubernetes pod's terminationGracePeriodSeconds covers its preStop sleep, the configured
`shutdown_grace_s`, the cut of late streams (`gateway.serving.drain.CUT_S`) and a margin for the
snapshot save; the compose files' stop_grace_period covers the grace and the cut."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gateway.config import build, parse
from gateway.serving.drain import CUT_S

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
MARGIN_S = 5.0
"""At least this much beyond the drain's bound for the snapshot save and the exit."""


def k8s(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "k8s" / name).read_text())
    return doc


def test_termination_grace_covers_prestop_drain_cut_and_margin() -> None:
    pod = k8s("deployment.yaml")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2
    pre_stop = float(command[1])
    assert pre_stop >= 2  # endpoints need a moment to leave the Service
    config = build(parse(k8s("configmap.yaml")["data"]["gateway.yaml"]))
    assert config.shutdown_grace_s > 0
    need = pre_stop + config.shutdown_grace_s + CUT_S + MARGIN_S
    assert pod["terminationGracePeriodSeconds"] >= need, need


def test_compose_stop_grace_covers_the_drain() -> None:
    for name in ("compose.cpu.yml", "compose.gpu.yml"):
        doc = yaml.safe_load((DEPLOY / "compose" / name).read_text())
        period = doc["x-gateway"]["stop_grace_period"]
        assert period.endswith("s")
        grace = build(parse("backends: [{url: 'http://b:8000'}]")).shutdown_grace_s  # default
        assert float(period[:-1]) >= grace + CUT_S + MARGIN_S, name
