"""`sagesched serve` stopped and reloaded as real processes next to `sagesched emulate`, with
1 and 2 workers (issue 18 part 5, docs/operations.md "Stopping and reloading"):

- SIGTERM drains: new connections are refused at once, a stream in flight finishes, the
  completion it made is in the predictor snapshot saved at exit, exit status 0;
- a stream longer than `--shutdown-grace` is ended within the grace + slack with an SSE
  `shutting_down` error event and `[DONE]`, counted once (`shutdown`, code 503 in the
  capture);
- SIGHUP reloads the keys from the config file: a stream in flight completes, an added key
  is accepted, a removed key is 401, a worker restarted afterwards reads the file too, an
  invalid file keeps the keys and logs no key.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from loadgen.procs import Children, free_port, sagesched
from predictor.state import read_snapshot_header

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODEL = "tiny-llama"
ADMIN = "adm-4c1e"


def start(children: Children, tmp_path: Path, backend: str, workers: int, text: str,
          *flags: str) -> tuple[str, subprocess.Popen[bytes], Path]:  # fmt: skip
    port = free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(f"backends: [{{url: '{backend}', max_inflight: 4}}]\n"
                      "adaptive_cap: {enabled: false}\nhealth_interval_s: 0.5\n"
                      + text)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    cmd = sagesched("serve", "--config", str(config), "--port", str(port),
                    "--workers", str(workers), *flags)  # fmt: skip
    proc = children.start(f"gateway-{port}", cmd, url + "/ready", timeout_s=180)
    return url, proc, children.log_dir / f"gateway-{port}.log"


def chat(text: str, n: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": n, "ignore_eos": True, "stream": True}  # fmt: skip


def fresh() -> aiohttp.ClientSession:
    """Every request on its own connection (the kernel picks a worker for each)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def tokens(body: bytes) -> int:
    return body.count(b'"content":"') - body.count(b'"content":""')


async def opened(url: str, body: dict[str, Any], key: str | None = None
                 ) -> tuple[aiohttp.ClientSession, aiohttp.ClientResponse]:  # fmt: skip
    """A stream that has sent its first token (so it is running on the backend)."""
    s = fresh()
    headers = bearer(key) if key else None
    try:
        r = await s.post(url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status == 200, await r.text()
        first = await r.content.readuntil(b"\n\n")
        assert first.startswith(b"data: "), first
    except BaseException:
        await s.close()
        raise
    r._sagesched_first = first  # type: ignore[attr-defined]
    return s, r


async def rest(s: aiohttp.ClientSession, r: aiohttp.ClientResponse) -> bytes:
    try:
        return r._sagesched_first + await r.read()  # type: ignore[attr-defined,no-any-return]
    finally:
        r.release()
        await s.close()


async def refused(url: str) -> bool:
    try:
        async with fresh() as s, s.get(url + "/health", timeout=aiohttp.ClientTimeout(2)):
            return False
    except aiohttp.ClientConnectorError:
        return True


async def ready_workers(url: str) -> list[int]:
    """The pids of the workers that listen, from the authority's admin view."""
    async with fresh() as s, s.get(url + "/admin/queue", headers=bearer(ADMIN)) as r:
        assert r.status == 200, await r.text()
        return [w["pid"] for w in (await r.json())["workers"] if w["ready"]]


def learned(snapshot: Path) -> list[int]:
    """The output lengths in a predictor snapshot (with workers too, the host has one)."""
    out: list[int] = []
    header = read_snapshot_header(snapshot)
    with np.load(snapshot, allow_pickle=False) as z:
        for i, m in enumerate(header["models"]):
            n = min(int(m["history"]["added"]), int(m["history"]["capacity_items"]))
            out += [int(v) for v in z[f"m{i}.output"][:n]]
    return sorted(out)


@pytest.mark.parametrize("workers", [1, 2])
async def test_sigterm_finishes_streams_refuses_connections_and_saves_what_they_taught(
    children: Children, tmp_path: Path, backend: str, workers: int
) -> None:
    snapshot = tmp_path / "predictor.snapshot"
    predictor = f"predictor: {{snapshot_path: '{snapshot}', save_interval_s: 0}}\n"
    url, proc, _ = start(children, tmp_path, backend, workers, "policy: sagesched\n" + predictor)
    async with fresh() as s, s.post(url + "/v1/chat/completions", json=chat("Before.", 7)) as r:
        assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
    s1, r1 = await opened(url, chat("A long answer, still running at SIGTERM.", 250))
    proc.send_signal(signal.SIGTERM)  # the parent only (it stops its workers)
    deadline = time.monotonic() + 10
    while not await refused(url):
        assert time.monotonic() < deadline, "still accepting connections 10 s after SIGTERM"
        await asyncio.sleep(0.05)
    assert not r1.content.at_eof(), "the stream ended before the listener closed"
    body = await asyncio.wait_for(rest(s1, r1), 60)
    assert body.endswith(b"data: [DONE]\n\n") and tokens(body) == 250
    assert await asyncio.to_thread(proc.wait, 60) == 0
    assert learned(snapshot) == [7, 250]  # the stream that finished while draining, too


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_stream_longer_than_the_grace_ends_with_a_shutdown_event(
    children: Children, tmp_path: Path, backend: str, workers: int
) -> None:
    capture, grace = tmp_path / "capture", 2.0
    url, proc, _ = start(children, tmp_path, backend, workers, "policy: fcfs\n",
                         "--shutdown-grace", str(grace), "--capture", str(capture))  # fmt: skip
    s1, r1 = await opened(url, chat("An answer far longer than the grace.", 2000))
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    body = await asyncio.wait_for(rest(s1, r1), 30)
    ended = time.monotonic() - sent
    print(f"stream ended {ended:.2f} s after SIGTERM (grace {grace} s)")
    assert grace - 0.5 < ended < grace + 3.0, ended  # the cut itself is immediate
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error"
    assert all(json.loads(e[6:]).get("choices") for e in events[:-2])  # whole events only
    assert await asyncio.to_thread(proc.wait, 30) == 0
    records = [json.loads(line) for f in sorted(capture.rglob("*.jsonl"))
               for line in f.read_text().splitlines()]  # fmt: skip
    assert [(r["outcome"], r["status"]) for r in records] == [("shutdown", 503)]


@pytest.mark.parametrize("workers", [1, 2])
async def test_sighup_reloads_keys_without_dropping_a_stream(
    children: Children, tmp_path: Path, backend: str, workers: int
) -> None:
    old, kept, new = "key-old-5f3a", "key-kept-91c2", "key-new-77d0"
    text = f"policy: fcfs\napi_keys: [{old}, {kept}]\nadmin_key: {ADMIN}\n"
    url, proc, log = start(children, tmp_path, backend, workers, text)
    config = tmp_path / "gateway.yaml"

    async def status(key: str) -> set[int]:
        """Statuses of /v1/models with `key`, over 8 connections (both workers)."""
        out = set()
        async with fresh() as s:
            for _ in range(8):
                async with s.get(url + "/v1/models", headers=bearer(key)) as r:
                    out.add(r.status)
        return out

    async def reloaded(line: str, count: int, timeout_s: float = 15) -> None:
        deadline = time.monotonic() + timeout_s
        while log.read_text().count(line) < count:
            assert time.monotonic() < deadline, f"no {count} × {line!r} in the log"
            await asyncio.sleep(0.05)

    if workers > 1:  # every worker hears SIGHUP only once it serves: wait for the last one
        await reloaded(f"with {workers} workers", 1)
    assert await status(old) == {200} and await status(new) == {401}
    s1, r1 = await opened(url, chat("Runs across the reload.", 120), key=old)
    try:
        config.write_text(config.read_text().replace(old, new))
        proc.send_signal(signal.SIGHUP)
        await reloaded("SIGHUP: keys reloaded", workers)
        assert await status(new) == {200} and await status(kept) == {200}
        assert await status(old) == {401}
    finally:
        body = await asyncio.wait_for(rest(s1, r1), 60)
    assert body.endswith(b"data: [DONE]\n\n") and tokens(body) == 120
    if workers > 1:  # a worker restarted after the reload reads the file, not its parent's keys
        pids = await ready_workers(url)
        os.kill(pids[-1], signal.SIGKILL)
        await reloaded("worker start: keys reloaded", workers + 1, timeout_s=90)
        deadline = time.monotonic() + 60
        while len(set(await ready_workers(url)) - set(pids)) < 1:  # the new one listens
            assert time.monotonic() < deadline, "the killed worker never came back"
            await asyncio.sleep(0.2)
        assert await status(new) == {200} and await status(old) == {401}
    config.write_text("api_keys: [" + new + "\n  - : broken")  # invalid YAML
    proc.send_signal(signal.SIGHUP)
    await reloaded("SIGHUP: config not reloaded", workers)
    assert await status(new) == {200} and await status(old) == {401}
    assert proc.poll() is None
    text = log.read_text()
    assert not any(k in text for k in (old, kept, new)), "a key is in the log"


@pytest.mark.parametrize("workers", [1, 2])
async def test_served_process_cuts_an_unfinished_request_head(
    children: Children, tmp_path: Path, backend: str, workers: int
) -> None:
    """`serve` itself (one process and each worker) runs the guarded runner: a request head
    left unfinished is cut after `header_timeout_s` and counted, a normal request passes."""
    url, _, _ = start(children, tmp_path, backend, workers, "header_timeout_s: 1\n")
    host, port = url.removeprefix("http://").split(":")
    start_s = time.monotonic()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n")  # never finished
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), timeout=10) == b""  # closed, nothing sent
    waited = time.monotonic() - start_s
    writer.close()
    assert 0.9 <= waited <= 4.0, waited
    async with fresh() as s:
        async with s.post(url + "/v1/chat/completions", json=chat("hi", 3)) as r:
            assert r.status == 200
            assert tokens(await r.read()) == 3
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    series = 'sagesched_connections_cut_total{reason="header_timeout"}'
    cut = [line for line in text.splitlines() if line.startswith(series)]
    assert cut and float(cut[0].split()[-1]) >= 1, cut
