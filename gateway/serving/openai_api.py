"""Validation of OpenAI request bodies and the upstream bodies the gateway sends.

The gateway checks only what it relies on (model, messages/prompt/input, stream, token caps,
priority, stream options) and forwards every other field untouched, so new vLLM parameters
pass through without a gateway release. Three kinds generate and are queued under the policy:
`chat` (`/v1/chat/completions`), `completions` (`/v1/completions`) and `responses`
(`/v1/responses`, relayed as it comes: never preempted, no usage chunk added).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from gateway.errors import InvalidRequest

Kind = Literal["chat", "completions", "responses"]

PATHS: dict[Kind, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
}
"""The upstream route of each kind."""

# A cheap prompt-size estimate (≈4 characters per token for English BPE vocabularies). The
# scheduler only needs a magnitude for the kv cost model; vLLM's usage gives exact counts.
CHARS_PER_TOKEN = 4.0
MAX_INT = 2**63 - 1
"""Largest integer accepted in a field the gateway uses (a 400-digit `max_tokens` would
overflow the scheduler's floats; no engine accepts one)."""
MAX_DEPTH = 128
"""Deepest nesting of arrays and objects accepted in a body (a JSON schema in `tools` or
`response_format` is a few levels; 400 beyond)."""


@dataclass(slots=True)
class Call:
    """One validated client request."""

    kind: Kind
    body: dict[str, Any]
    model: str
    stream: bool
    wants_usage: bool
    """The client asked for the usage chunk (`stream_options.include_usage`)."""
    max_tokens: int | None
    priority: int
    prompt_text: str
    """All prompt text, for the size estimate and continuations."""
    tenant: str

    @property
    def prompt_tokens_estimate(self) -> int:
        return max(1, round(len(self.prompt_text) / CHARS_PER_TOKEN))

    @property
    def continuable(self) -> bool:
        """Can this request be preempted and resumed as a continuation?"""
        if not self.stream or self.body.get("n", 1) not in (1, None):
            return False
        return self.kind == "chat" or isinstance(self.body.get("prompt"), str)

    @property
    def text_body(self) -> dict[str, Any]:
        """The body in chat or completions form, for the predictor's text choice (a
        responses `input` becomes `messages`)."""
        if self.kind != "responses":
            return self.body
        return {"messages": _responses_messages(self.body)}


def parse_body(raw: bytes) -> dict[str, Any]:
    """JSON object or `InvalidRequest`. Nesting beyond `MAX_DEPTH` is refused as invalid
    input: deeper than the parser's recursion limit (a body of 100,000 `[`) it would be a
    RecursionError, and a body the parser just accepts could still fail when it is encoded
    again for the backend, deeper in the stack."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest(f"request body is nested deeper than {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    # bytes.count bounds the depth at C speed: only a body with that many brackets is walked
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _too_deep(body):
        raise InvalidRequest(f"request body is nested deeper than {MAX_DEPTH} levels")
    return body


def _too_deep(value: Any) -> bool:
    """Is any container nested deeper than `MAX_DEPTH`? (iterative: no recursion limit)"""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def parse_call(kind: Kind, body: dict[str, Any], tenant: str | None = None) -> Call:
    """Validate the fields the gateway uses; raise `InvalidRequest` naming the bad one."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a string", param="model")
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, None)
    wants_usage = bool(options and options.get("include_usage") is True)
    if options is not None and not stream:
        raise InvalidRequest("'stream_options' requires 'stream': true", param="stream_options")
    if kind == "responses":
        max_tokens = _positive_int(body, "max_output_tokens")
    else:
        max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(
            body, "max_tokens"
        )
    _typed(body, "min_tokens", int, None)
    priority = _typed(body, "priority", int, 0)
    user = _typed(body, "user", str, None)
    if kind == "chat":
        text = _chat_text(body)
    elif kind == "completions":
        text = _prompt_text(body)
    else:
        text = _chat_text({"messages": _responses_messages(body)})
    return Call(
        kind=kind,
        body=body,
        model=model,
        stream=stream,
        wants_usage=wants_usage,
        max_tokens=max_tokens,
        priority=priority,
        prompt_text=text,
        tenant=tenant or user or "default",
    )


def _typed(body: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    # bool is an int in Python; refuse it where a number is meant, and numbers where a bool is.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequest(f"'{key}' must be of type {kind.__name__}", param=key)
    if isinstance(value, int) and not -MAX_INT <= value <= MAX_INT:  # JSON ints: no bound
        raise InvalidRequest(f"'{key}' must be a 64-bit integer", param=key)
    return value


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = _typed(body, key, int, None)
    if value is not None and value < 1:
        raise InvalidRequest(f"'{key}' must be >= 1", param=key)
    return value  # type: ignore[no-any-return]


def _chat_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        elif content is not None:
            raise InvalidRequest(
                f"messages[{i}].content must be a string or a list", param="messages"
            )
    return "\n".join(parts)


def _prompt_text(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)
    if isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
        return " " * (len(prompt) * int(CHARS_PER_TOKEN))  # token ids: only the size matters
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and _ids(p) for p in prompt):
        n = sum(len(p) for p in prompt)  # a batch of token-id prompts
        return " " * (n * int(CHARS_PER_TOKEN))
    raise InvalidRequest(
        "'prompt' must be a string, a list of strings or token ids", param="prompt"
    )


def _is_ids(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(values: list[Any]) -> bool:
    return bool(values) and all(_is_ids(v) for v in values)


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A responses body's `instructions` and `input` as chat messages (text only)."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("'input' must be a string or a non-empty list", param="input")
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("role"), str):
            content = item.get("content")
            if isinstance(content, list):  # input_text / output_text parts
                content = [p for p in content if isinstance(p, dict)]
            messages.append({"role": item["role"], "content": content})
    return messages or [{"role": "user", "content": ""}]


def upstream_body(
    call: Call, *, priority: int | None, continuation: str = "", done_tokens: int = 0
) -> dict[str, Any]:
    """The body sent to a backend: the client's, plus what the gateway needs.

    Always asks for the usage chunk when streaming (true output length for the predictor and
    metrics); sets or strips `priority` depending on the backend; and for a continuation
    after preemption appends the text generated so far and lowers the token cap and
    `min_tokens` by what was generated (vLLM rejects `min_tokens` above the cap).
    """
    body = dict(call.body)
    if call.stream and call.kind != "responses":
        body["stream_options"] = {**(call.body.get("stream_options") or {}), "include_usage": True}
    if priority is None:
        body.pop("priority", None)
    else:
        body["priority"] = priority
    if not continuation:
        return body
    if call.max_tokens is not None:
        left = max(1, call.max_tokens - done_tokens)
        body.pop("max_tokens", None)
        body["max_completion_tokens" if call.kind == "chat" else "max_tokens"] = left
    min_tokens = call.body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        body["min_tokens"] = max(0, min_tokens - done_tokens)
    if call.kind == "chat":
        body["messages"] = [*call.body["messages"], {"role": "assistant", "content": continuation}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        body["prompt"] = call.body["prompt"] + continuation
    return body
