"""Typed gateway configuration and the pipeline that builds it.

Steps, each a named function: `parse` (YAML text → dict) → `apply_env` (SAGESCHED_* variables)
→ `apply_overrides` (command-line flags) → `build` (dict → frozen dataclasses; unknown keys and
wrong types are errors) → `validate` (cross-field rules). The effective config is logged at
start (`as_dict`) with secrets masked.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from policies.capacity import CapLaw


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending key."""


@dataclass(frozen=True)
class BackendConfig:
    """One OpenAI-compatible inference server (vLLM)."""

    url: str
    """Base URL without `/v1`, e.g. `http://10.0.0.5:8000`."""
    name: str = ""
    """Label used in metrics and logs; defaults to host:port."""
    models: tuple[str, ...] = ()
    """Models it serves; empty = discover from its `/v1/models`."""
    max_inflight: int = 8
    """Requests the gateway lets run on it at once (the fixed cap, or where the self-tuning
    cap starts)."""
    api_key: str | None = None
    """Bearer token sent upstream, if the backend wants one."""
    priority_scheduling: bool = False
    """The backend runs `--scheduling-policy priority`, so it accepts `priority`."""
    owned: bool = True
    """This gateway admits requests here (else only while none of its own backends serving the
    model is healthy). With `replicas` the pipeline keeps it only on this replica's share."""
    kv_events: str | None = None
    """The ZMQ endpoint where the backend publishes vLLM's KV-cache events (its
    `--kv-events-config` endpoint, e.g. `tcp://10.0.0.5:5557`): prefix routers then match
    prompts against what it really caches (`gateway.scheduling.kv_events`)."""
    kv_events_topic: str = ""
    """The topic it publishes them under (`--kv-events-config` `topic`)."""


@dataclass(frozen=True)
class ReplicaSettings:
    """Several gateway replicas behind one Service, each with its own queue: backend i (in
    `backends` order) belongs to replica i mod `count`, so no two replicas admit into one
    backend (docs/gateway.md, "Several replicas"; measured in docs/benchmarks.md)."""

    count: int = 1
    """Gateway replicas in the deployment (at most the number of backends)."""
    index: int = 0
    """This replica's index, 0 to count - 1 (e.g. a StatefulSet's pod ordinal)."""


@dataclass(frozen=True)
class AdaptiveCapConfig:
    """The self-tuning in-flight cap (`policies.capacity.CapLaw`; `gateway.scheduling.backends`)."""

    enabled: bool = True
    """Adjust each backend's cap from its own `/metrics` (off: `max_inflight` is fixed)."""
    min_inflight: int = 1
    """Lowest cap."""
    max_inflight: int = 1024
    """Highest cap."""
    interval_s: float = 1.0
    """Seconds between scrapes (a quarter of it while slow-starting)."""
    kv_high: float = 0.95
    """KV-cache usage above which the cap shrinks."""
    waiting_high: float = 2.0
    """vLLM waiting requests above which the cap shrinks."""
    plateau_fraction: float = 0.85
    """The cap is the smallest batch whose fitted throughput is this share of the engine's
    plateau (docs/gateway.md, "The self-tuning cap")."""
    memory_path: str | None = None
    """JSON file the fitted engine curves are kept in (per backend and served model), so a
    restarted gateway starts at the last efficient batch. None: beside the predictor snapshot
    (`<snapshot_path>.engines.json`) when there is one, else not kept."""

    def law(self) -> CapLaw:
        """The control law's parameters. Raises ValueError when they are inconsistent."""
        from policies.capacity import CapLaw

        return CapLaw(
            interval_s=self.interval_s,
            slow_start_interval_s=self.interval_s / 4,
            min_cap=self.min_inflight,
            max_cap=self.max_inflight,
            kv_high=self.kv_high,
            waiting_high=self.waiting_high,
            plateau_fraction=self.plateau_fraction,
        )

    def memory_file(self, snapshot_path: str | None) -> str | None:
        """Where the curves are kept, given the predictor's snapshot path."""
        if self.memory_path:
            return self.memory_path
        return f"{snapshot_path}.engines.json" if snapshot_path else None


@dataclass(frozen=True)
class TokenizerSettings:
    """Prompt size from the backend's own tokenizer (vLLM `/tokenize`), see
    `gateway.scheduling.prompts`."""

    enabled: bool = True
    """Count a queued request's prompt with the backend's tokenizer (else characters / 4)."""
    timeout_s: float = 0.25
    """Longest wait for `/tokenize`; beyond it the request keeps the characters / 4 estimate."""
    cache_entries: int = 4096
    """Counts remembered per backend (LRU, keyed by a hash of the prompt)."""
    retry_after_s: float = 30.0
    """A backend without `/tokenize` (404) or that timed out is not asked again for this long."""


@dataclass(frozen=True)
class CaptureSettings:
    """Traffic capture to rotating JSONL files (`gateway.observability.capture`); off unless `dir`
    is set.
    Records hold counts and times, never prompt or answer text."""

    dir: str | None = None
    """Folder for the capture files (None: no capture)."""
    max_file_mb: float = 64.0
    """A file is rotated once it reaches this size."""
    max_files: int = 16
    """Only the newest files are kept (bounded disk use: max_files × max_file_mb)."""
    queue: int = 10_000
    """Records waiting for the writer; beyond it a record is dropped and counted."""
    embeddings: bool = False
    """Also record each prompt's embedding as the predictor made it (int8, base64). Sensitive:
    an embedding can leak what the prompt said. Off by default."""


@dataclass(frozen=True)
class TracingSettings:
    """OpenTelemetry traces of every request (`gateway.observability.tracing`); off unless
    `enabled`. Unset fields fall back to the standard `OTEL_*` variables (`OTEL_SERVICE_NAME`,
    `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`,
    `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, `OTEL_TRACES_SAMPLER_ARG`), then to the defaults."""

    enabled: bool = False
    endpoint: str | None = None
    """Where spans go: an OTLP collector (http/protobuf: `http://host:4318/v1/traces`;
    grpc: `http://host:4317`). None: the `OTEL_*` variables, else the exporter's default."""
    protocol: str | None = None
    """`http/protobuf` or `grpc` (None: `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else http)."""
    sample_ratio: float | None = None
    """Share of new traces recorded (a request that arrives with a sampled `traceparent`
    follows its parent). None: `OTEL_TRACES_SAMPLER_ARG`, else 1."""
    service_name: str | None = None
    """None: `OTEL_SERVICE_NAME`, else `sagesched-gateway`."""
    max_queue: int = 2048
    """Spans waiting for export; beyond it a span is dropped and counted."""


@dataclass(frozen=True)
class TrafficClass:
    """One request class (`gateway.scheduling.classes`): its band and what it is promised."""

    name: str
    """Named by the `x-sagesched-class` header, in metric labels and errors."""
    priority: int = 1
    """Band: the lowest priority with waiting requests is served first (vLLM's convention)."""
    share: float = 0.0
    """Fraction of the engine's work the band is guaranteed while it waits behind more urgent
    bands (0: strict priority only; classes of one band must agree)."""
    ttft_slo_s: float | None = None
    """Time-to-first-token objective (seconds), judged per request in the metrics."""
    ttlt_slo_s: float | None = None
    """Time-to-last-token objective (seconds)."""
    tpot_slo_s: float | None = None
    """Time-per-output-token objective (seconds). While the class is active, less urgent bands
    start on a backend only while its batch's predicted TPOT (the self-tuning cap's fitted
    curve) stays within it (`policies.shares`); judged per request in the metrics."""
    engine_share: float | None = None
    """Fraction of each backend's in-flight slots the band may hold while a more urgent band is
    active (None: no bound of its own). Idle share is lent; it is taken back by not granting
    more, never by preemption (classes of one band must agree)."""
    slo_target: float = 0.99
    """Share of requests that must meet the objectives (the SLO-burn alerts' budget)."""
    max_waiting: int | None = None
    """Requests of this class waiting to start; 429 beyond (None: only the global bound)."""
    queue_timeout_s: float | None = None
    """Longest wait before 503 (None: the global `queue_timeout_s`)."""
    sheddable: bool = False
    """Refused first (429) when the gateway queue is full, and evicted to make room."""
    api_keys: tuple[str, ...] = ()
    """Client keys whose requests belong to this class (at most as urgent as it)."""


DEFAULT_CLASSES = (
    TrafficClass("interactive", priority=0, ttft_slo_s=2.0, max_waiting=2000, queue_timeout_s=60),
    TrafficClass("standard", priority=1),
    TrafficClass("batch", priority=2, share=0.05, ttlt_slo_s=3600.0, sheddable=True),
)


@dataclass(frozen=True)
class ClassesSettings:
    """Request classes: priority bands, tenant fairness and overload
    (`gateway.scheduling.classes`)."""

    default: str = "standard"
    """Class of a request that names none and whose key maps to none."""
    header: bool = True
    """Honour the `x-sagesched-class` header (off: only `api_keys` mappings decide)."""
    tenant_labels: int = 10
    """Tenants named (hashed) in per-tenant metrics; the rest are `other`."""
    list: tuple[TrafficClass, ...] = DEFAULT_CLASSES
    """The classes; the default set is interactive (0), standard (1), batch (2)."""
    active_window_s: float = 10.0
    """A class counts as active, for the engine shares and TPOT objectives of the others, while
    it has requests waiting or for this long after one arrived."""

    def __post_init__(self) -> None:
        names = [c.name for c in self.list]
        if not names or len(set(names)) != len(names) or not all(names):
            raise ConfigError(f"classes.list needs unique, non-empty names, got {names}")
        if self.default not in names:
            raise ConfigError(f"classes.default {self.default!r} is not one of {names}")
        shares: dict[int, float] = {}
        engine: dict[int, float | None] = {}
        for c in self.list:
            if not 0.0 <= c.share < 1.0 or shares.setdefault(c.priority, c.share) != c.share:
                raise ConfigError(f"classes.{c.name}.share: in [0, 1), one per priority")
            share = c.engine_share
            if share is not None and not 0.0 < share <= 1.0:
                raise ConfigError(f"classes.{c.name}.engine_share must be in (0, 1]")
            if engine.setdefault(c.priority, share) != share:
                raise ConfigError(f"classes.{c.name}.engine_share: one per priority")
            if not 0.0 < c.slo_target < 1.0:
                raise ConfigError(f"classes.{c.name}.slo_target must be in (0, 1)")
            positive = (c.ttft_slo_s, c.ttlt_slo_s, c.tpot_slo_s, c.queue_timeout_s,
                        c.max_waiting)  # fmt: skip
            if any(v is not None and v <= 0 for v in positive):
                raise ConfigError(f"classes.{c.name}: SLOs, timeout and max_waiting must be > 0")
        keys = [k for c in self.list for k in c.api_keys]
        if len(set(keys)) != len(keys):
            raise ConfigError("classes: an API key maps to one class only")
        if self.tenant_labels < 0:
            raise ConfigError("classes.tenant_labels must be >= 0")
        if self.active_window_s < 0:
            raise ConfigError("classes.active_window_s must be >= 0")


@dataclass(frozen=True)
class PredictorSettings:
    """The semantic length predictor in the gateway."""

    enabled: bool | None = None
    """True/False, or None = on exactly when the policy needs predictions."""
    snapshot_path: str | None = None
    """Load the history from here at start and save it here periodically and at exit."""
    warm_start_jsonl: str | None = None
    """Learn this JSONL of {prompt, output_tokens} at start (if no snapshot exists)."""
    save_interval_s: float = 300.0
    """Seconds between snapshots (0 = only at exit)."""
    embed_backend: str | None = None
    """The embedding model's backend (`predictor.encoders`): "onnx-int8" (the default, CPU),
    "onnx" (fp32, CPU) or "torch" (the reference; on a GPU when torch sees one). None: the
    snapshot's, else the default. All embed the same model (cosine ≥ 0.99 between them), so a
    snapshot learnt with one serves another."""


@dataclass(frozen=True)
class SharedLearningSettings:
    """Completions shared between gateway replicas through a Redis stream (`predictor.shared`);
    off unless `redis_url` is set. Losing Redis degrades to local learning, never an error."""

    redis_url: str | None = None
    """`redis://host:6379/0` (`rediss://`, `unix://` too; a password is masked in logs)."""
    stream: str = "sagesched:learning"
    """Stream key; replicas that learn from each other use the same one."""
    maxlen: int = 100_000
    """Records the stream keeps (trimmed approximately); a late starter warms from them."""
    replica_id: str = ""
    """This replica's name in its records (its own are skipped); "" = host name-pid."""
    encoding: str = "int8"
    """Embedding encoding in the stream: int8 (~0.55 KB a record) or float32 (~1.9 KB)."""
    buffer: int = 1024
    """Records waiting to be published; beyond it a record is dropped and counted."""


@dataclass(frozen=True)
class GatewayConfig:
    """Everything `sagesched serve` needs."""

    host: str = "127.0.0.1"
    """Listen address."""
    port: int = 8080
    """Listen port."""
    workers: int = 1
    """Processes that relay requests, all listening on `port` (SO_REUSEPORT). 1: one process
    does everything; N > 1: N workers relay bytes and predict, one scheduling authority per
    host (this process) keeps one queue per model (`gateway.workers.supervisor`)."""
    policy: str = "sagesched"
    """Policy spec, `name[:key=value,...]` (see `sagesched policies`)."""
    routing: str = "sagesched"
    """Router spec, `name[:key=value,...]` (see `sagesched routers`): which backend a granted
    job goes to (docs/gateway.md "Routing"). The default weighs each backend's expected cached
    prefix, engine queue and batch in the engine's seconds; `least-loaded` is the lowest
    in-flight/cap."""
    backends: tuple[BackendConfig, ...] = ()
    """Upstream servers."""
    max_waiting: int = 10_000
    """Queue bound; beyond it requests get 429 (protects memory and latency)."""
    queue_timeout_s: float = 600.0
    """Longest wait in the queue before 503."""
    retry_after_s: int = 1
    """Retry-After seconds sent with 429."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest request body accepted (413 beyond)."""
    max_headers: int = 100
    """Request headers accepted (431 beyond; aiohttp's parser cuts at twice this)."""
    max_header_bytes: int = 8192
    """Largest request header (name and value) and request target (431 / 414 beyond)."""
    header_timeout_s: float = 10.0
    """A connection must finish a request's line and headers this long after it opened, or
    after the first byte of a later request on it; else it is closed (slowloris)."""
    body_timeout_s: float = 30.0
    """A request body must have arrived this long after its headers; else 408 and the
    connection is closed."""
    stream_buffer_bytes: int = 65_536
    """Bytes of a stream the gateway holds for a client that reads slowly (the transport's
    write-buffer high-water mark); beyond it the stream waits for the client."""
    slow_client_timeout_s: float = 30.0
    """Longest a stream may wait on a client that does not read; then the gateway cuts it
    (outcome `client_too_slow`, the upstream request aborted, the backend slot freed)."""
    admin_listen: str | None = None
    """`host:port` serving the admin routes (`/admin/*`) alone; the main address then answers
    them 404 (None: admin routes on the main address, as before). `/metrics` stays on the main
    address."""
    max_retries: int = 2
    """Extra backends tried when one fails before the first byte."""
    api_keys: tuple[str, ...] = ()
    """Accepted client bearer tokens; empty = no client auth."""
    admin_key: str | None = None
    """Bearer token for /admin routes; None = admin routes disabled."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM: seconds the requests in flight get to finish before the rest are ended
    (a stream with an SSE error event); the process exits within about this + 5 s
    (`gateway.serving.drain`). Kubernetes' terminationGracePeriodSeconds must cover it."""
    health_interval_s: float = 2.0
    """Seconds between backend health checks."""
    connect_timeout_s: float = 5.0
    """Upstream connect timeout."""
    read_timeout_s: float = 600.0
    """Longest silence from an upstream stream before it counts as failed."""
    preemption: bool = True
    """Let preemptive policies abort and requeue running requests as continuations. The
    policy decides when: `sagesched` (the default) only when the swap pays (docs/policies.md),
    as in the simulator; false forbids every gateway preemption."""
    preemption_margin: float = 0.0
    """A waiting job must also beat the victim's primary key by this fraction (extra
    hysteresis; 0: the policy's own rule alone, as the simulator runs it)."""
    forward_priority: bool = True
    """Send the job's policy key at dispatch, quantised to vLLM's integer `priority`
    (`policies.capacity.priority_level`), to backends with `priority_scheduling`."""
    adaptive_cap: AdaptiveCapConfig = field(default_factory=AdaptiveCapConfig)
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    tracing: TracingSettings = field(default_factory=TracingSettings)
    predictor: PredictorSettings = field(default_factory=PredictorSettings)
    classes: ClassesSettings = field(default_factory=ClassesSettings)
    shared_learning: SharedLearningSettings = field(default_factory=SharedLearningSettings)
    replicas: ReplicaSettings = field(default_factory=ReplicaSettings)
    log_level: str = "INFO"
    """Python logging level."""


# -- pipeline ---------------------------------------------------------------------------


def parse(text: str) -> dict[str, Any]:
    """YAML text → mapping (empty text → {})."""
    data = yaml.safe_load(text) if text.strip() else {}
    if not isinstance(data, dict):
        raise ConfigError("the config file must hold a mapping at the top level")
    return data


ENV_PREFIX = "SAGESCHED_"
_ENV_KEYS = {
    "HOST": "host",
    "PORT": "port",
    "WORKERS": "workers",
    "POLICY": "policy",
    "ROUTING": "routing",
    "ADMIN_KEY": "admin_key",
    "ADMIN_LISTEN": "admin_listen",
    "API_KEYS": "api_keys",
    "BACKENDS": "backends",
    "MAX_WAITING": "max_waiting",
    "QUEUE_TIMEOUT_S": "queue_timeout_s",
    "LOG_LEVEL": "log_level",
    "REDIS_URL": "shared_learning.redis_url",
    "REPLICA_ID": "shared_learning.replica_id",
    "SHUTDOWN_GRACE_S": "shutdown_grace_s",
    "TRACING": "tracing.enabled",
}


def apply_env(data: dict[str, Any], env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Overlay SAGESCHED_* variables (lists are comma-separated)."""
    env = os.environ if env is None else env
    out = dict(data)
    for suffix, key in _ENV_KEYS.items():
        value = env.get(ENV_PREFIX + suffix)
        if value is None:
            continue
        if key == "backends":
            out[key] = [{"url": u.strip()} for u in value.split(",") if u.strip()]
        elif key == "api_keys":
            out[key] = [k.strip() for k in value.split(",") if k.strip()]
        elif "." in key:  # a section's key, merged into the file's section
            section, name = key.split(".")
            out[section] = {**(out.get(section) or {}), name: value}
        else:
            out[key] = value
    for suffix, key in (("REPLICAS", "count"), ("REPLICA_INDEX", "index")):
        if (value := env.get(ENV_PREFIX + suffix)) is not None:
            out["replicas"] = {**out.get("replicas", {}), key: value}
    return out


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Overlay explicit values (command-line flags); None means "not given". A section's
    flags (a mapping) are merged into the section, keeping its other keys."""
    out = dict(data)
    for k, v in overrides.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = {**out[k], **v}
        elif v is not None:
            out[k] = v
    return out


def build(data: Mapping[str, Any]) -> GatewayConfig:
    """Mapping → `GatewayConfig`, rejecting unknown keys and values of the wrong type."""
    config: GatewayConfig = _build(GatewayConfig, data, "")
    validate(config)
    n, me = config.replicas.count, config.replicas.index
    owned = (
        dataclasses.replace(b, owned=b.owned and i % n == me) for i, b in enumerate(config.backends)
    )
    return dataclasses.replace(config, backends=tuple(owned))


def validate(config: GatewayConfig) -> None:
    """Cross-field rules."""
    if not config.backends:
        raise ConfigError("at least one backend is required (--backend URL)")
    names = [b.name for b in config.backends]
    if len(set(names)) != len(names):
        raise ConfigError(f"backend names must be unique, got {names}")
    for b in config.backends:
        if not b.url.startswith(("http://", "https://")):
            raise ConfigError(f"backend url {b.url!r} must start with http:// or https://")
        if b.max_inflight < 1:
            raise ConfigError(f"backends[{b.name}].max_inflight must be >= 1")
        if b.kv_events is not None and not b.kv_events.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"backends[{b.name}].kv_events must be a tcp:// or ipc:// address")
    if config.admin_listen is not None:
        host, _, port = config.admin_listen.rpartition(":")
        if not host or not port.isdigit() or int(port) == config.port:
            raise ConfigError("admin_listen must be host:port, on another port than the gateway")
    for key in ("max_waiting", "max_body_bytes", "port", "workers", "max_headers"):
        if getattr(config, key) < 1:
            raise ConfigError(f"{key} must be >= 1")
    if config.queue_timeout_s <= 0:
        raise ConfigError("queue_timeout_s must be > 0")
    if config.max_header_bytes < 1024:
        raise ConfigError("max_header_bytes must be >= 1024")
    for key in ("header_timeout_s", "body_timeout_s", "slow_client_timeout_s"):
        if getattr(config, key) <= 0:
            raise ConfigError(f"{key} must be > 0")
    if config.stream_buffer_bytes < 1024:
        raise ConfigError("stream_buffer_bytes must be >= 1024")
    rep = config.replicas
    if not 0 <= rep.index < rep.count <= len(config.backends):
        raise ConfigError("replicas: need 0 <= index < count <= number of backends")
    if config.tokenizer.timeout_s <= 0 or config.tokenizer.cache_entries < 0:
        raise ConfigError("tokenizer.timeout_s must be > 0 and tokenizer.cache_entries >= 0")
    tracing = config.tracing
    if tracing.protocol not in (None, "http/protobuf", "grpc"):
        raise ConfigError(
            f"tracing.protocol must be http/protobuf or grpc, not {tracing.protocol!r}"
        )
    if tracing.sample_ratio is not None and not 0 <= tracing.sample_ratio <= 1:
        raise ConfigError("tracing.sample_ratio must be within [0, 1]")
    if tracing.max_queue < 1:
        raise ConfigError("tracing.max_queue must be >= 1")
    cap = config.capture
    if cap.max_file_mb <= 0 or cap.max_files < 1 or cap.queue < 1:
        raise ConfigError("capture needs max_file_mb > 0, max_files >= 1 and queue >= 1")
    shared, schemes = config.shared_learning, ("redis://", "rediss://", "unix://")
    if shared.redis_url is not None and not shared.redis_url.startswith(schemes):
        raise ConfigError(f"shared_learning.redis_url must start with one of {schemes}")
    if shared.maxlen < 1 or shared.buffer < 1 or shared.encoding not in ("int8", "float32"):
        raise ConfigError("shared_learning needs maxlen, buffer >= 1 and encoding int8 or float32")
    backend = config.predictor.embed_backend
    if backend is not None:
        from predictor.encoders import ENCODERS

        if backend not in ENCODERS:
            raise ConfigError(f"predictor.embed_backend must be one of {sorted(ENCODERS)}")
    if config.shutdown_grace_s < 0:
        raise ConfigError("shutdown_grace_s must be >= 0")
    _validate_cap(config.adaptive_cap)
    from policies import parse_policy

    try:
        parse_policy(config.policy)
    except ValueError as exc:
        raise ConfigError(f"policy: {exc}") from None
    from policies.routing import parse_router

    try:
        parse_router(config.routing)
    except ValueError as exc:
        raise ConfigError(f"routing: {exc}") from None


def _validate_cap(cfg: AdaptiveCapConfig) -> None:
    """The self-tuning cap's settings, checked by the control law itself (one set of rules)."""
    try:
        cfg.law()
    except ValueError as exc:
        raise ConfigError(f"adaptive_cap: {exc}") from None


def load(
    path: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> GatewayConfig:
    """The whole pipeline: file (optional) → environment → flags → typed config."""
    text = ""
    if path is not None:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    data = apply_overrides(apply_env(parse(text), env), overrides or {})
    return build(data)


def as_dict(config: GatewayConfig) -> dict[str, Any]:
    """The effective config as plain data, secrets masked (for the start-up log)."""
    data = dataclasses.asdict(config)
    if data["admin_key"]:
        data["admin_key"] = "***"
    data["api_keys"] = ["***"] * len(data["api_keys"])
    for b in data["backends"]:
        if b["api_key"]:
            b["api_key"] = "***"
    for c in data["classes"]["list"]:
        c["api_keys"] = ["***"] * len(c["api_keys"])
    if data["shared_learning"]["redis_url"]:
        from predictor.shared import redacted

        data["shared_learning"]["redis_url"] = redacted(data["shared_learning"]["redis_url"])
    return data


# -- dict → dataclass -------------------------------------------------------------------


def _build(cls: type[Any], data: Any, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'} must be a mapping")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where or 'config'}")
    kwargs = {k: _convert(hints[k], v, f"{where}{k}") for k, v in data.items()}
    if cls is BackendConfig and not kwargs.get("name"):
        url = str(kwargs.get("url", ""))
        kwargs["name"] = url.split("://", 1)[-1].rstrip("/")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from None


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is types.UnionType or origin is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if value is None else _convert(args[0], value, where)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where + ".")  # type: ignore[arg-type]
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} must be a list")
        item = typing.get_args(hint)[0]
        return tuple(_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    return _scalar(hint, value, where)


def _scalar(hint: Any, value: Any, where: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            return hint(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if hint is str:
        if not isinstance(value, str | int | float):
            raise ConfigError(f"{where} must be a string")
        return str(value)
    raise ConfigError(f"{where}: unsupported type {hint}")
