"""Hand-written hostile input (issue 18 part 1): each gets a clean OpenAI-style JSON answer, never
a 5xx of the gateway's own, and exactly one counted terminal state; what is valid reaches the
backend as the client sent it (unknown fields included).

The generated cases (schemathesis, hypothesis) are in test_generated_input.py and
tests/unit/gateway/test_parser_fuzz.py; docs/reliability.md lists them all.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import RunningGateway, StartGateway
from fixtures.recording_backend import (  # noqa: F401  (fixture)
    MODEL,
    RecordingBackend,
    StartRecording,
    start_recording_backend,
)
from fixtures.scrape import scrape, total

CHAT = "/v1/chat/completions"
GOOD: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def post(gw: RunningGateway, path: str, body: Any) -> tuple[int, str, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s, s.post(gw.url + path, data=data, headers=headers) as r:
        return r.status, r.content_type, await r.read()


def openai_error(raw: bytes) -> dict[str, Any]:
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err  # type: ignore[no-any-return]


@pytest.fixture
async def rec(start_recording_backend: StartRecording) -> RecordingBackend:  # noqa: F811
    return await start_recording_backend()


@pytest.fixture
async def gw(rec: RecordingBackend, start_gateway: StartGateway) -> RunningGateway:
    return await start_gateway([rec.url], policy="sagesched", max_body_bytes=16 * 1024 * 1024)


async def counted(gw: RunningGateway) -> float:
    return total(await scrape(gw.url + "/metrics"), "sagesched_requests_total")


async def test_deep_nesting_is_a_400(gw: RunningGateway, rec: RecordingBackend) -> None:
    """100,000 nested arrays was a 500 (RecursionError in the JSON parser)."""
    for raw in (
        b"[" * 100_000 + b"]" * 100_000,
        b"[" * 100_000,  # unterminated too
        json.dumps({**GOOD, "extra": _nested(200)}).encode(),  # below the parser's limit
    ):
        status, ctype, body = await post(gw, CHAT, raw)
        assert (status, ctype) == (400, "application/json")
        assert "nested" in openai_error(body)["message"]
    status, _, _ = await post(gw, CHAT, {**GOOD, "extra": _nested(100)})  # within MAX_DEPTH
    assert status == 200
    assert rec.completions()[-1].json()["extra"] == _nested(100)
    # the passthrough leaves such a body to the backend, never a 500
    status, _, _ = await post(gw, "/tokenize", b"[" * 100_000)
    assert status < 500
    assert await counted(gw) == 5


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        # a 400-digit max_tokens overflowed the scheduler's floats (500): fields the gateway
        # uses must be 64-bit integers
        ({"max_tokens": 10**400}, 400),
        ({"max_tokens": 2**63}, 400),
        ({"max_tokens": 2**63 - 1}, 200),
        ({"priority": 10**400}, 400),
        ({"priority": -(10**40)}, 400),
        ({"min_tokens": 10**30}, 400),
        ({"max_tokens": 1e400}, 400),  # parses to inf: not an integer
        ({"max_tokens": -(10**400)}, 400),
        ({"temperature": 1e400}, 200),  # a field the gateway does not use: the backend's
        ({"n": 10**20}, 200),
        ({"x_big": -(10**4000)}, 200),
    ],
)
async def test_huge_numbers(
    gw: RunningGateway, rec: RecordingBackend, fields: dict[str, Any], status: int
) -> None:
    raw = json.dumps({**GOOD, **fields}).encode()  # json writes 1e400 as Infinity
    got, ctype, body = await post(gw, CHAT, raw)
    assert (got, ctype) == (status, "application/json"), body[:300]
    if status != 200:
        openai_error(body)
    assert await counted(gw) == 1


async def test_invalid_utf8(gw: RunningGateway) -> None:
    for raw in (b'{"model": "\xff\xfe", "messages": []}', b"\xc3\x28", b'{"\xc0\xaf": 1}'):
        status, ctype, body = await post(gw, CHAT, raw)
        assert (status, ctype) == (400, "application/json")
        assert "JSON" in openai_error(body)["message"]
    # a lone surrogate, escaped or UTF-8-encoded (Python's JSON parser passes both, as vLLM's
    # does): a string like any other, embedded and passed on
    for surrogate in (b"\\ud800", b"\xed\xa0\x80"):
        raw = b'{"model": "rec-model", "messages": [{"role": "user", "content": "a' + surrogate
        status, _, body = await post(gw, CHAT, raw + b'"}]}')
        assert status == 200, body[:300]
    while gw.state.background:  # the prediction beside the request embedded it: no error
        await asyncio.gather(*list(gw.state.background))
    assert await counted(gw) == 5


async def test_ten_thousand_messages(gw: RunningGateway, rec: RecordingBackend) -> None:
    messages = [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"}
                for i in range(10_000)]  # fmt: skip
    status, _, body = await post(gw, CHAT, {**GOOD, "messages": messages})
    assert status == 200, body[:300]
    assert len(rec.completions()[-1].json()["messages"]) == 10_000


async def test_list_of_parts_content(gw: RunningGateway, rec: RecordingBackend) -> None:
    parts = [
        {"type": "text", "text": "describe"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "briefly"},
        {"type": "input_audio"},
        "not an object",
    ]
    body = {**GOOD, "messages": [{"role": "user", "content": parts}], "stream": True}
    status, ctype, raw = await post(gw, CHAT, body)
    assert (status, ctype) == (200, "text/event-stream")
    assert raw.endswith(b"data: [DONE]\n\n")
    assert rec.completions()[-1].json()["messages"][0]["content"] == parts  # untouched


async def test_token_id_prompts(gw: RunningGateway, rec: RecordingBackend) -> None:
    """A prompt of token ids has no text: it is predicted from the global distribution at its
    size and not learned into the neighbour index (an empty string would be every such
    prompt's neighbour)."""
    predictor = gw.state.predictor
    assert predictor is not None
    for prompt in ([1, 2, 3, 4], [[5, 6], [7]]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
        status, _, raw = await post(gw, "/v1/completions", body)
        assert status == 200, raw[:300]
        assert rec.completions()[-1].json()["prompt"] == prompt
    status, _, _ = await post(gw, "/v1/completions", {"model": MODEL, "prompt": "words"})
    assert status == 200
    while gw.state.background:  # learning runs beside the requests
        await asyncio.gather(*list(gw.state.background))
    assert predictor.own_state(MODEL).index.added == 1  # only the text prompt was learned


async def test_unknown_fields_pass_through(gw: RunningGateway, rec: RecordingBackend) -> None:
    extra = {"guided_json": {"type": "object"}, "x_vendor": [1, {"a": None}], "top_k": 5,
             "logit_bias": {"50256": -100}, "seed": 2**63}  # fmt: skip
    for stream in (False, True):
        status, _, _ = await post(gw, CHAT, {**GOOD, **extra, "stream": stream})
        assert status == 200
        sent = rec.completions()[-1].json()
        assert {k: sent[k] for k in extra} == extra


async def test_a_real_backend_path_too(
    start_emulator: StartEmulator, start_gateway: StartGateway
) -> None:
    """The same hostile bodies against the emulated vLLM: its own 4xx pass through as JSON."""
    gw = await start_gateway([await start_emulator(time_scale=0.01)], policy="fcfs")
    base = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    # (not n = 10**20, nor temperature = Infinity: the emulator fails on them, a 502 counted as
    # an upstream fault; vLLM answers 400)
    for fields in ({"max_tokens": 10**400}, {"priority": 2**64}, {"x_big": 10**400},
                   {"max_tokens": 3, "stream": True, "x_unknown": {"deep": [[[]]]}}):  # fmt: skip
        status, ctype, raw = await post(gw, CHAT, json.dumps({**base, **fields}).encode())
        assert status < 500 and ctype in ("application/json", "text/event-stream"), raw[:300]
        if status >= 400:
            openai_error(raw)
    assert await counted(gw) == 4
