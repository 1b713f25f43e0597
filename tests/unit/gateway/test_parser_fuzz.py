"""hypothesis fuzzing of the request parser (`gateway.serving.openai_api`) and the relay's pure SSE
event handling (`Relay._events` on a real `LocalSlot`-like slot), issue 18 part 1.

The parser: any bytes, any JSON value and any mutation of a valid body either parse into a
`Call` or raise `InvalidRequest` (a 400) — never anything else; a parsed call's upstream body
keeps every field the client sent. The SSE events: any framing of any upstream bytes is
relayed without an exception, every relayed event is one `data:` line, `[DONE]` ends it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.serving.openai_api import Kind, parse_body, parse_call, upstream_body
from gateway.serving.relay import Relay

EXAMPLES = 300
"""Per test (4 tests): with the schemathesis run, over 1,000 generated cases per CI run."""
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))  # fmt: skip

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
FIELDS = ("model", "messages", "prompt", "input", "instructions", "stream", "stream_options",
          "max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens", "priority",
          "user", "n")  # fmt: skip
bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "", 3, None])},
    optional={f: json_values | st.integers(-(2**70), 2**70) for f in FIELDS if f != "model"},
)
valid_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                           "content": st.text() | st.lists(st.fixed_dictionaries(
                               {"type": st.just("text"), "text": st.text()}))}),
    min_size=1, max_size=5,
)  # fmt: skip


def parse(kind: Kind, raw: bytes) -> Any:
    """The gateway's step-1 parse: a call, or None for a 400 (anything else fails the test)."""
    try:
        call = parse_call(kind, parse_body(raw))
    except InvalidRequest as exc:
        assert exc.status == 400 and exc.message
        return None
    body = upstream_body(call, priority=3)
    json.dumps(body)  # encodable for the backend
    assert {k: v for k, v in body.items() if k not in ("priority", "stream_options")} == {
        k: v for k, v in call.body.items() if k not in ("priority", "stream_options")
    }
    return call


@FUZZ
@given(raw=st.binary(max_size=512), kind=st.sampled_from(["chat", "completions", "responses"]))
def test_any_bytes(raw: bytes, kind: Kind) -> None:
    parse(kind, raw)


@FUZZ
@given(body=bodies, kind=st.sampled_from(["chat", "completions", "responses"]))
def test_any_fields(body: dict[str, Any], kind: Kind) -> None:
    parse(kind, json.dumps(body).encode())


@FUZZ
@given(messages=valid_messages, extra=st.dictionaries(st.text(), json_values, max_size=3),
       depth=st.integers(0, 300))  # fmt: skip
def test_valid_bodies_parse(messages: list[Any], extra: dict[str, Any], depth: int) -> None:
    nested: Any = 0
    for _ in range(depth):
        nested = [nested]
    body = {**extra, "model": "m", "messages": messages, "x_nested": nested}
    call = parse("chat", json.dumps(body).encode())
    assert (call is not None) == (depth < 127), depth  # the body's depth is depth + 2


# -- SSE: the relay's pure event handling ----------------------------------------------


class _Slot:
    """The two things `Relay._events` reads of a slot: the job and `tokens`."""

    def __init__(self, call: Any) -> None:
        from types import SimpleNamespace

        from gateway.observability.metrics import RequestTrace

        trace = RequestTrace(model="m", arrived=0.0, policy="fcfs")
        self.job = SimpleNamespace(ctx=SimpleNamespace(call=call, trace=trace))
        self.counted = 0

    def tokens(self, n: int) -> None:
        self.counted += n


def _relay() -> Relay:
    from types import SimpleNamespace

    config = SimpleNamespace(connect_timeout_s=1.0, read_timeout_s=1.0, preemption=True)
    return Relay(None, None, config)  # type: ignore[arg-type]


chunk = st.fixed_dictionaries({"choices": st.lists(st.fixed_dictionaries(
    {"index": st.integers(0, 3), "delta": st.fixed_dictionaries({}, optional={
        "content": st.text() | st.none(), "role": st.just("assistant")})}), max_size=2)},
    optional={"usage": st.dictionaries(st.sampled_from(["completion_tokens", "prompt_tokens"]),
                                       st.integers(0, 10**6))})  # fmt: skip
lines = st.one_of(
    chunk.map(lambda c: b"data: " + json.dumps(c).encode()),
    st.just(b"data: [DONE]"),
    st.binary(max_size=64),  # garbage
    st.sampled_from([b": comment", b"event: x", b"data:", b"data: {", b"id: 1", b"retry: 5"]),
)


@FUZZ
@given(events=st.lists(st.lists(lines, min_size=1, max_size=4).map(b"\n".join), max_size=12),
       stream=st.booleans())  # fmt: skip
def test_sse_events(events: list[bytes], stream: bool) -> None:
    from gateway.serving.relay import StreamState

    call = parse_call("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                               "stream": True})  # fmt: skip
    slot = _Slot(call)
    state = StreamState()
    out, done = _relay()._events(slot, events, state)  # type: ignore[arg-type]
    relayed = [e for e in out.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in relayed)
    if done:
        assert any(b"data: [DONE]" in e.split(b"\n") or b"data:[DONE]" in e for e in events)
    assert slot.counted == state.tokens <= len(relayed)


@pytest.mark.parametrize("n", [10_000])
def test_parser_handles_many_messages(n: int) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}] * n}
    assert parse("chat", json.dumps(body).encode()) is not None
