"""The emulator's prefix cache: vLLM's two counter series, hits for re-sent prefixes (token
ids, chat turns), the block size, and the switch."""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import pytest

from loadgen.emulator.cli import build_parser, config_from_args

MODEL = "tiny-llama"


async def _post(url: str, path: str, body: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def _counters(url: str) -> tuple[float, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()

    def value(name: str) -> float:
        pattern = rf'^vllm:{name}_total\{{engine="0",model_name="{MODEL}"\}} (\S+)$'
        (v,) = re.findall(pattern, text, re.M)
        return float(v)

    return value("prefix_cache_queries"), value("prefix_cache_hits")


def _ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize("emulator_url", [{"time_scale": 0.05}], indirect=True)
async def test_series_count_queries_and_hits(emulator_url: str) -> None:
    assert await _counters(emulator_url) == (0.0, 0.0)  # exposed from the start
    body = {"model": MODEL, "max_tokens": 2, "ignore_eos": True}
    await _post(emulator_url, "/v1/completions", {**body, "prompt": _ids(100)})
    assert await _counters(emulator_url) == (100.0, 0.0)
    await _post(emulator_url, "/v1/completions", {**body, "prompt": _ids(70) + _ids(50, 5000)})
    assert await _counters(emulator_url) == (220.0, 64.0)  # 4 full 16-token blocks shared


@pytest.mark.parametrize("emulator_url", [{"time_scale": 0.05, "block_size": 32}], indirect=True)
async def test_chat_turns_share_their_prefix_in_the_block_size(emulator_url: str) -> None:
    turn1 = [{"role": "user", "content": "word " * 200}]
    turn2 = [*turn1, {"role": "assistant", "content": "answer " * 50},
             {"role": "user", "content": "more"}]  # fmt: skip
    body = {"model": MODEL, "max_tokens": 1}
    await _post(emulator_url, "/v1/chat/completions", {**body, "messages": turn1})
    q1, _ = await _counters(emulator_url)
    await _post(emulator_url, "/v1/chat/completions", {**body, "messages": turn2})
    q2, hits = await _counters(emulator_url)
    assert hits > 0 and hits % 32 == 0 and hits == (q1 - 2) // 32 * 32  # turn 1 minus its
    assert q2 > 2 * q1 - 10  # generation prompt, in whole 32-token blocks


@pytest.mark.parametrize(
    "emulator_url", [{"time_scale": 0.05, "prefix_caching": False}], indirect=True
)
async def test_caching_off_counts_nothing(emulator_url: str) -> None:
    body = {"model": MODEL, "max_tokens": 1, "prompt": _ids(100)}
    await _post(emulator_url, "/v1/completions", body)
    await _post(emulator_url, "/v1/completions", body)
    assert await _counters(emulator_url) == (0.0, 0.0)


def test_cli_flags() -> None:
    ap = build_parser("emulate")
    cfg = config_from_args(ap.parse_args(["--block-size", "128", "--no-enable-prefix-caching"]))
    assert (cfg.block_size, cfg.prefix_caching) == (128, False)
    assert cfg.engine_config().block_tokens == 128 and not cfg.engine_config().prefix_caching
    default = config_from_args(ap.parse_args([]))
    assert (default.block_size, default.prefix_caching) == (16, True)
