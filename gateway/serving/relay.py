"""The relay: one request's trip to a backend and back, with retries and continuations.

It talks to the scheduler only through the request's `Slot` (`gateway.scheduling.slot`): wait for a
grant, report tokens, report each attempt's outcome (completed, preempted, retry); the slot's
exit finishes the request. It raises `GatewayError`s and never renders them (the app's error
middleware does), except as the SSE error event of a stream that already started.

Streaming answers are relayed event by event with as little work per event as possible: no
JSON parsing of token chunks unless preemption needs the text, a byte check to recognise the
usage chunk (always requested upstream; dropped again if the client did not ask for it), one
write and one token report to the slot per upstream read (the response's headers leave with
its first events, the events read with `[DONE]` with the end of the body). TTFT, inter-token
gaps and TTLT are measured here, on the gateway's monotonic clock.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from gateway.config import GatewayConfig
from gateway.errors import GatewayError, Outcome, UpstreamBroken, UpstreamRejected, sse_error_event
from gateway.scheduling.dispatcher import Dispatcher, Ticket
from gateway.scheduling.slot import Attempt, Grant, Slot
from gateway.serving.backpressure import BoundedStream, ClientTooSlow
from gateway.serving.openai_api import PATHS, upstream_body
from policies import Job

if TYPE_CHECKING:
    from gateway.observability.tracing import Tracing

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_USAGE_MARK = b'"choices":[]'
_EMPTY_CONTENT = (b'"content":""', b'"content": ""', b'"delta":{}', b'"delta": {}')
_ROLE_MARK = b'"role":"assistant"'
_DELTA_MARK = b'"response.output_text.delta"'
_DONE_MARKS = (b'"response.completed"', b'"response.incomplete"')


class _Retryable(Exception):
    """The backend failed before sending anything: try another one."""

    def __init__(self, reason: str, *, down: bool) -> None:
        super().__init__(reason)
        self.down = down


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


TEXT_FOLD_BYTES = 64 * 1024
"""Token chunks a preemptible stream keeps unparsed at most (about 400 chunks): beyond it they
are folded into its generated text."""


@dataclass(slots=True)
class StreamState:
    """What has reached the client so far, across preemption segments."""

    response: web.StreamResponse | None = None
    keep_text: bool = False
    """Keep the generated text: the request may be preempted and resumed as a continuation
    (`Dispatcher.may_preempt` and a continuable call), decided once per request."""
    text: str = ""
    """Generated text of the chunks folded so far (see `generated_text`)."""
    chunks: list[bytes] = field(default_factory=list)
    """Token chunks relayed and not folded into `text` yet: a chunk's JSON is parsed only if
    the request is preempted, or once `TEXT_FOLD_BYTES` of them wait (bounding the memory)."""
    chunk_bytes: int = 0
    tokens: int = 0
    """Token chunks relayed so far (all segments)."""
    tokens_before: int = 0
    """Tokens relayed in earlier segments (before the last preemption)."""
    segments: int = 0
    last_token_at: float = 0.0
    usage: dict[str, Any] | None = field(default=None)
    usage_raw: bytes = b""
    """The backend's usage chunk as it came."""

    def keep_chunk(self, payload: bytes) -> None:
        """Keep a token chunk for the generated text (with `keep_text`)."""
        self.chunks.append(payload)
        self.chunk_bytes += len(payload)
        if self.chunk_bytes > TEXT_FOLD_BYTES:
            self.generated_text()

    def generated_text(self) -> str:
        """The generated text so far (all segments): what a continuation resumes from."""
        if self.chunks:
            self.text += "".join(_chunk_text(c) for c in self.chunks)
            self.chunks.clear()
            self.chunk_bytes = 0
        return self.text


class Relay:
    """Runs requests against backends on behalf of the handlers."""

    def __init__(
        self, session: aiohttp.ClientSession, dispatcher: Dispatcher, config: GatewayConfig
    ) -> None:
        self._session = session
        self._dispatcher = dispatcher
        self._config = config
        self.tracing: Tracing | None = None
        """Spans for step 4 and each attempt (`gateway.observability.tracing`; None: off)."""
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=config.connect_timeout_s, sock_read=config.read_timeout_s
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        """The upstream HTTP client (shared with the passthrough routes)."""
        return self._session

    @property
    def timeout(self) -> aiohttp.ClientTimeout:
        return self._timeout

    async def serve(self, request: web.Request, job: Job) -> web.StreamResponse:
        """Queue `job`, run it (retrying elsewhere before the first byte, resuming after
        preemption) and return the client's response. Sets the trace's outcome, except on
        errors raised before anything was sent, which propagate (the error middleware renders
        them)."""
        trace = job.ctx.trace
        state = StreamState(keep_text=self._dispatcher.may_preempt and job.ctx.call.continuable)
        try:
            async with self._dispatcher.slot(job) as slot:
                await self._run(request, slot, state)
            trace.outcome = Outcome.COMPLETED
            assert state.response is not None
            return state.response
        except GatewayError as exc:
            if state.response is None:
                raise
            trace.outcome, trace.status = _after_start(exc), 200
            await _write_quietly(state.response, sse_error_event(exc))
            return state.response
        except ClientGone:
            trace.outcome, trace.status = Outcome.CANCELLED_RUNNING, 499
            return state.response or web.Response(status=499)
        except ClientTooSlow:  # upstream closed and slot freed by now; then cut the client
            trace.outcome, trace.status = Outcome.CLIENT_TOO_SLOW, 200
            assert isinstance(state.response, BoundedStream)
            state.response.cut()
            return state.response
        finally:
            trace.output_tokens = max(trace.output_tokens, state.tokens)

    async def _run(self, request: web.Request, slot: Slot, state: StreamState) -> None:
        """Attempts until one completes; each ends in one report to the slot."""
        trace = slot.job.ctx.trace
        while True:
            grant = await slot.granted()
            if trace.dispatched is None:
                trace.dispatched = time.monotonic()
            trace.backend = grant.backend.name
            trace.attempts += 1
            span, headers = None, grant.backend.headers()
            if self.tracing is not None:
                span, carrier = self.tracing.attempt(trace, trace.backend, trace.attempts)
                headers = {**headers, **carrier}
            ended = "failed"  # the attempt span's result, unless it ends as below
            try:
                result = await self._attempt(request, slot, grant, state, headers)
                ended = result.value
            except _Retryable as exc:
                ended = Attempt.RETRY.value
                slot.ended(Attempt.RETRY, backend_down=exc.down)
                continue
            finally:
                if span is not None:
                    span.set_attribute("sagesched.result", ended)
                    span.end()
            slot.ended(result)
            if result is Attempt.COMPLETED:
                return
            state.tokens_before = state.tokens
            state.segments += 1

    async def _attempt(
        self,
        request: web.Request,
        slot: Slot,
        grant: Grant,
        state: StreamState,
        headers: dict[str, str],
    ) -> Attempt:
        """One upstream request: COMPLETED, or PREEMPTED (the slot's window was preempted);
        `_Retryable` when the backend failed before answering."""
        call = slot.job.ctx.call
        backend = grant.backend
        body = upstream_body(
            call,
            priority=grant.priority,
            continuation=state.generated_text(),
            done_tokens=state.tokens,
        )
        try:
            resp = await self._session.post(
                backend.url + PATHS[call.kind],
                json=body,
                headers=headers,
                timeout=self._timeout,
            )
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise _Retryable(f"{backend.name}: {exc!r}", down=True) from None
        async with resp:
            if resp.status >= 500:
                raise _Retryable(f"{backend.name} answered {resp.status}", down=False)
            if resp.status != 200:
                raise UpstreamRejected(resp.status, await resp.read())
            if not call.stream:
                await self._whole(slot.job, resp, state)
                return Attempt.COMPLETED
            if call.kind == "responses":
                await self._copy(request, slot, resp, state)
                return Attempt.COMPLETED
            return await self._stream(request, slot, resp, state)

    async def _whole(self, job: Job, resp: aiohttp.ClientResponse, state: StreamState) -> None:
        """A non-streaming answer: read it whole and pass it on."""
        trace = job.ctx.trace
        try:
            data = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._broken(trace.backend, exc, "its answer") from None
        trace.first_token = trace.finished = time.monotonic()
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):  # never a 200 that is not what it says
            log.warning("backend %s: a 200 answer that is not a JSON object", trace.backend)
            raise UpstreamBroken("the backend's answer was not a JSON object")
        try:
            _take_usage(answer.get("usage"), state, trace)
        except (ValueError, TypeError):
            state.tokens = 0
        trace.output_tokens = state.tokens
        state.response = web.Response(body=data, status=200, content_type="application/json")

    async def _stream(
        self, request: web.Request, slot: Slot, resp: aiohttp.ClientResponse, state: StreamState
    ) -> Attempt:
        """Relay a chat or completions stream. Reading it is the attempt's preemptible window:
        a preemption stops it wherever it waits (also on a backend that sends nothing), and
        the upstream request is closed here, which aborts it in vLLM."""
        done = False
        pending = last = b""
        with slot.preemptible() as window:
            try:
                # Whatever bytes are available at once are handled together and relayed in one
                # write: under load several events arrive per read, and writes are the cost.
                # The events read with `[DONE]` go out with the end of the body, in one write.
                async for data in resp.content.iter_any():
                    pending += data.replace(b"\r\n", b"\n") if b"\r" in data else data
                    *events, pending = pending.split(b"\n\n")
                    out, done = self._events(slot, events, state)
                    if done:
                        last = out
                        break
                    if out:
                        response = state.response or await self._open(request, state)
                        await _write(response, out)
                    if window.requested:
                        break
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
                raise self._broken(slot.job.ctx.trace.backend, exc, "the stream") from None
        if done:
            await self._finish_stream(request, slot.job, state, last)
            return Attempt.COMPLETED
        if window.preempted:
            resp.close()
            return Attempt.PREEMPTED
        raise self._broken(slot.job.ctx.trace.backend, None, "the stream")

    def _events(self, slot: Slot, events: list[bytes], state: StreamState) -> tuple[bytes, bool]:
        """Complete upstream SSE events → the bytes to relay, and whether `[DONE]` came.
        The slot hears of their tokens once, after the read."""
        if not state.segments:
            bulk = self._bulk_events(slot, events, state)
            if bulk is not None:
                return bulk
        out: list[bytes] = []
        before = state.tokens
        done = False
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # comments and other fields; events are re-framed below
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                if self._event(slot, payload, state):
                    out.append(b"data: " + payload + b"\n\n")
            if done:
                break
        _report(slot, state, before)
        return b"".join(out), done

    def _bulk_events(
        self, slot: Slot, events: list[bytes], state: StreamState
    ) -> tuple[bytes, bool] | None:
        """`_events` for the common case, in bulk: a first segment (nothing of it dropped),
        every event one `data: ` line, relayed as it came. The empty-delta marks are searched
        once in the whole read (they are rare: the role and the finish chunk), token events
        arriving in one read are timed together (gaps of 0 between them), and a preemptible
        stream keeps them all unparsed (an empty delta adds no text). None, with nothing
        changed, when an event is not of that form (the general path runs)."""
        keep: list[bytes] = []
        usage = None
        done = False
        for event in events:
            if not event.startswith(b"data: ") or b"\n" in event:
                return None
            if event.startswith(b"data: [DONE]") and event.rstrip() == b"data: [DONE]":
                done = True
                break
            if _USAGE_MARK in event:
                usage = event
                continue
            keep.append(event)
        blob = b"\n\n".join(keep)
        tokens = len(keep) - _marked_events(blob, keep)
        if state.keep_text:
            for event in keep:
                state.keep_chunk(event[6:])
        if usage is not None:
            self._event(slot, usage[6:].strip(), state)  # held back, read for its counts
        if tokens:
            self._count_token(slot, state, tokens)
            slot.tokens(tokens)
        return (blob + b"\n\n" if keep else b""), done

    def _event(self, slot: Slot, payload: bytes, state: StreamState) -> bool:
        """Count and time one upstream event; True if it is relayed as it is (the usage
        chunk is held back, a continuation's repeated role chunk dropped)."""
        if _USAGE_MARK in payload:
            state.usage_raw = payload
            try:
                state.usage = json.loads(payload).get("usage")
            except ValueError:
                state.usage = None
            return False
        is_token = not _is_empty(payload)
        if state.segments and not is_token and _ROLE_MARK in payload:
            return False
        if is_token:
            if state.keep_text:
                state.keep_chunk(payload)
            self._count_token(slot, state)
        return True

    async def _copy(
        self, request: web.Request, slot: Slot, resp: aiohttp.ClientResponse, state: StreamState
    ) -> None:
        """A streamed `/v1/responses` answer, relayed byte for byte (its events are named
        and typed; nothing is dropped or re-framed): text deltas are counted and timed, the
        final event's usage read."""
        response = state.response or await self._open(request, state)
        pending = b""
        try:
            async for data in resp.content.iter_any():
                pending += data.replace(b"\r\n", b"\n") if b"\r" in data else data
                *events, pending = pending.split(b"\n\n")
                before = state.tokens
                for event in events:
                    self._response_event(slot, event, state)
                _report(slot, state, before)
                await _write(response, data)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise self._broken(slot.job.ctx.trace.backend, exc, "the stream") from None
        trace = slot.job.ctx.trace
        trace.finished = time.monotonic()
        trace.output_tokens = state.tokens
        try:
            await response.write_eof()
        except ConnectionResetError:
            raise ClientGone() from None

    def _response_event(self, slot: Slot, event: bytes, state: StreamState) -> None:
        if _DELTA_MARK in event:
            self._count_token(slot, state)
        elif _DONE_MARKS[0] in event or _DONE_MARKS[1] in event:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    try:
                        final = json.loads(line[5:]).get("response") or {}
                        _take_usage(final.get("usage"), state, slot.job.ctx.trace)
                    except (ValueError, AttributeError, TypeError):
                        pass

    def _broken(self, backend: str, exc: BaseException | None, what: str) -> UpstreamBroken:
        """The client's error in the gateway's own words (`what`: "the stream" or "its
        answer"); the HTTP library's exception text, which names its internals and not the
        fault, goes to the log only."""
        if isinstance(exc, TimeoutError):
            message = (
                f"the backend sent nothing for {self._config.read_timeout_s:g} s"
                f" (read_timeout_s) and {what} was cut"
            )
        else:
            message = f"the backend closed the connection before {what} was complete"
        # the text, not the exception: a record kept by a handler must not keep its frames
        log.warning("backend %s broke off %s: %s (%s)", backend, what, message, repr(exc))
        return UpstreamBroken(message)

    def _count_token(self, slot: Slot, state: StreamState, n: int = 1) -> None:
        """Time `n` token events that came together (the first's gap, then 0 s each); the
        slot hears of them once per read."""
        now = time.monotonic()
        trace = slot.job.ctx.trace
        if trace.first_token is None:
            trace.first_token = now
        else:
            trace.gaps_s.append(now - state.last_token_at)
        trace.gaps_s.extend([0.0] * (n - 1))
        state.last_token_at = now
        state.tokens += n

    async def _open(self, request: web.Request, state: StreamState) -> web.StreamResponse:
        """Start the client's stream: bounded buffer, bounded wait (`gateway.serving.backpressure`);
        its headers leave with its first events (`_SSEResponse`)."""
        config = self._config
        response = _SSEResponse(
            limit=config.stream_buffer_bytes,
            timeout_s=config.slow_client_timeout_s,
            status=200,
            headers=SSE_HEADERS,
        )
        try:
            await response.prepare(request)
        except ConnectionResetError:
            raise ClientGone() from None
        state.response = response
        return response

    async def _finish_stream(
        self, request: web.Request, job: Job, state: StreamState, events: bytes
    ) -> None:
        """The usage chunk (if the client asked for it) and `[DONE]` after `events` (the
        events that came with the upstream's `[DONE]`), and the end of the body: one write."""
        ticket: Ticket = job.ctx
        trace = ticket.trace
        response = state.response or await self._open(request, state)
        usage = state.usage
        if usage is not None:
            last = int(usage.get("completion_tokens", state.tokens - state.tokens_before))
            state.tokens = state.tokens_before + last
            prompt = usage.get("prompt_tokens")
            if isinstance(prompt, int):  # the continuation carried the earlier tokens
                trace.prompt_tokens = max(prompt - state.tokens_before, 0)
        tail = b"data: [DONE]\n\n"
        if ticket.call.wants_usage and usage is not None:
            chunk = state.usage_raw if not state.segments else _usage_chunk(usage, state)
            tail = b"data: " + chunk + b"\n\n" + tail
        tail = events + tail
        trace.finished = time.monotonic()
        trace.output_tokens = state.tokens
        try:
            await response.write_eof(tail)  # the last events and the end of the body, one write
        except ConnectionResetError:
            raise ClientGone() from None


class _SSEResponse(BoundedStream):
    """A streamed answer whose headers leave with its first events, in one write (aiohttp
    otherwise sends them alone at `prepare`: one more send, and one more wake-up of the
    client, per request). `prepare` comes right before the first write, so nothing waits."""

    _send_headers_immediately = False  # aiohttp's own switch (its `Response` sets it too)


_OWN_OUTCOMES = frozenset(
    {Outcome.QUEUE_TIMEOUT, Outcome.QUEUE_FULL, Outcome.SHED, Outcome.SHUTDOWN}
)
"""Errors of the gateway's own queue, not of a backend: a stream the gateway preempted that
then times out in the queue (or is shed, or the gateway stops) ends with them."""


def _after_start(error: GatewayError) -> Outcome:
    """The outcome of a stream that started and then failed with `error`: the queue's own
    outcome when the gateway ended it (a preempted stream waiting for its continuation: no
    backend failed), `upstream_broken` for everything else (the backend broke off, or the
    continuation found no backend or was refused by it)."""
    return error.outcome if error.outcome in _OWN_OUTCOMES else Outcome.UPSTREAM_BROKEN


def _report(slot: Slot, state: StreamState, before: int) -> None:
    """Tell the slot of the tokens counted since `before`: once per upstream read, not per
    token (review points and preemption are decided at read boundaries; the events of one
    read reach the client in one write anyway)."""
    if state.tokens > before:
        slot.tokens(state.tokens - before)


def _is_empty(payload: bytes) -> bool:
    """Is this chunk an empty delta (a role or finish chunk, not a token)?"""
    e = _EMPTY_CONTENT
    return e[0] in payload or e[1] in payload or e[2] in payload or e[3] in payload


def _marked_events(blob: bytes, events: list[bytes]) -> int:
    """How many of `events` (joined by blank lines into `blob`) contain an empty-delta mark:
    each mark's occurrences in `blob`, mapped to their event by its end offset."""
    marked: set[int] = set()
    ends: list[int] | None = None
    for mark in _EMPTY_CONTENT:
        at = blob.find(mark)
        while at >= 0:
            ends = ends or list(itertools.accumulate(len(e) + 2 for e in events))
            marked.add(bisect.bisect_right(ends, at))
            at = blob.find(mark, at + 1)
    return len(marked)


def _take_usage(usage: Any, state: StreamState, trace: Any) -> None:
    """Output and prompt tokens of a whole answer's usage (chat and completions name them
    `completion_tokens` / `prompt_tokens`, responses `output_tokens` / `input_tokens`)."""
    if not isinstance(usage, dict):
        state.tokens = 0
        return
    state.tokens = int(usage.get("completion_tokens", usage.get("output_tokens")) or 0)
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    if isinstance(prompt, int):
        trace.prompt_tokens = prompt


def _chunk_text(payload: bytes) -> str:
    """The text a token chunk adds (chat delta content or completion text)."""
    try:
        choice = json.loads(payload)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return ""
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def _usage_chunk(usage: dict[str, Any], state: StreamState) -> bytes:
    """The backend's usage chunk, corrected after preemption to count every segment's tokens
    (prompt tokens: the last continuation's minus the tokens it carried over)."""
    fixed = dict(usage)
    prompt = max(int(usage.get("prompt_tokens", 0)) - state.tokens_before, 0)
    fixed.update(
        prompt_tokens=prompt, completion_tokens=state.tokens, total_tokens=prompt + state.tokens
    )
    chunk = json.loads(state.usage_raw)
    chunk["usage"] = fixed
    return json.dumps(chunk, separators=(",", ":")).encode()


async def _write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError:
        raise ClientGone() from None


async def _write_quietly(response: web.StreamResponse, data: bytes) -> None:
    """The last words of a stream that failed; a client gone or too slow by now is let go."""
    try:
        await response.write(data)
        await response.write_eof()
    except ConnectionResetError:
        pass
    except ClientTooSlow:
        if isinstance(response, BoundedStream):
            response.cut()
