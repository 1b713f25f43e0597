"""The OpenAPI 3 document of the gateway's own routes, served at `/openapi.json`.

Why hand-written: the gateway validates only the fields it relies on and passes every other
field through (`gateway.serving.openai_api`), so the document describes exactly that contract — the
fields it checks, with `additionalProperties` left open — and the error responses every route
can give (OpenAI's error object, `gateway.errors`). schemathesis generates hostile and valid
requests from it against a live gateway (tests/functional/gateway/test_generated_input.py,
docs/reliability.md). Routes the gateway forwards to its backends (`/tokenize`, ...) are the
backend's and not described here.
"""

from __future__ import annotations

from typing import Any

from gateway.serving.openai_api import MAX_DEPTH

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error_responses(*codes: int) -> dict[str, Any]:
    ref = _json({"$ref": "#/components/schemas/Error"})
    out: dict[str, Any] = {str(c): {"description": "error", "content": ref} for c in codes}
    out["default"] = {"description": "any other error, same form", "content": ref}
    return out


_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string"},
        "content": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "object",
                                            "properties": {"type": {"type": "string"},
                                                           "text": {"type": "string"}}}},
                {"type": "null"},
            ]
        },
    },
}  # fmt: skip

_COMMON = {
    "model": {"type": "string", "minLength": 1},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "priority": {"type": "integer"},
    "user": {"type": "string"},
    "min_tokens": {"type": "integer"},
}
_CAP = {"type": "integer", "minimum": 1}

_CHAT = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_COMMON,
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "max_tokens": _CAP,
        "max_completion_tokens": _CAP,
    },
}
_COMPLETIONS = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **_COMMON,
        "prompt": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": {"type": "string"}},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                {"type": "array", "minItems": 1,
                 "items": {"type": "array", "minItems": 1,
                           "items": {"type": "integer", "minimum": 0}}},
            ]
        },
        "max_tokens": _CAP,
    },
}  # fmt: skip
_RESPONSES = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        **_COMMON,
        "instructions": {"type": "string"},
        "input": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": _MESSAGE},
            ]
        },
        "max_output_tokens": _CAP,
    },
}
_ANSWER = {
    "description": "the backend's answer (JSON), or its stream (server-sent events)",
    "content": {
        "application/json": {"schema": {"type": "object"}},
        "text/event-stream": {"schema": {"type": "string"}},
    },
}
_BEARER: list[dict[str, list[str]]] = [{"bearer": []}]


def _generate(summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": _BEARER,
            "requestBody": {"required": True, "content": _json(schema)},
            "responses": {"200": _ANSWER, **_error_responses(400, 401, 404, 413, 429, 502, 503)},
        }
    }


def _get(summary: str, schema: dict[str, Any], *codes: int, admin: bool = False,
         content: str = "application/json") -> dict[str, Any]:  # fmt: skip
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "ok", "content": {content: {"schema": schema}}},
                      **_error_responses(*codes)},
    }  # fmt: skip
    if admin:
        op["security"] = [{"admin": []}]
    return {"get": op}


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document (a fresh dict each call)."""
    status = {"type": "object", "properties": {"status": {"type": "string"}}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "SageSched gateway",
            "version": "1",
            "description": "OpenAI-compatible scheduling gateway. Fields not listed are passed "
            f"to the backend unchanged. Bodies nest at most {MAX_DEPTH} levels.",
        },
        "paths": {
            "/v1/chat/completions": _generate("chat completion, queued", _CHAT),
            "/v1/completions": _generate("text completion, queued", _COMPLETIONS),
            "/v1/responses": _generate("responses, queued", _RESPONSES),
            "/v1/models": _get("served models", {"type": "object"}, 401),
            "/health": _get("liveness", status),
            "/ready": _get("a healthy backend exists", status, 503),
            "/metrics": _get("Prometheus exposition", {"type": "string"}, content="text/plain"),
            "/admin/queue": _get("the queue", {"type": "object"}, 401, 404, admin=True),
            "/admin/backends": _get("the backends", {"type": "object"}, 401, 404, admin=True),
            "/openapi.json": _get("this document", {"type": "object"}),
        },
        "components": {
            "schemas": {"Error": _ERROR},
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "admin": {"type": "http", "scheme": "bearer", "description": "the admin key"},
            },
        },
    }
