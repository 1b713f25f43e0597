"""OpenTelemetry traces of every request: one span per request and one per step (accept,
predict, queue, relay with one child per attempt, settle), exported over OTLP off the event
loop. Off by default (`tracing: {enabled: true}`); when off nothing here is imported.

The request span continues an incoming W3C `traceparent` and each attempt's span is sent
upstream in the same header, so vLLM (`--otlp-traces-endpoint`) puts its own span in the same
trace. Attributes follow OpenTelemetry's GenAI semantic conventions where one applies
(`gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...) and `sagesched.*` for the rest.

A request that is not sampled (its caller's `traceparent` says so, or the sample ratio's
draw) makes no span at all: it only carries a trace context upstream, its caller's or a new
unsampled one, so that vLLM records nothing of it either. At a ratio of 0.01 tracing then costs
almost nothing per request (docs/benchmarks.md, "Tracing").

Spans whose times are known only at the end (accept, predict, queue, settle) are made then,
from the request's `RequestTrace` (monotonic seconds, converted to the epoch once per process);
the request, relay and attempt spans are live, since their contexts go upstream. Export runs
on the SDK's batch thread: a collector that is down never delays or fails a request; a span
that cannot be queued or exported is counted (`dropped`).
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace as otel
from opentelemetry.context import Context
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from gateway.config import TracingSettings

if TYPE_CHECKING:
    from gateway.observability.metrics import RequestTrace

log = logging.getLogger(__name__)

DEFAULT_SERVICE = "sagesched-gateway"
EXPORT_TIMEOUT_S = 5.0
"""One export's limit (the batch thread's, never a request's)."""
SHUTDOWN_TIMEOUT_MS = 3000
"""What a stopping gateway gives the last spans to leave."""


class _Counting(SpanExporter):
    """The exporter, counting the spans of every batch it failed to deliver."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.failed = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as exc:
            log.debug("span export failed: %r", exc)
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _Bounded(BatchSpanProcessor):
    """The SDK's batch processor, counting the spans it drops for a full queue."""

    def __init__(self, exporter: SpanExporter, max_queue: int) -> None:
        super().__init__(
            exporter, max_queue_size=max_queue, max_export_batch_size=min(512, max_queue)
        )
        self.max_queue = max_queue
        self.full = 0

    def on_end(self, span: ReadableSpan) -> None:
        queue = getattr(self._batch_processor, "_queue", None)
        if queue is not None and len(queue) >= self.max_queue:
            self.full += 1
        super().on_end(span)


def make_exporter(settings: TracingSettings) -> SpanExporter:
    """The OTLP exporter the settings (or the `OTEL_*` variables) ask for."""
    protocol = settings.protocol or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=settings.endpoint, timeout=EXPORT_TIMEOUT_S)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=settings.endpoint, timeout=EXPORT_TIMEOUT_S)


def sample_ratio(settings: TracingSettings) -> float:
    if settings.sample_ratio is not None:
        return settings.sample_ratio
    try:
        return min(1.0, max(0.0, float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", "1"))))
    except ValueError:
        return 1.0


class Tracing:
    """The gateway's tracer: `begin` a request (its span, or only the context an unsampled
    one carries), open each `attempt` (and the relay span) live, `finish` the rest from the
    request's trace. Not thread-safe (one event loop)."""

    def __init__(self, settings: TracingSettings, exporter: SpanExporter | None = None) -> None:
        service = settings.service_name or os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE
        self._exporter = _Counting(exporter or make_exporter(settings))
        self._processor = _Bounded(self._exporter, settings.max_queue)
        self.ratio = sample_ratio(settings)
        self._draw = random.Random()
        self._provider = TracerProvider(  # its default sampler: children follow their parent
            resource=Resource.create({"service.name": service})
        )
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("sagesched.gateway")
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()

    @property
    def dropped(self) -> int:
        """Spans lost so far (queue full or export failed)."""
        return self._exporter.failed + self._processor.full

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_offset_ns

    # -- live spans -------------------------------------------------------------------------

    def begin(self, trace: RequestTrace, headers: Mapping[str, str], name: str) -> None:
        """Open `trace`'s request span when it is sampled (its caller's `traceparent` decides,
        parent-based; without one, a draw at the sample ratio), else keep only the trace
        context it carries upstream unrecorded."""
        if "traceparent" in headers:
            context = extract(headers)
            parent = otel.get_current_span(context).get_span_context()
            if parent.is_valid:
                if parent.trace_flags.sampled:
                    self._open(trace, name, context)
                else:
                    trace.trace_headers = {k: headers[k] for k in PROPAGATED if k in headers}
                return
        if self.ratio < 1.0 and self._draw.random() >= self.ratio:
            trace_id = self._draw.getrandbits(128) or 1
            span_id = self._draw.getrandbits(64) or 1
            trace.trace_headers = {"traceparent": f"00-{trace_id:032x}-{span_id:016x}-00"}
            return
        self._open(trace, name, None)

    def _open(self, trace: RequestTrace, name: str, context: Context | None) -> None:
        span = self._tracer.start_span(
            name, context=context, kind=otel.SpanKind.SERVER, start_time=self._ns(trace.arrived)
        )
        trace.span = span
        trace.trace_id = format(span.get_span_context().trace_id, "032x")

    def attempt(
        self, trace: RequestTrace, backend: str, number: int
    ) -> tuple[otel.Span | None, dict[str, str]]:
        """One upstream request's span (the relay span opened on the first) and the headers
        that carry its context upstream; for an unsampled request no span, only the context
        it carries."""
        if trace.span is None:
            return None, trace.trace_headers or {}
        if trace.relay_span is None:  # step 4 runs from the first grant to the last attempt
            trace.relay_span = self._tracer.start_span(
                "sagesched.relay", context=otel.set_span_in_context(trace.span),
                start_time=self._ns(trace.dispatched or time.monotonic()),
            )  # fmt: skip
        span = self._tracer.start_span(
            "sagesched.attempt", context=otel.set_span_in_context(trace.relay_span),
            kind=otel.SpanKind.CLIENT,
            attributes={"sagesched.backend": backend, "sagesched.attempt": number},
        )  # fmt: skip
        headers: dict[str, str] = {}
        inject(headers, context=otel.set_span_in_context(span))
        return span, headers

    # -- at the end -------------------------------------------------------------------------

    def finish(self, trace: RequestTrace, job: Any) -> None:
        """The step spans from `trace`'s times, the request's attributes, and the end of the
        request (and relay) span. Called once, when the request settles."""
        request = trace.span
        if request is None:
            return
        attributes = request_attributes(trace, job)
        context = otel.set_span_in_context(request)
        steps = (
            ("sagesched.accept", trace.arrived, trace.accepted),
            ("sagesched.predict", trace.accepted, trace.predicted),
            ("sagesched.queue", trace.predicted or trace.accepted, trace.dispatched),
        )
        for name, start, end in steps:
            if start is not None and end is not None:
                self._tracer.start_span(name, context=context, start_time=self._ns(start)).end(
                    end_time=self._ns(end)
                )
        now = time.monotonic()
        if trace.relay_span is not None:
            trace.relay_span.end(end_time=self._ns(trace.finished or now))
        settle = self._tracer.start_span(
            "sagesched.settle", context=context, start_time=self._ns(now)
        )
        request.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if trace.status >= 500:
            request.set_status(otel.Status(otel.StatusCode.ERROR))
        end = self._ns(time.monotonic())
        settle.end(end_time=end)
        request.end(end_time=end)

    def force_flush(self) -> bool:
        """Export what is queued now (blocking, bounded by the export timeout); True when it
        all left."""
        return self._processor.force_flush(int(2 * EXPORT_TIMEOUT_S * 1000))

    def shutdown(self) -> None:
        """Send what is queued (bounded), then stop the batch thread."""
        self._processor.force_flush(SHUTDOWN_TIMEOUT_MS)
        self._provider.shutdown()


PROPAGATED = ("traceparent", "tracestate")
"""W3C trace-context headers an unrecorded request passes upstream as it got them."""

OPERATIONS = {"chat": "chat", "completions": "text_completion", "responses": "chat"}
"""GenAI semantic conventions' `gen_ai.operation.name` of each generating route."""


def request_attributes(trace: RequestTrace, job: Any) -> dict[str, Any]:
    """The request span's attributes (GenAI conventions where one applies)."""
    ticket = None if job is None else job.ctx
    kind = None if ticket is None else ticket.call.kind
    return {
        "gen_ai.operation.name": OPERATIONS.get(kind, "chat") if kind else None,
        "gen_ai.request.model": trace.model,
        "gen_ai.usage.input_tokens": trace.prompt_tokens,
        "gen_ai.usage.output_tokens": trace.output_tokens,
        "http.response.status_code": trace.status,
        "sagesched.outcome": None if trace.outcome is None else trace.outcome.value,
        "sagesched.backend": trace.backend or None,
        "sagesched.policy": trace.policy,
        "sagesched.class": trace.klass or None,
        "sagesched.predicted_median_tokens": trace.predicted_median,
        "sagesched.queue_depth_at_admit": trace.queue_depth,
        "sagesched.preemptions": None if job is None else job.preemptions,
        "sagesched.attempts": trace.attempts,
        "sagesched.prompt_count_source": trace.prompt_count_source,
        "sagesched.session": None if ticket is None else getattr(ticket, "session", None),
    }
