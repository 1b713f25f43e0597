"""The Kubernetes manifests, validated structurally (no cluster here): kinds, selectors that
match labels, probes on the gateway's real routes and port, resource requests, the predictor
snapshot on a volume, and the ConfigMap's YAML built by the gateway's own config loader.
`kubectl kustomize` also renders them when kubectl is installed (it needs no cluster)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gateway.config import GatewayConfig, build, load, parse
from gateway.serving.app import create_app

K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
KINDS = {"ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "PodDisruptionBudget",
         "ServiceMonitor"}  # fmt: skip


GATEWAY, REDIS = "sagesched-gateway", "sagesched-redis"


def all_manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) → object, from the files the kustomization lists."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"two {key} objects"
            assert doc["apiVersion"]
            out[key] = doc
    return out


def manifests(name: str = GATEWAY) -> dict[str, dict[str, Any]]:
    """kind → the object of that kind named `name` (the gateway's by default), or the only
    object of a kind that has one."""
    out: dict[str, dict[str, Any]] = {}
    for (kind, obj_name), doc in all_manifests().items():
        if obj_name == name or kind not in out:
            out[kind] = doc
    return out


def container() -> dict[str, Any]:
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return c  # type: ignore[no-any-return]


def gateway_config() -> GatewayConfig:
    return build(parse(manifests()["ConfigMap"]["data"]["gateway.yaml"]))


def test_every_kind_is_present_and_listed() -> None:
    assert set(manifests()) == KINDS
    assert {name for kind, name in all_manifests() if kind in ("Deployment", "Service")} == {
        GATEWAY,
        REDIS,
    }
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


def test_redis_for_shared_learning_is_reached_by_its_service_and_selected_by_nothing_else() -> None:
    redis = manifests(REDIS)
    deployment, service = redis["Deployment"], redis["Service"]
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (c,) = pod["spec"]["containers"]
    assert c["image"].split(":")[1].startswith("7")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    (port,) = service["spec"]["ports"]
    assert ports[port["targetPort"]] == 6379
    # the gateway's config points at this Service
    url = urlsplit(gateway_config().shared_learning.redis_url or "")
    assert (url.hostname, url.port) == (service["metadata"]["name"], port["port"])
    # and the gateway's selectors (Service, PDB, ServiceMonitor) never pick the Redis pod
    gw = manifests()
    for selector in (
        gw["Service"]["spec"]["selector"],
        gw["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
    ):
        assert not selector.items() <= labels.items()
    assert not gw["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= (
        service["metadata"]["labels"].items()
    )
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_each_gateway_pod_names_itself_in_the_shared_records(tmp_path: Path) -> None:
    env = {e["name"]: e for e in container()["env"]}
    field = env["SAGESCHED_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == "metadata.name"
    path = tmp_path / "gateway.yaml"  # the ConfigMap's file, then the pod's environment
    path.write_text(manifests()["ConfigMap"]["data"]["gateway.yaml"])
    shared = load(
        str(path), {}, {"SAGESCHED_REPLICA_ID": "sagesched-gateway-7d9f-x2"}
    ).shared_learning
    assert shared.replica_id == "sagesched-gateway-7d9f-x2" and shared.redis_url


def test_kubectl_kustomize_renders_the_manifests() -> None:
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl is missing: `make system-deps` installs it"
    proc = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rendered = [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(proc.stdout)]
    assert {kind for kind, _ in rendered} == KINDS
    assert sorted(rendered) == sorted(all_manifests())
