"""OpenAI wire format as vLLM writes it: request parsing, token rules, bodies and chunks.

Pure functions, no I/O. Three documented rules make the emulator deterministic
(docs/emulator.md):

- prompt tokens: a string counts `ceil(1.3 × units)` where units are words and punctuation
  marks (`\\w+|[^\\w\\s]`); a list of token ids counts its length; a chat request adds 4 tokens
  per message plus 2 for the generation prompt;
- natural output length (no `ignore_eos`): `natural_output_tokens(text)`, a log-normal quantile
  of a SHA-256 hash of the prompt text, then capped by `max_tokens`;
- output text: token i of a response is a filler word chosen from the same hash, with a space.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
import uuid
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

_UNITS = re.compile(r"\w+|[^\w\s]")
TOKENS_PER_UNIT = 1.3
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_GENERATION_PROMPT_TOKENS = 2
NATURAL_MEDIAN_TOKENS = 128.0
"""Median of the natural output length (no `ignore_eos`)."""
NATURAL_SIGMA = 0.8
"""Log-normal shape of the natural output length."""
NATURAL_MAX_TOKENS = 1024
FILLER = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "will",
    "more",
    "can",
    "out",
    "up",
    "into",
    "do",
    "time",
    "than",
    "only",
    "other",
    "new",
    "some",
    "could",
    "these",
    "two",
    "may",
]


class ProtocolError(Exception):
    """A request the server rejects; rendered as vLLM's error body."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.status, self.err_type = message, status, err_type


def error_body(message: str, status: int, err_type: str) -> dict[str, Any]:
    """vLLM's error JSON."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


def count_text_tokens(text: str) -> int:
    """Cheap token estimate of a text (see module docstring)."""
    return max(1, math.ceil(TOKENS_PER_UNIT * len(_UNITS.findall(text))))


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def natural_output_tokens(text: str) -> int:
    """Output length without `ignore_eos`: a stable function of the prompt text.

    u = (first 8 bytes of SHA-256(text) + 0.5) / 2⁶⁴; length = round(128 · exp(0.8 · Φ⁻¹(u))),
    clipped to [1, 1024]."""
    u = (_digest(text) + 0.5) / 2.0**64
    n = round(NATURAL_MEDIAN_TOKENS * math.exp(NATURAL_SIGMA * NormalDist().inv_cdf(u)))
    return min(max(1, n), NATURAL_MAX_TOKENS)


def token_text(seed: int, i: int) -> str:
    """Text of output token `i` (0-based) of a response whose prompt hashes to `seed`."""
    return " " + FILLER[(seed + i * 7) % len(FILLER)]


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated request (tokens counted, lengths decided)."""

    kind: str
    """"chat" or "completion"."""
    model: str
    prompt_text: str
    prompt_tokens: int
    output_tokens: int
    """Tokens the engine will generate."""
    finish_reason: str
    """"length" when `max_tokens` cut it, else "stop"."""
    stream: bool
    include_usage: bool
    priority: int
    seed: int
    """Hash of the prompt text (filler words)."""


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"{name} must be an integer")
    return value


def _chat_prompt(body: dict[str, Any]) -> tuple[str, int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list")
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ProtocolError("each message needs a role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(str(content or ""))
    text = "\n".join(parts)
    n = sum(count_text_tokens(p) for p in parts)
    return text, n + CHAT_TOKENS_PER_MESSAGE * len(parts) + CHAT_GENERATION_PROMPT_TOKENS


def _completion_prompt(body: dict[str, Any]) -> tuple[str, int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt, count_text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt)), len(prompt)
    raise ProtocolError("prompt must be a string or a list of token ids (one prompt)")


def parse(
    kind: str,
    body: Any,
    *,
    models: set[str],
    max_model_len: int,
    priority_on: bool,
    reject_priority: bool = False,
) -> Parsed:
    """Validate a request body as vLLM would (the subset the emulator supports).

    A non-zero `priority` without priority scheduling is ignored, as vLLM 0.32.0 does, or
    rejected with the older vLLM error when `reject_priority`."""
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    model = body.get("model")
    if model not in models:
        raise ProtocolError(
            f"The model `{model}` does not exist.", status=404, err_type="NotFoundError"
        )
    text, n_prompt = _chat_prompt(body) if kind == "chat" else _completion_prompt(body)
    if (_int_field(body, "n") or 1) != 1:
        raise ProtocolError("the emulator supports n=1 only")
    max_tokens = _int_field(body, "max_completion_tokens") if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    room = max_model_len - n_prompt
    if max_tokens is not None and max_tokens < 1:
        raise ProtocolError("max_tokens must be at least 1")
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise ProtocolError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n_prompt + (max_tokens or 1)} tokens ({n_prompt} in the messages, "
            f"{max_tokens or 1} in the completion). Please reduce the length of the messages "
            "or completion."
        )
    cap = room if max_tokens is None else max_tokens
    want = cap if body.get("ignore_eos") else natural_output_tokens(text)
    out = min(want, cap)
    priority = _int_field(body, "priority") or 0
    if priority != 0 and not priority_on:
        if reject_priority:  # vLLM before 0.32 (and its docs); 0.32 accepts and ignores it
            raise ProtocolError(f"Got priority {priority} but Priority scheduling is not enabled.")
        priority = 0
    opts = body.get("stream_options") or {}
    stream = bool(body.get("stream"))
    include_usage = bool(stream and isinstance(opts, dict) and opts.get("include_usage"))
    return Parsed(
        kind,
        str(model),
        text,
        n_prompt,
        out,
        "length" if out >= cap else "stop",
        stream,
        include_usage,
        priority,
        _digest(text),
    )


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:16]


SYSTEM_FINGERPRINT = "vllm-0.32.0-emulated"


def usage(p: Parsed, completion_tokens: int, *, details: bool = True) -> dict[str, Any]:
    """Usage object; the streamed usage chunk carries no `*_details` keys (as vLLM)."""
    u: dict[str, Any] = {
        "prompt_tokens": p.prompt_tokens,
        "total_tokens": p.prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if details:
        u["prompt_tokens_details"] = None
        u["completion_tokens_details"] = None
    return u


def full_body(
    p: Parsed, rid: str, created: int, text: str, n_tokens: int, finish: str
) -> dict[str, Any]:
    """A non-streaming response, with vLLM 0.32.0's keys."""
    head = {"id": rid, "object": "", "created": created, "model": p.model}
    tail = {
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(p, n_tokens),
    }
    if p.kind == "chat":
        message = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
        head["object"] = "chat.completion"
        extra = {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }
        head["object"] = "text_completion"
        extra = {}
    return {
        **head,
        "choices": [choice],
        **tail,
        **extra,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chunk(
    p: Parsed, rid: str, created: int, text: str | None, finish: str | None, *, role: bool = False
) -> dict[str, Any]:
    """One streaming chunk with one choice (`role`: the chat opening chunk), vLLM's keys."""
    out: dict[str, Any] = {"id": rid, "object": "", "created": created, "model": p.model}
    if p.kind == "chat":
        out["object"] = "chat.completion.chunk"
        if role:
            delta = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            out["choices"] = [choice]
            out["prompt_token_ids"] = out["prompt_text"] = None
            return out
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
    else:
        out["object"] = "text_completion"
        choice = {
            "index": 0,
            "text": text or "",
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }
    out["choices"] = [choice]
    return out


def usage_chunk(p: Parsed, rid: str, created: int, n_tokens: int) -> dict[str, Any]:
    """The final `include_usage` chunk: empty choices, usage filled."""
    obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": p.model,
        "choices": [],
        "usage": usage(p, n_tokens, details=False),
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def now_created() -> int:
    return int(time.time())
