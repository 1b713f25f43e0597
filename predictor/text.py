"""What text of a request is embedded.

For a chat body we embed the system prompt followed by the *last* user turn. The last user
turn is what the model is about to answer, so it carries most of the signal about the answer's
length ("write an essay" vs "yes or no?"); the system prompt sets the style ("answer briefly",
"you are a coding assistant") and is usually short. Earlier turns are left out: they describe
answers already given, and would drown the question in MiniLM's 256-word-piece window.

MiniLM itself truncates at the *end*, which would keep a pasted document and drop the question
that follows it. So we clip first, in characters: the head of the text (where instructions such
as "Summarise the following" sit) and its tail (where a trailing question sits), joined by an
ellipsis. The system prompt gets at most a quarter of the budget.

Pure functions; no imports beyond the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_ELLIPSIS = " … "


def clip_text(text: str, max_chars: int, head_fraction: float = 0.25) -> str:
    """Keep at most `max_chars` characters: `head_fraction` of them from the start, the rest
    from the end (the middle is replaced by an ellipsis)."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    head = int(max_chars * head_fraction)
    tail = max(max_chars - head - len(_ELLIPSIS), 0)
    start = text[:head].rstrip()
    end = text[len(text) - tail :].lstrip() if tail else ""
    return f"{start}{_ELLIPSIS}{end}" if start else end


def _content_text(content: Any) -> str:
    """The text of an OpenAI message `content`: a string, or a list of parts (text parts are
    joined; images and audio are ignored)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
        return "\n".join(p for p in parts if isinstance(p, str) and p)
    return ""


def chat_text(messages: list[Any], max_chars: int, head_fraction: float = 0.25) -> str:
    """System prompt(s) plus the last user turn of a chat, clipped to `max_chars`."""
    system = "\n".join(
        _content_text(m.get("content"))
        for m in messages
        if isinstance(m, Mapping) and m.get("role") in ("system", "developer")
    ).strip()
    user = ""
    for m in reversed(messages):
        if isinstance(m, Mapping) and m.get("role") == "user":
            user = _content_text(m.get("content"))
            break
    if not system:
        return clip_text(user, max_chars, head_fraction)
    system = clip_text(system, max_chars // 4, head_fraction)
    budget = max(max_chars - len(system) - 1, 1)
    return f"{system}\n{clip_text(user, budget, head_fraction)}"


def request_text(body: Mapping[str, Any], max_chars: int = 512, head_fraction: float = 0.25) -> str:
    """The text to embed for an OpenAI request body (`/v1/chat/completions` with `messages`,
    or `/v1/completions` with `prompt`, a string or a list whose first string is used).
    Returns "" when the body has no text (the predictor then falls back to the global
    distribution)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return chat_text(messages, max_chars, head_fraction)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = next((p for p in prompt if isinstance(p, str)), "")
    if isinstance(prompt, str):
        return clip_text(prompt, max_chars, head_fraction)
    return ""
