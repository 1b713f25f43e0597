"""Bad input gets an OpenAI-style JSON error with the right status; the process stays up."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import RunningGateway, StartGateway
from fixtures.scrape import scrape, total


@pytest.fixture
async def gw(start_emulator: StartEmulator, start_gateway: StartGateway) -> RunningGateway:
    backend = await start_emulator(time_scale=0.05)
    return await start_gateway(
        [backend], policy="fcfs", api_keys=["k1"], admin_key="adm", max_body_bytes=20_000
    )


AUTH = {"Authorization": "Bearer k1"}
GOOD = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def post(
    gw: RunningGateway,
    body: Any,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(AUTH if headers is None else headers)}
    async with aiohttp.ClientSession() as s, s.post(gw.url + path, data=data, headers=hdrs) as r:
        return r.status, await r.json()


def assert_openai_error(body: dict[str, Any]) -> None:
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
        ({**GOOD, "messages": "hello"}, 400, "messages"),
        ({**GOOD, "messages": [{"content": "no role"}]}, 400, "messages"),
        ({**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
        ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
        ({**GOOD, "stream": "yes"}, 400, "stream"),
        ({**GOOD, "priority": 1.5}, 400, "priority"),
        ({**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({**GOOD, "model": "no-such-model"}, 404, "model"),
    ],
)
async def test_bad_bodies(gw: RunningGateway, body: Any, status: int, param: str | None) -> None:
    got, data = await post(gw, body)
    assert got == status
    assert_openai_error(data)
    assert data["error"]["param"] == param


async def test_completions_prompt_type(gw: RunningGateway) -> None:
    status, data = await post(
        gw, {"model": "tiny-llama", "prompt": {"a": 1}}, path="/v1/completions"
    )
    assert status == 400 and data["error"]["param"] == "prompt"


async def test_auth_size_and_routes(gw: RunningGateway) -> None:
    assert (await post(gw, GOOD, headers={}))[0] == 401
    assert (await post(gw, GOOD, headers={"Authorization": "Bearer wrong"}))[0] == 401
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * 30_000}]}
    status, data = await post(gw, big)
    assert status == 413
    assert_openai_error(data)
    status, data = await post(gw, GOOD, path="/v1/nope")
    assert status == 404
    assert_openai_error(data)
    async with aiohttp.ClientSession() as s:
        async with s.get(gw.url + "/v1/chat/completions") as r:
            assert r.status == 405
            assert_openai_error(await r.json())
        async with s.get(gw.url + "/admin/queue") as r:
            assert r.status == 401
        async with s.get(gw.url + "/admin/queue", headers={"Authorization": "Bearer adm"}) as r:
            assert r.status == 200
            assert (await r.json())["policy"] == "fcfs"
        async with s.get(gw.url + "/admin/backends", headers={"Authorization": "Bearer adm"}) as r:
            backends = (await r.json())["backends"]
            assert backends[0]["healthy"] is True and backends[0]["models"] == ["tiny-llama"]


async def test_errors_are_counted_and_process_stays_up(gw: RunningGateway) -> None:
    for body in (b"{", {**GOOD, "model": "nope"}, {**GOOD, "max_tokens": -1}):
        await post(gw, body)
    status, data = await post(gw, GOOD)
    assert status == 200 and data["choices"][0]["message"]["content"]
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="rejected") == 3
    assert total(samples, "sagesched_requests_total", outcome="completed", code="200") == 1
    assert total(samples, "sagesched_requests_total", model="nope") == 0  # no unbounded labels


async def test_every_error_renders_in_one_form(
    gw: RunningGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error middleware renders every route's errors, the gateway's own (401 on
    `/v1/models` and the admin routes) and a bug's (500, counted as internal_error)."""
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/models", "/admin/queue", "/admin/backends"):
            async with s.get(gw.url + path) as r:
                assert r.status == 401
                data = await r.json()
                assert_openai_error(data)
                assert data["error"]["code"] == "invalid_api_key"

    def bug(*_: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(gw.state.prediction, "predict", bug)  # fault injection: a bug in step 2
    status, data = await post(gw, GOOD)
    assert status == 500
    assert_openai_error(data)
    assert data["error"] == {
        "message": "internal error in the gateway", "type": "internal_error", "param": None,
        "code": None,
    }  # fmt: skip
    samples = await scrape(gw.url + "/metrics")
    assert total(samples, "sagesched_requests_total", outcome="internal_error", code="500") == 1
