"""Replay a capture live (issue 19 part 3), end to end, against the emulated backend.

A gateway with `capture.embeddings` on (sagesched, with the predictor) serves shipped prompts;
a second gateway without a predictor, capturing into the same folder, serves two chat requests
(no embeddings). `sagesched replay --source capture --windows whole --factor 2` then replays
the capture through a fresh capturing gateway, once with `--prompts nearest` and once with
synthetic prompts (`ids`); the target's own capture shows what arrived: the same requests, the
recorded gaps halved, the recorded prompt and output lengths. The nearest prompts are the very
shipped prompts that were captured, and the two requests without an embedding fall back.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fixtures.emulator_fixtures import StartEmulator

from gateway.config import build
from gateway.serving.app import create_app
from loadgen.replay.cli import _replay_parser, workloads
from loadgen.replay.cli import main as replay_main
from loadgen.replay.prompts import load_prompt_rows
from loadgen.traces.capture import read_records
from predictor import Embedder, LengthPredictor

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
PAUSES_S = (0.0, 0.5, 0.4, 0.8, 0.45, 0.6)
"""Before each shipped prompt: recorded gaps of at least 0.4 s, 0.2 s once replayed at x2."""
MAX_TOKENS = (5, 9, 3, 12, 7, 4)


@asynccontextmanager
async def gateway(
    emu: str, folder: Path, predictor: LengthPredictor | None = None, **config: Any
) -> AsyncIterator[str]:
    """A capturing gateway in front of `emu`; stopping it flushes its capture."""
    cfg = build({"backends": [{"url": emu}], "port": 1, "adaptive_cap": {"enabled": False},
                 "capture": {"dir": str(folder), "embeddings": True}, **config})  # fmt: skip
    runner = web.AppRunner(create_app(cfg, predictor=predictor), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def completed(folder: Path) -> list[dict[str, Any]]:
    records = read_records(folder)
    assert all(r["outcome"] == "completed" for r in records), records
    return sorted(records, key=lambda r: float(r["arrival_s"]))


def lengths(records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(r["prompt_tokens"], r["output_tokens"]) for r in records]


def gaps(records: list[dict[str, Any]]) -> list[float]:
    t = [float(r["arrival_s"]) for r in records]
    return [b - a for a, b in itertools.pairwise(t)]


async def test_a_capture_replays_with_its_arrivals_lengths_and_nearest_prompts(
    start_emulator: StartEmulator,
    embedder: Embedder,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    emu = await start_emulator(time_scale=0.05)
    shipped = load_prompt_rows("sample")
    sent = [r for r in shipped if 60 <= len(r.prompt) <= 600][: len(PAUSES_S)]
    cap = tmp_path / "cap"
    async with aiohttp.ClientSession() as s:
        predictor = LengthPredictor(embedder=embedder)
        async with gateway(emu, cap, predictor, policy="sagesched") as url:
            for pause, row, n in zip(PAUSES_S, sent, MAX_TOKENS, strict=True):
                await asyncio.sleep(pause)  # the arrival pattern to replay
                body = {"model": MODEL, "prompt": row.prompt, "max_tokens": n, "ignore_eos": True}
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
        async with gateway(emu, cap, policy="fcfs") as url:  # no predictor: no embeddings
            for n in (6, 8):
                await asyncio.sleep(0.5)
                body = {"model": MODEL, "max_tokens": n, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"chat request {n}"}]}  # fmt: skip
                async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
    recorded = completed(cap)
    assert [r["output_tokens"] for r in recorded] == [*MAX_TOKENS, 6, 8]
    assert ["embedding" in r for r in recorded] == [True] * 6 + [False] * 2
    assert all(row.prompt[:40] not in f.read_text() for row in sent for f in cap.iterdir())

    # the replay's plan: the very prompts captured, synthetic ones where no embedding was kept
    argv = ["--source", "capture", "--path", str(cap), "--windows", "whole", "--factor", "2",
            "--no-progress", "--json"]  # fmt: skip
    args = _replay_parser("replay").parse_args(["--target", emu, *argv, "--prompts", "nearest"])
    [(_, plan)] = await asyncio.to_thread(workloads, args)
    assert [r.prompt for r in plan[:6]] == [row.prompt for row in sent]
    assert all(r.prompt in {row.prompt for row in shipped} for r in plan[:6])
    assert all(isinstance(r.prompt, list) for r in plan[6:])
    assert [len(r.prompt) for r in plan[6:]] == [r["prompt_tokens"] for r in recorded[6:]]
    assert "6 nearest shipped prompts, 2 synthetic" in capsys.readouterr().err

    # live: what the target gateway saw, for nearest and for synthetic prompts
    for prompts in ("nearest", "ids"):
        target = tmp_path / f"target-{prompts}"
        async with gateway(emu, target, policy="fcfs") as url:
            cmd = ["--target", url, *argv, "--prompts", prompts]
            assert await asyncio.to_thread(replay_main, cmd) == 0
        report = json.loads(capsys.readouterr().out)
        [summary] = [v["summary"] for v in report.values()]
        assert (summary["successful"], summary["failed"]) == (8, 0)
        arrived = completed(target)
        assert len(arrived) == len(recorded)
        assert lengths(arrived) == lengths(recorded), prompts  # recorded prompt and output sizes
        for got, want in zip(gaps(arrived), gaps(recorded), strict=True):
            assert got == pytest.approx(want / 2, abs=0.1), (prompts, gaps(arrived))
