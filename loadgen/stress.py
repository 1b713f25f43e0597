"""A light aiohttp client for load tests and the soak (issue 18 part 3): one request, streamed or
not, optionally cancelled mid-stream, with what a load check needs from it (status, content
tokens counted from the answer itself, usage, Retry-After, time to first token and to the
last byte); and the gateway's `/metrics` read as numbers.

Not the replay client (`loadgen.replay`, through `openai`): thousands of concurrent streams
need one connector without a connection limit and as little client CPU per chunk as possible,
so lines are only parsed as JSON when they carry data.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass(slots=True)
class Result:
    """One request as the client saw it."""

    status: int
    tokens: int = 0
    """Content pieces received (streamed: chunks with text, chat or completions; non-streamed:
    usage)."""
    usage_tokens: int | None = None
    """`usage.completion_tokens`, when the answer carried it."""
    retry_after: str | None = None
    ttft_s: float | None = None
    ttlt_s: float = 0.0
    cancelled: bool = False
    error_json: bool = True
    """False when an error answer (>= 400) was not an OpenAI JSON error object."""
    stream_error: str | None = None
    """The message of an SSE error event (a stream that broke after it started)."""


def chat_body(text: str, max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    """A chat request with an exact output length (`ignore_eos`: the emulator generates
    `max_tokens` tokens)."""
    return {
        "model": extra.pop("model", "tiny-llama"),
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        **extra,
    }


async def request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    cancel_after: int | None = None,
    headers: dict[str, str] | None = None,
    on_first: asyncio.Event | None = None,
) -> Result:
    """POST `body` to `url`; stream if the body asks. `cancel_after`: close the connection
    after that many content chunks (a client that goes away mid-stream)."""
    t0 = time.monotonic()
    async with session.post(url, json=body, headers=headers) as resp:
        res = Result(resp.status, retry_after=resp.headers.get("Retry-After"))
        if resp.status >= 400 or not body.get("stream"):
            raw = await resp.read()
            res.ttlt_s = time.monotonic() - t0
            try:
                doc = json.loads(raw)
            except ValueError:
                res.error_json = False  # an error, or an answer, that is not JSON
                return res
            if resp.status >= 400:
                err = doc.get("error") if isinstance(doc, dict) else None
                res.error_json = isinstance(err, dict) and "message" in err
            else:
                res.usage_tokens = (doc.get("usage") or {}).get("completion_tokens")
                res.tokens = res.usage_tokens or 0
            return res
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if isinstance(chunk.get("error"), dict):
                res.stream_error = str(chunk["error"].get("message"))
            if chunk.get("usage"):
                res.usage_tokens = chunk["usage"].get("completion_tokens")
            choices = chunk.get("choices") or ()
            if choices and (
                choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
            ):
                res.tokens += 1
                if res.ttft_s is None:
                    res.ttft_s = time.monotonic() - t0
                    if on_first is not None:
                        on_first.set()
                if cancel_after is not None and res.tokens >= cancel_after:
                    res.cancelled = True
                    resp.close()
                    break
        res.ttlt_s = time.monotonic() - t0
        return res


def session(timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """A client session without a connection limit (every request its own connection when
    they are concurrent)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


def metrics(base_url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the gateway's `/metrics`: (name, labels, value)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return [
        (s.name, dict(s.labels), float(s.value))
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def total(samples: Iterable[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        v
        for n, lab, v in samples
        if n == name and all(lab.get(k) == want for k, want in labels.items())
    )


def outcomes(base_url: str) -> dict[str, float]:
    """`sagesched_requests_total` by outcome."""
    out: dict[str, float] = {}
    for n, lab, v in metrics(base_url):
        if n == "sagesched_requests_total":
            out[lab["outcome"]] = out.get(lab["outcome"], 0.0) + v
    return out
