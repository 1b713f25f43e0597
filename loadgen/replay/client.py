"""Open-loop streaming replay through the official `openai` async client.

The client sends, pools connections, times out and raises HTTP errors; the streamed chunks
are read as JSON lines rather than built into the SDK's typed objects, so the client's work
per token stays small and its sends stay on schedule on a busy machine.

Every send is scheduled from the workload's arrival times on the monotonic clock
(`time.perf_counter`) and launched as its own task at its scheduled time; nothing waits for
earlier requests, so a slow server cannot hold back arrivals (no coordinated omission). Each
request records its scheduled and actual send time (schedule lag), first-token time, every
inter-token gap, last-token time, output tokens, and its status or error. Requests go to
`/v1/completions` (a session's turns: `/v1/chat/completions`, `loadgen.replay.sessions`) with
`max_tokens` = the recorded output length and `ignore_eos`, so the server produces exactly
the trace's output.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai

from loadgen.metrics import RequestRecord

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request to send (times in seconds from the start of the replay)."""

    arrival_s: float
    prompt: Prompt
    prompt_tokens: int
    output_tokens: int
    deadline_s: float | None = None
    """Absolute deadline for the last token on the replay's clock, if an SLO applies."""
    priority: int | None = None
    """vLLM `priority` to send (lower first; needs `--scheduling-policy priority`), if any."""
    messages: tuple[dict[str, str], ...] | None = None
    """A chat request (`/v1/chat/completions`) instead of `prompt` (a session's turn)."""
    headers: dict[str, str] | None = None
    """Extra request headers (a session's key)."""


@dataclass(slots=True)
class ReplayResult:
    """What happened to one request (seconds on the replay's clock, 0 = replay start)."""

    id: int
    scheduled_s: float
    prompt_tokens: int
    output_tokens: int
    deadline_s: float | None = None
    sent_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)
    """Inter-token gaps (s): between consecutive chunks carrying text."""
    status: str = "pending"
    """`ok`, or the error class (`connection`, `timeout`, `http_<code>`, `error`)."""
    error: str | None = None

    @property
    def lag_s(self) -> float:
        """Actual minus scheduled send time (NaN if never sent)."""
        return math.nan if self.sent_s is None else self.sent_s - self.scheduled_s

    @property
    def ttft_s(self) -> float:
        """First token minus scheduled send (NaN without a first token)."""
        return math.nan if self.first_token_s is None else self.first_token_s - self.scheduled_s

    @property
    def ttlt_s(self) -> float:
        """Last token (or failure) minus scheduled send (NaN if unfinished)."""
        return math.nan if self.finish_s is None else self.finish_s - self.scheduled_s

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def record(self) -> RequestRecord:
        """The shared metrics record; latencies measured from the *scheduled* send."""
        return RequestRecord(
            id=self.id,
            arrival_s=self.scheduled_s,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            deadline_s=self.deadline_s,
            first_token_s=self.first_token_s,
            finish_s=self.finish_s if self.ok else None,
            tokens=self.tokens,
            dropped=not self.ok,
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.id,
            "scheduled_s": self.scheduled_s,
            "sent_s": self.sent_s,
            "lag_s": None if self.sent_s is None else self.lag_s,
            "ttft_s": None if self.first_token_s is None else self.first_token_s - self.scheduled_s,
            "ttlt_s": None if self.finish_s is None else self.finish_s - self.scheduled_s,
            "itl_s": self.gaps_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "tokens": self.tokens,
            "status": self.status,
            "error": self.error,
        }


def classify(exc: BaseException) -> str:
    """A short status for an exception (the error summary groups by it)."""
    if isinstance(exc, openai.APITimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError | ConnectionError):
        return "connection"
    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}"
    return "error"


def make_client(url: str, *, concurrency: int, timeout_s: float) -> openai.AsyncOpenAI:
    """An `AsyncOpenAI` for `url` (base URL without /v1): no retries (a retry would hide a
    failure and shift the schedule), a pool as large as the expected concurrency, and a short
    connect timeout so a dead target fails each request quickly."""
    timeout = openai.Timeout(timeout_s, connect=5.0)
    http = openai.DefaultAsyncHttpxClient(
        limits=_limits(concurrency), timeout=timeout, trust_env=False
    )
    return openai.AsyncOpenAI(
        base_url=url.rstrip("/") + "/v1",
        api_key="none",
        max_retries=0,
        timeout=timeout,
        http_client=http,
    )


def _limits(concurrency: int) -> Any:
    # the client's HTTP library (httpx or its successor) is whatever openai was built on
    http_lib = importlib.import_module(
        openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0]
    )
    return http_lib.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)


async def send(
    client: openai.AsyncOpenAI,
    model: str,
    req: ReplayRequest,
    res: ReplayResult,
    t0: float,
    on_done: Callable[[ReplayResult], None] | None,
) -> None:
    """Send one request now and record what happened into `res` (never raises but for
    cancellation); `t0` is the replay's start on `time.perf_counter`."""
    now = time.perf_counter
    res.sent_s = now() - t0
    last: float | None = None
    extra: dict[str, Any] = {"ignore_eos": True}
    if req.priority is not None:
        extra["priority"] = req.priority
    common: dict[str, Any] = {"model": model, "max_tokens": req.output_tokens, "stream": True,
                              "stream_options": {"include_usage": True}, "extra_body": extra,
                              "extra_headers": req.headers}  # fmt: skip
    try:
        if req.messages is None:
            opened: Any = client.completions.with_streaming_response.create(
                prompt=req.prompt, **common
            )
        else:
            messages: Any = req.messages
            opened = client.chat.completions.with_streaming_response.create(
                messages=messages, **common
            )
        async with opened as response:
            async for line in response.iter_lines():
                data = line[5:].lstrip() if line.startswith("data:") else ""
                if not data.startswith("{"):
                    continue  # blank separators, comments, [DONE]
                chunk = json.loads(data)
                if error := chunk.get("error"):  # an error event in an answer that had started
                    message = error.get("message") if isinstance(error, dict) else None
                    raise openai.APIError(str(message or error), response.http_request, body=error)
                choices = chunk.get("choices")
                if choices and _text(choices[0]):
                    t = now() - t0
                    if last is None:
                        res.first_token_s = t
                    else:
                        res.gaps_s.append(t - last)
                    last = t
                    res.tokens += 1
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
        res.finish_s = now() - t0
        res.status = "ok"
    except asyncio.CancelledError:
        res.status, res.error = "cancelled", "replay cancelled"
        raise
    except Exception as exc:  # one failed request must never stop the replay
        res.status, res.error = classify(exc), f"{type(exc).__name__}: {exc}"[:300]
        res.finish_s = now() - t0
    finally:
        if on_done is not None:
            on_done(res)


def _text(choice: dict[str, Any]) -> str | None:
    """The text a streamed choice carries (completions: `text`; chat: `delta.content`)."""
    delta = choice.get("delta")
    return delta.get("content") if delta is not None else choice.get("text")


async def _until(target: float) -> None:
    """Return at `target` (perf_counter seconds) or as soon after as the loop allows."""
    delay = target - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def replay(
    url: str,
    model: str,
    requests: Sequence[ReplayRequest],
    *,
    timeout_s: float = 600.0,
    concurrency: int = 1024,
    on_done: Callable[[ReplayResult], None] | None = None,
) -> list[ReplayResult]:
    """Send `requests` open-loop (arrival times relative to now); results in request order.

    Each request is its own task, started at `t0 + arrival_s`; failures are recorded, not
    raised. `timeout_s` bounds each request's silence (read timeout).
    """
    results = [
        ReplayResult(i, r.arrival_s, r.prompt_tokens, r.output_tokens, r.deadline_s)
        for i, r in enumerate(requests)
    ]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    gc.collect()
    gc.freeze()  # what exists now (prompts, modules) is never scanned again during the replay
    async with make_client(url, concurrency=concurrency, timeout_s=timeout_s) as client:
        tasks: list[asyncio.Task[None]] = []
        t0 = time.perf_counter()
        try:
            for i in order:
                await _until(t0 + requests[i].arrival_s)
                tasks.append(
                    asyncio.create_task(send(client, model, requests[i], results[i], t0, on_done))
                )
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return results
