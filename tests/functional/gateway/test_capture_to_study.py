"""Your traffic, your ranking, end to end: a gateway in front of the emulator captures real
requests, `sagesched study --mode lssp --trace` runs the what-if on that file and writes the
report with its recommendation, and `sagesched replay` sends the same capture again."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any

import aiohttp
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import StartGateway

from loadgen.replay.cli import main as replay_main
from loadgen.study.cli import main as study_main
from loadgen.study.grid import METRICS
from loadgen.traces.capture import read_records

MODEL = "tiny-llama"
N = 40
POLICIES = ("fifo", "gateway_fcfs", "gateway_sagesched", "vllm_faithful")


async def _send(s: aiohttp.ClientSession, url: str, i: int) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": 4 + (i * 7) % 29, "ignore_eos": True}  # fmt: skip
    async with s.post(url, json=body) as r:
        await r.read()
        return r.status


async def capture_traffic(start_gateway: StartGateway, emu: str, folder: Path) -> list[int]:
    """N requests through a capturing FCFS gateway, 15 ms apart; their statuses."""
    gw = await start_gateway([emu], policy="fcfs", capture={"dir": str(folder)})
    try:
        async with aiohttp.ClientSession() as s:
            tasks = []
            for i in range(N):
                tasks.append(asyncio.create_task(_send(s, f"{gw.url}/v1/chat/completions", i)))
                await asyncio.sleep(0.015)
            return list(await asyncio.gather(*tasks))
    finally:
        await gw.stop()  # stopping flushes the capture


async def test_gateway_capture_feeds_the_whatif_study_and_the_replay(
    start_emulator: StartEmulator, start_gateway: StartGateway, tmp_path: Path, capsys: Any
) -> None:
    emu = await start_emulator(time_scale=0.05)
    statuses = await capture_traffic(start_gateway, emu, tmp_path / "cap")
    assert statuses == [200] * N
    records = read_records(tmp_path / "cap")
    assert {r["class"] for r in records} == {"standard"}  # the default class, recorded
    out = tmp_path / "whatif"
    argv = ["--mode", "lssp", "--trace", str(tmp_path / "cap"), "--out", str(out),
            "--profile", "cpu-tiny-vllm", "--window-requests", "20", "--public-windows", "1",
            "--regions", "KNEE", "--policies", ",".join(POLICIES), "--executor", "serial",
            "--boot", "200", "--no-plots", "--no-progress"]  # fmt: skip
    assert await asyncio.to_thread(study_main, argv) == 0
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert summary["capture"]["completed_requests"] == N
    assert len(summary["windows"]) == N // 20 and summary["profile"] == "cpu-tiny-vllm"
    assert summary["recommended"] in POLICIES
    assert summary["recommended"] == summary["ranking"]["MEASURED"][0]
    assert set(summary["tau"]) == {f"KNEE|{s}" for s in ("lssp-azure2024", "lssp-bailian",
                                                         "lssp-burstgpt")}  # fmt: skip
    with gzip.open(out / "whatif.csv.gz", "rt") as f:
        rows = f.read().splitlines()[1:]
    cells = 2 * 2 + 3  # capture windows x (KNEE, MEASURED) + one public window per source
    assert len(rows) == cells * len(POLICIES) * len(METRICS)
    assert f"**{summary['recommended']}**" in (out / "report.md").read_text()

    # the same file replayed live, at twice the recorded pace
    argv = ["--target", emu, "--source", "capture", "--path", str(tmp_path / "cap"),
            "--windows", "whole", "--factor", "2", "--no-progress", "--json"]  # fmt: skip
    capsys.readouterr()
    assert await asyncio.to_thread(replay_main, argv) == 0
    [replayed] = [v["summary"] for v in json.loads(capsys.readouterr().out).values()]
    assert (replayed["successful"], replayed["failed"]) == (N, 0)
