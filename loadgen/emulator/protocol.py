"""OpenAI wire format as vLLM writes it: request parsing, bodies and chunks.

Pure functions, no I/O. The deterministic token rules (prompt count, natural output length,
filler text, continuations) live in `tokens`; `parse` applies them to a request body. A
request becomes one `Answer` per choice: `n` per prompt, for each prompt of a completions
batch, numbered `prompt × n + j` as vLLM numbers them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from loadgen.emulator.tokens import (
    CHAT_GENERATION_PROMPT_TOKENS,
    CHAT_TOKENS_PER_MESSAGE,
    FILLER,
    answer_ids,
    answer_text,
    answered_tokens,
    count_text_tokens,
    detokenize,
    digest,
    generation_prompt_ids,
    message_ids,
    natural_output_tokens,
    split_appended,
    text_ids,
    token_text,
)

__all__ = [
    "FILLER",
    "Answer",
    "Parsed",
    "ProtocolError",
    "count_text_tokens",
    "detokenize",
    "natural_output_tokens",
    "parse",
    "prompt_ids",
    "token_text",
]


class ProtocolError(Exception):
    """A request the server rejects; rendered as vLLM's error body."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.status, self.err_type = message, status, err_type


def error_body(message: str, status: int, err_type: str) -> dict[str, Any]:
    """vLLM's error JSON."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


# -- prompts ------------------------------------------------------------------------------

Segment = tuple[str, Any]
"""A piece of a prompt: ("text", str), ("ids", list[int]), ("answer", (seed, k)),
("message", None) or ("generation", None)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt as the engine sees it."""

    text: str
    """The text whose hash decides the answer (an original prompt for a continuation)."""
    segments: tuple[Segment, ...]
    offset: int = 0
    """Answer tokens already in the prompt (a continuation resumes at this token)."""

    @property
    def tokens(self) -> int:
        return sum(_segment_tokens(s) for s in self.segments)


def _segment_tokens(segment: Segment) -> int:
    kind, value = segment
    if kind == "text":
        return count_text_tokens(value)
    if kind == "ids":
        return len(value)
    if kind == "answer":
        return int(value[1])
    return CHAT_TOKENS_PER_MESSAGE if kind == "message" else CHAT_GENERATION_PROMPT_TOKENS


def prompt_ids(prompt: Prompt) -> list[int]:
    """The token ids of a prompt (`/tokenize`), as many as `prompt.tokens`."""
    ids: list[int] = []
    for kind, value in prompt.segments:
        if kind == "text":
            ids += text_ids(value)
        elif kind == "ids":
            ids += value
        elif kind == "answer":
            ids += answer_ids(value[0], 0, value[1])
        elif kind == "message":
            ids += message_ids()
        else:
            ids += generation_prompt_ids()
    return ids


def _content(m: Any) -> str:
    if not isinstance(m, dict) or "role" not in m:
        raise ProtocolError("each message needs a role")
    content = m.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def chat_prompt(body: dict[str, Any]) -> Prompt:
    """A chat request's prompt: 4 tokens around each message plus 2 for the generation
    prompt (`add_generation_prompt`, default true). With `continue_final_message` the final
    message stays open (its header counts as the generation prompt) and, when it holds the
    first k tokens of this conversation's own answer, the answer resumes at token k."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list")
    parts = [_content(m) for m in messages]
    add_generation = body.get("add_generation_prompt", True) is not False
    if body.get("continue_final_message") is True:
        if add_generation:
            raise ProtocolError(
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final "
                "message, and add_generation_prompt when you want to add a header that will "
                "prompt it to start a new assistant message instead."
            )
        before = [s for p in parts[:-1] for s in (("text", p), ("message", None))]
        text = "\n".join(parts[:-1])
        k = answered_tokens(text, parts[-1])
        if k:
            final: Segment = ("answer", (digest(text), k))
            return Prompt(text, (*before, ("generation", None), final), k)
        segments = (*before, ("generation", None), ("text", parts[-1]))
        return Prompt("\n".join(parts), segments)
    segments = tuple(s for p in parts for s in (("text", p), ("message", None)))
    if add_generation:
        segments += (("generation", None),)
    return Prompt("\n".join(parts), segments)


def completion_prompts(body: dict[str, Any]) -> list[Prompt]:
    """The prompts of a completions request: a string, a list of token ids, or a batch (a
    list of strings or of token-id lists). A string that ends with the first k ≥ 2 tokens of
    its own answer resumes that answer (the appended-prompt continuation)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        return [_one_prompt(prompt)]  # type: ignore[arg-type]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) or _is_ids(p) for p in prompt)
    ):
        return [_one_prompt(p) for p in prompt]
    raise ProtocolError("prompt must be a string, a list of token ids, or a list of either")


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _one_prompt(prompt: str | list[int]) -> Prompt:
    if isinstance(prompt, list):
        return Prompt(" ".join(map(str, prompt)), (("ids", prompt),))
    original, k = split_appended(prompt)
    if k:
        return Prompt(original, (("text", original), ("answer", (digest(original), k))), k)
    return Prompt(prompt, (("text", prompt),))


# -- requests -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """One choice of a response: one sequence in the engine."""

    index: int
    prompt_tokens: int
    output_tokens: int
    """Tokens the engine will generate for it."""
    finish_reason: str
    """"length" when the token cap cut it, else "stop"."""
    seed: int
    """Hash of the prompt text (filler words)."""
    offset: int
    """Token index of its first output token in the whole answer (a continuation's k)."""
    prompt: Prompt | None = None
    """Its prompt (the prefix cache hashes its token ids)."""

    def text(self, start: int, stop: int) -> str:
        """Its output tokens `start` … `stop - 1`."""
        return answer_text(self.seed, self.offset + start, self.offset + stop)


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated request (tokens counted, lengths decided)."""

    kind: str
    """"chat" or "completion"."""
    model: str
    prompt_text: str
    """The first prompt's text."""
    prompt_tokens: int
    """Summed over the prompts (each counted once, whatever `n`), as vLLM's usage."""
    answers: tuple[Answer, ...]
    stream: bool
    include_usage: bool
    priority: int


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"{name} must be an integer")
    return value


def check_model(body: Any, models: set[str]) -> str:
    """The requested model, or vLLM's 404 (`model` may be omitted where vLLM allows it)."""
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    model = body.get("model")
    if model not in models:
        raise ProtocolError(
            f"The model `{model}` does not exist.", status=404, err_type="NotFoundError"
        )
    return str(model)


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
    model = check_model(body, models)
    prompts = [chat_prompt(body)] if kind == "chat" else completion_prompts(body)
    n = _int_field(body, "n")
    n = 1 if n is None else n
    if n < 1:
        raise ProtocolError(f"n must be at least 1, got {n}.")
    max_tokens = _int_field(body, "max_completion_tokens") if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise ProtocolError("max_tokens must be at least 1")
    min_tokens = _int_field(body, "min_tokens") or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise ProtocolError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    answers: list[Answer] = []
    for p in prompts:
        cap = _cap(p.tokens, max_tokens, max_model_len)
        for j in range(n):
            text = p.text if j == 0 else f"{p.text}\x00{j}"  # choice j > 0: its own draw
            natural = max(1, natural_output_tokens(text) - p.offset)
            want = cap if body.get("ignore_eos") else max(natural, min_tokens)
            out = min(want, cap)
            reason = "length" if out >= cap else "stop"
            answers.append(Answer(len(answers), p.tokens, out, reason, digest(text), p.offset, p))
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
        model,
        prompts[0].text,
        sum(p.tokens for p in prompts),
        tuple(answers),
        stream,
        include_usage,
        priority,
    )


def _cap(n_prompt: int, max_tokens: int | None, max_model_len: int) -> int:
    room = max_model_len - n_prompt
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise ProtocolError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n_prompt + (max_tokens or 1)} tokens ({n_prompt} in the messages, "
            f"{max_tokens or 1} in the completion). Please reduce the length of the messages "
            "or completion."
        )
    return room if max_tokens is None else max_tokens


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


def full_body(p: Parsed, rid: str, created: int, texts: list[str], n_tokens: int) -> dict[str, Any]:
    """A non-streaming response (one choice per answer, `texts` in answer order), with vLLM
    0.32.0's keys."""
    head = {"id": rid, "object": "", "created": created, "model": p.model}
    tail = {
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(p, n_tokens),
    }
    pairs = zip(p.answers, texts, strict=True)
    choices = [_full_choice(p, a.index, text, a.finish_reason) for a, text in pairs]
    head["object"] = "chat.completion" if p.kind == "chat" else "text_completion"
    extra = (
        {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        if p.kind == "chat"
        else {}
    )
    return {
        **head,
        "choices": choices,
        **tail,
        **extra,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _full_choice(p: Parsed, index: int, text: str, finish: str) -> dict[str, Any]:
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
        return {
            "index": index,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }


def chunk(
    p: Parsed,
    rid: str,
    created: int,
    text: str | None,
    finish: str | None,
    *,
    index: int = 0,
    role: bool = False,
) -> dict[str, Any]:
    """One streaming chunk with one choice (`role`: the chat opening chunk), vLLM's keys."""
    out: dict[str, Any] = {"id": rid, "object": "", "created": created, "model": p.model}
    if p.kind == "chat":
        out["object"] = "chat.completion.chunk"
        if role:
            opening = {"role": "assistant", "content": ""}
            choice = {"index": index, "delta": opening, "logprobs": None, "finish_reason": None}
            out["choices"] = [choice]
            out["prompt_token_ids"] = out["prompt_text"] = None
            return out
        delta = {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
    else:
        out["object"] = "text_completion"
        choice = {
            "index": index,
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
