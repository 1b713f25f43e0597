"""vLLM's `/v1/responses` (the OpenAI Responses API) in the emulator: a request is the chat
request of its `instructions` (as a system message) and `input` (a string, or message items
whose content is a string or text parts), capped by `max_output_tokens`; the answer has
vLLM 0.32.0's keys, whole or as its event stream (created, in_progress, output_item.added,
content_part.added, one output_text.delta per token, the .done events, completed).

Pure functions, no I/O; `server` drives them.
"""

from __future__ import annotations

import uuid
from typing import Any

from loadgen.emulator.protocol import Parsed, ProtocolError, parse

_CHAT_FIELDS = ("model", "stream", "priority", "ignore_eos", "min_tokens")


def parse_responses(body: Any, **limits: Any) -> Parsed:
    """Validate a responses body as the chat request it amounts to (`limits`: `parse`'s)."""
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    chat = {k: body[k] for k in _CHAT_FIELDS if k in body}
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return parse("chat", chat, **limits)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ProtocolError("input must be a string or a non-empty list of items")
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise ProtocolError("each input item needs a role")
        messages.append({"role": item["role"], "content": item.get("content")})
    return messages


def ids() -> tuple[str, str]:
    """A response id and its message item's id."""
    return "resp_" + uuid.uuid4().hex[:16], "msg_" + uuid.uuid4().hex[:16]


def _part(text: str, logprobs: Any) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _item(msg_id: str, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {
        "id": msg_id,
        "content": parts,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def response(
    p: Parsed,
    rid: str,
    msg_id: str,
    created: int,
    body: dict[str, Any],
    text: str | None,
    n_tokens: int,
) -> dict[str, Any]:
    """The response object for request `body`: in progress (`text` None) or finished."""
    max_output_tokens = body.get("max_output_tokens")
    done = text is not None
    capped = done and p.answers[0].finish_reason == "length" and max_output_tokens is not None
    usage = None
    if done:
        usage = {
            "input_tokens": p.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": 0,
                "cache_write_tokens": 0,
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": n_tokens,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": p.prompt_tokens + n_tokens,
        }
    return {
        "id": rid,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if capped else None,
        "instructions": body.get("instructions"),
        "metadata": None,
        "model": p.model,
        "object": "response",
        "output": [_item(msg_id, [_part(text, None)], "completed")] if text is not None else [],
        "parallel_tool_calls": True,
        "temperature": 1.0,
        "tool_choice": "none",
        "tools": [],
        "top_p": 1.0,
        "background": False,
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": None,
        "previous_response_id": None,
        "prompt": None,
        "reasoning": None,
        "service_tier": "auto",
        "status": ("incomplete" if capped else "completed") if done else "in_progress",
        "text": None,
        "top_logprobs": None,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def opening_events(head: dict[str, Any], msg_id: str) -> list[dict[str, Any]]:
    """The events before the first token (`head`: the in-progress response)."""
    return [
        {"response": head, "type": "response.created"},
        {"response": head, "type": "response.in_progress"},
        {"item": _item(msg_id, [], "in_progress"), "output_index": 0,
         "type": "response.output_item.added"},
        {"content_index": 0, "item_id": msg_id, "output_index": 0, "part": _part("", []),
         "type": "response.content_part.added"},
    ]  # fmt: skip


def delta_event(msg_id: str, text: str) -> dict[str, Any]:
    return {"content_index": 0, "delta": text, "item_id": msg_id, "logprobs": [],
            "output_index": 0, "type": "response.output_text.delta"}  # fmt: skip


def closing_events(final: dict[str, Any], msg_id: str, text: str) -> list[dict[str, Any]]:
    """The events after the last token (`final`: the finished response)."""
    return [
        {"content_index": 0, "item_id": msg_id, "logprobs": [], "output_index": 0,
         "text": text, "type": "response.output_text.done"},
        {"content_index": 0, "item_id": msg_id, "output_index": 0, "part": _part(text, None),
         "type": "response.content_part.done"},
        {"item": _item(msg_id, [_part(text, None)], "completed"), "output_index": 0,
         "type": "response.output_item.done"},
        {"response": final, "type": "response.completed"},
    ]  # fmt: skip
