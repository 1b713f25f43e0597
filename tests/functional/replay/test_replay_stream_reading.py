"""How the replay client reads a stream: tokens, usage, and each way an answer can fail, on a
small server whose answer depends on the prompt."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from loadgen.replay import ReplayRequest, ReplayResult, replay


def _event(obj: dict[str, Any]) -> bytes:
    return b"data:" + json.dumps(obj).encode() + b"\n\n"  # SSE: the space after ':' is optional


async def _answer(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    chat = "messages" in body
    prompt = body["messages"][-1]["content"] if chat else body["prompt"]
    if prompt == "refuse":
        return web.json_response({"error": {"message": "no", "code": "nope"}}, status=500)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b": a comment line\n\n")
    words = ["a", "b", "c"] if prompt == "ok" else ["a"]
    for w in words:
        choice = {"index": 0, "delta": {"content": w}} if chat else {"index": 0, "text": w}
        await resp.write(_event({"choices": [choice]}))
    if prompt == "break":
        await resp.write(_event({"error": {"message": "backend broke", "code": "upstream_broken"}}))
    else:
        await resp.write(_event({"choices": [], "usage": {"completion_tokens": len(words) + 10}}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _replay(prompts: list[str], chat: bool = False) -> list[ReplayResult]:
    app = web.Application()
    app.router.add_post("/v1/completions", _answer)
    app.router.add_post("/v1/chat/completions", _answer)
    async with TestServer(app) as server:
        reqs = [
            ReplayRequest(
                0.01 * i, p, 1, 3, messages=({"role": "user", "content": p},) if chat else None
            )
            for i, p in enumerate(prompts)
        ]
        return await replay(str(server.make_url("")), "m", reqs)


async def test_tokens_gaps_and_usage_are_read_from_completions_and_chat_streams() -> None:
    for chat in (False, True):
        (res,) = await _replay(["ok"], chat=chat)
        assert res.status == "ok" and res.error is None
        assert res.first_token_s is not None and res.finish_s is not None
        assert len(res.gaps_s) == 2  # three text chunks
        assert res.tokens == 13  # the usage chunk's count wins over the chunks counted


async def test_an_error_event_after_the_first_token_fails_the_request() -> None:
    broken, ok = await _replay(["break", "ok"])
    assert broken.status == "error" and broken.error == "APIError: backend broke"
    assert broken.tokens == 1 and broken.first_token_s is not None
    assert ok.status == "ok"


async def test_an_http_error_is_recorded_with_its_status() -> None:
    (res,) = await _replay(["refuse"])
    assert res.status == "http_500" and res.first_token_s is None and res.tokens == 0
