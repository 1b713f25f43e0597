"""Prometheus metrics: the only module that imports prometheus-client.

Nothing on the hot path touches a series. A request records a plain `RequestTrace`;
`GatewayMetrics.settle` turns it into metric updates when the request ends. The pool and the
dispatcher keep plain numbers (in-flight, caps, health, queue depths, preemption and retry
counts) that `_Live` reads when Prometheus scrapes (`GatewayMetrics.watch`). Each app gets
its own `CollectorRegistry`, so tests and several gateways in one process never share series.
Names carry units and the `sagesched_` prefix; histogram edges follow vLLM's own (REFERENCE.md
§4) so gateway and engine series can be compared bucket for bucket, with a few finer edges
below vLLM's first one, where gateway overhead lives. Labels are bounded: model (validated
against the backends' models), backend (from config), policy (one per process), outcome (an
enum), code (HTTP status), class (from config), tenant (the hashed ids of at most
`tenant_labels` busiest tenants, else `other`).
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector

from gateway.errors import Outcome

if TYPE_CHECKING:
    from gateway.config import TrafficClass
    from gateway.scheduling.backends import BackendPool


class QueueCounts(Protocol):
    """What the metrics read from the dispatcher at scrape time
    (`gateway.scheduling.dispatcher`)."""

    label: str
    """The policy's label."""
    preemptions: dict[tuple[str, str], int]
    """(model, backend) -> running requests preempted and requeued."""
    retries: dict[tuple[str, str], int]
    """(model, backend) -> requests retried elsewhere before the first byte."""

    def queue_depths(self) -> dict[str, int]: ...
    def class_depths(self) -> dict[str, int]: ...


# vLLM's edges (vllm/v1/metrics/loggers.py) with finer ones prepended for sub-ms overhead.
TTFT_BUCKETS_S = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS_S = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
PREDICTOR_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
ERROR_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _KnownLabels:
    """`labels(...)` of a labelset seen before is one dict lookup. prometheus-client keys a
    metric's children by their label values as strings (`_metrics`) but checks, converts and
    locks on every call (~1.5 µs); the gateway calls it ~20 times per request. Values that
    are not all strings, keyword labels and new labelsets take prometheus-client's own path."""

    _metrics: Any

    def labels(self, *values: Any, **kw: Any) -> Any:
        child = None if kw else self._metrics.get(values)
        return child if child is not None else super().labels(*values, **kw)  # type: ignore[misc]


class Counter(_KnownLabels, prometheus_client.Counter):
    pass


class Gauge(_KnownLabels, prometheus_client.Gauge):
    pass


class Histogram(_KnownLabels, prometheus_client.Histogram):
    pass


@dataclass(slots=True)
class RequestTrace:
    """Times (monotonic seconds) and counts of one request, filled as it proceeds."""

    model: str
    arrived: float
    policy: str
    backend: str = ""
    dispatched: float | None = None
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    """The backend's count (`usage.prompt_tokens`), once the answer reported it."""
    prompt_count_source: str | None = None
    """How the prompt was sized before dispatch: `tokenizer`, `cache` or `estimate`."""
    predicted_median: float | None = None
    predictor_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    outcome: Outcome | None = None
    status: int = 200
    klass: str = ""
    """The request's class (`gateway.scheduling.classes`), once resolved."""
    accepted: float | None = None
    """When step 1 (accept) ended."""
    predicted: float | None = None
    """When step 2 (predict) ended."""
    queue_depth: int | None = None
    """Jobs of its model waiting when it was admitted."""
    attempts: int = 0
    """Upstream requests made for it (retries and resumed continuations included)."""
    span: Any = None
    """Its OpenTelemetry span (`gateway.observability.tracing`; None: not traced)."""
    trace_id: str | None = None
    """Its trace's id (32 hex digits) when the trace is sampled: the TTFT histogram's
    exemplar and the capture record carry it."""
    relay_span: Any = None
    """Step 4's span, once granted a backend."""
    trace_headers: dict[str, str] | None = None
    """The trace context an unsampled request carries upstream (no span of its own)."""
    tenant: str = ""
    """Who the request is billed to (never a label as is: hashed, top tenants only)."""


SLO_JUDGED = frozenset(
    {Outcome.COMPLETED, Outcome.SHED, Outcome.QUEUE_TIMEOUT, Outcome.UPSTREAM_ERROR,
     Outcome.UPSTREAM_BROKEN, Outcome.INTERNAL_ERROR}
)  # fmt: skip
"""Outcomes judged against a class's objectives: served, or failed by the service (a request
that never got its first or last token misses it). Client errors and cancellations are not."""


@functools.lru_cache(maxsize=4096)  # hashed once per tenant, not per request
def tenant_id(tenant: str, digits: int = 8) -> str:
    """A tenant's stable pseudonym: `t-` + the first `digits` hex of its SHA-256."""
    return "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:digits]


class TenantLabels:
    """Bounded tenant label values: `t-<8 hex of sha256>` for a tenant among the `top` busiest
    (by requests, a Space-Saving sketch of 2·top counters), `other` for the rest. At most
    4·top distinct labels are ever handed out, so the series stay bounded as tenants churn."""

    def __init__(self, top: int) -> None:
        self._top = top
        self._counts: dict[str, int] = {}
        self._issued: set[str] = set()

    def label(self, tenant: str) -> str:
        """Count one request of `tenant` and return its label."""
        if self._top <= 0:
            return "other"
        counts = self._counts
        if tenant in counts or len(counts) < 2 * self._top:
            counts[tenant] = counts.get(tenant, 0) + 1
        else:  # Space-Saving: the newcomer takes the smallest counter's place and count
            smallest = min(counts, key=counts.__getitem__)
            counts[tenant] = counts.pop(smallest) + 1
        top = sorted(counts, key=lambda t: (-counts[t], t))[: self._top]
        if tenant not in top:
            return "other"
        label = tenant_id(tenant)
        if label in self._issued or len(self._issued) < 4 * self._top:
            self._issued.add(label)
            return label
        return "other"


class GatewayMetrics:
    """The gateway's series, registered in a private registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        mbp = ("model", "backend", "policy")
        self.ttft = Histogram(
            "sagesched_time_to_first_token_seconds",
            "Arrival at the gateway to the first streamed token relayed.",
            mbp, buckets=TTFT_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.ttlt = Histogram(
            "sagesched_time_to_last_token_seconds",
            "Arrival at the gateway to the last token relayed (end-to-end latency).",
            mbp, buckets=E2E_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "sagesched_inter_token_latency_seconds",
            "Gap between consecutive streamed chunks, measured at the gateway.",
            mbp, buckets=ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "sagesched_queue_wait_seconds",
            "Time from admission to dispatch to a backend.",
            ("model", "policy"), buckets=TTFT_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.predictor_latency = Histogram(
            "sagesched_predictor_latency_seconds",
            "Time to predict a request's output-length distribution.",
            ("model",), buckets=PREDICTOR_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.prediction_error = Histogram(
            "sagesched_prediction_error_ratio",
            "|predicted median - true output tokens| / true output tokens.",
            ("model", "policy"), buckets=ERROR_RATIO_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "sagesched_requests",
            "Requests by terminal state and HTTP status.",
            ("model", "policy", "outcome", "code"), registry=r,
        )  # fmt: skip
        self.output_tokens = Counter(
            "sagesched_output_tokens", "Output tokens relayed.", ("model", "backend"), registry=r
        )
        self.prompt_tokens = Counter(
            "sagesched_prompt_tokens", "Prompt tokens of answered requests (the backend's usage).",
            ("model", "backend"), registry=r,
        )  # fmt: skip
        self.prompt_counts = Counter(
            "sagesched_prompt_counts",
            "Queued requests sized before dispatch, by source: the backend's tokenizer, the "
            "gateway's cache of its counts, or the characters/4 estimate (fallback).",
            ("model", "source"), registry=r,
        )  # fmt: skip
        self.capture_records = Counter(
            "sagesched_capture_records", "Traffic-capture records by result (written, dropped).",
            ("result",), registry=r,
        )  # fmt: skip
        for result in ("written", "dropped"):
            self.capture_records.labels(result)
        self.connections_cut = Counter(
            "sagesched_connections_cut",
            "Client connections cut before a request was parsed (header_timeout: request line "
            "and headers not complete within header_timeout_s). Not requests.",
            ("reason",), registry=r,
        )  # fmt: skip
        self.connections_cut.labels("header_timeout")
        self.live = _Live()
        """The pool's and the dispatcher's plain numbers, read at scrape time."""
        r.register(self.live)
        self.engine_shares = _EngineShares()
        r.register(self.engine_shares)
        self._class_series(r)
        self._slos: dict[str, tuple[float | None, float | None, float | None]] = {}
        self._tenants = TenantLabels(0)

    def _class_series(self, r: CollectorRegistry) -> None:
        """Per request class (`gateway.scheduling.classes`); labels bounded by the configured
        classes."""
        mc = ("model", "class")
        self.class_ttft = Histogram(
            "sagesched_class_time_to_first_token_seconds",
            "Arrival at the gateway to the first token relayed, by request class.",
            mc, buckets=TTFT_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.class_ttlt = Histogram(
            "sagesched_class_time_to_last_token_seconds",
            "Arrival at the gateway to the last token relayed, completed requests, by class.",
            mc, buckets=E2E_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.class_tpot = Histogram(
            "sagesched_class_time_per_output_token_seconds",
            "First to last token relayed over the tokens after the first, completed requests "
            "of at least two tokens, by class.",
            mc, buckets=ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.class_queue_wait = Histogram(
            "sagesched_class_queue_wait_seconds",
            "Admission to first dispatch to a backend, by request class.",
            mc, buckets=TTFT_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.class_requests = Counter(
            "sagesched_class_requests",
            "Requests by class and terminal state (shed: refused or evicted from a full queue).",
            ("model", "class", "outcome"), registry=r,
        )  # fmt: skip
        self.class_slo = Counter(
            "sagesched_class_slo",
            "Requests judged against their class's objective (slo: ttft, ttlt or tpot), met "
            "or missed; a request the service failed or shed misses it.",
            ("class", "slo", "result"), registry=r,
        )  # fmt: skip
        self.class_objective = Gauge(
            "sagesched_class_slo_objective",
            "Share of a class's requests that must meet its objective (the burn alerts' budget).",
            ("class", "slo"), registry=r,
        )  # fmt: skip
        self.tenant_requests = Counter(
            "sagesched_tenant_requests",
            "Requests by class and tenant (hashed, the busiest tenants only; the rest: other).",
            ("class", "tenant"), registry=r,
        )  # fmt: skip
        self.tenant_output_tokens = Counter(
            "sagesched_tenant_output_tokens", "Output tokens relayed, by class and tenant.",
            ("class", "tenant"), registry=r,
        )  # fmt: skip

    def declare_classes(self, classes: Sequence[TrafficClass], tenant_labels: int = 10) -> None:
        """The configured classes: their objectives exported, their counters created at zero."""
        self._tenants = TenantLabels(tenant_labels)
        for c in classes:
            self._slos[c.name] = (c.ttft_slo_s, c.ttlt_slo_s, c.tpot_slo_s)
            for slo, target in zip(("ttft", "ttlt", "tpot"), self._slos[c.name], strict=True):
                if target is None:
                    continue
                self.class_objective.labels(c.name, slo).set(c.slo_target)
                for result in ("met", "missed"):
                    self.class_slo.labels(c.name, slo, result)

    def watch_embedding_cache(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Expose the predictor's embedding-cache lookups, `counts()` = (hits, misses) since
        start, read at scrape time, as `sagesched_embedding_cache_lookups_total{result}`."""
        self.registry.register(_CacheLookups(counts))

    def watch(self, pool: BackendPool, dispatcher: QueueCounts) -> None:
        """Export the pool's and the dispatcher's state (read at scrape time, see `_Live`)."""
        self.live.pool, self.live.dispatcher = pool, dispatcher

    def watch_engine_shares(self, dispatcher: EngineShareCounts) -> None:
        """Expose the classes' engine shares (`policies.shares`), read at scrape time: the
        slots each bounded class may hold per backend now, and the jobs lent a share or held
        back at it (`gateway.scheduling.dispatcher`)."""
        self.engine_shares.dispatcher = dispatcher

    def watch_tracing(self, dropped: Callable[[], int]) -> None:
        """Expose the spans tracing lost (queue full or export failed), read at scrape time."""
        self.registry.register(_Dropped(dropped))

    def watch_shared_learning(self, stats: Callable[[], Mapping[str, float]]) -> None:
        """Expose shared learning's plain numbers (`predictor.shared.SharedLearning.stats`),
        read at scrape time."""
        self.registry.register(_SharedLearning(stats))

    def settle(self, t: RequestTrace) -> None:
        """Record a finished request (exactly once per request)."""
        assert t.outcome is not None, "a request must end with an outcome"
        self.requests.labels(t.model, t.policy, t.outcome.value, str(t.status)).inc()
        if t.dispatched is not None:
            self.queue_wait.labels(t.model, t.policy).observe(t.dispatched - t.arrived)
        if t.predictor_s is not None:
            self.predictor_latency.labels(t.model).observe(t.predictor_s)
        if t.prompt_count_source is not None:
            self.prompt_counts.labels(t.model, t.prompt_count_source).inc()
        if t.prompt_tokens is not None and t.backend:
            self.prompt_tokens.labels(t.model, t.backend).inc(t.prompt_tokens)
        if t.klass:
            self._settle_class(t)
        if t.first_token is None or not t.backend:
            return
        labels = (t.model, t.backend, t.policy)
        exemplar = None if t.trace_id is None else {"trace_id": t.trace_id}
        self.ttft.labels(*labels).observe(t.first_token - t.arrived, exemplar)
        itl = self.itl.labels(*labels)
        for gap in t.gaps_s:
            itl.observe(gap)
        self.output_tokens.labels(t.model, t.backend).inc(t.output_tokens)
        if t.outcome is Outcome.COMPLETED and t.finished is not None:
            self.ttlt.labels(*labels).observe(t.finished - t.arrived)
            if t.predicted_median is not None and t.output_tokens > 0:
                err = abs(t.predicted_median - t.output_tokens) / t.output_tokens
                self.prediction_error.labels(t.model, t.policy).observe(err)

    def _settle_class(self, t: RequestTrace) -> None:
        assert t.outcome is not None
        c = t.klass
        self.class_requests.labels(t.model, c, t.outcome.value).inc()
        tenant = self._tenants.label(t.tenant)
        self.tenant_requests.labels(c, tenant).inc()
        if t.output_tokens:
            self.tenant_output_tokens.labels(c, tenant).inc(t.output_tokens)
        if t.dispatched is not None:
            self.class_queue_wait.labels(t.model, c).observe(t.dispatched - t.arrived)
        last = t.finished if t.outcome is Outcome.COMPLETED else None
        tpot = None
        if t.first_token is not None:
            self.class_ttft.labels(t.model, c).observe(t.first_token - t.arrived)
            if last is not None:
                self.class_ttlt.labels(t.model, c).observe(last - t.arrived)
                if t.output_tokens >= 2:
                    tpot = (last - t.first_token) / (t.output_tokens - 1)
                    self.class_tpot.labels(t.model, c).observe(tpot)
        if t.outcome not in SLO_JUDGED:
            return
        ttft_slo, ttlt_slo, tpot_slo = self._slos.get(c, (None, None, None))
        judged = [
            ("ttft", ttft_slo, None if t.first_token is None else t.first_token - t.arrived),
            ("ttlt", ttlt_slo, None if last is None else last - t.arrived),
        ]
        if last is None or tpot is not None:  # a one-token answer has no time per token
            judged.append(("tpot", tpot_slo, tpot))
        for slo, target, took in judged:
            if target is not None:
                met = took is not None and took <= target
                self.class_slo.labels(c, slo, "met" if met else "missed").inc()

    def count_cut(self, reason: str) -> None:
        """A connection cut before its request was parsed (`gateway.serving.security`)."""
        self.connections_cut.labels(reason).inc()

    def count_capture(self, result: str) -> None:
        """One traffic-capture record `written` or `dropped` (`gateway.observability.capture`)."""
        self.capture_records.labels(result).inc()

    def exposition(self, openmetrics: bool = False) -> tuple[bytes, str]:
        """Every series and their content type: Prometheus text, or OpenMetrics (which
        carries the TTFT histogram's exemplars: the trace ids of sampled requests)."""
        if openmetrics:
            return openmetrics_latest(self.registry), OPENMETRICS  # type: ignore[no-untyped-call]
        return generate_latest(self.registry), CONTENT_TYPE


class _Live(Collector):
    """Series of state the pool and the dispatcher keep as plain numbers, built when
    Prometheus scrapes: backend in-flight, cap and health (every configured backend), queue
    depth per model with a scheduler, class queue depth (every configured class), and the
    preemption and retry counters (at zero per (model, backend) once the model has a
    scheduler, so `increase()` counts the first event too)."""

    def __init__(self) -> None:
        self.pool: BackendPool | None = None
        self.dispatcher: QueueCounts | None = None
        self._created: dict[tuple[str, ...], float] = {}

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily(
            "sagesched_backend_inflight", "Requests running on a backend.", labels=("backend",)
        )
        cap = GaugeMetricFamily(
            "sagesched_backend_inflight_cap", "Current in-flight cap of a backend.",
            labels=("backend",),
        )  # fmt: skip
        healthy = GaugeMetricFamily(
            "sagesched_backend_healthy", "1 if the backend passed its last health check.",
            labels=("backend",),
        )  # fmt: skip
        for b in self.pool.backends if self.pool is not None else ():
            inflight.add_metric((b.name,), b.inflight)
            cap.add_metric((b.name,), b.cap)
            healthy.add_metric((b.name,), 1 if b.healthy else 0)
        depth = GaugeMetricFamily(
            "sagesched_queue_depth", "Requests waiting in the gateway queue.",
            labels=("model", "policy"),
        )  # fmt: skip
        class_depth = GaugeMetricFamily(
            "sagesched_class_queue_depth", "Requests of a class waiting for their first dispatch.",
            labels=("class",),
        )  # fmt: skip
        preemptions = CounterMetricFamily(
            "sagesched_preemptions", "Running requests preempted and requeued.",
            labels=("model", "backend", "policy"),
        )  # fmt: skip
        retries = CounterMetricFamily(
            "sagesched_retries", "Requests retried on another backend before the first byte.",
            labels=("model", "backend"),
        )  # fmt: skip
        d = self.dispatcher
        if d is not None:
            for model, n in d.queue_depths().items():
                depth.add_metric((model, d.label), n)
            for name, n in d.class_depths().items():
                class_depth.add_metric((name,), n)
            for (model, backend), n in list(d.preemptions.items()):
                labels = (model, backend, d.label)
                preemptions.add_metric(labels, n, created=self._since("p", *labels))
            for (model, backend), n in list(d.retries.items()):
                retries.add_metric((model, backend), n, created=self._since("r", model, backend))
        yield from (inflight, cap, healthy, depth, class_depth, preemptions, retries)
        yield from self._routing()

    def _routing(self) -> Iterator[Metric]:
        """Routing decisions by reason, and the prompt tokens routed with those the router
        expected cached (their rates' ratio: the gateway's predicted prefix-cache hit ratio,
        to read beside vLLM's own `vllm:prefix_cache_hits`)."""
        decisions = CounterMetricFamily(
            "sagesched_routing_decisions", "Requests routed to a backend, by the router's reason "
            "(affinity: where most of the prefix is expected cached; balance: elsewhere, for "
            "load; fallback: no backend expected to hold any of it).",
            labels=("model", "backend", "router", "reason"),
        )  # fmt: skip
        routed = CounterMetricFamily(
            "sagesched_routing_prompt_tokens", "Prompt tokens of the requests routed to a backend.",
            labels=("model", "backend"),
        )  # fmt: skip
        cached = CounterMetricFamily(
            "sagesched_routing_cached_tokens",
            "Of those, the prompt tokens the router expected cached on that backend.",
            labels=("model", "backend"),
        )  # fmt: skip
        exact = GaugeMetricFamily(
            "sagesched_backend_kv_events_exact",
            "1 while the backend's KV-cache events are complete and current (prefix routers "
            "match what it caches); 0: they were lost or lag, routing is approximate.",
            labels=("backend",),
        )  # fmt: skip
        events = CounterMetricFamily(
            "sagesched_backend_kv_events", "KV-cache events applied, per backend.",
            labels=("backend",),
        )  # fmt: skip
        gaps = CounterMetricFamily(
            "sagesched_backend_kv_event_gaps", "Gaps in a backend's KV-event sequence (lost).",
            labels=("backend",),
        )  # fmt: skip
        pool = self.pool
        for b in pool.backends if pool is not None else ():
            stream = b.events
            if stream is not None:
                exact.add_metric((b.name,), 1 if stream.exact else 0)
                events.add_metric((b.name,), stream.events, created=self._since("e", b.name))
                gaps.add_metric((b.name,), stream.gaps, created=self._since("g", b.name))
        exact_decisions = CounterMetricFamily(
            "sagesched_routing_exact_decisions",
            "Routing decisions that matched the prompt's tokens against a backend's own KV "
            "events (the others used the router's approximate index).",
            labels=("model",),
        )  # fmt: skip
        for model, n in list(pool.exact_decisions.items()) if pool is not None else ():
            exact_decisions.add_metric((model,), n, created=self._since("x", model))
        yield from (exact, events, gaps, exact_decisions)
        if pool is not None:
            router = pool.routing
            for (model, backend, reason), n in list(pool.decisions.items()):
                labels = (model, backend, router, reason)
                decisions.add_metric(labels, n, created=self._since("d", *labels))
            for family, counts, tag in ((routed, pool.routed_tokens, "t"),
                                        (cached, pool.cached_tokens, "c")):  # fmt: skip
                for (model, backend), n in list(counts.items()):
                    family.add_metric((model, backend), n, created=self._since(tag, model, backend))
        yield from (decisions, routed, cached)

    def _since(self, *key: str) -> float:
        """When a counter series was first exported (its `_created` sample)."""
        return self._created.setdefault(key, time.time())


class _CacheLookups(Collector):
    """Counters kept by the predictor (plain ints in the hot path), turned into a series when
    Prometheus scrapes."""

    def __init__(self, counts: Callable[[], tuple[int, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        hits, misses = self._counts()
        family = CounterMetricFamily(
            "sagesched_embedding_cache_lookups",
            "Prompt embeddings looked up in the predictor's cache, by result (a hit skips the "
            "embedding model).",
            labels=("result",),
        )
        family.add_metric(("hit",), hits)
        family.add_metric(("miss",), misses)
        yield family


class EngineShareCounts(Protocol):
    """What the engine-share series read from the dispatcher at scrape time."""

    share_lent: dict[str, int]
    share_held: dict[str, int]

    def engine_shares(self) -> dict[tuple[str, str], int]: ...


class _EngineShares(Collector):
    """Engine shares per class: the slots in force, and the jobs lent or held back."""

    def __init__(self) -> None:
        self.dispatcher: EngineShareCounts | None = None

    def collect(self) -> Iterator[Metric]:
        d = self.dispatcher
        slots = GaugeMetricFamily(
            "sagesched_engine_share_slots",
            "Slots of a backend a class's band may hold now (its engine share, or what a more "
            "urgent class's TPOT objective leaves; the cap while nothing more urgent is active).",
            labels=("class", "backend"),
        )
        shares = {} if d is None else d.engine_shares()
        for (klass, backend), n in shares.items():
            slots.add_metric((klass, backend), n)
        lent = CounterMetricFamily(
            "sagesched_engine_share_lent",
            "Jobs started beyond their band's engine share: lent while no more urgent class "
            "was active.",
            labels=("class",),
        )
        held = CounterMetricFamily(
            "sagesched_engine_share_held",
            "Requests held back, as their band's next in line, at its engine share (or a more "
            "urgent class's TPOT bound) while a backend had room; each counted once.",
            labels=("class",),
        )
        if d is not None:
            for family, counts in ((lent, d.share_lent), (held, d.share_held)):
                for klass, n in counts.items():
                    family.add_metric((klass,), n)
        yield from (slots, lent, held)


class _Dropped(Collector):
    """`sagesched_tracing_spans_dropped_total`: spans the tracer could not queue or export."""

    def __init__(self, dropped: Callable[[], int]) -> None:
        self._dropped = dropped

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "sagesched_tracing_spans_dropped",
            "Spans tracing lost: its export queue was full or the collector failed.",
        )
        family.add_metric((), self._dropped())
        yield family


class _SharedLearning(Collector):
    """Shared learning between replicas: whether Redis answers, records by result, losses."""

    RESULTS = ("published", "received", "warmed", "dropped", "failed", "malformed")

    def __init__(self, stats: Callable[[], Mapping[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            "sagesched_shared_learning_connected",
            "1 while the shared-learning Redis answers; 0: this replica learns locally only.",
            value=s["connected"],
        )
        records = CounterMetricFamily(
            "sagesched_shared_learning_records",
            "Shared-learning records: published, received (learned from other replicas), warmed "
            "(learned at start), dropped (publish buffer full), failed (publish lost with Redis), "
            "malformed.",
            labels=("result",),
        )
        for result in self.RESULTS:
            records.add_metric((result,), s[result])
        yield records
        yield CounterMetricFamily(
            "sagesched_shared_learning_disconnects",
            "Times the shared-learning Redis was lost (each logged once).",
            value=s["disconnects"],
        )


def scrape_values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum every sample of each named series in a Prometheus text exposition (e.g. a
    backend's `/metrics`); names absent from the text are absent from the result."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    wanted = set(names)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def merge_expositions(own: bytes, others: Sequence[bytes]) -> bytes:
    """Several processes' expositions as one process's (`serve --workers N`): `own` is the
    scheduling authority's, `others` the workers'. Counters and histograms are summed series by
    series (same names and labels as one process), a `_created` series keeps the earliest
    start, and gauges come from `own` only: queue depths, in-flight counts, caps and health live
    in the authority, and a worker's copies of them are not the state."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for i, text in enumerate((own, *others)):
        for family in text_string_to_metric_families(text.decode()):
            created = family.name.endswith("_created")
            if family.type == "gauge" and i > 0 and not created:
                continue
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            merged = values[family.name]
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in merged:
                    merged[key] = s.value
                elif created:
                    merged[key] = min(merged[key], s.value)
                else:
                    merged[key] += s.value
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(families, values))
    return generate_latest(registry)


class _Merged(Collector):
    """Families rebuilt from merged samples (`merge_expositions`)."""

    def __init__(
        self,
        families: dict[str, Metric],
        values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]],
    ) -> None:
        self._families = families
        self._values = values

    def collect(self) -> Iterator[Metric]:
        for name, family in self._families.items():
            for (sample, labels), value in self._values[name].items():
                family.add_sample(sample, dict(labels), value)
            yield family
