"""The gateway learns every completed request's true length, embedding each prompt once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import aiohttp
import pytest
from fixtures.emulator_fixtures import StartEmulator
from fixtures.gateway_fixtures import StartGateway

from predictor import Embedder, LengthPredictor
from predictor.embedder import EmbeddingCache
from predictor.encoders import Embeddings

pytestmark = pytest.mark.timeout(120)

PROMPTS = [
    f"Tell me about topic number {i} and why it matters to {i * 7} people." for i in range(8)
]


@pytest.mark.parametrize(("cap", "together"), [(1, True), (8, False)], ids=["queued", "idle"])
async def test_each_prompt_is_embedded_once(
    start_emulator: StartEmulator,
    start_gateway: StartGateway,
    embedder: Embedder,
    monkeypatch: pytest.MonkeyPatch,
    cap: int,
    together: bool,
) -> None:
    """Queued: seven of eight requests wait behind a cap of 1, so their predictions order the
    queue. Idle: one request at a time, each starting at once while its prediction runs beside
    it; the embedder is slowed down so that the response ends before the prediction does, and
    learning has to wait for it. Either way the prediction's embedding is the one learned
    from."""
    predictor = LengthPredictor(embedder=embedder)
    predictor.observe_many(["a short question", "a long essay request"], [5, 60])
    embedded: list[str] = []
    encode = embedder.encode

    def counting(texts: Sequence[str], batch_size: int | None = None) -> Embeddings:
        embedded.extend(texts)
        if not together:
            time.sleep(0.3)  # in the embedder's thread: the prediction outlasts the response
        return encode(texts, batch_size)

    monkeypatch.setattr(embedder, "encode", counting)
    # the session's embedder is shared: an empty cache, so no earlier test answers for us
    monkeypatch.setattr(embedder, "cache", EmbeddingCache(1024))
    backend = await start_emulator()
    gw = await start_gateway([{"url": backend, "max_inflight": cap}], policy="sagesched",
                             predictor=predictor)  # fmt: skip

    async def one(s: aiohttp.ClientSession, text: str) -> int:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": text}],
                "max_tokens": 30, "ignore_eos": True}  # fmt: skip
        async with s.post(gw.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return int((await r.json())["usage"]["completion_tokens"])

    async with aiohttp.ClientSession() as s:
        if together:
            got = await asyncio.gather(*(one(s, p) for p in PROMPTS))
        else:
            got = [await one(s, p) for p in PROMPTS]
    assert got == [30] * len(PROMPTS)
    # learning runs in the background after each response: wait for the gateway's tasks
    while gw.state.background:
        await asyncio.gather(*list(gw.state.background))
    # learned per served model: the default state keeps its warm start, tiny-llama has its own
    assert predictor.index.added == 2
    assert predictor.own_state("tiny-llama").index.added == len(PROMPTS)
    assert len(embedded) == len(PROMPTS), embedded
    assert len(set(embedded)) == len(PROMPTS)
