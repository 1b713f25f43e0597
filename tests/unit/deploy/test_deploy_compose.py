"""The Dockerfile and the compose stacks, checked without a Docker engine: structure, the
project's real commands and flags (parsed by the real CLI parsers), and mounts that exist.
`docker compose config` / `docker-compose config` also runs when a client is installed."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway import cli as gateway_cli
from gateway.config import GatewayConfig, load
from loadgen.emulator import cli as emulator_cli

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "deploy" / "compose"
STACKS = {"gpu": ["compose.gpu.yml"], "cpu": ["compose.cpu.yml"],
          "cpu-vllm": ["compose.cpu.yml", "compose.cpu-vllm.yml"]}  # fmt: skip
SERVICES = {"vllm", "gateway", "gateway-2", "redis", "prometheus", "grafana", "otel-collector",
            "jaeger"}  # fmt: skip
REPLICAS = ("gateway", "gateway-2")
DISTROLESS = {"otel-collector", "jaeger"}
"""Images with no client to probe with, so no healthcheck; nothing waits on them."""


def interpolate(value: Any) -> Any:
    """Compose's `${VAR:-default}` with every variable unset."""
    if isinstance(value, str):
        return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Compose's override rule, simplified: mappings merge, everything else is replaced."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def merged(files: list[str]) -> dict[str, Any]:
    """The stack's files merged in order, with every variable at its default."""
    out: dict[str, Any] = {"services": {}, "volumes": {}}
    for name in files:
        doc = interpolate(yaml.safe_load((COMPOSE / name).read_text()))
        out = deep_merge(out, {"services": doc["services"], "volumes": doc.get("volumes") or {}})
    return out


@pytest.mark.parametrize("stack", STACKS)
def test_stack_has_every_service_with_a_healthcheck(stack: str) -> None:
    services = merged(STACKS[stack])["services"]
    assert set(services) == SERVICES
    for name, svc in services.items():
        assert "image" in svc, name
        if name in DISTROLESS:
            assert "healthcheck" not in svc, name
            assert all(name not in (s.get("depends_on") or {}) for s in services.values()
                       if s is not services["otel-collector"])  # fmt: skip
            continue
        assert svc["healthcheck"]["test"][0] == "CMD", name
    assert services["gateway"]["ports"] == ["8080:8080"]
    assert services["gateway-2"]["ports"] == ["8081:8080"]
    assert services["grafana"]["ports"] == ["3000:3000"]
    assert services["prometheus"]["ports"] == ["9090:9090"]


def replica_config(svc: dict[str, Any]) -> GatewayConfig:
    """A gateway service's config, built from its command and environment by the real CLI."""
    command = svc["command"]
    assert command[0] == "serve"
    args = gateway_cli.build_parser("sagesched serve").parse_args(command[1:])
    return load(None, gateway_cli.overrides(args), env=svc.get("environment") or {})


@pytest.mark.parametrize("replica", REPLICAS)
@pytest.mark.parametrize("stack", STACKS)
def test_gateway_command_is_a_valid_sagesched_serve(stack: str, replica: str) -> None:
    svc = merged(STACKS[stack])["services"][replica]
    assert svc["build"]["context"] == "../.." and (COMPOSE / "../../Dockerfile").is_file()
    config = replica_config(svc)
    assert [b.url for b in config.backends] == ["http://vllm:8000"]
    assert config.host == "0.0.0.0" and config.port == GatewayConfig().port
    snapshot = config.predictor.snapshot_path
    assert snapshot is not None
    mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
    assert str(Path(snapshot).parent) in mounts, "the predictor snapshot must be on a volume"
    assert svc["depends_on"]["vllm"]["condition"] == "service_healthy"


@pytest.mark.parametrize("stack", STACKS)
def test_replicas_share_learning_through_redis_and_keep_their_own_snapshots(stack: str) -> None:
    services = merged(STACKS[stack])["services"]
    redis = services["redis"]
    assert redis["image"].split(":")[1].startswith("7")
    assert redis["healthcheck"]["test"][1:] == ["redis-cli", "ping"]
    configs = {name: replica_config(services[name]) for name in REPLICAS}
    for name, config in configs.items():
        url = urlsplit(config.shared_learning.redis_url or "")
        assert (url.hostname, url.port or 6379) == ("redis", 6379), name
        # Redis is optional: a replica starts (and serves) without it
        assert services[name]["depends_on"]["redis"]["condition"] == "service_started"
    ids = {c.shared_learning.replica_id for c in configs.values()}
    assert len(ids) == len(REPLICAS) and "" not in ids  # each skips its own records only
    streams = {c.shared_learning.stream for c in configs.values()}
    assert len(streams) == 1  # one stream: they learn from each other
    volumes = {services[name]["volumes"][0].split(":")[0] for name in REPLICAS}
    assert len(volumes) == len(REPLICAS), "each replica saves its snapshot on its own volume"


def test_gpu_stack_runs_official_vllm_image_on_a_gpu_with_priority_scheduling() -> None:
    services = merged(STACKS["gpu"])["services"]
    vllm = services["vllm"]
    assert vllm["image"].startswith("vllm/vllm-openai:")
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    command = vllm["command"]
    assert command[command.index("--scheduling-policy") + 1] == "priority"
    assert command[command.index("--port") + 1] == "8000"
    gateway = services["gateway"]["command"]
    assert "--forward-priority" in gateway and "--backend-priority" in gateway


def test_cpu_stack_runs_the_emulator_with_real_flags() -> None:
    vllm = merged(STACKS["cpu"])["services"]["vllm"]
    command = vllm["command"]
    assert command[0] == "emulate"
    args = emulator_cli.build_parser("sagesched emulate").parse_args(command[1:])
    assert (args.profile, args.host, args.port) == ("cpu-tiny-vllm", "0.0.0.0", 8000)
    emulator_cli.config_from_args(args).engine_config()  # a valid engine configuration


def test_cpu_vllm_override_builds_the_vllm_cpu_image() -> None:
    vllm = merged(STACKS["cpu-vllm"])["services"]["vllm"]
    assert (COMPOSE / vllm["build"]["dockerfile"]).is_file()
    assert vllm["command"][vllm["command"].index("--port") + 1] == "8000"
    assert "hf-cache" in merged(STACKS["cpu-vllm"])["volumes"]


@pytest.mark.parametrize("stack", STACKS)
def test_bind_mounts_exist_and_named_volumes_are_declared(stack: str) -> None:
    doc = merged(STACKS[stack])
    for svc in doc["services"].values():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), source
            else:
                assert source in doc["volumes"], source


def test_prometheus_and_grafana_wiring_matches_the_service_names() -> None:
    services = merged(STACKS["gpu"])["services"]
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}  # fmt: skip
    assert targets == {"gateway:8080", "gateway-2:8080", "vllm:8000"}
    assert {t.split(":")[0] for t in targets} <= set(services)
    datasources = ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml"
    url = yaml.safe_load(datasources.read_text())["datasources"][0]["url"]
    assert url == "http://prometheus:9090"
    provider = ROOT / "deploy/grafana/provisioning/dashboards/sagesched.yml"
    path = yaml.safe_load(provider.read_text())["providers"][0]["options"]["path"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    assert (COMPOSE / mounts[path] / "sagesched.json").is_file()


def compose_client() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.parametrize("stack", STACKS)
def test_compose_client_parses_the_stack(stack: str) -> None:
    client = compose_client()
    if client is None:
        pytest.fail("no compose client: run `make system-deps` (installs docker-compose)")
    files = [a for f in STACKS[stack] for a in ("-f", str(COMPOSE / f))]
    proc = subprocess.run([*client, *files, "config", "-q"], capture_output=True, text=True,
                          timeout=60, check=False, cwd=COMPOSE)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


# -- Dockerfile -------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    ins = instructions(path)
    last = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last:]


def test_dockerfile_is_slim_non_root_with_healthcheck() -> None:
    ins = instructions(ROOT / "Dockerfile")
    froms = [args for word, args in ins if word == "FROM"]
    assert froms and all("-slim" in f for f in froms)
    final = final_stage(ROOT / "Dockerfile")
    users = [args for word, args in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    health = " ".join(args for word, args in final if word == "HEALTHCHECK")
    assert "/health" in health
    exposed = [args for word, args in final if word == "EXPOSE"]
    assert exposed == [str(GatewayConfig().port)]


def test_dockerfile_builds_cpu_torch_by_default_with_a_cuda_build_arg() -> None:
    ins = instructions(ROOT / "Dockerfile")
    args = dict(a.split("=", 1) for word, a in ins if word == "ARG" and "=" in a)
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    run = " ".join(a for word, a in ins if word == "RUN")
    assert "${TORCH_INDEX_URL}" in run
    assert "TORCH_INDEX_URL" in (ROOT / "Dockerfile").read_text().split("FROM")[0]  # documented


def test_dockerfile_runs_sagesched_serve_with_real_flags() -> None:
    final = final_stage(ROOT / "Dockerfile")
    entry = [yaml.safe_load(a) for word, a in final if word == "ENTRYPOINT"]
    cmd = [yaml.safe_load(a) for word, a in final if word == "CMD"]
    assert entry == [["sagesched"]]
    assert cmd[-1][0] == "serve"
    args = gateway_cli.build_parser("sagesched serve").parse_args(cmd[-1][1:])
    env = {"SAGESCHED_BACKENDS": "http://vllm:8000"}
    for word, a in final:
        if word == "ENV":
            env.update(dict(kv.split("=", 1) for kv in shlex.split(a)))
    config = load(None, gateway_cli.overrides(args), env=env)
    assert config.host == "0.0.0.0" and config.port == 8080
    for word, a in instructions(ROOT / "Dockerfile"):
        if word == "COPY" and not a.startswith("--from"):
            for source in a.split()[:-1]:
                assert (ROOT / source).exists(), source
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


@pytest.mark.parametrize("stack", STACKS)
def test_traces_go_through_the_collector_to_jaeger(stack: str) -> None:
    services = merged(STACKS[stack])["services"]
    collector = yaml.safe_load((COMPOSE / "../otel/collector.yaml").read_text())
    mount = services["otel-collector"]["volumes"][0].split(":")
    assert (COMPOSE / mount[0]).resolve() == (COMPOSE / "../otel/collector.yaml").resolve()
    assert services["otel-collector"]["command"] == [f"--config={mount[1]}"]
    assert collector["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert collector["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    for name in REPLICAS:
        config = replica_config(services[name])
        env = services[name]["environment"]
        assert config.tracing.enabled
        endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
        assert (endpoint.hostname, endpoint.port) == ("otel-collector", int(http.split(":")[1]))
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    vllm = services["vllm"]["command"]
    if "--otlp-traces-endpoint" in vllm:  # the real vLLM (the emulator does not trace)
        grpc = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].split(":")[1]
        assert vllm[vllm.index("--otlp-traces-endpoint") + 1] == f"http://otel-collector:{grpc}"
    else:
        assert stack == "cpu"
