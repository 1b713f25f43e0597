"""One outcome enum and one error tree, mapped to HTTP in one place (`app.error_middleware`).

Every request the gateway accepts ends in exactly one `Outcome`, the only label of the
terminal-state counter. Every error the gateway raises is a `GatewayError` carrying its HTTP
status, OpenAI error `type` and `code`; handlers and the relay raise it, the app's error
middleware renders it as OpenAI's JSON error body, or, once a stream has started, the relay
sends it as an SSE error event (`sse_error_event`).
"""

from __future__ import annotations

import enum
import json
from typing import Any


class Outcome(enum.StrEnum):
    """How a request ended. Exactly one per request."""

    COMPLETED = "completed"
    """The full answer was relayed (streamed or not)."""
    REJECTED = "rejected"
    """Refused before queuing: bad input, auth, unknown model, body too large."""
    QUEUE_FULL = "queue_full"
    """Refused because the waiting queue was at its bound (429)."""
    SHED = "shed"
    """Refused or evicted from the full queue to make room for a more urgent class (429)."""
    QUEUE_TIMEOUT = "queue_timeout"
    """Waited longer than the queue timeout (503; 200 with an SSE error event for a stream the
    gateway preempted that then waited too long for its continuation)."""
    CANCELLED_WAITING = "cancelled_waiting"
    """The client went away while the request was queued."""
    CANCELLED_RUNNING = "cancelled_running"
    """The client went away while the answer was being generated."""
    CLIENT_TOO_SLOW = "client_too_slow"
    """The client read the stream, or a whole answer, too slowly: the gateway cut it
    (`slow_client_timeout_s`)."""
    SHUTDOWN = "shutdown"
    """Cut by the gateway's own shutdown: still unfinished when `shutdown_grace_s` ran out
    (503; a started stream ends with a `shutting_down` SSE error event)."""
    UPSTREAM_ERROR = "upstream_error"
    """The backend answered with an error, or failed before the first byte on every try."""
    UPSTREAM_BROKEN = "upstream_broken"
    """The backend failed after the answer had started (SSE error event sent; a passthrough
    stream, relayed byte for byte, is cut instead)."""
    INTERNAL_ERROR = "internal_error"
    """A bug in the gateway; logged with a traceback."""


class GatewayError(Exception):
    """Base of every error the gateway reports to a client."""

    status = 500
    type = "internal_error"
    code: str | None = None
    outcome = Outcome.INTERNAL_ERROR

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def headers(self) -> dict[str, str]:
        """Extra response headers (e.g. Retry-After)."""
        return {}

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(GatewayError):
    status, type, code, outcome = 400, "invalid_request_error", None, Outcome.REJECTED


class Unauthorized(GatewayError):
    status, type, code, outcome = 401, "invalid_request_error", "invalid_api_key", Outcome.REJECTED


class ModelNotFound(GatewayError):
    status, type, code, outcome = 404, "invalid_request_error", "model_not_found", Outcome.REJECTED


class NotFoundRoute(GatewayError):
    status, type, code, outcome = 404, "invalid_request_error", "not_found", Outcome.REJECTED


class MethodNotAllowed(GatewayError):
    status, type, code, outcome = 405, "invalid_request_error", None, Outcome.REJECTED


class PayloadTooLarge(GatewayError):
    status, type, code, outcome = (
        413,
        "invalid_request_error",
        "payload_too_large",
        Outcome.REJECTED,
    )


class HeadersTooLarge(GatewayError):
    """Too many request headers, or one too large (`max_headers`, `max_header_bytes`)."""

    status, type, code, outcome = (
        431,
        "invalid_request_error",
        "headers_too_large",
        Outcome.REJECTED,
    )


class UriTooLong(GatewayError):
    """The request target is longer than `max_header_bytes`."""

    status, type, code, outcome = 414, "invalid_request_error", "uri_too_long", Outcome.REJECTED


class BodyTimeout(GatewayError, TimeoutError):
    """The request body did not arrive within `body_timeout_s` of its headers. Also a
    `TimeoutError`, so that aiohttp, which reads what is left of a body after the response,
    stops there and closes the connection instead of logging an error."""

    status, type, code, outcome = 408, "invalid_request_error", "body_timeout", Outcome.REJECTED


class QueueFull(GatewayError):
    status, type, code, outcome = 429, "rate_limit_error", "queue_full", Outcome.QUEUE_FULL

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class Shed(QueueFull):
    """The queue was full: a sheddable request (or the lowest band's oldest) made room."""

    code, outcome = "shed", Outcome.SHED


class UnknownClass(GatewayError):
    """The request named a class the gateway does not define."""

    status, type, code, outcome = 400, "invalid_request_error", "unknown_class", Outcome.REJECTED


class QueueTimeout(GatewayError):
    status, type, code, outcome = 503, "server_error", "queue_timeout", Outcome.QUEUE_TIMEOUT


class ShuttingDown(GatewayError):
    """The gateway stopped before the request finished (its shutdown grace ran out)."""

    status, type, code, outcome = 503, "server_error", "shutting_down", Outcome.SHUTDOWN


class NoBackend(GatewayError):
    status, type, code, outcome = 503, "server_error", "no_healthy_backend", Outcome.UPSTREAM_ERROR


class UpstreamFailed(GatewayError):
    """The backend could not be reached or failed before answering, on every try."""

    status, type, code, outcome = 502, "server_error", "upstream_failed", Outcome.UPSTREAM_ERROR


class UpstreamRejected(GatewayError):
    """The backend answered with a non-retryable error (4xx): passed through as it came."""

    type, code, outcome = "invalid_request_error", "upstream_rejected", Outcome.UPSTREAM_ERROR

    def __init__(self, status: int, raw: bytes) -> None:
        super().__init__(raw.decode("utf-8", "replace")[:2000])
        self.status = status
        self.raw = raw

    def body(self) -> dict[str, Any]:
        try:
            data = json.loads(self.raw)
        except ValueError:
            data = None
        if isinstance(data, dict) and "error" in data:
            return data
        if isinstance(data, dict) and "detail" in data:  # FastAPI's own (unknown route, 422)
            detail = data["detail"]
            message = detail if isinstance(detail, str) else json.dumps(detail)[:2000]
            error = {"message": message, "type": self.type, "param": None, "code": self.status}
            return {"error": error}
        if isinstance(data, dict) and "message" in data:  # vLLM's older flat error form
            error = {
                "message": data["message"],
                "type": data.get("type", self.type),
                "param": data.get("param"),
                "code": data.get("code", self.status),
            }
            return {"error": error}
        return super().body()


class UpstreamBroken(GatewayError):
    """The backend failed mid-stream; sent to the client as an SSE error event."""

    status, type, code, outcome = 502, "server_error", "upstream_broken", Outcome.UPSTREAM_BROKEN


def sse_error_event(error: GatewayError) -> bytes:
    """An error as one SSE event (for streams that already started), then `[DONE]`."""
    return b"data: " + json.dumps(error.body()).encode() + b"\n\ndata: [DONE]\n\n"
