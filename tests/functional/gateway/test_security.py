"""Security (issue 18 part 6): keys never logged, the admin address, header limits, and no
upstream URL or header taken from the client."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fixtures.gateway_fixtures import StartGateway
from fixtures.recording_backend import (  # noqa: F401  (fixture)
    MODEL,
    RecordingBackend,
    StartRecording,
    start_recording_backend,
)

from gateway.config import build
from gateway.serving.app import ADMIN, create_app
from gateway.serving.security import admin_socket, key_matches, server_limits
from loadgen.procs import Children, free_port, sagesched

API_KEY, ADMIN_KEY, BACKEND_KEY = "sk-client-7f3a9c", "adm-secret-51be02", "bk-upstream-9d44e1"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_key_matches() -> None:
    assert key_matches("a", ("b", "a")) and not key_matches("a", ("b",))
    assert not key_matches("ä\udcff", ("a",))  # non-ASCII (and undecodable) headers never raise
    assert not key_matches("", ("a",)) and not key_matches("a", ())


def _get(url: str, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _post(url: str, body: bytes, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError):
        return 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_keys_never_logged(tmp_path: Path) -> None:
    """A gateway process at DEBUG with client, admin and backend keys: right and wrong keys,
    errors (401, 400, 404, 413, 431, a backend that is gone: 502/503), its effective-config
    line and its shutdown — the log holds none of the keys."""
    backend, port = free_port(), free_port()
    config = tmp_path / "gw.yaml"
    config.write_text(json.dumps({
        "backends": [{"url": f"http://127.0.0.1:{backend}", "api_key": BACKEND_KEY}],
        "port": port, "api_keys": [API_KEY], "admin_key": ADMIN_KEY, "log_level": "DEBUG",
        "policy": "fcfs", "max_body_bytes": 4096, "queue_timeout_s": 2,
    }))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    good = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with Children(tmp_path / "logs") as kids:
        emulate = sagesched("emulate", "--port", str(backend), "--time-scale", "0.01")
        emu = kids.start("emulate", emulate, f"http://127.0.0.1:{backend}/health")
        kids.start("serve", sagesched("serve", "--config", str(config)), f"{url}/ready")
        body = json.dumps({**CHAT, "model": "tiny-llama"}).encode()
        assert _post(url + "/v1/chat/completions", body, good) == 200
        assert _post(url + "/v1/chat/completions", body, {"Authorization": f"Bearer {API_KEY}x"}
                     ) == 401  # fmt: skip
        assert _post(url + "/v1/chat/completions", b"{", good) == 400
        assert _post(url + "/v1/chat/completions", b"{" + b" " * 5000 + b"}", good) == 413
        assert _post(url + "/tokenize", b'{"model": "nope"}', good) == 404
        assert _get(url + "/admin/queue", {"Authorization": f"Bearer {ADMIN_KEY}"}) == 200
        assert _get(url + "/admin/queue", {"Authorization": f"Bearer {API_KEY}"}) == 401
        many = {**good, **{f"x-h{i}": "v" for i in range(120)}}
        assert _post(url + "/v1/chat/completions", body, many) == 431
        kids.stop(emu)  # the backend goes: errors on the upstream path
        assert _post(url + "/v1/chat/completions", body, good) in (502, 503)
    log = (tmp_path / "logs" / "serve.log").read_text(errors="replace")
    assert "effective config" in log and "DEBUG" in log
    for secret in (API_KEY, ADMIN_KEY, BACKEND_KEY):
        assert secret not in log, secret


async def _serve(app: web.Application, config: Any, admin: bool = False) -> tuple[str, str]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           **server_limits(config))  # fmt: skip
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    main = f"http://127.0.0.1:{int(runner.addresses[0][1])}"
    admin_url = ""
    if admin:
        sock = admin_socket(config, app[ADMIN])
        assert sock is not None
        await web.SockSite(runner, sock).start()
        admin_url = f"http://127.0.0.1:{app[ADMIN].port}"
    _RUNNERS.append(runner)
    return main, admin_url


_RUNNERS: list[web.AppRunner] = []


@pytest.fixture
async def rec(start_recording_backend: StartRecording) -> RecordingBackend:  # noqa: F811
    return await start_recording_backend()


@pytest.fixture(autouse=True)
async def _cleanup() -> Any:
    yield
    while _RUNNERS:
        await _RUNNERS.pop().cleanup()


async def test_admin_listen(rec: RecordingBackend) -> None:
    config = build({"backends": [{"url": rec.url}], "policy": "fcfs", "admin_key": ADMIN_KEY,
                    "admin_listen": "127.0.0.1:0", "port": 1})  # fmt: skip
    main, admin = await _serve(create_app(config), config, admin=True)
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with aiohttp.ClientSession() as s:
        async with s.get(main + "/admin/queue", headers=auth) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        async with s.get(admin + "/admin/queue", headers=auth) as r:
            assert r.status == 200 and (await r.json())["policy"] == "fcfs"
        async with s.get(admin + "/admin/queue") as r:
            assert r.status == 401  # the key is still needed there
        async with s.post(admin + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 404  # the admin address serves nothing else
        async with s.get(main + "/metrics") as r:
            assert r.status == 200  # where Prometheus scrapes it
        async with s.post(main + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200


async def test_header_limits(rec: RecordingBackend) -> None:
    config = build({"backends": [{"url": rec.url}], "policy": "fcfs", "port": 1,
                    "max_headers": 20, "max_header_bytes": 2048})  # fmt: skip
    main, _ = await _serve(create_app(config), config)
    url = main + "/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=CHAT, headers={f"x-h{i}": "v" for i in range(30)}) as r:
            assert r.status == 431 and r.content_type == "application/json"
            assert (await r.json())["error"]["code"] == "headers_too_large"
        async with s.post(url, json=CHAT, headers={"x-big": "v" * 3000}) as r:
            assert r.status == 431 and (await r.json())["error"]["code"] == "headers_too_large"
        async with s.post(main + "/v1/" + "a" * 3000, json=CHAT) as r:
            assert r.status == 414 and (await r.json())["error"]["code"] == "uri_too_long"
        # beyond twice the limit aiohttp's parser refuses it (plain 400, connection closed)
        async with s.post(url, json=CHAT, headers={"x-big": "v" * 5000}) as r:
            assert r.status == 400
        async with s.post(url, json=CHAT, headers={f"x-h{i}": "v" for i in range(12)}) as r:
            assert r.status == 200  # within the limits (aiohttp adds its own few)
    assert len(rec.completions()) == 1


async def test_no_upstream_choice_from_the_client(
    rec: RecordingBackend,
    start_gateway: StartGateway,
    start_recording_backend: StartRecording,  # noqa: F811
) -> None:
    """Host, X-Forwarded-*, Forwarded and absolute-URI request targets never change which
    backend is called, nor reach it; the client's Authorization is replaced by the backend's."""
    other = await start_recording_backend()  # a server the client would like us to call
    gw = await start_gateway([{"url": rec.url, "api_key": BACKEND_KEY}], policy="fcfs",
                             api_keys=[API_KEY])  # fmt: skip
    host = other.url.split("//", 1)[1]
    tricks = {"Host": host, "X-Forwarded-Host": host, "X-Forwarded-Proto": "https",
              "X-Forwarded-For": "10.0.0.1", "X-Forwarded-Port": host.split(":")[1],
              "Forwarded": f"host={host};proto=http", "X-Real-IP": "10.0.0.2",
              "X-Original-URL": other.url + "/v1/chat/completions"}  # fmt: skip
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    body = json.dumps(CHAT).encode()
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/chat/completions", "/tokenize"):
            async with s.post(gw.url + path, data=body, headers={**auth, **tricks}) as r:
                assert r.status == 200
    port = int(gw.url.rsplit(":", 1)[1])
    for target in (f"{other.url}/v1/chat/completions", f"{other.url}/tokenize"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}"
                     f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)  # fmt: skip
        status = (await reader.readline()).split()[1]
        await reader.read()
        writer.close()
        assert status == b"200"
    assert [s for s in other.seen if s.method == "POST"] == []
    sent = [s for s in rec.seen if s.method == "POST"]
    assert len(sent) == 4
    rec_host = rec.url.split("//", 1)[1]
    for seen in sent:
        names = {k.lower() for k in seen.headers}
        assert seen.headers["Host"] == rec_host
        assert not names & {
            "x-forwarded-host",
            "x-forwarded-proto",
            "x-forwarded-for",
            "x-forwarded-port",
            "forwarded",
            "x-real-ip",
            "x-original-url",
        }
        assert seen.headers["Authorization"] == f"Bearer {BACKEND_KEY}"  # fmt: skip
