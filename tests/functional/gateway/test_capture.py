"""Traffic capture end to end: a gateway with `capture.dir` in front of the emulator records
every request (completed, streamed, rejected) with the backend's token counts and no text;
`loadgen.traces` reads the capture back as a trace of the completed requests, as the
registered source `capture`, and `sagesched traces --capture` summarises it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import StartGateway

from loadgen.traces import load_windows
from loadgen.traces.capture import capture_summary, read_capture
from loadgen.traces.cli import main as traces_main

MODEL = "tiny-llama"
SECRET = "the quick brown fox keeps its secrets"


def body(n: int, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"{SECRET} {n}"}],
            "max_tokens": n, "ignore_eos": True, "stream": stream}  # fmt: skip


async def test_capture_records_traffic_and_reads_back_as_a_trace(
    start_emulator: StartEmulator, start_gateway: StartGateway, tmp_path: Path, capsys: Any
) -> None:
    emu = await start_emulator(time_scale=0.05)
    gw = await start_gateway([emu], policy="fcfs", capture={"dir": str(tmp_path / "cap")})
    url = f"{gw.url}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as s:
            for n in (3, 5, 7):
                async with s.post(url, json=body(n, stream=n == 5)) as r:
                    assert r.status == 200
                    await r.read()
            async with s.post(url, json={"model": MODEL}) as r:  # no messages: 400
                assert r.status == 400
    finally:
        await gw.stop()  # stopping flushes the writer
    files = list((tmp_path / "cap").glob("capture-*.jsonl"))
    assert len(files) == 1
    raw = files[0].read_text()
    assert SECRET not in raw and "quick" not in raw  # counts and times, never text
    records = [json.loads(line) for line in raw.splitlines()]
    assert [r["outcome"] for r in records] == ["completed"] * 3 + ["rejected"]
    assert all(r["ttlt_s"] >= r["ttft_s"] > 0 for r in records[:3])
    trace = read_capture(tmp_path / "cap", "capture")
    assert [r.output_tokens for r in trace] == [3, 5, 7]  # completed only, in arrival order
    assert all(r.prompt_tokens > 5 and r.tenant == MODEL for r in trace)
    assert trace[0].arrival_s <= trace[1].arrival_s <= trace[2].arrival_s
    summary = capture_summary(tmp_path / "cap")
    assert summary["records"] == 4 and summary["outcomes"]["completed"] == 3
    [window] = load_windows("capture", n_requests=3, count=1, path=tmp_path / "cap")
    assert window.requests[0].arrival_s == 0.0 and len(window) == 3
    assert traces_main(["--capture", str(tmp_path / "cap"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["completed_requests"] == 3
