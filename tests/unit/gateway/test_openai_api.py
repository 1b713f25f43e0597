"""The upstream body: continuations lower `max_tokens` and `min_tokens` alike; the responses
kind is sized from `input` and sent without chat-only fields."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.scheduling.prompts import tokenize_requests
from gateway.serving.openai_api import parse_call, upstream_body


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_continuation_lowers_max_and_min_tokens(kind: str) -> None:
    body = chat(max_tokens=100, min_tokens=80) if kind == "chat" else {
        "model": "m", "prompt": "Once", "stream": True, "max_tokens": 100, "min_tokens": 80,
    }  # fmt: skip
    call = parse_call(kind, body)  # type: ignore[arg-type]
    up = upstream_body(call, priority=None, continuation=" a b c", done_tokens=30)
    cap = "max_completion_tokens" if kind == "chat" else "max_tokens"
    assert up[cap] == 70 and up["min_tokens"] == 50
    if kind == "chat":
        assert up["messages"][-1] == {"role": "assistant", "content": " a b c"}
        assert up["continue_final_message"] is True and up["add_generation_prompt"] is False
    else:
        assert up["prompt"] == "Once a b c"
    late = upstream_body(call, priority=None, continuation=" x", done_tokens=90)
    assert late["min_tokens"] == 0 and late[cap] == 10  # min never above the cap
    first = upstream_body(call, priority=None)
    assert first["min_tokens"] == 80 and "continue_final_message" not in first


def test_responses_kind() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
        "max_output_tokens": 12,
        "stream": True,
    }
    call = parse_call("responses", body)
    assert call.max_tokens == 12 and not call.continuable
    assert call.text_body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert "Hello there" in call.prompt_text
    up = upstream_body(call, priority=3)
    assert "stream_options" not in up and up["priority"] == 3
    assert tokenize_requests(call) is None  # sized by the estimate
    with pytest.raises(InvalidRequest):
        parse_call("responses", {"model": "m", "input": 5})


def test_tokenize_requests_follow_the_template_fields() -> None:
    call = parse_call("chat", chat(add_generation_prompt=False, continue_final_message=True))
    (req,) = tokenize_requests(call) or []
    assert req["continue_final_message"] is True and req["add_generation_prompt"] is False
    batch = parse_call("completions", {"model": "m", "prompt": ["a", "b"]})
    assert [r["prompt"] for r in tokenize_requests(batch) or []] == ["a", "b"]
    ids = parse_call("completions", {"model": "m", "prompt": [[1, 2], [3]]})
    assert tokenize_requests(ids) is None and ids.prompt_tokens_estimate == 3
