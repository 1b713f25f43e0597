"""The Kubernetes manifests, validated structurally (no cluster here): kinds, selectors that
match labels, probes on the gateway's real routes and port, resource requests, the predictor
snapshot on a volume, and the ConfigMap's YAML built by the gateway's own config loader.
`kubectl kustomize` also renders them when kubectl is installed (it needs no cluster)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from gateway.app import create_app
from gateway.config import GatewayConfig, build, parse

K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
KINDS = {"ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "PodDisruptionBudget",
         "ServiceMonitor"}  # fmt: skip


def manifests() -> dict[str, dict[str, Any]]:
    """kind → the one object of that kind, from the files the kustomization lists."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out: dict[str, dict[str, Any]] = {}
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            assert doc["kind"] not in out, f"two {doc['kind']} objects"
            assert doc["apiVersion"] and doc["metadata"]["name"]
            out[doc["kind"]] = doc
    return out


def container() -> dict[str, Any]:
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return c  # type: ignore[no-any-return]


def gateway_config() -> GatewayConfig:
    return build(parse(manifests()["ConfigMap"]["data"]["gateway.yaml"]))


def test_every_kind_is_present_and_listed() -> None:
    assert set(manifests()) == KINDS
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_selectors_match_the_pod_labels() -> None:
    m = manifests()
    deployment = m["Deployment"]["spec"]
    pod_labels = deployment["template"]["metadata"]["labels"]
    for selector in (
        deployment["selector"]["matchLabels"],
        m["Service"]["spec"]["selector"],
        m["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= pod_labels.items()


def test_servicemonitor_selects_the_service_port_and_metrics_path() -> None:
    m = manifests()
    monitor, service = m["ServiceMonitor"], m["Service"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    port_names = {p["name"] for p in service["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    # the Operator's job label is the Service name; the alert rules select on it
    assert service["metadata"]["name"] == "sagesched-gateway"


def test_probes_use_the_gateway_routes_and_port() -> None:
    c = container()
    routes = {
        r.resource.canonical for r in create_app(gateway_config()).router.routes() if r.resource
    }
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] in routes
        assert ports[get["port"]] == gateway_config().port
    service_port = manifests()["Service"]["spec"]["ports"][0]
    assert ports[service_port["targetPort"]] == gateway_config().port
    assert "/metrics" in routes


def test_container_runs_sagesched_serve_on_the_configmap() -> None:
    c = container()
    args = c["args"]
    assert args[0] == "serve"
    config_path = args[args.index("--config") + 1]
    mounts = {v["name"]: v for v in c["volumeMounts"]}
    volumes = {
        v["name"]: v for v in manifests()["Deployment"]["spec"]["template"]["spec"]["volumes"]
    }
    config_volume = next(v for v in volumes.values() if "configMap" in v)
    assert config_volume["configMap"]["name"] == manifests()["ConfigMap"]["metadata"]["name"]
    mount = mounts[config_volume["name"]]
    assert Path(config_path).parent == Path(mount["mountPath"])
    assert Path(config_path).name in manifests()["ConfigMap"]["data"]


def test_configmap_loads_with_the_gateway_config() -> None:
    config = gateway_config()
    assert config.host == "0.0.0.0"
    assert config.backends and config.predictor.snapshot_path


def test_predictor_snapshot_is_on_the_persistent_volume() -> None:
    c = container()
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    claim = manifests()["PersistentVolumeClaim"]["metadata"]["name"]
    (volume,) = [v for v in pod["volumes"] if v.get("persistentVolumeClaim")]
    assert volume["persistentVolumeClaim"]["claimName"] == claim
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
    snapshot = gateway_config().predictor.snapshot_path
    assert snapshot and Path(snapshot).parent == Path(mount["mountPath"])
    # one ReadWriteOnce volume: never two pods at once
    assert manifests()["Deployment"]["spec"]["strategy"]["type"] == "Recreate"
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]


def test_resources_and_security() -> None:
    c = container()
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0


def test_kubectl_kustomize_renders_the_manifests() -> None:
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl is missing: `make system-deps` installs it"
    proc = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert {d["kind"] for d in yaml.safe_load_all(proc.stdout)} == KINDS
