from __future__ import annotations

from predictor import chat_text, clip_text, request_text


def test_clip_keeps_head_and_tail() -> None:
    text = "HEAD " + "x" * 5_000 + " TAIL?"
    out = clip_text(text, 100, head_fraction=0.25)
    assert len(out) <= 100
    assert out.startswith("HEAD")
    assert out.endswith("TAIL?")
    assert "…" in out


def test_clip_leaves_short_text_alone() -> None:
    assert clip_text("  hello  ", 100) == "hello"


def test_clip_tail_only() -> None:
    out = clip_text("a" * 50 + "END", 10, head_fraction=0.0)
    assert out.endswith("END") and len(out) <= 10


def test_chat_uses_system_and_last_user_turn() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "an old answer"},
            {"role": "user", "content": [{"type": "text", "text": "second question"}]},
        ]
    }
    out = request_text(body)
    assert out == "Answer briefly.\nsecond question"
    assert "old answer" not in out and "first question" not in out


def test_chat_system_prompt_gets_at_most_a_quarter() -> None:
    msgs = [{"role": "system", "content": "S" * 1_000}, {"role": "user", "content": "Q" * 1_000}]
    out = chat_text(msgs, 400)
    assert out.count("S") <= 100
    assert out.endswith("Q") and len(out) <= 400


def test_completions_prompt_string_and_list() -> None:
    assert request_text({"prompt": "hi there"}) == "hi there"
    assert request_text({"prompt": ["first", "second"]}) == "first"
    assert request_text({"model": "m"}) == ""
